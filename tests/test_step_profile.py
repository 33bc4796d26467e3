"""The emulated cluster's step profile (tools/cluster/profiled_pretrain.py +
netns_step_profile.breakdown): only training steps after the first are profiled, on
the main thread's CPU clock, and their CPU is split into the reference quantizers and
the rest. (The link itself is covered by tests/test_emulated_cluster.py.)"""

import cProfile
import time

import torch

import netns_step_profile  # tools/cluster (pyproject.toml: pytest's pythonpath)
import profiled_pretrain

from megaq import training
from megaq.kernels import reference


def _spin(seconds):
    """Burn this thread's CPU for `seconds` (what the profiler must count)."""
    t, spins = time.thread_time(), 0
    while time.thread_time() - t < seconds:
        spins += 1
    return spins


def test_steps_after_the_first_are_split_into_quantizers_and_rest(tmp_path, monkeypatch):
    x = torch.randn(1 << 16)
    calls = []

    def train_step(self, batches):   # a stand-in step: 20 ms of CPU, then a quantize
        calls.append(batches)
        _spin(0.02)
        return reference.quantize(x, 4, 64, "square")

    monkeypatch.setattr(training.Trainer, "train_step", train_step)
    prof, steps, process_steps = cProfile.Profile(time.thread_time), [], []
    profiled_pretrain.profile_steps(prof, steps, process_steps)
    for i in range(4):
        training.Trainer.train_step(None, i)
    reference.dequantize(reference.quantize(x, 4, 64), x.numel(), 4, 64)  # outside a step
    path = str(tmp_path / "p.r0")
    prof.dump_stats(path)
    assert calls == [0, 1, 2, 3] and len(steps) == len(process_steps) == 3  # not the first
    b = netns_step_profile.breakdown(path, steps, process_steps)
    assert b["iterations"] == 3 and b["collective_waits"] == 0   # no process group here
    # thread_time is the main thread's CPU: each step spins 20 ms of it
    assert b["train_step_cpu_ms"] >= 20 and b["rest_cpu_ms"] >= 19
    # only the quantize inside the steps is charged (the calls outside were not profiled)
    assert 0 < b["quantizer_cpu_ms"] < b["train_step_cpu_ms"]
    assert abs(b["quantizer_cpu_ms"] + b["rest_cpu_ms"] - b["train_step_cpu_ms"]) <= 0.2
    # the process clock covers the main thread and more (0.5 ms: the clocks' own rounding)
    assert b["process_cpu_ms"] >= b["train_step_cpu_ms"] - 0.5


def test_bench_table_gives_speedups_busy_share_and_link_ms():
    """netns_zero_bench's table: speedups against ZeRO-3 and ZeRO++ at the same rate,
    and link ms = busy share x step (the step a link-bound machine would take)."""
    import netns_zero_bench

    def rec(config, step, busy):
        return {"config": config, "rate": "250mbit", "step_ms": step, "link_busy_share": busy,
                "steady_link_bytes_per_iteration": 7e6, "steady_accounted_per_iteration": 7e6,
                "steady_link_over_accounted": 1.0}
    rows = netns_zero_bench.table([rec("ZeRO-3", 1200.0, 0.8), rec("ZeRO++", 800.0, 0.15),
                                   rec("deltas", 400.0, 0.15)]).splitlines()
    assert rows[0].endswith("| link busy share | link ms |")
    assert rows[4] == ("| 250mbit | deltas | 400 | 3.00x | 2.00x | 7.00 | 7.00 | 1.000 | 15% | 60 |")
    assert rows[2].endswith("| 80% | 960 |")


def test_bench_ranks_run_gloo_on_the_device_asked_for():
    """The benchmark's ranks always name gloo (the emulated link carries gloo's TCP; on a
    GPU host the default would be NCCL, which needs a GPU per rank) and the device: the
    argv parses for the benchmark's 2 x 2 world either way."""
    from megaq.config.arguments import parse_config
    for device in ("cpu", "cuda"):
        argv = netns_step_profile.bench.model_args(2, 256, 16, 1, 2, 7, device)
        config = parse_config(argv[1:], world_size=4, ranks_per_node=2)
        assert config.parallel.distributed_backend == "gloo"
        assert config.parallel.device == device
