"""A tiny gloo job for checking the emulated cluster without the trainer.

Launched by torchrun on each emulated node: every iteration it all-gathers and
reduce-scatters a flat fp32 buffer over the whole world through megaq's collective
layer (so megaq's byte accounting is charged exactly as in training), then writes
one JSON line per iteration in the trainer's metrics-file shape (megaq.runtime.metrics):

    {"type": "train", "iteration": i, "elapsed_ms": t, "nodes": k,
     "comm": {phase: {"intra_node": B, "inter_node": B}}}   # B: bytes sent per node

Usage (under torchrun): python tools/cluster/netns_gloo_probe.py --numel 1000000 --iters 3 \
    --metrics-file out.jsonl
"""

from __future__ import annotations

import argparse
import os
import time

import torch

import _checkout  # noqa: E402  (a link to tools/_checkout.py: the checkout's megaq first)

_checkout.use_checkout()
from megaq.runtime.metrics import MetricsWriter, comm_per_node_per_iteration  # noqa: E402
from megaq.parallel import comm  # noqa: E402
from megaq.parallel.launch import DEFAULT_TIMEOUT_MINUTES, group_timeout, init_from_env  # noqa: E402
from megaq.parallel.topology import Layout, build_topology, ranks_per_node_from_env  # noqa: E402


def run_op(op: str, world, rank: int, shard, full, reduced) -> None:
    """One collective through megaq's layer, checked, so a broken link cannot pass."""
    n = world.size
    expect = torch.arange(n, dtype=torch.float32).repeat_interleave(shard.numel())
    if op == "all_gather":
        comm.all_gather(full, shard, world, phase="weight_gather_fwd")
        assert torch.equal(full, expect), "all-gather delivered wrong data"
    elif op == "reduce_scatter":
        comm.reduce_scatter(reduced, expect.clone(), world, phase="grad_reduce")
        # every rank reduces the same `expect`: my chunk sums to n * my rank
        assert torch.equal(reduced, torch.full_like(reduced, float(n * rank))), \
            "reduce-scatter delivered wrong data"
    elif op == "all_reduce":
        t = torch.full_like(full, float(rank))
        comm.all_reduce(t, world, phase="dp_misc")
        assert torch.equal(t, torch.full_like(t, float(n * (n - 1) // 2))), "all-reduce wrong"
    elif op == "all_to_all":
        out = torch.empty_like(full)
        comm.all_to_all(out, torch.full_like(full, float(rank)), world, phase="grad_reduce")
        assert torch.equal(out, expect), "all-to-all delivered wrong data"
    else:
        raise SystemExit(f"unknown --ops entry {op!r}: use all_gather, reduce_scatter, "
                         f"all_reduce or all_to_all")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=1 << 20,
                    help="fp32 elements gathered per collective")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--ops", default="all_gather,reduce_scatter",
                    help="comma list of all_gather, reduce_scatter, all_reduce, all_to_all")
    ap.add_argument("--metrics-file", required=True)
    args = ap.parse_args()

    torch.set_num_threads(1)
    rank, world = init_from_env("gloo")
    layout = Layout(world_size=world, ranks_per_node=ranks_per_node_from_env(world, rank))
    topo = build_topology(layout, rank, timeout=group_timeout(DEFAULT_TIMEOUT_MINUTES))
    n = topo.world.size
    numel = -(-args.numel // n) * n          # equal shards
    shard = torch.full((numel // n,), float(rank))
    full = torch.empty(numel)
    reduced = torch.empty(numel // n)

    ops = [o for o in args.ops.split(",") if o]
    if rank == 0 and os.path.exists(args.metrics_file):
        os.remove(args.metrics_file)   # the writer appends; start this run afresh
    writer = MetricsWriter(args.metrics_file, enabled=rank == 0)
    for it in range(args.iters):
        comm.STATS.reset()
        comm.barrier(topo.world)
        t0 = time.perf_counter()
        for op in ops:
            run_op(op, topo.world, rank, shard, full, reduced)
        elapsed_ms = (time.perf_counter() - t0) * 1e3
        per_node = comm_per_node_per_iteration(topo.world, 1)
        writer.write({"type": "train", "iteration": it + 1, "elapsed_ms": elapsed_ms,
                      "nodes": layout.num_nodes, "world_size": n, "comm": per_node})
        if rank == 0:
            print(f"probe iteration {it + 1}: {n} ranks on {layout.num_nodes} nodes, "
                  f"{numel * 4 / 1e6:.1f} MB gathered, {elapsed_ms:.1f} ms", flush=True)
    writer.close()
    comm.barrier(topo.world)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
