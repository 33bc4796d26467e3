"""Byte accounting of the collective layer against hand-computed values.

8 ranks pose as 2 nodes x 4. Groups used:
- node-spanning: the world (n=8, k=2) and a DP group of TP=2 (n=4, k=2, 2 per node);
- intra-only: the intra group of DP=8 (n=4, k=1).
"""

import pytest
import torch

from megaq.parallel import comm
from megaq.parallel.comm import INTER, INTRA
from megaq.testing.ranks import run_on_ranks

N_ELEM = 96  # divisible by every group size used; fp32 -> S = 384 bytes


def _exercise(topo, which: str, op: str):
    group = {"world": topo.world, "dp": topo.dp, "intra": topo.intra}[which]
    n = group.size
    full = torch.arange(N_ELEM, dtype=torch.float32) + 1000 * topo.rank
    comm.STATS.reset()
    if op == "all_gather":
        out = torch.empty(N_ELEM)
        comm.all_gather(out, full[: N_ELEM // n].contiguous(), group, "p")
        # member j contributed its own first chunk
        expect = torch.cat([torch.arange(N_ELEM // n, dtype=torch.float32) + 1000 * r
                            for r in group.ranks])
        assert torch.equal(out, expect)
    elif op == "reduce_scatter":
        out = torch.empty(N_ELEM // n)
        comm.reduce_scatter(out, full, group, "p")
        i = group.rank
        expect = sum(torch.arange(N_ELEM, dtype=torch.float32) + 1000 * r
                     for r in group.ranks)[i * N_ELEM // n:(i + 1) * N_ELEM // n]
        assert torch.equal(out, expect)
    elif op == "all_reduce":
        t = full.clone()
        comm.all_reduce(t, group, "p")
        assert torch.equal(t, sum(torch.arange(N_ELEM, dtype=torch.float32) + 1000 * r
                                  for r in group.ranks))
    elif op == "all_to_all":
        out = torch.empty(N_ELEM)
        h = comm.all_to_all(out, full, group, "p", async_op=True)
        h.wait()
        c = N_ELEM // n
        expect = torch.cat([(torch.arange(N_ELEM, dtype=torch.float32) + 1000 * r)
                            [group.rank * c:(group.rank + 1) * c] for r in group.ranks])
        assert torch.equal(out, expect)
    per_node = comm.per_node_totals(topo.world)
    return {node: d.get("p", {INTRA: 0, INTER: 0}) for node, d in per_node.items()}


S = N_ELEM * 4


def _ring(n, k, passes=1):
    """One group's bytes per node per ring pass (see comm.py's model)."""
    per = S * (n - 1) // n
    if k == 1:  # the ring closes inside the node: all n links are in-node
        return {INTER: 0, INTRA: passes * n * per}
    return {INTER: passes * per, INTRA: passes * (n // k - 1) * per}


def _a2a(n, k):
    # each rank sends S/n to every other member; (n/k - 1) peers in-node, n - n/k remote
    c = S // n
    local = n // k
    return {INTRA: local * (local - 1) * c, INTER: local * (n - local) * c}


def _scale(d, groups_per_node):
    return {key: v * groups_per_node for key, v in d.items()}


@pytest.mark.parametrize("which, tp, n, k, groups_per_node", [
    ("world", 1, 8, 2, 1),   # one group spanning both nodes
    ("dp", 2, 4, 2, 2),      # TP=2: two DP groups, each with 2 ranks on each node
    ("intra", 1, 4, 1, 1),   # in-node group: one per node
])
@pytest.mark.parametrize("op", ["all_gather", "reduce_scatter", "all_reduce", "all_to_all"])
def test_accounting_matches_hand_computed(which, tp, n, k, groups_per_node, op):
    got = run_on_ranks(_exercise, 8, tp=tp, ranks_per_node=4, args=(which, op))[0]
    if op == "all_to_all":
        want = _a2a(n, k)
    else:
        want = _ring(n, k, passes=2 if op == "all_reduce" else 1)
    want = _scale(want, groups_per_node)
    assert got == {0: want, 1: want}


def _bcast_p2p(topo):
    comm.STATS.reset()
    t = torch.full((10,), float(topo.rank))
    comm.broadcast(t, 0, topo.world, "b")
    assert torch.all(t == 0)
    # ring of p2p: rank r sends 10 floats to r+1
    n, r = topo.world.size, topo.rank
    recv = torch.empty(10)
    comm.batch_p2p([(torch.full((10,), float(r)), (r + 1) % n)], [(recv, (r - 1) % n)],
                   topo.world, "p2p").wait()
    assert torch.all(recv == (r - 1) % n)
    return comm.per_node_totals(topo.world)


def test_broadcast_and_p2p_accounting():
    got = run_on_ranks(_bcast_p2p, 8, ranks_per_node=4)[0]
    # broadcast chain 0->1->...->7: 7 links of 40 bytes; only 3->4 crosses.
    assert got[0]["b"] == {INTRA: 3 * 40, INTER: 40}
    assert got[1]["b"] == {INTRA: 3 * 40, INTER: 0}
    # p2p ring: 3->4 and 7->0 cross nodes, 3 in-node sends per node.
    assert got[0]["p2p"] == {INTRA: 3 * 40, INTER: 40}
    assert got[1]["p2p"] == {INTRA: 3 * 40, INTER: 40}


def test_single_member_group_is_local_copy():
    g = comm.Group(ranks=[0], nodes=[0], pg=None, rank_index=0)
    comm.STATS.reset()
    out = torch.empty(4)
    comm.all_gather(out, torch.ones(4), g, "x")
    assert torch.equal(out, torch.ones(4)) and comm.STATS.snapshot() == {}


def _timed_ops(topo):
    """Every kind of collective with the topology's timing on: results and bytes as with it off,
    handles already finished, seconds charged to each op's own phase."""
    results = {}
    for timing in (False, True):
        comm.STATS.reset()
        topo.comm_timing.on = timing
        try:
            g = topo.world
            full = torch.arange(N_ELEM, dtype=torch.float32) + 1000 * topo.rank
            gathered = torch.empty(N_ELEM)
            h = comm.all_gather(gathered, full[: N_ELEM // g.size].contiguous(), g, "ag", async_op=True)
            h.wait()
            scattered = torch.empty(N_ELEM // g.size)
            comm.reduce_scatter(scattered, full, g, "rs")
            reduced = full.clone()
            comm.all_reduce(reduced, g, "ar")
            swapped = torch.empty(N_ELEM)
            comm.all_to_all(swapped, full, g, "a2a", async_op=True).wait()
            n, r = g.size, topo.rank
            recv = torch.empty(10)
            comm.batch_p2p([(torch.full((10,), float(r)), (r + 1) % n)], [(recv, (r - 1) % n)], g, "p2p").wait()
            seconds = comm.mean_seconds(g)
        finally:
            topo.comm_timing.on = False
        results[timing] = {"tensors": [gathered, scattered, reduced, swapped, recv],
                           "bytes": comm.STATS.snapshot(), "seconds": seconds}
    return results


def test_timing_charges_each_phase_and_changes_nothing_else():
    for res in run_on_ranks(_timed_ops, 4, ranks_per_node=2):
        off, on = res[False], res[True]
        assert all(torch.equal(a, b) for a, b in zip(off["tensors"], on["tensors"]))
        assert off["bytes"] == on["bytes"] and off["seconds"] == {}
        assert set(on["seconds"]) == {"ag", "rs", "ar", "a2a", "p2p"}
        assert all(s > 0 for s in on["seconds"].values())
