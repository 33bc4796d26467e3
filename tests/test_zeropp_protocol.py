"""ZeRO++ protocols (qwZ, hpZ, qgZ) on 8 gloo ranks posing as 2 nodes x 4.

No engine here: the seams are driven directly with hand-made units, so every
number can be checked against an exact fp64 reference and against the analytical
byte model (megaq.zero.zeropp.volume). bf16 weights and gradients throughout.

Error bounds (docs/ZEROPP.md derives them). Symmetric blockwise quantization with
q = 2^(bits-1) - 1 (127 for int8, 7 for int4) rounds each element to within half a
step, absmax/(2q), and never returns a value above the block's absmax.

* qwZ: |gathered - exact| <= M (1/254 + 2^-8) per element, M = absmax of its block
  (half an int8 step, then one bf16 rounding, unit roundoff 2^-8, of a value <= M);
  with the int4-weights option 1/14 replaces 1/254.
* qgZ, one call: for my shard element p in block b,
      |result - exact| <= (1/n) sum_r M_r(b) (1/(2 q_intra) + 1/(2 q_inter)),
  M_r(b) = absmax of rank r's gradient on block b of my chunk: hop 1 errs by at
  most M_r/(2 q_intra) per rank; a node's partial sum is at most sum M_r in
  magnitude, so hop 2 errs by at most that over 2 q_inter; the sum is divided by
  n = DP size once. One node: only the first term; one rank per node: only the
  second. A relative slack of 1e-5 covers fp32 rounding of scales and sums.
* qgZ with error feedback, T calls summed: the residuals telescope, leaving
      (1/n) sum_r M_r (1/(2 q_intra - 1) + (2 q_intra/(2 q_intra - 1)) / (2 q_inter - 1))
  however large T is (without feedback the same error repeats T times).
* The square-law int4 code (--zero-quantized-gradients-code square): 6.5/49 of the
  absmax per hop replaces 1/(2q) = 1/14 (the widest gap between its levels, 36 .. 49
  steps of absmax/49); with feedback c/(1-c) replaces 1/(2q-1) (_qgz_coef).
"""

from __future__ import annotations

import os

import pytest
import torch

from megaq.kernels.format import QMAX, max_error_over_absmax
from megaq.parallel import comm
from megaq.parallel.comm import INTER, INTRA, Group
from megaq.testing.ranks import run_on_ranks
from megaq.zero import ZeroConfig, ZeroConfigError
from megaq.zero.collectives import GradReducer, make_gatherer, make_reducer
from megaq.zero.zeropp import (QuantizedGradReducer, RailOrderError, ZeroPPWeightGatherer,
                               padded, rails_of)

from zero_harness import modelled_step_bytes, world_totals

BLOCK = 64
CHUNK = 128          # elements of each shard per qgZ chunk: several chunks per unit
SHARDS = (256, 200)  # one block-aligned unit, one that needs padding (200 -> 256)
SLACK = 1e-5         # relative: fp32 rounding of scales, products and sums


class _Unit:  # what the seams read of an engine partition
    def __init__(self, name, shard, full):
        self.name, self.shard, self.full = name, shard, full


def _cfg(**kw) -> ZeroConfig:
    return ZeroConfig(block_size=BLOCK, grad_chunk=CHUNK, **kw)


def _weights(u: int, n: int, S: int, topo) -> torch.Tensor:
    """The full bf16 weights of unit u (same on every DP rank of a TP/PP position)."""
    g = torch.Generator().manual_seed(1000 * u + 10 * topo.tp_rank + topo.pp_rank)
    w = torch.randn(n * S, generator=g)
    w[: S // 2] *= 40.0  # blocks of very different magnitude
    return w.to(torch.bfloat16)


def _grads(u: int, n: int, S: int, topo) -> torch.Tensor:
    """[n DP ranks, n*S] bf16 gradients: every rank can rebuild its peers'."""
    out = []
    for r in range(n):
        g = torch.Generator().manual_seed(7919 * u + 100 * r + 10 * topo.tp_rank + topo.pp_rank)
        x = torch.randn(n * S, generator=g) * torch.exp(torch.randn(n * S, generator=g))
        x[BLOCK: 2 * BLOCK] = 0.0  # an all-zero block (scale 0 path)
        out.append(x)
    return torch.stack(out).to(torch.bfloat16)


def _block_absmax(x: torch.Tensor) -> torch.Tensor:
    """[..., S] -> [..., S] absmax of each element's block (padding as zeros)."""
    S = x.shape[-1]
    pad = torch.zeros(*x.shape[:-1], padded(S, BLOCK), dtype=torch.float64)
    pad[..., :S] = x.abs().double()
    mx = pad.reshape(*x.shape[:-1], -1, BLOCK).amax(-1, keepdim=True).expand(*x.shape[:-1], -1, BLOCK)
    return mx.reshape(*x.shape[:-1], -1)[..., :S]


def _qgz_coef(rails, cfg, feedback=False) -> float:
    """The per-hop coefficients c (worst error / absmax: 1/(2q) for linear, 6.5/49 for
    the square int4 code; format.max_error_over_absmax) combined as the docstring says:
    c1 + c2, with feedback c1/(1-c1) + c2/((1-c1)(1-c2)) (for linear, 1/(2q1-1) + ...)."""
    c1 = max_error_over_absmax(cfg.grad_bits_intra, cfg.grad_code)
    c2 = max_error_over_absmax(cfg.grad_bits_inter, cfg.grad_code)
    if feedback:
        first, second = c1 / (1 - c1), c2 / ((1 - c1) * (1 - c2))
    else:
        first, second = c1, c2
    if rails.k == 1:
        return first
    if rails.m == 1:
        return c2 / (1 - c2) if feedback else c2
    return first + second


def _run_step(topo, cfg: ZeroConfig | None, units, grads):
    """One step with one micro-batch: fwd gather, bwd gather, grad reduce (per unit).

    cfg None = plain ZeRO-3 through comm directly. Returns what each stage produced.
    """
    dp, n = topo.dp, topo.dp.size
    gatherer = make_gatherer(topo, cfg) if cfg and cfg.weights_need_zeropp else None
    reducer = make_reducer(topo, cfg) if cfg and cfg.quantized_gradients else None
    fwd, bwd, red = [], [], []
    for unit in units:
        unit.full.zero_()
        if gatherer:
            gatherer.start_gather(unit, "weight_gather_fwd").wait()
            gatherer.on_forward_gathered(unit)
        else:
            comm.all_gather(unit.full, unit.shard, dp, "weight_gather_fwd")
        fwd.append(unit.full.clone())
    for unit in reversed(units):
        unit.full.zero_()
        if gatherer:
            gatherer.start_gather(unit, "weight_gather_bwd").wait()
        else:
            comm.all_gather(unit.full, unit.shard, dp, "weight_gather_bwd")
        bwd.insert(0, unit.full.clone())
    handles = []
    for unit, g in zip(units, grads):
        S = unit.shard.numel()
        out = torch.zeros(S, dtype=torch.float32)
        mine = g[topo.dp.rank]
        if reducer:
            handles.append(reducer.start_reduce(unit.name, mine, out))  # all started, then finished
        else:
            tmp = torch.empty(S, dtype=mine.dtype)
            comm.reduce_scatter(tmp, mine, dp, "grad_reduce")
            out.add_(tmp.float() / n)
        red.append(out)
    for h in handles:
        h.finish()
    mem = gatherer.memory_bytes() if gatherer else {}
    return fwd, bwd, red, mem


def _protocol_worker(topo, cases):
    n = topo.dp.size
    rails = rails_of(topo)
    units = [_Unit(f"u{u}", None, torch.empty(n * S, dtype=torch.bfloat16))
             for u, S in enumerate(SHARDS)]
    exact_w, grads = [], []
    for u, (unit, S) in enumerate(zip(units, SHARDS)):
        w = _weights(u, n, S, topo)
        unit.shard = w[topo.dp.rank * S:(topo.dp.rank + 1) * S].clone()
        exact_w.append(w)
        grads.append(_grads(u, n, S, topo))
    result = {"rails": (rails.k, rails.m)}
    for name, kw in cases.items():
        cfg = _cfg(**kw) if kw is not None else None
        comm.STATS.reset()
        if name.endswith("@aligned"):  # the engine's case: block-aligned units only
            _run_step(topo, cfg, units[:1], grads[:1])
            result[name] = {"bytes": world_totals(comm.per_node_totals(topo.world))}
            continue
        fwd, bwd, red, mem = _run_step(topo, cfg, units, grads)
        rec = {"bytes": world_totals(comm.per_node_totals(topo.world)), "mem": mem,
               "w_ratio": 0.0, "g_ratio": 0.0, "bwd_equals_fwd": all(torch.equal(a, b) for a, b in zip(fwd, bwd)),
               "w_max_err": 0.0}
        for u, S in enumerate(SHARDS):
            # qwZ: every element of the gathered unit against the exact bf16 gather
            err = (fwd[u].double() - exact_w[u].double()).abs()
            q = QMAX[cfg.weight_bits] if cfg is not None else 127
            bound = _block_absmax(exact_w[u].reshape(n, S)).reshape(-1) * (1 / (2 * q) + 2 ** -8)
            rec["w_ratio"] = max(rec["w_ratio"], float((err / (bound * (1 + SLACK) + 1e-30)).max()))
            rec["w_max_err"] = max(rec["w_max_err"], float(err.max()))
            # qgZ: my shard against an exact fp64 reduce-scatter
            mine = grads[u].reshape(n, n, S)[:, topo.dp.rank].double()  # [rank, S]
            exact = mine.sum(0) / n
            err = (red[u].double() - exact).abs()
            if cfg is not None and cfg.quantized_gradients:
                bound = _block_absmax(mine).sum(0) / n * _qgz_coef(rails, cfg)
                rec["g_ratio"] = max(rec["g_ratio"], float((err / (bound * (1 + SLACK) + 1e-30)).max()))
            else:  # bf16 ring sum: n roundings of partial sums, each within 2^-8 relative
                bound = mine.abs().sum(0) / n * n * 2 ** -8
                rec["g_ratio"] = max(rec["g_ratio"], float((err / (bound + 1e-30)).max()))
        result[name] = rec
    return result


def _expected(case_kw, k, m, groups):
    """Analytical bytes for one step over the world (all DP groups, all units)."""
    return modelled_step_bytes(SHARDS, k, m, _cfg(**case_kw) if case_kw is not None else _cfg(), groups)


ALL_ON = dict(quantized_weights=True, quantized_gradients=True)


def _check(results, cases, hpz, tp_pp):
    k, m = results[0]["rails"]
    for name, kw in cases.items():
        if name.endswith("@aligned"):
            continue
        if os.environ.get("MEGAQ_PROTOCOL_REPORT"):  # the figures in docs/ZEROPP.md
            print(f"[protocol] k={k} m={m} tp_pp={tp_pp} {name}: worst error / bound: weights "
                  f"{max(r[name]['w_ratio'] for r in results):.3f}, "
                  f"gradients {max(r[name]['g_ratio'] for r in results):.3f}")
        exp = _expected(kw, k, m, tp_pp)
        got = results[0][name]["bytes"]
        for phase, links in exp.items():
            assert got.get(phase, {INTRA: 0, INTER: 0}) == links, (name, phase, got, exp)
        for r, res in enumerate(results):
            rec = res[name]
            quant_w = kw is not None and kw.get("quantized_weights")
            if quant_w:
                assert 0 < rec["w_ratio"] <= 1.0, (name, r, rec["w_ratio"])
            else:
                assert rec["w_max_err"] == 0.0, (name, r)  # unquantized gathers are exact
            assert rec["g_ratio"] <= 1.0, (name, r, rec["g_ratio"])
            if kw is not None and kw.get("quantized_gradients"):
                assert rec["g_ratio"] > 0, (name, r)  # really quantized
            # hpZ or not, backward must see exactly the weights forward used
            assert rec["bwd_equals_fwd"], (name, r)
            if kw is not None and kw.get("hpz_partition_size", 1) > 1:
                full = sum(2 * S * k * m for S in SHARDS)  # bytes of the bf16 full units
                assert rec["mem"]["hpz_secondary"] == full // kw["hpz_partition_size"], rec["mem"]
    for name, kw in cases.items():
        if kw is not None and kw.get("hpz_partition_size", 1) > 1 and not name.endswith("@aligned"):
            assert results[0][name]["bytes"]["weight_gather_bwd"][INTER] == 0


def _cases(hpz):
    return {
        "zero3": None,
        "qwz": dict(quantized_weights=True),
        "qwz4": dict(quantized_weights=True, weight_bits=4),
        "hpz": dict(hpz_partition_size=hpz),
        "qgz": dict(quantized_gradients=True),
        "qgz8": dict(quantized_gradients=True, grad_bits_intra=8, grad_bits_inter=8),
        "qgz84": dict(quantized_gradients=True, grad_bits_intra=8, grad_bits_inter=4),
        "all": dict(ALL_ON, hpz_partition_size=hpz),
        # both int4 codes explicitly, whichever is the default (bound: _qgz_coef)
        "qgz_linear": dict(quantized_gradients=True, grad_code="linear"),
        "qgz_square": dict(quantized_gradients=True, grad_code="square"),
        "qgz84_square": dict(quantized_gradients=True, grad_bits_intra=8, grad_bits_inter=4, grad_code="square"),
    }


@pytest.mark.parametrize("tp, pp, rpn, hpz", [
    (1, 1, 4, 4),   # DP=8 over 2 nodes x 4: k=2, m=4
    (2, 1, 4, 2),   # TP=2 x DP=4: k=2, m=2
    (2, 2, 4, 2),   # TP=2 x PP=2 x DP=2: each DP group inside one node: k=1, m=2
    (1, 1, 8, 8),   # one node of 8: the cross-node hop is empty
])
def test_zeropp_protocols_match_exact_and_byte_model(tp, pp, rpn, hpz):
    cases = _cases(hpz)
    two_nodes_dp8 = rpn == 4 and tp == pp == 1
    if two_nodes_dp8:
        cases.update({"zero3@aligned": None, "all@aligned": cases["all"]})
    results = run_on_ranks(_protocol_worker, 8, tp=tp, pp=pp, ranks_per_node=rpn,
                           hpz_size=hpz, args=(cases,))
    _check(results, cases, hpz, tp * pp)
    # the square-law int4 code sends exactly the linear code's bytes, per phase and link
    assert results[0]["qgz_square"]["bytes"] == results[0]["qgz_linear"]["bytes"]
    if two_nodes_dp8:
        # Cross-node bytes of a step, all three on vs ZeRO-3 (bf16 weights and grads),
        # for block-aligned units as the engine lays them out: ~0.23 here with 64-element
        # blocks (scales cost 4/64 bytes per element), ~0.21 with 4096-element blocks.
        z3 = sum(v[INTER] for v in results[0]["zero3@aligned"]["bytes"].values())
        zpp = sum(v[INTER] for v in results[0]["all@aligned"]["bytes"].values())
        assert zpp <= z3 / 4, (zpp, z3)


# ----------------------------------------------------------------- error feedback
def _feedback_worker(topo, steps):
    n, S = topo.dp.size, 256
    g = _grads(3, n, S, topo)
    rails = rails_of(topo)
    out = {}
    for fb in (False, True):
        cfg = _cfg(quantized_gradients=True, error_feedback=fb)
        red = QuantizedGradReducer.for_topology(topo, cfg)
        acc = torch.zeros(S)
        for _ in range(steps):
            red.start_reduce("u", g[topo.dp.rank], acc).finish()
        mine = g.reshape(n, n, S)[:, topo.dp.rank].double()
        err = (acc.double() - steps * mine.sum(0) / n).abs()
        bound = _block_absmax(mine).sum(0) / n * _qgz_coef(rails, cfg, feedback=fb)
        out[fb] = (float(err.mean()), float((err / (bound * (1 + SLACK) + 1e-30)).max()),
                   red.memory_bytes()["qgz_error_feedback"])
    return out


def test_error_feedback_keeps_cumulative_error_at_one_step():
    steps = 6
    results = run_on_ranks(_feedback_worker, 8, ranks_per_node=4, args=(steps,))
    for r, res in enumerate(results):
        (mean_off, _, mem_off), (mean_on, ratio_on, mem_on) = res[False], res[True]
        # Feedback: the T-step sum errs by at most one (feedback) step's bound...
        assert ratio_on <= 1.0, (r, ratio_on)
        # ... while without it the same error repeats: expect ~T times larger.
        assert mean_on < mean_off / 2, (r, mean_on, mean_off)
        assert mem_off == 0 and mem_on > 0


def _order_worker(topo):
    """Log issue/wait of every all-to-all of one qgZ call with 4 chunks."""
    events, real = [], comm.all_to_all

    def logged(out, inp, group, phase, async_op=False):
        kind = "intra" if group is topo.intra else "inter"
        idx = sum(1 for e in events if e[:2] == ("issue", kind))
        events.append(("issue", kind, idx))
        h = real(out, inp, group, phase, async_op=async_op)

        class _H:
            def wait(self):
                events.append(("wait", kind, idx))
                h.wait()
        return _H()

    comm.all_to_all = logged
    try:
        n, S = topo.dp.size, 4 * CHUNK
        g = _grads(5, n, S, topo)
        red = QuantizedGradReducer.for_topology(topo, _cfg(quantized_gradients=True))
        red.start_reduce("u", g[topo.dp.rank], torch.zeros(S)).finish()
    finally:
        comm.all_to_all = real
    return events


def test_qgz_pipelines_the_two_hops_over_chunks():
    events = run_on_ranks(_order_worker, 8, ranks_per_node=4)[0]
    pos = {e: i for i, e in enumerate(events)}
    chunks = 4  # _order_worker's shard is 4 * CHUNK
    assert sum(1 for e in events if e[0] == "issue") == 2 * chunks
    for i in range(chunks - 1):
        # chunk i+1's in-node hop is in flight before chunk i's cross-node hop is awaited
        assert pos[("issue", "intra", i + 1)] < pos[("wait", "inter", i)], events
        assert pos[("issue", "inter", i)] < pos[("wait", "intra", i + 1)], events


# ------------------------------------------------------------------ refusals, seams
def test_rail_order_mismatch_is_refused():
    # A DP group whose members are listed node-interleaved: [0, 4, 1, 5] on nodes
    # 0, 1, 0, 1. The reorder kernel would hand rank 4 the shard of DP index 2.
    node = lambda r: r // 4  # noqa: E731
    dp = Group([0, 4, 1, 5], [node(r) for r in (0, 4, 1, 5)], rank_index=0)
    intra = Group([0, 1], [0, 0], rank_index=0)
    inter = Group([0, 4], [0, 1], rank_index=0)

    class Topo:
        """Just the attributes the rail check reads."""

    t = Topo()
    t.dp, t.intra, t.inter = dp, intra, inter
    with pytest.raises(RailOrderError, match="local index j on node a"):
        rails_of(t)


def test_seams_read_the_engine_config_and_refuse_bad_settings():
    z = ZeroConfig(quantized_gradients=True, grad_bits_intra=8, grad_bits_inter=4,
                   block_size=256, error_feedback=True)
    red = make_reducer(_FakeTopo(), z)
    assert isinstance(red, QuantizedGradReducer) and red.cfg is z
    assert not z.weights_need_zeropp
    assert isinstance(make_reducer(_FakeTopo(), ZeroConfig(quantized_weights=True)), GradReducer)
    with pytest.raises(ZeroConfigError, match="needs quantized_gradients"):
        ZeroConfig(error_feedback=True)
    with pytest.raises(ZeroConfigError, match="use 8 or 4"):
        ZeroConfig(weight_bits=2)
    g = make_gatherer(_FakeTopo(), ZeroConfig(quantized_weights=True))
    assert isinstance(g, ZeroPPWeightGatherer)


def test_unannounced_shard_write_drops_cached_copies():
    # One rank (DP=1): the packed shard is cached; an in-place write to the shard
    # without invalidate() must not serve the stale packed copy.
    g = ZeroPPWeightGatherer(_FakeTopo(), _cfg(quantized_weights=True))
    unit = _Unit("u", torch.ones(BLOCK, dtype=torch.bfloat16), torch.empty(BLOCK, dtype=torch.bfloat16))
    g.start_gather(unit, "weight_gather_fwd").wait()
    assert torch.equal(unit.full, unit.shard)
    unit.shard.mul_(3)
    g.start_gather(unit, "weight_gather_fwd").wait()
    assert torch.equal(unit.full, unit.shard)


class _FakeTopo:
    def __init__(self):
        self.dp = Group([0], [0], rank_index=0)
        self.hpz = Group([0], [0], rank_index=0)
        self.intra = Group([0], [0], rank_index=0)
        self.inter = Group([0], [0], rank_index=0)
