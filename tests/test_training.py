"""The training loop: Megatron log lines, non-finite steps skipped and counted, a run
that keeps diverging stopped, metrics and TensorBoard outputs."""

import json
import math
import os


import pretrain_gpt
from megaq.logging_utils import TensorBoard, training_log_line, validation_log_line
from megaq.parallel.launch import run_on_ranks


def argv(tmp, iters, extra=()):
    return ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
            "--train-iters", str(iters), "--lr", "1e-2", "--mock-data", "--vocab-size", "64",
            "--log-interval", "1", "--eval-iters", "0", "--hidden-dropout", "0",
            "--attention-dropout", "0", "--data-cache-path", os.path.join(tmp, "cache"), *extra]


def test_training_log_line_fields_in_megatron_order():
    line = training_log_line(iteration=5, train_iters=100, consumed_samples=40, elapsed_ms=812.3,
                             tflops_per_gpu=1.5, lr=3e-4, global_batch_size=8, lm_loss=9.87,
                             loss_scale=1.0, grad_norm=1.234, skipped=0, nan=1)
    fields = [f.strip() for f in line.split("|") if f.strip()]
    names = [f.split(":")[0] if ":" in f else f.split()[0] for f in fields]
    assert names == ["iteration", "consumed samples", "elapsed time per iteration (ms)",
                     "throughput per GPU (TFLOP/s/GPU)", "learning rate", "global batch size",
                     "lm loss", "loss scale", "grad norm", "number of skipped iterations",
                     "number of nan iterations"]
    assert fields[0].split() == ["iteration", "5/", "100"]
    assert "lm loss: 9.870000E+00" in line and "learning rate: 3.000000E-04" in line
    v = validation_log_line(100, 2.0)
    assert v.strip().startswith("validation loss at iteration 100 | lm loss value: 2.000000E+00 |")
    assert f"lm loss PPL: {math.exp(2.0):.6E}" in v


def _with_nan_at_iteration(topo, args, bad_iterations):
    # Make the loss of chosen iterations non-finite on every rank (process-local patch in
    # the forked rank), as a fp overflow would.
    from megaq import training
    real = training.Trainer.train_step

    def patched(self, batches):
        loss, norm, applied = real(self, batches) if self.state.iteration + 1 not in bad_iterations \
            else _nan_step(self, batches)
        return loss, norm, applied

    def _nan_step(self, batches):
        self.p.engine.zero_grad()
        self._run_schedule(batches, forward_only=False)
        self.p.engine.finish_grad_sync()
        self.p.engine.skip_step()
        return float("nan"), float("nan"), False

    training.Trainer.train_step = patched
    try:
        s = pretrain_gpt.main(args, topo=topo)
        return {"losses": s.losses, "skipped": s.skipped_total, "nan": s.nan_total}
    except training.TrainingDiverged as e:
        return {"diverged": str(e)}


def test_nonfinite_step_is_skipped_and_counted(tmp_path):
    metrics = str(tmp_path / "m.jsonl")
    out = run_on_ranks(_with_nan_at_iteration, 2,
                       args=(argv(str(tmp_path), 4, ["--metrics-file", metrics]), {2}))
    r = out[0]
    assert r["skipped"] == 1 and r["nan"] == 1
    assert math.isnan(r["losses"][2]) and all(math.isfinite(r["losses"][i]) for i in (1, 3, 4))
    rows = [json.loads(x) for x in open(metrics)]
    assert rows[1]["iteration"] == 2 and rows[1]["lm_loss"] is None
    assert rows[1]["nan_iterations"] == 1 and rows[2]["nan_iterations"] == 0
    # the skipped update did not advance the LR schedule: iteration 3 uses step 2's lr
    assert rows[2]["lr"] == rows[1]["lr"]


def test_many_nonfinite_in_a_row_stop_the_run(tmp_path):
    out = run_on_ranks(_with_nan_at_iteration, 1, args=(
        argv(str(tmp_path), 10, ["--max-consecutive-skipped-iters", "3"]), {2, 3, 4, 5}))
    msg = out[0]["diverged"]
    assert "stopping at iteration 4: 3 iterations in a row had a non-finite loss" in msg
    assert "--max-consecutive-skipped-iters" in msg


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


def _signal_rank1_at_iteration_2(topo, args):
    import signal as sig
    from megaq import training
    real = training.Trainer.train_step

    def patched(self, batches):
        if topo.rank == 1 and self.state.iteration + 1 == 2:
            os.kill(os.getpid(), sig.SIGTERM)  # e.g. slurm preempting one node
        return real(self, batches)

    training.Trainer.train_step = patched
    s = pretrain_gpt.main(args, topo=topo)
    return {"iteration": s.iteration, "reason": s.exit_reason}


def test_signal_on_one_rank_stops_all_after_a_save(tmp_path):
    from megaq import checkpoint as ckpt
    out = run_on_ranks(_signal_rank1_at_iteration_2, 2, args=(argv(str(tmp_path), 6, [
        "--exit-signal-handler", "--save", str(tmp_path / "ck"), "--save-interval", "5"]),))
    assert [r["iteration"] for r in out] == [2, 2]
    assert "signal" in out[0]["reason"]
    assert ckpt.read_tracker(str(tmp_path / "ck")) == 2


def test_plot_metrics_writes_png(tmp_path):
    import importlib.util
    from megaq.metrics import MetricsWriter
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
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("plot_metrics",
                                                  os.path.join(repo, "tools", "plot_metrics.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "curves.png"
    assert mod.main(paths + ["--output", str(out), "--labels", "a", "b"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _train_with_metrics(topo, args):
    s = pretrain_gpt.main(args, topo=topo)
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
        rows[timed] = ([json.loads(x) for x in open(m)], losses)
    (plain, plain_losses), (timed, timed_losses) = rows[False], rows[True]
    assert timed_losses == plain_losses
    for a, b in zip(plain, timed):
        assert a["comm"] == b["comm"] and "comm_time_ms" not in a
        moved = {p for p, links in b["comm"].items() if sum(links.values()) > 0}
        assert {"weight_gather_fwd", "weight_gather_bwd", "grad_reduce"} <= moved
        assert set(b["comm_time_ms"]) >= moved
        assert all(b["comm_time_ms"][p] > 0 for p in moved)
    assert "communication time per iteration (ms" in capfd.readouterr().out
