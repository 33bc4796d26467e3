"""Megatron's logging flags: the [timestamp] iteration line with --log-throughput and
--log-params-norm (the norm of the whole model, from the shards, no gather),
--timing-log-level 1/2 timer blocks, --log-memory-to-tensorboard (and each rank's peak
in the metrics file), and --wandb-* (the TensorBoard scalars to wandb; one error line
when wandb is not installed). wandb itself is not a test dependency: a stand-in module
records what megaq hands it; likewise a stand-in SummaryWriter records the TensorBoard
tags, which must be Megatron-LM's."""

import importlib.machinery
import importlib.util
import json
import math
import re
import sys
import types

import pytest
import torch

from megaq.runtime import logging_utils
from megaq.config.arguments import ArgumentsError, parse_config
from megaq.runtime.logging_utils import timers_block
from megaq.testing.ranks import run_on_ranks

LINE = re.compile(r"^ \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] iteration +(\d+)/ +\d+ \|")


def _argv(tmp_path, extra=()):
    return ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
            "--train-iters", "2", "--lr", "1e-2", "--mock-data", "--vocab-size", "64",
            "--log-interval", "1", "--eval-iters", "0", "--data-cache-path",
            str(tmp_path / "cache"), *extra]


def _train(topo, argv):
    from megaq.pretrain import main
    return main(argv, topo=topo).losses


def test_log_line_throughput_params_norm_timers_and_memory_at_pp2(tmp_path, capfd):
    from megaq.checkpoint.consolidate import load_consolidated_model

    metrics = tmp_path / "m.jsonl"
    argv = _argv(tmp_path, ["--pipeline-model-parallel-size", "2", "--log-throughput",
                            "--log-params-norm", "--timing-log-level", "2",
                            "--log-memory-to-tensorboard", "--metrics-file", str(metrics),
                            "--save", str(tmp_path / "ck")])
    capfd.readouterr()
    run_on_ranks(_train, 2, pp=2, args=(argv,))
    out = capfd.readouterr().out.splitlines()
    lines = [i for i, line in enumerate(out) if LINE.match(line)]
    assert [LINE.match(out[i]).group(1) for i in lines] == ["1", "2"]
    for i in lines:
        assert "| throughput per GPU (TFLOP/s/GPU): " in out[i]
        assert "| tokens per second per GPU: " in out[i] and "| params norm: " in out[i]
        # Megatron's timer block follows the line, every timed phase of both levels
        assert out[i + 1] == "(min, max) time across ranks (ms):"
        names = {m.group(1) for m in (re.match(r"^    (\S+) \.+: \([\d.]+, [\d.]+\)$", x)
                                      for x in out[i + 2:i + 12]) if m}
        assert {"forward-backward", "all-grads-sync", "optimizer", "batch-generator",
                "forward-compute", "backward-compute", "pipeline-p2p",
                "optimizer-clip-main-grad", "optimizer-inner-step"} <= names, names
    rows = [r for r in map(json.loads, open(metrics)) if r["type"] != "plan"]
    assert all(len(r["peak_memory_bytes"]) == 2 and min(r["peak_memory_bytes"]) > 2**20
               for r in rows)
    # the logged norm is the whole model's: the consolidated checkpoint's (tied
    # embedding counted once, though both stages hold a copy)
    model, _ = load_consolidated_model(str(tmp_path / "ck" / "iter_0000002"))
    whole = math.sqrt(sum(float((p.detach().double() ** 2).sum()) for p in model.parameters()))
    assert rows[-1]["params_norm"] == pytest.approx(whole, rel=1e-6)
    assert f"params norm: {whole:.3f} |" in out[lines[-1]]


def test_timers_block_is_megatrons_min_max_over_the_ranks_that_ran_a_phase():
    block = timers_block([{"forward-backward": 0.3, "pipeline-p2p": 0.02},
                          {"forward-backward": 0.5}], iterations=2)
    assert block.splitlines() == [
        "(min, max) time across ranks (ms):",
        "    forward-backward ...............................: (150.00, 250.00)",
        "    pipeline-p2p ...................................: (10.00, 10.00)"]
    assert timers_block([{}, {}], 1) is None


class _FakeWandb(types.ModuleType):
    """What megaq calls of wandb: init(...) -> run with log(dict, step) and finish()."""

    def __init__(self):
        super().__init__("wandb")
        self.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
        self.inits, self.logged, self.finished = [], [], 0

    def init(self, **kw):
        self.inits.append(kw)
        return self

    def log(self, values, step):
        self.logged.append((step, dict(values)))

    def finish(self):
        self.finished += 1


def test_wandb_gets_the_tensorboard_scalars(tmp_path, monkeypatch, capsys):
    from megaq.parallel.topology import Layout, build_topology
    from megaq.pretrain import main

    fake = _FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setattr(logging_utils, "WANDB_HOST", ("127.0.0.1", 9))  # nothing listens
    save_dir = tmp_path / "wb"
    main(_argv(tmp_path, ["--wandb-project", "proj", "--wandb-exp-name", "run1",
                          "--wandb-save-dir", str(save_dir), "--log-params-norm",
                          "--log-memory-to-tensorboard"]), topo=build_topology(Layout(1), 0))
    (init,) = fake.inits
    assert (init["project"], init["name"], init["dir"], init["mode"]) == (
        "proj", "run1", str(save_dir), "offline")  # the server is unreachable: offline
    assert init["config"]["logging"]["wandb_project"] == "proj" and save_dir.is_dir()
    assert "logging to wandb offline" in capsys.readouterr().out
    assert [step for step, _ in fake.logged] == [1, 2] and fake.finished == 1
    keys = set(fake.logged[-1][1])
    assert {"lm loss", "learning-rate", "grad-norm", "iteration-time", "tokens-per-second",
            "throughput", "batch-size", "loss-scale", "params-norm", "mem-max-rss-bytes",
            "zero-memory-bytes/optimizer"} <= keys, keys


# The tags Megatron-LM writes for the quantities megaq logs (megatron/training/training.py:
# training_log, with --log-loss-scale-to-tensorboard (its default), --log-params-norm,
# --log-timers-to-tensorboard, --log-throughput, --log-memory-to-tensorboard; and
# evaluate_and_print_results with --log-validation-ppl-to-tensorboard), each with its
# "vs samples" twin where Megatron writes one. A Megatron dashboard reads these names.
MEGATRON_TAGS = {
    "learning-rate", "learning-rate vs samples", "batch-size", "batch-size vs samples",
    "lm loss", "lm loss vs samples", "loss-scale", "loss-scale vs samples",
    "grad-norm", "grad-norm vs samples", "params-norm", "params-norm vs samples",
    "iteration-time", "throughput",
    "lm loss validation", "lm loss validation vs samples",
    "lm loss validation ppl", "lm loss validation ppl vs samples"}


class _FakeSummaryWriter:
    """Records what megaq hands TensorBoard: the directory, the scalars, the close."""
    written: list = []
    events: list = []

    def __init__(self, log_dir=None, max_queue=10):
        self.events.append(("open", log_dir))

    def add_scalar(self, tag, value, step):
        self.written.append((tag, value, step))

    def flush(self):
        self.events.append(("flush", None))

    def close(self):
        self.events.append(("close", None))


def test_tensorboard_tags_and_start_up_report_are_megatrons(tmp_path, monkeypatch, capsys):
    from megaq.checkpoint.consolidate import load_consolidated_model
    from megaq.parallel.topology import Layout, build_topology
    from megaq.pretrain import main

    module = types.ModuleType("torch.utils.tensorboard")
    module.SummaryWriter = _FakeSummaryWriter
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", module)
    monkeypatch.setattr(_FakeSummaryWriter, "written", [])
    monkeypatch.setattr(_FakeSummaryWriter, "events", [])
    main(_argv(tmp_path, ["--tensorboard-dir", str(tmp_path / "tb"), "--log-params-norm",
                          "--log-memory-to-tensorboard", "--eval-iters", "1",
                          "--eval-interval", "2", "--save", str(tmp_path / "ck")]),
         topo=build_topology(Layout(1), 0))
    out = capsys.readouterr().out.splitlines()
    # Megatron's arguments block: its rules, one dotted line per argparse name, sorted
    start = out.index("------------------------ arguments ------------------------")
    end = out.index("-------------------- end of arguments ---------------------")
    block = out[start + 1:end]
    assert block == sorted(block, key=str.lower)
    entries = dict(re.match(r"^  (\S+) \.* ?(.*)$", x).groups() for x in block)  # no dots past 48
    assert (entries["hidden_size"], entries["micro_batch_size"], entries["world_size"],
            entries["data_parallel_size"], entries["tensorboard_dir"]) == (
        "32", "2", "1", "1", str(tmp_path / "tb"))
    for x in block:  # the dots fill the name to 48 characters, as _print_args does
        name, dots = x.split(" ")[2:4]
        assert len(name) + len(dots) == 48 or len(name) >= 48, x
    # the parameter count of the (only) tensor/pipeline rank: the whole model's
    model, _ = load_consolidated_model(str(tmp_path / "ck" / "iter_0000002"))
    count = sum(p.numel() for p in model.parameters())
    assert (" > number of parameters on (tensor, pipeline) model parallel rank (0, 0): "
            f"{count}") in out
    assert not any("memory (MB)" in x for x in out)  # a CPU run: no CUDA allocator to report
    # one writer on --tensorboard-dir, closed at the end (its events reach the disk)
    events = _FakeSummaryWriter.events
    assert events[0] == ("open", str(tmp_path / "tb")) and events[-1] == ("close", None)
    assert [e for e in events if e[0] == "open"] == [events[0]]
    written = _FakeSummaryWriter.written
    tags = {tag for tag, _, _ in written}
    # megaq's own quantities keep their own names (no Megatron tag to take)
    own = {t for t in tags if t in ("tokens-per-second", "mem-max-rss-bytes")
           or t.startswith("zero-memory-bytes/")}
    assert own >= {"tokens-per-second", "mem-max-rss-bytes", "zero-memory-bytes/optimizer"}
    # a CPU run: no mem-reserved-bytes / mem-allocated-bytes / mem-max-allocated-bytes
    assert tags - own == MEGATRON_TAGS
    by_tag = {}
    for tag, value, step in written:
        by_tag.setdefault(tag, []).append((step, value))
    # the plain tag at the iteration, its twin at the consumed samples (4 per iteration)
    assert [s for s, _ in by_tag["lm loss"]] == [1, 2]
    assert by_tag["lm loss vs samples"] == [(4 * s, v) for s, v in by_tag["lm loss"]]
    assert by_tag["batch-size"] == [(1, 4), (2, 4)] and by_tag["loss-scale"][0] == (1, 1.0)
    (step, val), = by_tag["lm loss validation"]
    assert step == 2 and by_tag["lm loss validation ppl"] == [(2, pytest.approx(math.exp(val)))]
    assert by_tag["lm loss validation ppl vs samples"][0][0] == 8


@pytest.mark.parametrize("extra,message", [
    (["--wandb-project", "p"], "--wandb-project needs --wandb-exp-name NAME (the run's name, "
                               "as Megatron requires)"),
    (["--wandb-exp-name", "e"], "--wandb-exp-name / --wandb-save-dir need --wandb-project NAME"),
    (["--wandb-project", "p", "--wandb-exp-name", "e"], "--wandb-project needs --wandb-save-dir "
     "DIR (or --save, whose wandb/ subdirectory is the default)"),
])
def test_wandb_flag_refusals(tmp_path, monkeypatch, extra, message):
    monkeypatch.setitem(sys.modules, "wandb", _FakeWandb())
    with pytest.raises(ArgumentsError) as e:
        parse_config(_argv(tmp_path, extra), world_size=1)
    assert str(e.value) == message


def test_wandb_not_installed_is_one_error_line(tmp_path, capsys):
    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    from megaq.pretrain import cli
    rc = cli(_argv(tmp_path, ["--wandb-project", "p", "--wandb-exp-name", "e",
                              "--wandb-save-dir", str(tmp_path)]))
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err == ["error: --wandb-project: the wandb package is not installed; "
                               "`pip install wandb`, or drop the --wandb-* flags"]


def test_timing_level_zero_times_nothing():
    t = logging_utils.Timers(0, torch.device("cpu"))
    t.start("forward-backward")
    t.stop("forward-backward")
    assert t.take() == {}
    t = logging_utils.Timers(1, torch.device("cpu"))
    t.start("forward-compute", 2)
    t.stop("forward-compute", 2)
    t.start("optimizer")
    t.stop("optimizer")
    assert set(t.take()) == {"optimizer"}


def test_memory_report_line_is_megatrons_on_cuda(monkeypatch):
    """The CUDA allocator's four figures in MiB, in Megatron's report_memory order; the
    CPU gets no line."""
    mib = 2**20
    for name, value in [("memory_allocated", 100.5), ("max_memory_allocated", 200.25),
                        ("memory_reserved", 300), ("max_memory_reserved", 400)]:
        monkeypatch.setattr(torch.cuda, name, lambda device=None, v=value: int(v * mib))
    line = logging_utils.memory_report_line(3, 1, torch.device("cuda", 0))
    assert line == ("[Rank 3] (after 1 iterations) memory (MB) | allocated: 100.50 | "
                    "max allocated: 200.25 | reserved: 300.00 | max reserved: 400.00")
    assert logging_utils.memory_report_line(0, 1, torch.device("cpu")) is None


def test_device_busy_is_the_union_of_kernel_intervals():
    from megaq.runtime.profiling import device_busy
    # two streams overlapping at 15-20 count once; gaps before, between and after
    ev = [{"ts": 10, "dur": 10}, {"ts": 15, "dur": 10}, {"ts": 40, "dur": 5}]
    busy, gaps = device_busy(ev, 0, 50)
    assert busy == 20 and gaps == [10, 15, 5]
    # clipped to the window
    assert device_busy(ev, 12, 42) == (15, [15])


def test_profile_window_writes_a_trace_and_its_summary(tmp_path, capsys, monkeypatch):
    """--profile --use-pytorch-profiler: iterations 2-3 under torch.profiler, the trace in
    ./profile (no --tensorboard-dir), the top-ops table and the summary line."""
    from megaq.pretrain import cli
    monkeypatch.chdir(tmp_path)
    argv = _argv(tmp_path, ["--train-iters", "4", "--profile", "--use-pytorch-profiler",
                            "--profile-step-start", "1", "--profile-step-end", "3"])
    assert cli(argv) == 0
    out = capsys.readouterr().out
    trace = tmp_path / "profile" / "rank0.trace.json"
    assert trace.exists() and json.load(open(trace))["traceEvents"]
    line = [x for x in out.splitlines() if x.startswith("profile: ")]
    assert line and line[0].startswith("profile: rank 0, iterations 2-3: "), out[-2000:]
    assert "Self CPU time total" in out


def test_profile_window_must_be_ordered(tmp_path):
    with pytest.raises(ArgumentsError, match="--profile-step-start 5 and --profile-step-end 5"):
        parse_config(_argv(tmp_path, ["--profile", "--profile-step-start", "5",
                                      "--profile-step-end", "5"]), world_size=1)


def test_idle_gaps_name_what_the_device_waited_for():
    """The largest gaps between device events, largest first: the kernels around each, the
    host op that launched the one after, and whether the host was blocked (a sync ran in
    the gap) or launching it late (host-bound); the window's start is not a gap. The
    window's summary sums gaps under 2 us apart and splits the gaps between kernels by
    size, and device time by kind counts each kernel once."""
    from megaq.runtime.profiling import (device_time_by, gap_lines, gap_report, idle_by_launcher,
                                         idle_gaps, trace_busy)

    def kernel(name, ts, dur, corr, ext):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur,
                "args": {"correlation": corr, "External id": ext}}

    def sizes(counts, idle):  # trace_busy's gaps_by_size: [0, 1), [1, 2), [2, 10), [10, 100), [100, inf)
        bounds = (0.0, 1.0, 2.0, 10.0, 100.0, float("inf"))
        return [{"from_us": lo, "to_us": hi, "gaps": n, "idle_us": us}
                for lo, hi, n, us in zip(bounds, bounds[1:], counts, idle)]

    def call(name, ts, dur, corr=None):
        return {"ph": "X", "cat": "cuda_runtime", "name": name, "ts": ts, "dur": dur,
                "args": {} if corr is None else {"correlation": corr}}

    events = [
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5, "args": {"External id": 1}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::add", "ts": 95, "dur": 8, "args": {"External id": 2}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mul", "ts": 110, "dur": 5, "args": {"External id": 3}},
        call("cudaLaunchKernel", 1, 3, corr=10), kernel("gemm", 50, 40, 10, 1),
        # a sync on the host from 90 to 100, then add launched at 96-100 and run at 102:
        # 12 us idle, blocked by the sync
        call("cudaStreamSynchronize", 90, 10), call("cudaLaunchKernel", 96, 4, corr=11),
        call("cudaMemcpyAsync", 91, 2), call("cudaStreamWaitEvent", 93, 1),  # neither blocks
        kernel("add_kernel", 102, 10, 11, 2),
        # mul launched long before (at 111) but starts at 160: a dependency, 48 us
        call("cudaLaunchKernel", 111, 3, corr=12), kernel("mul_kernel", 160, 10, 12, 3),
        # a 30-us gap whose kernel was launched 2 us before it ran: the host was late
        call("cudaLaunchKernel", 195, 3, corr=13), kernel("copy", 200, 5, 13, 3),
    ]
    gaps = idle_gaps(events, min_gap_us=10)
    assert [(g["idle_us"], g["before"], g["after"]) for g in gaps] == [
        (48, "add_kernel", "mul_kernel"), (30, "mul_kernel", "copy"), (12, "gemm", "add_kernel")]
    assert [g["launched_by"] for g in gaps] == ["aten::mul", "aten::mul", "aten::add"]
    assert [g["host_bound"] for g in gaps] == [False, True, True]
    assert gaps[2]["blocking_calls"] == ["cudaStreamSynchronize"] and not gaps[0]["blocking_calls"]
    lines = gap_lines(gaps)
    assert "dependency" in lines[0] and "host launch" in lines[1]
    assert "cudaStreamSynchronize" in lines[2] and lines[2].startswith("  idle 0.01 ms: after gemm")
    # the smaller gaps are cut by min_gap_us (2 us by default keeps all three)
    assert len(idle_gaps(events, min_gap_us=20)) == 2 and len(idle_gaps(events)) == 3
    # summed by launching op: aten::mul's kernels ended two gaps, one a dependency, one late
    assert idle_by_launcher(gaps) == [
        "  idle 0.05 ms in 1 gaps before kernels launched by aten::mul (dependency)",
        "  idle 0.03 ms in 1 gaps before kernels launched by aten::mul (host launch)",
        "  idle 0.01 ms in 1 gaps before kernels launched by aten::add (cudaStreamSynchronize)"]
    assert idle_by_launcher(gaps, top=1)[0].startswith("  idle 0.05 ms in 1 gaps")
    # what --profile prints: the top gaps, then the sums
    assert gap_report(gaps, top=1) == (["largest idle gaps:", lines[0], "idle by launching op:"]
                                       + idle_by_launcher(gaps))
    assert gap_report([], top=5) == []
    # a second dependency gap before an aten::mul kernel (25 us) adds to the first (48)
    more = events + [call("cudaLaunchKernel", 206, 3, corr=14), kernel("mul_kernel", 230, 5, 14, 3)]
    assert idle_by_launcher(idle_gaps(more, min_gap_us=10), top=1) == [
        "  idle 0.07 ms in 2 gaps before kernels launched by aten::mul (dependency)"]
    # the window's summary counts the 50 us before the first kernel as idle too
    assert trace_busy(events) == {"busy_us": 65, "idle_us": 140, "busy_fraction": 65 / 205,
                                  "gaps": 4, "largest_gap_us": 50, "small_gaps": 0,
                                  "small_gaps_us": 0, "before_first_kernel_us": 50,
                                  "gaps_by_size": sizes([0, 0, 0, 3, 0], [0, 0, 0, 90, 0])}
    # gaps under 2 us (kernels back to back, the host far ahead) are summed apart: none of
    # them is a gap idle_gaps lists
    tight = [events[0], kernel("a", 0, 10, 20, 1), kernel("b", 10.5, 9.5, 21, 1),
             kernel("c", 21.5, 8.5, 22, 1), kernel("d", 50, 10, 23, 1)]
    # device time by kind: the kernels once each (the host ops that launched them not at all)
    assert device_time_by(events, lambda n: "mm" if n == "gemm" else "rest") == {"mm": 40, "rest": 25}
    busy = trace_busy(tight)
    assert (busy["small_gaps"], busy["small_gaps_us"], busy["idle_us"]) == (2, 2.0, 22.0)
    # by size, only the gaps between kernels (the 50 us before the first one above is not)
    assert busy["gaps_by_size"] == sizes([1, 1, 0, 1, 0], [0.5, 1.5, 0, 20, 0])
    assert [g["idle_us"] for g in idle_gaps(tight)] == [20]
