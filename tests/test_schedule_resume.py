"""Megatron-LM's schedule and checkpoint semantics (issue 19): sample-based runs
(--train-samples, --lr-warmup-samples, --lr-decay-samples), the LR-schedule check on
resume (--override-opt_param-scheduler, --use-checkpoint-opt_param-scheduler),
--finetune, --pretrained-checkpoint, --no-save-optim, and the metrics file truncated
back to the resumed iteration. Tiny model, mock data, fp32 on one CPU process (one
2-rank TP run for a weights-only reshard)."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from megaq import pretrain
from megaq.config.arguments import ArgumentsError, parse_config
from megaq.checkpoint import paths
from megaq.checkpoint.consolidate import load_consolidated_model
from megaq.lr_schedule import LRSchedule, ScheduleMismatchError
from megaq.runtime.metrics import drop_records_after
from megaq.testing.ranks import run_on_ranks

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GBS = 4


def base(tmp, *extra):
    return ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
            "--seq-length", "8", "--micro-batch-size", "2", "--global-batch-size", str(GBS),
            "--lr", "5e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine",
            "--mock-data", "--vocab-size", "64", "--eval-iters", "0", "--log-interval", "1",
            "--attention-dropout", "0", "--hidden-dropout", "0",
            "--data-cache-path", os.path.join(str(tmp), "cache"),
            # these tests read model_optim.pt; torch_dist's --finetune / --no-save-optim:
            # tests/test_dist_checkpoint.py
            "--ckpt-format", "torch", *extra]


# iteration-based and the sample-based run with the same curve: warm-up 2 steps = 8
# samples, decay 5 steps = 20 samples, 6 steps = 24 samples
ITERS = ["--train-iters", "6", "--lr-warmup-iters", "2", "--lr-decay-iters", "5"]
SAMPLES = ["--train-samples", "24", "--lr-warmup-samples", "8", "--lr-decay-samples", "20"]


def _train(topo, argv):
    s = pretrain.main(argv, topo=topo)
    return {"losses": s.losses, "iteration": s.iteration, "consumed": s.consumed_samples}


def train(argv, world=1, **kw):
    return run_on_ranks(_train, world, args=(argv,), **kw)[0]


def _setup(topo, argv):
    """build_trainer only (the checkpoint load, no training): what it loaded."""
    try:
        config = parse_config(argv, world_size=1)
        tr = pretrain.build_trainer(config, topo)
    except Exception as e:  # noqa: BLE001 - the test reads the one-line message
        return {"error": f"{type(e).__name__}: {e}"}
    full = tr.p.engine.full_state()
    return {"iteration": tr.state.iteration, "consumed": tr.state.consumed_samples,
            "lr": tr.p.lr_schedule.get_lr(), "schedule": tr.p.lr_schedule.state_dict(),
            "step": full["step"], "params": {k: v["param"] for k, v in full["params"].items()},
            "moments_zero": all(not v["exp_avg"].any() and not v["exp_avg_sq"].any()
                                for v in full["params"].values())}


def setup(argv):
    return run_on_ranks(_setup, 1, args=(argv,))[0]


def metrics(path):
    """The iteration records (each run's first record, the plan, left out)."""
    return [r for r in map(json.loads, open(path)) if r.get("type") != "plan"]


def saved_params(root, iteration):
    sd = torch.load(paths.model_file(paths.iteration_dir(root, iteration), 0, 0),
                    weights_only=True)
    return {k: v["param"] for k, v in sd["model_optim"]["params"].items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The iteration-based run and the sample-based run, 6 steps each, saving at 3 and 6."""
    tmp = tmp_path_factory.mktemp("runs")
    out = {}
    for name, flags in (("iters", ITERS), ("samples", SAMPLES)):
        argv = base(tmp, *flags, "--save", str(tmp / name), "--save-interval", "3",
                    "--metrics-file", str(tmp / f"{name}.jsonl"))
        out[name] = train(argv)
    return tmp, out


# ------------------------------------------------------------------ configuration
@pytest.mark.parametrize("extra,line", [
    (["--train-iters", "6", "--train-samples", "24"],
     "--train-iters and --train-samples are both set; pass only one"),
    ([], "the run's length is not set; pass --train-iters N"),
    (["--train-samples", "24", "--lr-decay-iters", "5"],
     "--lr-decay-iters 5 mixes iteration- and sample-based settings: this run is sample-based "
     "(--train-samples); use --lr-decay-samples instead"),
    (["--train-iters", "6", "--lr-warmup-samples", "8"],
     "--lr-warmup-samples 8 mixes iteration- and sample-based settings: this run is "
     "iteration-based (--train-iters); use --lr-warmup-iters instead"),
    (["--train-samples", "3"], "--train-samples 3 is less than one global batch (4)"),
    (["--train-iters", "6", "--override-opt_param-scheduler",
      "--use-checkpoint-opt_param-scheduler"], "are both set; pass only one"),
    (["--train-iters", "6", "--finetune"], "--finetune needs --load DIR"),
    # values torch or numpy would refuse later, with a traceback
    (["--train-iters", "6", "--seed", "-1"], "--seed must be between 0 and 2^31 - 1 (got -1)"),
    (["--train-iters", "6", "--adam-beta1", "1.5"], "--adam-beta1 must be in [0, 1) (got 1.5)"),
    (["--train-iters", "6", "--adam-beta2", "1"], "--adam-beta2 must be in [0, 1) (got 1.0)"),
    (["--train-iters", "6", "--adam-eps", "-1"], "--adam-eps must be >= 0 (got -1.0)"),
    (["--train-iters", "6", "--hidden-dropout", "2"], "--hidden-dropout must be in [0, 1] (got 2.0)"),
    (["--train-iters", "6", "--attention-dropout", "-1"], "--attention-dropout must be in [0, 1]"),
    (["--train-iters", "6", "--init-method-std", "-1"], "--init-method-std must be >= 0 (got -1.0)"),
])
def test_refused_combinations_are_one_line(tmp_path, extra, line):
    with pytest.raises(ArgumentsError) as e:
        parse_config(base(tmp_path, *extra), world_size=1)
    assert line in str(e.value) and "\n" not in str(e.value)


def test_save_hf_never_replaces_a_checkpoint_or_other_files(tmp_path):
    """--save-hf replaces its directory at the end of the run: refused up front where that
    would take a checkpoint or someone's files with it."""
    ck, notes = tmp_path / "ck", tmp_path / "notes"
    notes.mkdir()
    (notes / "a.txt").write_text("keep me")
    for hf, line in ((ck, f"--save-hf {ck} overlaps --save {ck}"),
                     (tmp_path, f"--save-hf {tmp_path} overlaps --save {ck}"),  # around it
                     (ck / "hf", "overlaps --save"),  # inside it
                     (notes, f"--save-hf {notes} exists and is not a Hugging Face export")):
        with pytest.raises(ArgumentsError) as e:
            parse_config(base(tmp_path, "--train-iters", "1", "--save", str(ck), "--save-hf", str(hf)),
                         world_size=1)
        assert line in str(e.value) and "\n" not in str(e.value), e.value
    with pytest.raises(ArgumentsError, match="overlaps --load"):
        parse_config(base(tmp_path, "--train-iters", "1", "--save", str(ck), "--load", str(notes),
                          "--save-hf", str(notes / "hf")), world_size=1)
    # an empty directory, or an earlier export (its config.json and weights), is replaced
    earlier = tmp_path / "hf"
    earlier.mkdir()
    (earlier / "config.json").write_text("{}")
    (earlier / "model.safetensors").write_bytes(b"")
    for hf in (earlier, tmp_path / "new"):
        c = parse_config(base(tmp_path, "--train-iters", "1", "--save", str(ck), "--save-hf", str(hf)),
                         world_size=1)
        assert c.checkpointing.save_hf == str(hf)
    assert (notes / "a.txt").read_text() == "keep me"


def test_sample_based_config_derives_the_step_count(tmp_path):
    c = parse_config(base(tmp_path, "--train-samples", "26", "--lr-warmup-fraction", "0.25"),
                     world_size=1)
    # Megatron without ramp-up: train_samples // global batch steps; the decay defaults
    # to the run's samples and the warm-up is a fraction of it, in samples
    assert (c.training.train_iters, c.training.sample_based) == (6, True)
    assert (c.training.schedule_unit, c.optimizer.lr_decay_samples,
            c.optimizer.lr_warmup_samples, c.optimizer.lr_decay_iters) == ("samples", 26, 6, None)
    c = parse_config(base(tmp_path, "--train-iters", "6"), world_size=1)
    assert (c.training.schedule_unit, c.optimizer.lr_decay_iters) == ("iterations", 6)


def test_sample_schedule_curve():
    """Counting samples: equal to the step-counting curve where they coincide, and
    Megatron's lr * samples / warm-up samples where the warm-up is no whole step."""
    it = LRSchedule(1.0, 0.1, 2, 5, "cosine")
    sa = LRSchedule(1.0, 0.1, 8, 20, "cosine", unit="samples", samples_per_step=4)
    for _ in range(7):
        assert sa.get_lr() == it.get_lr()
        it.step()
        sa.step()
    odd = LRSchedule(1.0, 0.0, 10, 40, "linear", unit="samples", samples_per_step=4)
    lrs = []
    for _ in range(4):
        lrs.append(odd.get_lr())
        odd.step()
    assert lrs == [0.4, 0.8, 1.0 - 2 / 30, 1.0 - 6 / 30]  # warm-up ends inside step 3
    assert (odd.num_steps, odd.num_samples) == (4, 16)


def test_schedule_load_state_dict_rules():
    saved = LRSchedule(1.0, 0.1, 2, 5, "cosine", num_steps=3, num_samples=12).state_dict()
    longer = dict(max_lr=1.0, min_lr=0.1, warmup_steps=2, decay_steps=9, decay_style="cosine",
                  samples_per_step=4)
    with pytest.raises(ScheduleMismatchError, match=r"decay 9 \(checkpoint: 5\)"):
        LRSchedule(**longer).load_state_dict(saved)
    flags = LRSchedule(**longer, override=True)
    flags.load_state_dict(saved)
    assert (flags.decay_steps, flags.num_steps) == (9, 3)
    ours = LRSchedule(**longer, use_checkpoint=True)
    ours.load_state_dict(saved)
    assert (ours.decay_steps, ours.num_steps) == (5, 3)
    # a switch to samples under the override continues at the samples already consumed
    sa = LRSchedule(1.0, 0.1, 8, 20, "cosine", unit="samples", samples_per_step=4, override=True)
    sa.load_state_dict(saved)
    assert sa.position == 12 and sa.get_lr() == LRSchedule(1.0, 0.1, 2, 5, "cosine",
                                                           num_steps=3).get_lr()
    same = LRSchedule(1.0, 0.1, 2, 5, "cosine")
    same.load_state_dict(saved)  # equal settings: the position only
    assert same.num_steps == 3
    imported = LRSchedule(**longer)  # a converter's checkpoint records no settings
    imported.load_state_dict({"num_steps": 0, "num_samples": 0})
    assert (imported.decay_steps, imported.num_steps) == (9, 0)


# ------------------------------------------------------------------ training runs
def test_sample_based_run_equals_iteration_based(runs):
    tmp, out = runs
    a, b = out["iters"], out["samples"]
    assert sorted(b["losses"]) == [1, 2, 3, 4, 5, 6] and b["consumed"] == 24
    assert b["losses"] == a["losses"]  # bit-identical: same batches, same lr per step
    lr_a = [r["lr"] for r in metrics(tmp / "iters.jsonl")]
    lr_b = [r["lr"] for r in metrics(tmp / "samples.jsonl")]
    assert lr_a == lr_b and lr_a[0] == pytest.approx(2.5e-3) and lr_a[-1] == 1e-4


def test_sample_based_resume_is_exact_and_truncates_the_metrics_file(runs, tmp_path, capfd):
    """Resumed at iteration 3 (a crash after 6 logged lines): the file's lines 4..6
    are removed, then logged again by the resumed run, which repeats the
    uninterrupted losses; the file ends with one line per iteration."""
    tmp, out = runs
    ck = tmp_path / "ck"
    shutil.copytree(tmp / "samples", ck)
    paths.write_tracker(str(ck), 3)
    m = tmp_path / "m.jsonl"
    shutil.copy(tmp / "samples.jsonl", m)
    with open(m, "a") as f:
        f.write('{"type": "train", "iteration": 7, "lm_lo')  # a line cut off by the kill
    capfd.readouterr()
    b = train(base(tmp_path, *SAMPLES, "--load", str(ck), "--metrics-file", str(m)))
    assert sorted(b["losses"]) == [4, 5, 6] and b["consumed"] == 24
    assert all(b["losses"][i] == out["samples"]["losses"][i] for i in (4, 5, 6))
    assert f"metrics file {m}: removed 4 line(s) after iteration 3" in capfd.readouterr().out
    rows = metrics(m)
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r["lm_loss"] for r in rows] == [out["samples"]["losses"][i] for i in range(1, 7)]


def test_drop_records_after_and_plot_one_history(tmp_path):
    path = tmp_path / "m.jsonl"
    rows = ([{"type": "train", "iteration": i, "lm_loss": 9.0 - i} for i in (1, 2, 3, 4)]
            + [{"type": "validation", "iteration": 4, "val_loss": 1.0}]
            + [{"type": "train", "iteration": i, "lm_loss": 5.0 - i} for i in (3, 4, 5)])
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    from megaq.cli import plot_metrics as plot
    # an old file, resumed at 2 without truncation: the resumed run's 3..5 win
    assert plot.series(rows, "lm_loss") == ([1, 2, 3, 4, 5], [8.0, 7.0, 2.0, 1.0, 0.0])
    assert plot.series(rows, "val_loss", "validation") == ([4], [1.0])
    assert drop_records_after(str(path), 2) == 6
    assert [r["iteration"] for r in metrics(path)] == [1, 2]
    assert drop_records_after(str(path), 2) == 0


def _schedule_trainer_ck(runs, tmp_path, name="iters"):
    tmp, _ = runs
    ck = tmp_path / "ck"
    shutil.copytree(tmp / name, ck)
    paths.write_tracker(str(ck), 3)
    return ck


def test_changed_schedule_on_resume_refused_unless_overridden(runs, tmp_path):
    """The issue's trial: a longer --train-iters on resume (the decay follows it) used to
    move the LR silently. Now it is refused; the override flags pick a side."""
    ck = _schedule_trainer_ck(runs, tmp_path)
    longer = ["--train-iters", "10", "--lr-warmup-iters", "2"]  # decay default 10 (was 5)
    r = setup(base(tmp_path, *longer, "--load", str(ck)))
    assert "the LR schedule differs from the checkpoint's: decay 10 (checkpoint: 5)" in r["error"]
    assert "--override-opt_param-scheduler" in r["error"]
    same = setup(base(tmp_path, *ITERS, "--load", str(ck)))
    over = setup(base(tmp_path, *longer, "--load", str(ck), "--override-opt_param-scheduler"))
    keep = setup(base(tmp_path, *longer, "--load", str(ck), "--use-checkpoint-opt_param-scheduler"))
    assert same["iteration"] == over["iteration"] == keep["iteration"] == 3
    assert keep["lr"] == same["lr"] and keep["schedule"]["decay_steps"] == 5
    assert over["schedule"]["decay_steps"] == 10 and over["schedule"]["num_steps"] == 3
    expect = LRSchedule(5e-3, 1e-4, 2, 10, "cosine", num_steps=3).get_lr()
    assert over["lr"] == expect and over["lr"] > same["lr"]
    # --no-load-optim: no optimizer state, schedule settings from the flags, position kept
    fresh = setup(base(tmp_path, *longer, "--load", str(ck), "--no-load-optim"))
    assert fresh["lr"] == expect and fresh["moments_zero"] and fresh["iteration"] == 3


def test_schedule_mismatch_is_one_error_line_from_the_cli(runs, tmp_path):
    ck = _schedule_trainer_ck(runs, tmp_path)
    r = subprocess.run([sys.executable, os.path.join(REPO, "pretrain_gpt.py"),
                        *base(tmp_path, *ITERS[:2], "--lr-warmup-iters", "2", "--lr", "6e-3",
                              "--load", str(ck))],
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "WORLD_SIZE": "1", "OMP_NUM_THREADS": "1"})
    assert r.returncode == 2 and "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "error: the LR schedule differs from the checkpoint's: --lr 0.006 (checkpoint: 0.005); "
        "decay 6 (checkpoint: 5)"), r.stderr


def test_finetune_resets_iteration_and_loads_weights(runs, tmp_path):
    tmp, _ = runs
    ck = str(tmp / "iters")  # latest: iteration 6
    r = setup(base(tmp_path, "--train-iters", "4", "--lr", "1e-3", "--finetune", "--load", ck))
    assert (r["iteration"], r["consumed"], r["step"]) == (0, 0, 0)
    assert r["moments_zero"] and r["schedule"]["num_steps"] == 0
    assert r["lr"] == LRSchedule(1e-3, 1e-4, 0, 4, "cosine").get_lr()  # the flags', from 0
    want = saved_params(ck, 6)
    assert r["params"].keys() == want.keys()
    assert all(torch.equal(r["params"][k], want[k]) for k in want)
    # and it trains from there, saving its own iterations 1..2
    out = train(base(tmp_path, "--train-iters", "2", "--finetune", "--load", ck,
                     "--save", str(tmp_path / "ft")))
    assert sorted(out["losses"]) == [1, 2] and paths.read_tracker(str(tmp_path / "ft")) == 2
    empty = setup(base(tmp_path, "--train-iters", "2", "--finetune", "--load",
                       str(tmp_path / "none")))
    assert "--finetune: " in empty["error"] and "holds no checkpoint" in empty["error"]


def test_load_of_something_else_than_a_checkpoint_root_is_refused(runs, tmp_path):
    """A --load that names a file, one iteration's directory or a Hugging Face model is a
    mistake, not a fresh start: one line saying what it is and what to pass instead. An
    empty or missing directory still starts from scratch, as in Megatron-LM."""
    tmp, _ = runs
    ck = str(tmp / "iters")
    it = paths.iteration_dir(ck, 6)
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"")
    for path, flag, line in (
            (it, "--load", f"--load {it} is one iteration of the checkpoint {ck}; name the checkpoint "
                           f"directory itself"),
            (paths.model_file(it, 0, 0), "--load", "is a file; name the checkpoint directory"),
            (str(hf), "--load", f"--load {hf} is a Hugging Face model directory, not a megaq "
                                f"checkpoint; convert it with `python tools/convert_checkpoint.py "
                                f"--from hf --to megaq"),
            (it, "--pretrained-checkpoint", f"--pretrained-checkpoint {it} is one iteration")):
        r = setup(base(tmp_path, "--train-iters", "2", flag, path))
        assert line in r.get("error", ""), r.get("error")
    fresh = setup(base(tmp_path, "--train-iters", "2", "--load", str(tmp_path / "empty")))
    assert (fresh["iteration"], fresh["step"]) == (0, 0)
    # a tracker file that is not text is a damaged tracker, not a traceback
    bad = tmp_path / "bad"
    shutil.copytree(ck, bad)
    (bad / paths.TRACKER_FILE).write_bytes(b"\xff\xfe")
    r = setup(base(tmp_path, "--train-iters", "2", "--load", str(bad)))
    assert "not an iteration number" in r["error"], r["error"]


def test_unwritable_save_and_metrics_paths_are_one_line(tmp_path):
    """A regular file where --save or --metrics-file needs a directory: the flag, the path
    and the OS's reason, not an OSError traceback."""
    blocker = tmp_path / "afile"
    blocker.write_text("")
    r = setup(base(tmp_path, "--train-iters", "1", "--save", str(blocker / "ck")))
    assert f"--save {blocker / 'ck'}: cannot write there" in r["error"], r["error"]
    r = setup(base(tmp_path, "--train-iters", "1", "--metrics-file", str(blocker / "m.jsonl")))
    assert f"--metrics-file {blocker / 'm.jsonl'}: cannot append to it" in r["error"], r["error"]


def test_pretrained_checkpoint_starts_then_resumes_from_load(runs, tmp_path):
    tmp, _ = runs
    ft = str(tmp_path / "ft")
    flags = ["--pretrained-checkpoint", str(tmp / "iters"), "--load", ft, "--save", ft,
             "--lr-decay-iters", "4"]
    first = train(base(tmp_path, "--train-iters", "2", *flags))
    assert sorted(first["losses"]) == [1, 2]  # a fine-tuning start: iteration 0
    r = setup(base(tmp_path, "--train-iters", "4", *flags))
    assert (r["iteration"], r["consumed"], r["schedule"]["num_steps"]) == (2, 2 * GBS, 2)
    assert not r["moments_zero"]  # resumed from --load: the fine-tuning run's own state
    bad = setup(base(tmp_path, "--train-iters", "2", "--pretrained-checkpoint",
                     str(tmp_path / "none")))
    assert "--pretrained-checkpoint" in bad["error"] and "holds no checkpoint" in bad["error"]


def test_no_save_optim_is_smaller_and_needs_no_load_optim(runs, tmp_path):
    tmp, out = runs
    ck = str(tmp_path / "ck")
    small = train(base(tmp_path, *ITERS, "--save", ck, "--save-interval", "3",
                       "--no-save-optim"))
    assert small["losses"] == out["iters"]["losses"]  # saving less changes no step
    size = lambda root: os.path.getsize(paths.model_file(paths.iteration_dir(root, 6), 0, 0))  # noqa: E731
    assert size(ck) < 0.5 * size(str(tmp / "iters"))  # weights only: about a third
    refused = setup(base(tmp_path, *ITERS, "--load", ck))
    assert ("was saved with --no-save-optim (no optimizer state); load it with "
            "--no-load-optim") in refused["error"]
    r = setup(base(tmp_path, *ITERS, "--load", ck, "--no-load-optim"))
    assert (r["iteration"], r["consumed"], r["schedule"]["num_steps"]) == (6, 24, 6)
    assert r["moments_zero"]
    assert all(torch.equal(r["params"][k], v) for k, v in saved_params(ck, 6).items())
    assert setup(base(tmp_path, *ITERS, "--load", ck, "--finetune"))["iteration"] == 0


def test_no_save_optim_tp2_finetunes_at_tp1(tmp_path):
    """A weights-only checkpoint saved at TP=2 is resharded for one process by --finetune
    (the reshard path reads weights without moments): the loaded weights are the
    checkpoint's, consolidated."""
    ck = str(tmp_path / "ck")
    pad = ["--make-vocab-size-divisible-by", "32"]  # the same padded vocab at TP 1 and 2
    run_on_ranks(_train, 2, tp=2, args=(base(tmp_path, *pad, "--tensor-model-parallel-size",
                                             "2", "--train-iters", "2", "--save", ck,
                                             "--no-save-optim"),))
    r = setup(base(tmp_path, *pad, "--train-iters", "1", "--finetune", "--load", ck))
    assert r["iteration"] == 0 and r["moments_zero"]
    full = load_consolidated_model(paths.iteration_dir(ck, 2))[0]
    assert r["params"].keys() == dict(full.named_parameters()).keys()
    for name, p in full.named_parameters():
        assert torch.equal(r["params"][name], p.detach()), name
