"""Rank grid, node map and ZeRO++ subgroups: membership and refusals."""

import datetime
import gc

import pytest
import torch.distributed as dist

from megaq.testing.ranks import run_on_ranks
from megaq.parallel.topology import (Layout, LayoutError, check_hpz_size, check_model_fits_tp,
                                     ranks_per_node_from_env)


def test_megatron_rank_order_tp2_pp2_dp2():
    lay = Layout(world_size=8, tp=2, pp=2, ranks_per_node=4)
    assert lay.dp == 2 and lay.num_nodes == 2
    assert lay.tp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert lay.dp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert lay.pp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert lay.embedding_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # PP=4: middle stages get one-member groups, so every rank is in exactly one.
    lay4 = Layout(world_size=8, tp=2, pp=4)
    assert lay4.embedding_groups() == [[0, 6], [2], [4], [1, 7], [3], [5]]
    assert lay.coords(6) == (0, 1, 1)
    # This DP group sits on one node: intra is the whole group, inter is per rank.
    assert lay.intra_groups([0, 2]) == [[0, 2]]
    assert lay.inter_groups([0, 2]) == [[0], [2]]


def test_tp2_dp4_two_nodes_has_two_dp_ranks_per_node():
    # 8 ranks = 2 nodes x 4, TP=2: each DP group has 2 ranks on each node.
    lay = Layout(world_size=8, tp=2, ranks_per_node=4)
    g = lay.dp_groups()[0]
    assert g == [0, 2, 4, 6]
    assert lay.intra_groups(g) == [[0, 2], [4, 6]]
    assert lay.inter_groups(g) == [[0, 4], [2, 6]]
    assert lay.hpz_groups(g, 2) == [[0, 2], [4, 6]]
    assert lay.intra_groups(lay.dp_groups()[1]) == [[1, 3], [5, 7]]


def test_dp8_two_nodes_hpz2():
    lay = Layout(world_size=8, ranks_per_node=4)
    g = lay.dp_groups()[0]
    assert lay.intra_groups(g) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert lay.inter_groups(g) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert lay.hpz_groups(g, 2) == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_sixteen_ranks_demo_layout_spans_both_nodes():
    # Megatron's default order keeps each PP stage on one node of 8 ...
    lay = Layout(world_size=16, tp=2, pp=2, ranks_per_node=8)
    assert all(len(lay.intra_groups(g)) == 1 for g in lay.dp_groups())
    # ... DP-outermost order spreads every DP group over both nodes, 2 ranks on each.
    lay = Layout(world_size=16, tp=2, pp=2, ranks_per_node=8, order="tp-pp-dp")
    check_hpz_size(lay, 2)
    assert lay.dp_groups()[0] == [0, 4, 8, 12]
    assert lay.pp_groups()[0] == [0, 2]
    for g in lay.dp_groups():
        intra = lay.intra_groups(g)
        assert len(intra) == 2 and all(len(m) == 2 for m in intra), g
    assert lay.coords(lay.rank_at(1, 3, 1)) == (1, 3, 1)


@pytest.mark.parametrize("kw, needle", [
    (dict(world_size=8, tp=3), "not divisible by TP x PP"),
    (dict(world_size=8, tp=2, pp=3), "not divisible by TP x PP"),
    (dict(world_size=8, ranks_per_node=3), "not a multiple of the ranks per node"),
    (dict(world_size=6, tp=2, ranks_per_node=3), "uneven number of ranks per node"),
    (dict(world_size=8, order="dp-tp"), "unknown rank order"),
])
def test_refusals(kw, needle):
    with pytest.raises(LayoutError, match=needle) as e:
        Layout(**kw)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("kw, hpz, needle", [
    (dict(world_size=8, ranks_per_node=4), 3, "does not divide the 4 DP ranks per node"),
    (dict(world_size=8, tp=2, ranks_per_node=4), 4, "does not divide the 2 DP ranks per node"),
    (dict(world_size=8, ranks_per_node=4), 0, "must be >= 1"),
])
def test_hpz_refusals(kw, hpz, needle):
    with pytest.raises(LayoutError, match=needle) as e:
        check_hpz_size(Layout(**kw), hpz)
    assert "\n" not in str(e.value)


def test_model_refusals():
    with pytest.raises(LayoutError, match="--num-attention-heads 6 is not divisible"):
        check_model_fits_tp(4, 6)
    with pytest.raises(LayoutError, match="--num-query-groups 2 is not divisible"):
        check_model_fits_tp(4, 8, 2)
    check_model_fits_tp(2, 8, 2)


def test_node_map_from_launchers(monkeypatch):
    for v in ("LOCAL_WORLD_SIZE", "GROUP_RANK", "SLURM_NTASKS_PER_NODE", "SLURM_NODEID"):
        monkeypatch.delenv(v, raising=False)
    assert ranks_per_node_from_env(8, 0) == 8
    assert ranks_per_node_from_env(8, 0, gpus_per_node=4) == 4
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "4(x2)")
    monkeypatch.setenv("SLURM_NODEID", "1")
    assert ranks_per_node_from_env(8, 5) == 4
    with pytest.raises(LayoutError, match="block distribution"):
        ranks_per_node_from_env(8, 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("GROUP_RANK", "3")
    assert ranks_per_node_from_env(8, 7) == 2  # torchrun wins over slurm


def _membership(topo):
    return {k: getattr(topo, k).ranks for k in
            ("tp", "dp", "pp", "embedding", "intra", "inter", "hpz")}


@pytest.mark.parametrize("tp, pp, hpz, order", [(1, 1, 2, "tp-dp-pp"), (2, 1, 2, "tp-dp-pp"),
                                               (2, 2, 1, "tp-dp-pp"), (1, 2, 2, "tp-pp-dp"),
                                               (1, 4, 1, "tp-dp-pp")])
def test_built_groups_match_layout(tp, pp, hpz, order):
    lay = Layout(world_size=8, tp=tp, pp=pp, ranks_per_node=4, order=order)
    got = run_on_ranks(_membership, 8, tp=tp, pp=pp, ranks_per_node=4, hpz_size=hpz, order=order)
    for rank, groups in enumerate(got):
        dp = next(g for g in lay.dp_groups() if rank in g)
        want = {
            "tp": next(g for g in lay.tp_groups() if rank in g),
            "dp": dp,
            "pp": next(g for g in lay.pp_groups() if rank in g),
            "embedding": next(g for g in lay.embedding_groups() if rank in g),
            "intra": next(g for g in lay.intra_groups(dp) if rank in g),
            "inter": next(g for g in lay.inter_groups(dp) if rank in g),
            "hpz": next(g for g in lay.hpz_groups(dp, hpz) if rank in g),
        }
        assert groups == want, rank


def _rank1_waits_forever_in_a_named_place(topo):
    import time
    if topo.rank == 1:
        while True:
            time.sleep(0.05)
    return topo.rank


def test_a_rank_that_never_reports_fails_with_its_stack_not_a_bare_timeout():
    """run_on_ranks' timeout names the silent rank and shows where it stood (its Python
    stack, from faulthandler), so a hang in CI is diagnosable from the log alone; the
    rank is killed, not left behind."""
    with pytest.raises(TimeoutError) as e:
        run_on_ranks(_rank1_waits_forever_in_a_named_place, 2, timeout=5)
    msg = str(e.value)
    assert msg.startswith("rank(s) [1] reported nothing within 5 s"), msg
    assert "--- rank 1's stacks ---" in msg and "_rank1_waits_forever_in_a_named_place" in msg, msg


def _collect_now(topo):
    gc.collect()  # reaches whatever the parent left uncollected, unless the rank froze it
    return topo.rank


def test_ranks_never_collect_the_parents_garbage():
    """A gloo group left in a reference cycle by an earlier in-process test (a CLI run
    that raised, say) is forked into every rank; collected there, its destructor joins
    worker threads that exist only in the parent and blocks for ever (a CI run lost two
    tests to this: ranks stuck in "Garbage-collecting"). Ranks freeze what they
    inherit, so they finish; the parent collects its own garbage."""
    cycle = [dist.ProcessGroupGloo(dist.HashStore(), 0, 1, datetime.timedelta(seconds=30))]
    cycle.append(cycle)
    del cycle
    gc.disable()  # keep the cycle uncollected until after the fork, as a GC schedule may
    try:
        assert run_on_ranks(_collect_now, 2, timeout=30) == [0, 1]
    finally:
        gc.enable()
        gc.collect()
