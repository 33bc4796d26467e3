"""The pipeline's idle time, from the order megaq's schedules run their work in.

:func:`stage_orders` lists, per pipeline stage, the forward and backward passes in the
order megaq.parallel.pipeline issues them (1F1B: ``pp - rank - 1`` warm-up forwards,
then one forward / one backward, then the drain; interleaved: Megatron's warm-up count
and chunk rotation). :func:`simulate` plays those orders against each other: a pass
starts when its stage is free and the pass it needs (the previous stage's forward of
that micro-batch and chunk, the next stage's backward) has finished and its activation
or gradient has arrived. The idle slots of each stage are the bubble.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass


def _interleaved_ids(k: int, pp: int, vp: int, forward: bool) -> tuple[int, int]:
    """(micro-batch, chunk) of the k-th forward / backward of a rank (Megatron's order)."""
    group, within = divmod(k, pp * vp)
    chunk = within // pp
    mb = group * pp + within % pp
    return mb, (chunk if forward else vp - 1 - chunk)


def stage_orders(pp: int, vp: int, m: int) -> list[list[tuple[str, int, int]]]:
    """Per stage, its passes in issue order: ("F" | "B", micro-batch, chunk)."""
    orders = []
    for rank in range(pp):
        if vp == 1:
            warmup = min(pp - rank - 1, m)
            fwd = [("F", i, 0) for i in range(m)]
            bwd = [("B", i, 0) for i in range(m)]
        else:
            total = m * vp
            warmup = total if m == pp else min((pp - rank - 1) * 2 + (vp - 1) * pp, total)
            fwd = [("F", *_interleaved_ids(k, pp, vp, True)) for k in range(total)]
            bwd = [("B", *_interleaved_ids(k, pp, vp, False)) for k in range(total)]
        order = fwd[:warmup]
        for i in range(len(fwd) - warmup):
            order += [fwd[warmup + i], bwd[i]]
        order += bwd[len(fwd) - warmup:]
        orders.append(order)
    return orders


@dataclass(frozen=True)
class PipelineTimes:
    makespan_s: float             # first forward to last backward, any stage
    busy_s: tuple[float, ...]     # per stage: time spent in passes
    idle_s: tuple[float, ...]     # per stage: makespan - busy (the bubble)


@functools.lru_cache(maxsize=64)
def _play_order(pp: int, vp: int, m: int) -> tuple:
    """The passes of every stage in an order that respects their dependencies, each as
    (stage, chunk, forward?, index of the stage's previous pass or -1, index of the pass
    it waits for or -1, whether that wait includes a transfer). Computed once per shape."""
    orders = stage_orders(pp, vp, m)
    index: dict[tuple, int] = {}
    played = []
    pos = [0] * pp
    last = [-1] * pp
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for s in range(pp):
            while pos[s] < len(orders[s]):
                kind, mb, c = orders[s][pos[s]]
                v = c * pp + s  # the virtual stage: chunk c of stage s
                if kind == "F":
                    dep = None if v == 0 else ("F", mb, v - 1)
                else:
                    dep = ("F", mb, v) if v == pp * vp - 1 else ("B", mb, v + 1)
                if dep is not None and dep not in index:
                    break
                transfer = not (kind == "B" and v == pp * vp - 1)  # after its own forward
                index[(kind, mb, v)] = len(played)
                played.append((s, c, kind == "F", last[s],
                               -1 if dep is None else index[dep], transfer))
                last[s] = len(played) - 1
                pos[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError("pipeline schedule deadlocked: the stage orders do not pair up")
    return tuple(played)


def simulate(pp: int, vp: int, m: int, fwd_s, bwd_s, p2p_s: float = 0.0) -> PipelineTimes:
    """Play the schedules: a pass starts when its stage has finished its previous pass and
    the pass it needs has finished (plus `p2p_s` when its input crosses stages).
    fwd_s(stage, chunk) / bwd_s(stage, chunk) give a pass's seconds."""
    fwd = {(s, c): fwd_s(s, c) for s in range(pp) for c in range(vp)}
    bwd = {(s, c): bwd_s(s, c) for s in range(pp) for c in range(vp)}
    if pp == 1:  # one stage: its passes back to back, nothing to wait for
        busy1 = m * sum(fwd[0, c] + bwd[0, c] for c in range(vp))
        return PipelineTimes(busy1, (busy1,), (0.0,))
    end = []
    busy = [0.0] * pp
    for s, c, forward, prev, dep, transfer in _play_order(pp, vp, m):
        start = end[prev] if prev >= 0 else 0.0
        if dep >= 0:
            ready = end[dep] + (p2p_s if transfer else 0.0)
            start = ready if ready > start else start
        length = fwd[s, c] if forward else bwd[s, c]
        end.append(start + length)
        busy[s] += length
    makespan = max(end)
    return PipelineTimes(makespan, tuple(busy), tuple(makespan - b for b in busy))
