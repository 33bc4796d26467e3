"""Measured pipeline bubble vs theory for 1F1B and interleaved 1F1B, on CPU gloo ranks.

Method
------
Each of the p ranks (PP = p, TP = DP = 1, started by ``run_on_ranks``) holds a stage
model whose layers have a *fixed, known cost*: an autograd function that sleeps
``--fwd-ms`` per layer in forward and ``--bwd-ms`` (default 2x) in backward, standing
in for a GPU kernel the rank waits on. Sleeping rather than spinning keeps the cost
independent of how many cores the machine has and of what else runs on it (this box
has 2 cores shared with other jobs; p busy-looping ranks would measure the scheduler,
not the pipeline). Activations are real tensors moved by the real p2p path and the
real schedules (megaq.parallel.pipeline), so every wait the schedule causes is real.

Per rank the schedule's StepTimer records the seconds spent inside forward/backward
(compute) and inside the batched p2p calls (waiting for a neighbour + transfer). All
ranks enter the schedule together (after a barrier); the step time is the longest
rank's time in the schedule (later stages return earlier, but the next step's forward
cannot reach them sooner). The measured bubble of a rank is

    bubble = 1 - compute / step_time

i.e. the fraction of the step the rank was not computing, averaged over ranks (the
worst rank's is also shown; "compute s" is the mean measured compute per rank next to
the nominal layers x (fwd + bwd) x m / p, which shows how much the sleeps overshoot on
a loaded machine; "p2p share" is the mean fraction of the step spent inside p2p calls,
the rest of the bubble being the tail after a later stage has finished its last
backward). Theory for m micro-batches, p stages and v virtual
chunks per stage with forward+backward cost balanced over stages:

    1F1B:        (p - 1) / (m + p - 1)
    interleaved: (p - 1) / (v*m + p - 1)

The model's total cost is fixed (--layers layers), so interleaving splits the same
per-stage work into v chunks. Each layout runs one warm-up step and reports the
median of --steps timed steps.

    python tools/bench/bench_pipeline.py [--fwd-ms 25 --bwd-ms 50 --layers 8 --steps 2]
        [--out bench_pipeline.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from types import SimpleNamespace

import torch
from torch import nn

import _checkout  # noqa: E402  (a link to tools/_checkout.py: the checkout's megaq first)

_checkout.use_checkout()
from megaq.parallel import comm  # noqa: E402
from megaq.testing.ranks import run_on_ranks  # noqa: E402
from megaq.parallel.pipeline import StepTimer, build_stage_chunks, get_forward_backward_func  # noqa: E402

SEQ, MBS, HIDDEN = 8, 1, 16


class _FixedCost(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fwd_s, bwd_s):
        ctx.bwd_s = bwd_s
        time.sleep(fwd_s)
        return x * 1.0

    @staticmethod
    def backward(ctx, g):
        time.sleep(ctx.bwd_s)
        return g * 1.0, None, None


class FixedCostStage(nn.Module):
    """GPTModel's forward contract (and its stage arguments) with layers of known duration."""

    def __init__(self, config, tp_group, pre_process=True, post_process=True, layer_start=0,
                 layer_end=None):
        super().__init__()
        self.cfg, self.pre_process, self.post_process = config, pre_process, post_process
        self.n_layers = (layer_end if layer_end is not None else config.num_layers) - layer_start
        self.scale = nn.Parameter(torch.ones(HIDDEN))  # something for backward to reach

    def forward(self, input_ids=None, hidden_states=None, labels=None, position_ids=None):
        if self.pre_process:
            x = input_ids.t().unsqueeze(-1).float().expand(SEQ, MBS, HIDDEN) * self.scale
        else:
            x = hidden_states
        for _ in range(self.n_layers):
            x = _FixedCost.apply(x, self.cfg.fwd_s, self.cfg.bwd_s)
        if self.post_process:
            return (x * self.scale).sum(-1).t()  # a per-token "loss" [b, s]
        return x


def _measure(topo, cfg, vp, m, steps):
    def make_chunk(layer_start, layer_end, pre_process, post_process):
        return FixedCostStage(cfg, topo.tp, pre_process, post_process, layer_start, layer_end)
    chunks = build_stage_chunks(make_chunk, cfg.num_layers, topo, vp)
    schedule = get_forward_backward_func(topo.layout.pp, vp)
    batch = dict(tokens=torch.ones(MBS, SEQ, dtype=torch.long),
                 labels=torch.zeros(MBS, SEQ, dtype=torch.long), loss_mask=torch.ones(MBS, SEQ))
    rows = []
    for step in range(steps + 1):
        timer = StepTimer()
        comm.barrier(topo.pp)
        t0 = time.perf_counter()
        schedule(chunks, [batch] * m, m, topo, tensor_shape=(SEQ, MBS, HIDDEN), timer=timer)
        wall = time.perf_counter() - t0
        comm.barrier(topo.pp)
        if step:  # the first step warms up gloo connections
            rows.append(dict(wall=wall, compute=timer.compute_s, p2p=timer.p2p_s))
    return rows


def run_layout(p, v, m, args):
    cfg = SimpleNamespace(num_layers=args.layers, fwd_s=args.fwd_ms / 1e3, bwd_s=args.bwd_ms / 1e3)
    per_rank = run_on_ranks(_measure, p, pp=p, args=(cfg, v if v > 1 else None, m, args.steps))
    bubbles, worst, walls, p2p, compute = [], [], [], [], []
    for s in range(args.steps):
        step = max(r[s]["wall"] for r in per_rank)
        b = [1 - r[s]["compute"] / step for r in per_rank]
        bubbles.append(sum(b) / len(b))
        worst.append(max(b))
        walls.append(step)
        p2p.append(sum(r[s]["p2p"] / step for r in per_rank) / len(per_rank))
        compute.append(sum(r[s]["compute"] for r in per_rank) / len(per_rank))
    theory = (p - 1) / (v * m + p - 1)
    nominal = m * args.layers / p * (args.fwd_ms + args.bwd_ms) / 1e3  # busy time per stage
    return dict(pp=p, vp=v, microbatches=m, theory=theory,
                measured=statistics.median(bubbles), measured_worst_rank=statistics.median(worst),
                p2p_fraction=statistics.median(p2p), step_s=statistics.median(walls),
                compute_s=statistics.median(compute), nominal_compute_s=nominal)


LAYOUTS = [(2, 1, 4), (2, 1, 8), (4, 1, 4), (4, 1, 8), (4, 1, 16), (2, 2, 4), (4, 2, 4), (4, 2, 8)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fwd-ms", type=float, default=25.0, help="forward cost per layer (ms)")
    ap.add_argument("--bwd-ms", type=float, default=50.0, help="backward cost per layer (ms)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--out", default="bench_pipeline.json")
    args = ap.parse_args(argv)
    results = []
    print(f"{'pp':>3} {'vp':>3} {'m':>4} {'theory':>8} {'measured':>9} {'worst rank':>10} "
          f"{'p2p share':>10} {'step s':>8} {'compute s':>10} {'nominal s':>10}")
    for p, v, m in LAYOUTS:
        r = run_layout(p, v, m, args)
        results.append(r)
        print(f"{p:>3} {v:>3} {m:>4} {r['theory']:>8.3f} {r['measured']:>9.3f} "
              f"{r['measured_worst_rank']:>10.3f} {r['p2p_fraction']:>10.3f} "
              f"{r['step_s']:>8.3f} {r['compute_s']:>10.3f} {r['nominal_compute_s']:>10.3f}",
              flush=True)
    meta = dict(command="python tools/bench/bench_pipeline.py " + " ".join(argv or sys.argv[1:]),
                machine=f"{platform.node()} {platform.machine()} {os.cpu_count()} cores, "
                        f"load avg {os.getloadavg()[0]:.1f}",
                fwd_ms=args.fwd_ms, bwd_ms=args.bwd_ms, layers=args.layers, steps=args.steps)
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(dict(meta=meta, results=results), f, indent=1)
    os.replace(tmp, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
