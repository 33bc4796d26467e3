"""Reading an emulated-cluster run: link counters per training iteration vs megaq's
own byte accounting, and step times, optionally over a schedule of link rates.

The trainer's metrics file (megaq.runtime.metrics) has one JSON line per iteration (with
--log-interval 1) holding ``elapsed_ms``, ``nodes`` and ``comm`` = {phase:
{intra_node, inter_node}} bytes sent per node (averaged over nodes). The sampler
reads the veth counters the moment each line appears, so counter differences between
two lines are the traffic of the iterations in between.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass

from netns_link import EmulatedLink, rate_to_bits

# Per-frame header bytes that the veth counters include but a collective's payload does
# not: Ethernet 14 + IPv4 20 + TCP 20 + TCP timestamp option 12 (Linux default).
FRAME_HEADER_BYTES = 14 + 20 + 20 + 12


@dataclass
class Segment:
    """Iterations [first, last] (1-based) ran at `rate`; [timed_first, last] are timed."""

    rate: str
    first: int
    timed_first: int
    last: int


def plan_segments(rates: list[str], iters_per_rate: int, warmup: int, settle: int) -> list[Segment]:
    """Warm-up iterations at the first rate, then `iters_per_rate` per rate; after each
    rate change the first `settle` iterations are left out of the timing (the change
    lands while an iteration may be in flight)."""
    segs, first = [], warmup + 1
    for i, rate in enumerate(rates):
        last = first + iters_per_rate - 1
        segs.append(Segment(rate, first, first + (settle if i else 0), last))
        first = last + 1
    if any(s.timed_first > s.last for s in segs):
        raise ValueError(f"{iters_per_rate} iterations per rate leave none to time after "
                         f"{settle} settling iteration(s): use more --iters-per-rate")
    return segs


class IterationSampler:
    """Counters at the moment each metrics line appears; switches the link's rate when
    a segment ends. poll() is called every ~2 ms by the launcher."""

    def __init__(self, link: EmulatedLink, metrics_file: str,
                 segments: list[Segment] | None = None):
        self.link, self.path, self.segments = link, metrics_file, segments or []
        self.samples: dict[int, list] = {}   # training iteration -> counters of both ends
        self._size, self.t0, self.first_line_s = -1, time.perf_counter(), None
        self.rate_changes: list[tuple[int, str, float]] = []

    def poll(self) -> None:
        try:
            size = os.path.getsize(self.path)
        except OSError:
            return
        if size == self._size:
            return
        self._size = size
        counters = [self.link.counters(n) for n in (0, 1)]   # read first: least delay
        it = last_train_iteration(self.path)
        if it and it not in self.samples:
            self.samples[it] = counters
            if self.first_line_s is None:
                self.first_line_s = time.perf_counter() - self.t0
            for seg in self.segments[1:]:
                if it == seg.first - 1 and self.link.rate != seg.rate:
                    t = time.perf_counter()
                    self.link.set_rate(seg.rate)
                    self.rate_changes.append((it, seg.rate, round(time.perf_counter() - t, 4)))


def last_train_iteration(path: str) -> int | None:
    """Iteration number of the last complete training line (validation lines skipped)."""
    with open(path, "rb") as f:
        data = f.read()
    for raw in reversed(data[: data.rfind(b"\n") + 1].splitlines()):
        try:
            line = json.loads(raw)
        except ValueError:
            continue
        if line.get("type", "train") == "train" and "iteration" in line:
            return int(line["iteration"])
    return None


def inter_node_bytes(line: dict) -> float:
    """All nodes' inter-node bytes of one line (the file holds the per-node mean)."""
    return sum(v.get("inter_node", 0) for v in line.get("comm", {}).values()) * line.get("nodes", 2)


def by_phase(line: dict) -> dict[str, float]:
    nodes = line.get("nodes", 2)
    return {p: v.get("inter_node", 0) * nodes for p, v in line.get("comm", {}).items()}


def window(lines: list[dict], samples: dict, before: list, seg: Segment) -> dict:
    """One segment: median step time, link bytes per iteration vs megaq's accounting."""
    timed = [x for x in lines if seg.timed_first <= x["iteration"] <= seg.last]
    if not timed:
        raise RuntimeError(f"no metrics lines for iterations {seg.timed_first}..{seg.last}: "
                           f"run pretrain_gpt.py with --log-interval 1")
    out = {"rate": seg.rate, "rate_bits": rate_to_bits(seg.rate),
           "iterations_timed": [seg.timed_first, seg.last],
           "step_ms": round(statistics.median(x["elapsed_ms"] for x in timed), 1),
           "step_ms_all": [round(x["elapsed_ms"], 1) for x in timed],
           "loss_last": timed[-1].get("lm_loss"),
           "accounted_by_phase_per_iteration": {
               k: int(v) for k, v in sorted(by_phase(timed[-1]).items())}}
    acc = sum(inter_node_bytes(x) for x in timed) / len(timed)
    start = samples.get(seg.timed_first - 1, before if seg.timed_first == 1 else None)
    end = samples.get(seg.last)
    out["steady_accounted_per_iteration"] = acc
    if start is not None and end is not None:
        diff = [b - a for a, b in zip(start, end)]
        n = seg.last - seg.timed_first + 1
        link = sum(d.tx_bytes for d in diff)
        packets = sum(d.tx_packets for d in diff)
        out.update(
            steady_link_bytes_per_iteration=link / n,
            steady_link_bytes_per_direction=[d.tx_bytes / n for d in diff],
            steady_header_bytes_per_iteration=packets * FRAME_HEADER_BYTES / n,
            steady_link_over_accounted=round(link / n / acc, 4) if acc else None)
        # the busier direction's transmit time at the nominal rate, as a share of the step
        busy_s = max(d.tx_bytes for d in diff) / n / (rate_to_bits(seg.rate) / 8)
        out["link_busy_share"] = round(busy_s / (out["step_ms"] / 1e3), 3)
    return out


def whole_run(lines: list[dict], veth: list, lo: list) -> dict:
    """Totals over the whole run (set-up and teardown traffic included)."""
    accounted, prev = 0.0, 0
    for x in lines:
        accounted += inter_node_bytes(x) * (x["iteration"] - prev)
        prev = x["iteration"]
    link = sum(v.tx_bytes for v in veth)
    packets = sum(v.tx_packets for v in veth)
    return {
        "iterations": lines[-1]["iteration"] if lines else 0,
        "link_bytes": link,
        "link_bytes_per_direction": [v.tx_bytes for v in veth],
        "link_packets": packets,
        "link_header_bytes": packets * FRAME_HEADER_BYTES,
        "loopback_bytes": [v.tx_bytes for v in lo],
        "accounted_inter_node_bytes": int(accounted),
        "link_over_accounted": round(link / accounted, 4) if accounted else None,
    }
