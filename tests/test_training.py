"""The training loop: Megatron log lines, non-finite steps skipped and counted, a run
that keeps diverging stopped, early exits (--exit-interval, --exit-duration-in-mins, a
signal), metrics and TensorBoard outputs. Faults are real: an inf in the data's loss
mask, a learning rate that overflows the weights, a real SIGTERM; nothing is patched."""

import dataclasses
import json
import math
import os
import signal
import subprocess
import sys

from megaq import pretrain
from megaq.checkpoint import paths
from megaq.training import Trainer, TrainingDiverged
from megaq.runtime.logging_utils import TensorBoard, training_log_line, validation_log_line
from megaq.testing.ranks import run_on_ranks

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def argv(tmp, iters, extra=()):
    return ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
            "--train-iters", str(iters), "--lr", "1e-2", "--mock-data", "--vocab-size", "64",
            "--log-interval", "1", "--eval-iters", "0", "--hidden-dropout", "0",
            "--attention-dropout", "0", "--data-cache-path", os.path.join(tmp, "cache"), *extra]


def test_training_log_line_fields_in_megatron_order():
    import datetime
    line = training_log_line(iteration=5, train_iters=100, consumed_samples=40, elapsed_ms=812.3,
                             tflops_per_gpu=1.5, tokens_per_s_per_gpu=2048.0, lr=3e-4,
                             global_batch_size=8, lm_loss=9.87, loss_scale=1.0, grad_norm=1.234,
                             params_norm=12.3456, skipped=0, nan=1,
                             now=datetime.datetime(2026, 12, 1, 7, 5, 9))
    assert line.startswith(" [2026-12-01 07:05:09] iteration        5/     100 |")
    fields = [f.strip() for f in line.split("] ", 1)[1].split("|") if f.strip()]
    names = [f.split(":")[0] if ":" in f else f.split()[0] for f in fields]
    assert names == ["iteration", "consumed samples", "elapsed time per iteration (ms)",
                     "throughput per GPU (TFLOP/s/GPU)", "tokens per second per GPU",
                     "learning rate", "global batch size", "lm loss", "loss scale", "grad norm",
                     "params norm", "number of skipped iterations", "number of nan iterations"]
    assert fields[0].split() == ["iteration", "5/", "100"]
    assert "throughput per GPU (TFLOP/s/GPU): 1.5 |" in line and "params norm: 12.346 |" in line
    # without --log-throughput / --log-params-norm the fields are left out (Megatron)
    plain = training_log_line(iteration=5, train_iters=100, consumed_samples=40,
                              elapsed_ms=812.3, lr=3e-4, global_batch_size=8, lm_loss=9.87,
                              loss_scale=1.0, grad_norm=1.234, skipped=0, nan=1)
    assert "throughput" not in plain and "tokens per second" not in plain
    assert "params norm" not in plain
    assert "lm loss: 9.870000E+00" in line and "learning rate: 3.000000E-04" in line
    v = validation_log_line(100, 2.0)
    assert v.strip().startswith("validation loss at iteration 100 | lm loss value: 2.000000E+00 |")
    assert f"lm loss PPL: {math.exp(2.0):.6E}" in v


def _with_batches(train_batches, gbs: int, on_step):
    """train_batches (TrainingParts' public callable) with `on_step(step, micro_batches)`
    applied to the micro-batches of each step before the loop gets them."""
    def make(consumed):
        step = consumed // gbs
        for micro_batches in train_batches(consumed):
            step += 1
            yield on_step(step, micro_batches)
    return make


def _inf_in_loss_mask(bad_steps):
    """A real non-finite loss and gradient: an inf in the loss mask of every micro-batch
    of the chosen steps makes sum(loss * mask) / sum(mask) = inf / inf = NaN, and its
    gradient NaN, through the real forward, backward, clipping and skip logic."""
    def on_step(step, micro_batches):
        if step not in bad_steps:
            return micro_batches
        out = []
        for mb in micro_batches:
            mask = mb["loss_mask"].clone()
            mask[0, 0] = float("inf")
            out.append({**mb, "loss_mask": mask})
        return out
    return on_step


def _train_with(topo, argv, on_step):
    """pretrain.main's setup, then the loop over batches passed through `on_step`."""
    from megaq.config.arguments import parse_config
    config = parse_config(argv, world_size=topo.layout.world_size,
                          ranks_per_node=topo.layout.ranks_per_node)
    trainer = pretrain.build_trainer(config, topo)
    parts = dataclasses.replace(trainer.p, train_batches=_with_batches(
        trainer.p.train_batches, config.training.global_batch_size, on_step))
    s = Trainer(parts, trainer.state).train()
    return {"losses": s.losses, "skipped": s.skipped_total, "nan": s.nan_total,
            "iteration": s.iteration, "reason": s.exit_reason}


def test_nonfinite_step_is_skipped_and_counted(tmp_path):
    metrics = str(tmp_path / "m.jsonl")
    out = run_on_ranks(_train_with, 2, args=(argv(str(tmp_path), 4, ["--metrics-file", metrics]),
                                             _inf_in_loss_mask({2})))
    r = out[0]
    assert r["skipped"] == 1 and r["nan"] == 1
    assert math.isnan(r["losses"][2]) and all(math.isfinite(r["losses"][i]) for i in (1, 3, 4))
    rows = [json.loads(x) for x in open(metrics)]
    # first the planner's prediction for the run (megaq.planner.run.plan_record)
    assert rows[0]["type"] == "plan" and rows[0]["step_time_s"] > 0 and "memory_gib" in rows[0]
    rows = [r for r in rows if r["type"] != "plan"]  # (this test builds two Trainers)
    assert rows[1]["iteration"] == 2 and rows[1]["lm_loss"] is None
    assert rows[1]["nan_iterations"] == 1 and rows[2]["nan_iterations"] == 0
    # the skipped update did not advance the LR schedule: iteration 3 uses step 2's lr
    assert rows[2]["lr"] == rows[1]["lr"]


def _train(topo, argv):
    try:
        s = pretrain.main(argv, topo=topo)
    except TrainingDiverged as e:
        return {"diverged": str(e)}
    return {"losses": s.losses, "iteration": s.iteration, "reason": s.exit_reason}


def test_many_nonfinite_in_a_row_stop_the_run(tmp_path):
    """A learning rate of 1e30: the first update throws the weights to ~1e30, every later
    forward overflows to a non-finite loss, and --max-consecutive-skipped-iters 3 stops
    the run after iterations 2, 3 and 4 (no patched code: the real loop and engine)."""
    out = run_on_ranks(_train, 2, args=(
        argv(str(tmp_path), 10, ["--lr", "1e30", "--max-consecutive-skipped-iters", "3"]),))
    for r in out:  # every rank stops, with the same message
        msg = r["diverged"]
        assert "stopping at iteration 4: 3 iterations in a row had a non-finite loss" in msg
        assert "--max-consecutive-skipped-iters" in msg


def test_cli_stops_a_diverging_run_with_one_error_line(tmp_path):
    r = subprocess.run([sys.executable, os.path.join(REPO, "pretrain_gpt.py")]
                       + argv(str(tmp_path), 10, ["--lr", "1e30",
                                                  "--max-consecutive-skipped-iters", "2"]),
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "WORLD_SIZE": "1", "OMP_NUM_THREADS": "1"})
    assert r.returncode == 2
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: stopping at iteration 3: 2 iterations")
    assert "number of skipped iterations:   1" in r.stdout  # iteration 2, logged before the stop


def test_exit_interval_saves_and_stops_every_rank(tmp_path):
    ck = str(tmp_path / "ck")
    out = run_on_ranks(_train, 2, args=(argv(str(tmp_path), 10, [
        "--exit-interval", "3", "--save", ck, "--save-interval", "2"]),))
    assert [r["iteration"] for r in out] == [3, 3]
    assert out[0]["reason"] == "--exit-interval 3" and sorted(out[0]["losses"]) == [1, 2, 3]
    assert paths.read_tracker(ck) == 3  # saved at the exit, off the save interval
    assert os.path.isdir(paths.iteration_dir(ck, 2))


def test_exit_duration_saves_and_stops_every_rank(tmp_path):
    """--exit-duration-in-mins: a budget shorter than one iteration ends the run after its
    first iteration, on every rank alike (the stop vote rides on the loss all-reduce)."""
    ck = str(tmp_path / "ck")
    out = run_on_ranks(_train, 2, args=(argv(str(tmp_path), 10, [
        "--exit-duration-in-mins", "1e-6", "--save", ck]),))
    assert [r["iteration"] for r in out] == [1, 1]
    assert "--exit-duration-in-mins 1e-06 passed" in out[0]["reason"]
    assert paths.read_tracker(ck) == 1


def test_tensorboard_optional(tmp_path, capsys):
    tb = TensorBoard(str(tmp_path / "tb"))
    try:
        from torch.utils.tensorboard import SummaryWriter
        has_tb = SummaryWriter is not None
    except Exception:  # noqa: BLE001
        has_tb = False
    if has_tb:
        assert tb.writer is not None
        tb.scalars({"lm loss": 1.0}, 1)
        tb.close()
        assert os.listdir(tmp_path / "tb")
    else:
        assert tb.writer is None
        err = capsys.readouterr().err
        assert err.count("WARNING: --tensorboard-dir") == 1 and "pip install tensorboard" in err
        tb.scalars({"lm loss": 1.0}, 1)  # a no-op, never an error


def _sigterm_on_rank1_at_step_2(topo):
    def on_step(step, micro_batches):
        if topo.rank == 1 and step == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # e.g. slurm preempting one node
        return micro_batches
    return on_step


def _signalled(topo, args):
    return _train_with(topo, args, _sigterm_on_rank1_at_step_2(topo))


def test_signal_on_one_rank_stops_all_after_a_save(tmp_path):
    out = run_on_ranks(_signalled, 2, args=(argv(str(tmp_path), 6, [
        "--exit-signal-handler", "--save", str(tmp_path / "ck"), "--save-interval", "5"]),))
    assert [r["iteration"] for r in out] == [2, 2]
    assert "signal" in out[0]["reason"]
    assert paths.read_tracker(str(tmp_path / "ck")) == 2


def _handlers_around_training(topo, args):
    received = []

    def callers(signum, frame):  # noqa: ARG001 - signal API
        received.append(signum)  # the caller's own handling: it just records
    signal.signal(signal.SIGTERM, callers)
    during = []

    def on_step(step, micro_batches):
        during.append(signal.getsignal(signal.SIGTERM) is not callers)
        return micro_batches
    _train_with(topo, args, on_step)
    return {"during": bool(during) and all(during),
            "after": signal.getsignal(signal.SIGTERM) is callers}


def test_exit_signal_handler_gives_the_callers_handler_back_after_training(tmp_path):
    """A program that trains in-process (a notebook, a sweep driver) has its own SIGTERM
    and Ctrl-C handling again once train() returns."""
    out = run_on_ranks(_handlers_around_training, 1,
                       args=(argv(str(tmp_path), 2, ["--exit-signal-handler"]),))
    assert out == [{"during": True, "after": True}]


def test_plot_metrics_writes_png(tmp_path):
    from megaq.runtime.metrics import MetricsWriter
    paths = []
    for run in range(2):  # two files -> two curves per panel
        w = MetricsWriter(str(tmp_path / f"m{run}.jsonl"))
        for it in (1, 2, 3):
            w.write({"type": "train", "iteration": it, "lm_loss": 5.0 - it - run, "lr": 1e-3,
                     "grad_norm": 1.0, "tokens_per_s": 100.0,
                     "comm": {"grad_reduce": {"intra_node": 1.0, "inter_node": 2.0}}})
        w.write({"type": "validation", "iteration": 3, "val_loss": 2.5, "val_ppl": 12.2})
        w.close()
        paths.append(str(tmp_path / f"m{run}.jsonl"))
    from megaq.cli import plot_metrics as mod
    out = tmp_path / "curves.png"
    assert mod.main(paths + ["--output", str(out), "--labels", "a", "b"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _train_with_metrics(topo, args):
    s = pretrain.main(args, topo=topo)
    return s.losses


def test_log_comm_time_reports_phases_and_keeps_losses(tmp_path, capfd):
    """--log-comm-time: the metrics file gets milliseconds per phase for every phase that
    moved bytes, the log shows them, and the losses and bytes equal an untimed run's
    (4 ranks as 2 nodes x 2, ZeRO-3 with qwZ, hpZ and qgZ: every ZeRO++ path is timed)."""
    zpp = ["--gpus-per-node", "2", "--zero-stage", "3", "--zero-quantized-weights", "--global-batch-size", "8",
           "--zero-hpz-partition-size", "2", "--zero-quantized-gradients",
           "--zero-quantization-block-size", "32"]
    rows = {}
    for timed in (False, True):
        m = str(tmp_path / f"m{int(timed)}.jsonl")
        extra = zpp + ["--metrics-file", m] + (["--log-comm-time"] if timed else [])
        losses = run_on_ranks(_train_with_metrics, 4, ranks_per_node=2, hpz_size=2,
                              args=(argv(str(tmp_path), 2, extra),))[0]
        rows[timed] = ([r for r in map(json.loads, open(m)) if r["type"] != "plan"], losses)
    (plain, plain_losses), (timed, timed_losses) = rows[False], rows[True]
    assert timed_losses == plain_losses
    for a, b in zip(plain, timed):
        assert a["comm"] == b["comm"] and "comm_time_ms" not in a
        moved = {p for p, links in b["comm"].items() if sum(links.values()) > 0}
        assert {"weight_gather_fwd", "weight_gather_bwd", "grad_reduce"} <= moved
        assert set(b["comm_time_ms"]) >= moved
        assert all(b["comm_time_ms"][p] > 0 for p in moved)
    assert "communication time per iteration (ms" in capfd.readouterr().out


def test_test_split_is_evaluated_at_the_end_when_the_split_gives_it_documents(
        tmp_path, capsys, tiny_dataset, tiny_tokenizer):
    """Megatron's end of training: the validation set, then the test set ("on test
    set"), eval_iters batches each; a split that gives the test set no documents builds
    none and evaluates none (not an error)."""
    from megaq.parallel.topology import Layout, build_topology

    def run(split, name):
        metrics = tmp_path / f"{name}.jsonl"
        flags = argv(str(tmp_path / name), 3, [  # the last --eval-iters wins
            "--eval-iters", "2", "--eval-interval", "2", "--data-path", tiny_dataset,
            "--tokenizer-model", tiny_tokenizer, "--split", split, "--metrics-file", str(metrics)])
        flags.remove("--mock-data")
        flags.remove("--vocab-size")
        flags.remove("64")
        state = pretrain.main(flags, topo=build_topology(Layout(1), 0))
        rows = [json.loads(x) for x in open(metrics)]
        return state, capsys.readouterr().out.splitlines(), rows

    state, out, rows = run("80,10,10", "with_test")
    (test_row,) = [r for r in rows if r["type"] == "test"]
    assert test_row["iteration"] == 3 and state.test_loss == test_row["test_loss"]
    assert math.isfinite(state.test_loss) and test_row["test_ppl"] == math.exp(state.test_loss)
    printed = [x for x in out if "on test set" in x]
    assert printed == [validation_log_line(3, state.test_loss, "on test set")]
    at = out.index(printed[0])  # after the final validation, between Megatron's rules
    assert out[at - 1] == out[at + 1] == "-" * (len(printed[0]) + 1)
    assert any("validation loss at iteration 3 on validation set" in x for x in out[:at])
    # the test loss is not a validation loss (a different split's documents)
    assert state.test_loss != state.val_losses[3]

    state, out, rows = run("90,10,0", "no_test")
    assert state.test_loss is None and not any("on test set" in x for x in out)
    assert not [r for r in rows if r["type"] == "test"] and state.val_losses
