"""Megatron's --profile: a window of training iterations under a profiler.

With --use-pytorch-profiler the window runs under torch.profiler and leaves a Chrome /
Perfetto trace (rank<r>.trace.json) in the profile directory, prints the kernels that
took the most device time, and one line that says how busy the device was:

    profile: rank 0, iterations 11-12: T ms per iteration, device busy B ms (P%),
    idle I ms in N gaps (largest G ms; S ms in M under 2 us)

The idle time is what the host costs the step (a host sync, data loading, kernel
launches the device waits for) and what the device spends between kernels (the gaps
under 2 us, paid per kernel even while the host is far ahead); the largest gaps follow,
each with the kernels around it and the host op that launched the next
(:func:`idle_gaps`), and the idle time summed by that op (:func:`idle_by_launcher`),
both by :func:`gap_report`. Without --use-pytorch-profiler the window is marked for
Nsight Systems (cudaProfilerStart / Stop: `nsys profile --capture-range=cudaProfilerApi`),
as Megatron-LM does.
"""

from __future__ import annotations

import json
import os
import time

import torch

# Kernels, copies and fills: what keeps the device busy in a Chrome trace ("cat").
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def _busy_spans(events) -> list[list]:
    """The union of events' [ts, ts + dur] intervals (several streams' kernels overlap),
    in time order: [start, end, the event that began it, the event that ends it] each."""
    spans: list[list] = []
    for e in sorted(events, key=lambda e: e["ts"]):
        lo, hi = e["ts"], e["ts"] + e["dur"]
        if spans and lo <= spans[-1][1]:
            if hi > spans[-1][1]:
                spans[-1][1], spans[-1][3] = hi, e
        else:
            spans.append([lo, hi, e, e])
    return spans


def device_busy(events, start_us: float, end_us: float):
    """(busy us, idle gaps in us) of the device between start_us and end_us, from Chrome
    trace events with "ts" and "dur" (microseconds): the union of their intervals, so
    kernels on several streams that overlap count once."""
    clipped = [{"ts": max(e["ts"], start_us), "dur": min(e["ts"] + e["dur"], end_us)
                - max(e["ts"], start_us)}
               for e in events if e["ts"] < end_us and e["ts"] + e["dur"] > start_us]
    spans = _busy_spans(clipped)
    edges = [start_us] + [x for lo, hi, _, _ in spans for x in (lo, hi)] + [end_us]
    gaps = [hi - lo for lo, hi in zip(edges[::2], edges[1::2]) if hi > lo]
    return sum(hi - lo for lo, hi, _, _ in spans), gaps


class StepProfiler:
    """Profiles iterations start+1 .. end (Megatron's --profile-step-start / -end count
    completed iterations) on the ranks listed; `before_step(i)` / `after_step(i)` are
    called around each training step with the number of completed iterations."""

    def __init__(self, logging_config, rank: int, device: torch.device, out_dir: str):
        log = logging_config
        self.on = log.profile and rank in log.profile_ranks
        self.torch_profiler = log.use_pytorch_profiler
        self.start, self.end = log.profile_step_start, log.profile_step_end
        self.rank, self.device, self.out_dir = rank, device, out_dir
        self._prof = None
        self._t0 = None

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def before_step(self, completed: int) -> None:
        if not self.on or completed != self.start:
            return
        self._sync()  # the window starts with an idle device, whatever came before
        if self.torch_profiler:
            from torch.profiler import ProfilerActivity, profile
            activities = [ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(ProfilerActivity.CUDA)
            self._prof = profile(activities=activities)
            self._prof.__enter__()
        elif self.device.type == "cuda":
            torch.cuda.cudart().cudaProfilerStart()
        self._t0 = time.perf_counter()

    def after_step(self, completed: int) -> None:
        if not self.on or self._t0 is None or completed != self.end:
            return
        self._sync()
        wall_us = (time.perf_counter() - self._t0) * 1e6
        iterations = self.end - self.start
        if not self.torch_profiler:
            if self.device.type == "cuda":
                torch.cuda.cudart().cudaProfilerStop()
            self._t0 = None
            return
        prof, self._prof, self._t0 = self._prof, None, None
        prof.__exit__(None, None, None)
        os.makedirs(self.out_dir, exist_ok=True)
        path = os.path.join(self.out_dir, f"rank{self.rank}.trace.json")
        prof.export_chrome_trace(path + ".tmp")
        os.replace(path + ".tmp", path)
        sort = "self_cuda_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=sort, row_limit=15, max_name_column_width=70),
              flush=True)
        events = trace_events(path)
        print(self.summary_line(events, path, wall_us, iterations), flush=True)
        report = gap_report(idle_gaps(events), top=5)
        if report:
            print("\n".join(report), flush=True)

    def summary_line(self, events: list[dict], trace_path: str, wall_us: float,
                     iterations: int) -> str:
        head = (f"profile: rank {self.rank}, iterations {self.start + 1}-{self.end}: "
                f"{wall_us / 1e3 / iterations:.1f} ms per iteration")
        busy = trace_busy(events)
        if busy is None:
            return f"{head}; trace {trace_path}"
        n = iterations
        return (f"{head}, device busy {busy['busy_us'] / 1e3 / n:.1f} ms "
                f"({100 * busy['busy_fraction']:.1f}%), idle {busy['idle_us'] / 1e3 / n:.1f} ms "
                f"in {busy['gaps'] / n:.0f} gaps (largest {busy['largest_gap_us'] / 1e3:.1f} ms; "
                f"{busy['small_gaps_us'] / 1e3 / n:.1f} ms in {busy['small_gaps'] / n:.0f} under "
                f"{SMALL_GAP_US:g} us); "
                f"trace {trace_path}")


# host calls that make the host wait for the device (or for the driver): a gap in which
# one of these ran was the host's wait, not its launch rate. By exact name, besides every
# *Synchronize: cudaMemcpyAsync and cudaStreamWaitEvent return at once, cudaMemcpy and
# cudaFree wait for the device
BLOCKING_CALLS = ("cudaMemcpy", "cudaFree", "cudaMalloc", "cudaHostAlloc", "cudaFreeHost")


def _blocking(name: str) -> bool:
    return name in BLOCKING_CALLS or name.endswith("Synchronize")


# a gap shorter than this is the device's own time between two kernels (a launch that
# came late leaves more): idle_gaps lists only longer ones, trace_busy sums the shorter
SMALL_GAP_US = 2.0
# trace_busy's split of the gaps between kernels by size: [0, 1), [1, 2), ... [100, inf) us
GAP_SIZE_EDGES_US = (1.0, SMALL_GAP_US, 10.0, 100.0)


def idle_gaps(events, min_gap_us: float = SMALL_GAP_US) -> list[dict]:
    """The device's idle gaps in a Chrome trace's events, largest first, between its first
    and its last device event (a window's start, an idle device waiting for the first
    launch, is left out), each with what ended before it, what started after it, the host
    op that launched the latter (the kernel's "External id") and the blocking host calls
    that ran during it. `host_bound`: the kernel after the gap was launched less than 5 us
    before it started, so the device was waiting for the host to launch it, not for a
    dependency."""
    device = _device_events(events)
    ops = {e["args"]["External id"]: e["name"] for e in events
           if e.get("cat") in ("cpu_op", "user_annotation") and "External id" in e.get("args", {})}
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    blocking = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver") and "dur" in e
                and _blocking(e["name"])]
    spans = _busy_spans(device)
    gaps = []
    for (_, end, _, before), (start, _, after, _) in zip(spans, spans[1:]):
        if start - end < min_gap_us:
            continue
        args = after.get("args", {})
        launch = launches.get(args.get("correlation"))
        gaps.append({
            "start_us": end, "idle_us": start - end, "before": before["name"],
            "after": after["name"], "launched_by": ops.get(args.get("External id"), "?"),
            "host_bound": launch is not None and start - (launch["ts"] + launch["dur"]) < 5.0,
            "blocking_calls": sorted({b["name"] for b in blocking
                                      if b["ts"] < start and b["ts"] + b["dur"] > end})})
    return sorted(gaps, key=lambda g: -g["idle_us"])


def _why(gap: dict) -> str:
    return ", ".join(gap["blocking_calls"]) or ("host launch" if gap["host_bound"] else "dependency")


def gap_lines(gaps: list[dict]) -> list[str]:
    """One line a gap (idle_gaps' dicts): how long, between what, and why."""
    return [f"  idle {g['idle_us'] / 1e3:.2f} ms: after {g['before'][:60]}, before "
            f"{g['after'][:60]} (launched by {g['launched_by'][:50]}; {_why(g)})" for g in gaps]


def idle_by_launcher(gaps: list[dict], top: int = 5) -> list[str]:
    """Lines of the idle time of `gaps` (idle_gaps' dicts) summed by the host op that
    launched the kernel after each gap, and why it waited, largest first: many short gaps
    (a host that only just keeps ahead) add up to what no single gap shows."""
    total: dict = {}
    for g in gaps:
        key = (g["launched_by"], _why(g))
        us, n = total.get(key, (0.0, 0))
        total[key] = (us + g["idle_us"], n + 1)
    rows = sorted(total.items(), key=lambda kv: -kv[1][0])[:top]
    return [f"  idle {us / 1e3:.2f} ms in {n} gaps before kernels launched by {op[:50]} ({why})"
            for (op, why), (us, n) in rows]


def gap_report(gaps: list[dict], top: int) -> list[str]:
    """The lines --profile and bench_train.py --profile print after the busy summary: the
    `top` largest of `gaps` (idle_gaps' dicts, largest first), then the idle time summed by
    launching op. Empty without gaps."""
    if not gaps:
        return []
    return (["largest idle gaps:"] + gap_lines(gaps[:top])
            + ["idle by launching op:"] + idle_by_launcher(gaps))


def trace_busy(events: list[dict]) -> dict | None:
    """How busy the device was over a Chrome trace's window (its events, from the first
    host event to the last event's end): busy and idle microseconds, the idle gaps' count
    and largest, how long the window ran before the first kernel, how much of the idle
    time lies in gaps between kernels shorter than SMALL_GAP_US (a step of many small
    kernels pays those even while the host keeps far ahead), and those gaps' count and sum
    by size (GAP_SIZE_EDGES_US). None when the trace has no device events (a CPU run)."""
    device = _device_events(events)
    host = [e for e in events if e.get("ph") == "X" and "dur" in e
            and e.get("cat") not in DEVICE_CATEGORIES]
    if not device or not host:
        return None
    start = min(e["ts"] for e in host)
    end = max(e["ts"] + e["dur"] for e in host + device)
    busy, gaps = device_busy(device, start, end)
    first = min(e["ts"] for e in device)
    last = max(e["ts"] + e["dur"] for e in device)
    # the gaps between kernels: not the window's start nor its end (host work after them)
    between = gaps[int(first > start):len(gaps) - int(end > last)]
    bounds = (0.0,) + GAP_SIZE_EDGES_US + (float("inf"),)
    by_size = []
    for lo, hi in zip(bounds, bounds[1:]):
        sel = [g for g in between if lo <= g < hi]
        by_size.append({"from_us": lo, "to_us": hi, "gaps": len(sel), "idle_us": sum(sel)})
    small = [b for b in by_size if b["to_us"] <= SMALL_GAP_US]  # SMALL_GAP_US is an edge
    return {"busy_us": busy, "idle_us": end - start - busy, "busy_fraction": busy / (end - start),
            "gaps": len(gaps), "largest_gap_us": max(gaps, default=0.0),
            "small_gaps": sum(b["gaps"] for b in small),
            "small_gaps_us": sum(b["idle_us"] for b in small), "gaps_by_size": by_size,
            # the window's start: the host's first op until the device's first kernel
            "before_first_kernel_us": first - start}


def device_time_by(events: list[dict], key) -> dict[str, float]:
    """Device microseconds of a Chrome trace's events (kernels, copies, memsets), summed by
    ``key(name)``. From the trace, not the profiler's key_averages: those also give the op
    that launched a kernel that kernel's time as its own "self" device time, so a sum over
    their rows counts it twice."""
    out: dict[str, float] = {}
    for e in _device_events(events):
        k = key(e["name"])
        out[k] = out.get(k, 0.0) + e["dur"]
    return out


def _device_events(events) -> list[dict]:
    return [e for e in events if e.get("cat") in DEVICE_CATEGORIES and "dur" in e]


def trace_events(trace_path: str) -> list[dict]:
    """A Chrome trace's events (torch.profiler's export_chrome_trace)."""
    with open(trace_path) as f:
        return json.load(f).get("traceEvents", [])
