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


def simulate(pp: int, vp: int, m: int, fwd_s, bwd_s, p2p_s: float = 0.0) -> PipelineTimes:
    """Play the schedules; fwd_s(stage, chunk) / bwd_s(stage, chunk) give a pass's time,
    p2p_s the time an activation or gradient takes to reach the neighbouring stage."""
    orders = stage_orders(pp, vp, m)
    done: dict[tuple, float] = {}
    pos = [0] * pp
    free = [0.0] * pp
    busy = [0.0] * pp
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for s in range(pp):
            while pos[s] < len(orders[s]):
                kind, mb, c = orders[s][pos[s]]
                # the virtual stage this pass runs at: chunk c of stage s is c*pp + s
                v = c * pp + s
                if kind == "F":
                    dep = None if v == 0 else ("F", mb, v - 1)
                else:
                    dep = ("F", mb, v) if v == pp * vp - 1 else ("B", mb, v + 1)
                if dep is not None and dep not in done:
                    break
                last_v = kind == "B" and v == pp * vp - 1  # after its own forward
                ready = 0.0 if dep is None else done[dep] + (0.0 if last_v else p2p_s)
                length = fwd_s(s, c) if kind == "F" else bwd_s(s, c)
                start = max(free[s], ready)
                free[s] = start + length
                busy[s] += length
                done[(kind, mb, v)] = free[s]
                pos[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError("pipeline schedule deadlocked: the stage orders do not pair up")
    makespan = max(free)
    return PipelineTimes(makespan, tuple(busy), tuple(makespan - b for b in busy))
