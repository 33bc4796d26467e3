"""The metrics file (--metrics-file): one JSON object per line, written by global rank 0.

Training lines (one per logged iteration) carry: iteration, consumed_samples, lm_loss,
lr, grad_norm, elapsed_ms (mean per iteration over the logging interval), tokens_per_s,
tflops_per_gpu, skipped_iterations, nan_iterations, comm, zero_model_bytes, nodes,
world_size, and the layout (tp, pp, dp). Validation lines carry iteration and val_loss
(and val_ppl); the one test line (the test split, evaluated at the end of training)
iteration, test_loss and test_ppl. Each line has "type": "train" | "validation" | "test"
(and the planner's first line "plan").

``comm`` is ``{phase: {"intra_node": B, "inter_node": B}}`` where B is the bytes *sent*
per node per training iteration: the collective layer's per-rank counters
(megaq.parallel.comm.STATS, ring model) are summed over the ranks of each node
(comm.per_node_totals), averaged over the nodes, and divided by the number of
iterations in the logging interval. Evaluation and checkpoint traffic is excluded
(the counters are set aside around them), so the numbers describe training steps only.

With --log-comm-time, train lines also carry ``comm_time_ms``: ``{phase: ms}`` per
iteration, the mean over all ranks of the time spent in that phase's collectives, each
run synchronously between two device synchronizations (comm.py, "Time per phase").
"""

from __future__ import annotations

import json
import math
import os

from megaq.parallel import comm


def comm_per_node_per_iteration(world: comm.Group, iterations: int,
                                stats: comm.CommStats = comm.STATS) -> dict:
    """Collective over `world`: averaged bytes per node per iteration, by phase and link."""
    totals = comm.per_node_totals(world, stats)
    nodes = max(1, len(set(world.nodes)))
    out: dict[str, dict[str, float]] = {}
    for per_phase in totals.values():
        for phase, links in per_phase.items():
            d = out.setdefault(phase, {comm.INTRA: 0.0, comm.INTER: 0.0})
            for link, b in links.items():
                d[link] += b
    scale = 1.0 / (nodes * max(1, iterations))
    return {p: {k: v * scale for k, v in links.items()} for p, links in sorted(out.items())}


class SetAside:
    """Context manager: traffic inside the block is not charged to training steps."""

    def __init__(self, stats: comm.CommStats = comm.STATS):
        self.stats = stats

    def __enter__(self):
        self.saved = self.stats.snapshot()
        self.saved_seconds = self.stats.seconds_snapshot()
        return self

    def __exit__(self, *exc):
        self.stats.reset()
        for phase, links in self.saved.items():
            for link, b in links.items():
                self.stats.add(phase, link, b)
        for phase, sec in self.saved_seconds.items():
            self.stats.add_time(phase, sec)
        return False


def _clean(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None  # JSON has no NaN/inf; null says "not a number" to any reader
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    return v


class MetricsFileError(ValueError):
    """The metrics file cannot be opened for appending: a user's path, one line."""


class MetricsWriter:
    """Appends JSON lines; flushed after each line so a killed run keeps what it logged."""

    def __init__(self, path: str | None, enabled: bool = True):
        self.path = path if enabled else None
        self._f = None
        if self.path:
            d = os.path.dirname(os.path.abspath(self.path))
            try:
                os.makedirs(d, exist_ok=True)
                self._f = open(self.path, "a", encoding="utf-8")
            except OSError as e:  # a directory or file in the way, no permission
                raise MetricsFileError(f"--metrics-file {self.path}: cannot append to it ({e.strerror}: "
                                       f"{e.filename}); pass a writable file path") from None

    def write(self, record: dict) -> None:
        if self._f is None:
            return
        self._f.write(json.dumps(_clean(record), sort_keys=False) + "\n")
        self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def drop_records_after(path: str, iteration: int) -> int:
    """Remove the lines of iterations after `iteration` (any type), rewriting the file
    through a temporary file + rename so a crash leaves the old or the new file, never
    half of one. A resumed run calls it with its checkpoint's iteration: the lines the
    stopped run logged after that save are repeated by the resumed run. A last line cut
    off by a crash (not JSON) goes too; other lines stay as they are. Returns the number
    of lines removed."""
    with open(path, encoding="utf-8") as f:
        lines = f.readlines()
    keep = []
    for n, line in enumerate(lines):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if n == len(lines) - 1:
                continue  # a line half written when the run was killed
            keep.append(line)
            continue
        if not (isinstance(record, dict) and isinstance(record.get("iteration"), int)
                and record["iteration"] > iteration):
            keep.append(line if line.endswith("\n") else line + "\n")
    dropped = len([x for x in lines if x.strip()]) - len([x for x in keep if x.strip()])
    if dropped:
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(keep)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    return dropped

