"""Hadamard-smoothed qgZ (--zero-hadamard-gradients, docs/ZEROPP.md).

Every rank multiplies each 64-element group of its flat gradient by the same orthogonal
H = (1/8) W D (W the Sylvester Walsh-Hadamard matrix, D fixed random signs) before the
first quantization, and the owner applies H^T after the final sum. What is checked:

* H is orthogonal, in fp32: per group ||H^T H x - x||_2 <= 12 u ||x||_2 (u = 2^-24).
  Each butterfly stage replaces (a, b) by the rounded (a + b, a - b): its error vector
  is at most u times the stage's exact output in 2-norm, and every stage scales norms
  by exactly sqrt(2), so one transform errs by at most ((1 + u)^6 - 1) ||x||_2 ~ 6u
  ||x||_2 (sign flips and the factor 1/8 are exact); forward then inverse, 12u.
* Without quantization, summing transformed gradients and transforming back gives the
  plain sum: the reduce-scatter stays in H's domain.
* On 4 gloo ranks as 2 nodes x 2 (and 2 nodes x 1, 1 node x 2): with heavy-tailed gradients (one
  large element per block) Hadamard qgZ's relative error is well below plain qgZ's, for
  int4/int4, the 8-bit in-node / 4-bit cross-node split, and the square code; its error
  is within the qgZ bound taken in H's domain; error feedback (residuals in H's domain)
  keeps the error of a T-call sum at one call's feedback bound; exact own rows compose;
  and the bytes on every link are those of plain qgZ.
* Inside the engine (2 nodes x 2), training with the flag tracks ZeRO-3's losses.
"""

from __future__ import annotations

import math

import pytest
import torch

from megaq.kernels import ops
from megaq.kernels.format import HADAMARD_SIZE
from megaq.parallel import comm
from megaq.parallel.comm import INTER
from megaq.testing.ranks import run_on_ranks
from megaq.zero import ZeroConfig
from megaq.zero.zeropp import QuantizedGradReducer, padded, rails_of

from test_zeropp_protocol import _qgz_coef
from test_zeropp_training import MARGIN, _scenarios
from zero_harness import world_totals

U = 2.0 ** -24
BLOCK = 256          # 4 Hadamard groups per quantization block
CHUNK = 256          # several qgZ chunks per unit
SHARDS = (512, 440)  # one block-aligned shard, one padded per chunk (440 -> 512)
SLACK = 1e-5         # relative: fp32 rounding of scales, products and sums (as the protocol tests)
EF_CALLS = 6


def _groups(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, HADAMARD_SIZE)


def test_hadamard_is_orthogonal_within_fp32_rounding():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, 256, generator=g) * torch.exp(3 * torch.randn(64, 256, generator=g))
    hx = ops.hadamard(x)
    for back in (ops.hadamard(hx, inverse=True), ops.hadamard(ops.hadamard(x, inverse=True))):
        err = _groups(back.double() - x.double()).norm(dim=1)
        assert (err <= 12 * U * (1 + 1e-6) * _groups(x.double()).norm(dim=1)).all()
    # It is the real transform, not a no-op: a unit vector spreads to +-1/8 everywhere,
    # and the inverse is the transpose (<H x, y> = <x, H^T y>).
    e = torch.zeros(64)
    e[5] = 1.0
    assert torch.equal(ops.hadamard(e).abs(), torch.full((64,), 0.125))
    y = torch.randn(64, 256, generator=g)
    lhs = (hx.double() * y.double()).sum()
    rhs = (x.double() * ops.hadamard(y, inverse=True).double()).sum()
    assert abs(lhs - rhs) <= 1e-5 * (x.double().norm() * y.double().norm())
    # norms are kept (Parseval per group), so outliers are spread, not amplified
    assert torch.allclose(_groups(hx.double()).norm(dim=1), _groups(x.double()).norm(dim=1), rtol=1e-6)


def test_transformed_sum_equals_plain_sum_without_quantization():
    """What the hops compute, minus the quantization: each rank's H g_r summed in fp32 in
    rank order, times 1/n, then H^T. Per group, against the fp64 mean of the g_r: the n
    forward transforms err by 6u ||g_r||_2 each (a sum of n of them: 6u sum_r ||g_r||),
    the n - 1 fp32 adds by (n - 1) u sum_r ||g_r|| at most, 1/n is exact (n a power of
    two), and the inverse by 6u ||result||; the bound below is their sum over n."""
    n = 4
    g = torch.Generator().manual_seed(8)
    grads = [torch.randn(1024, generator=g) * torch.exp(2 * torch.randn(1024, generator=g)) for _ in range(n)]
    acc = torch.zeros(1024)
    for x in grads:
        acc = acc + ops.hadamard(x)
    got = ops.hadamard(acc * (1.0 / n), inverse=True)
    exact = sum(x.double() for x in grads) / n
    norms = sum(_groups(x.double()).norm(dim=1) for x in grads)
    bound = (6 + (n - 1) + 6) * U * norms / n * (1 + 1e-6)
    assert (_groups(got.double() - exact).norm(dim=1) <= bound).all()


# --------------------------------------------------------------- qgZ on gloo ranks
def _grads(u: int, n: int, S: int) -> torch.Tensor:
    """[n ranks, n*S] bf16, heavy-tailed: a Gaussian times a log-normal scale, exp(N(0,1))
    (the protocol tests' family; kurtosis ~ 3 e^4). A block's absmax is then ~10x its
    RMS, so plain int4's step (absmax / 7) sends a quarter of the elements as 0, while in
    H's domain a 64-element group is close to Gaussian (absmax ~ 2.5x its RMS)."""
    out = []
    for r in range(n):
        g = torch.Generator().manual_seed(31 * u + r)
        out.append(torch.randn(n * S, generator=g) * torch.exp(torch.randn(n * S, generator=g)))
    return torch.stack(out).to(torch.bfloat16)


def _block_absmax(x: torch.Tensor) -> torch.Tensor:
    """[..., L] (L a block multiple) -> the absmax of each element's block."""
    b = x.abs().reshape(*x.shape[:-1], -1, BLOCK).amax(-1, keepdim=True)
    return b.expand(*b.shape[:-1], BLOCK).reshape(x.shape)


# the linear code unless a case names the square one (the default is square: the cases
# compare the transform against the code it was built to help)
CASES = {
    "plain": dict(),
    "had": dict(grad_hadamard=True),
    "plain84": dict(grad_bits_intra=8),
    "had84": dict(grad_bits_intra=8, grad_hadamard=True),
    "plain_sq": dict(grad_code="square"),
    "had_sq": dict(grad_code="square", grad_hadamard=True),
    "had_xown": dict(grad_hadamard=True, grad_exact_own_rows=True),
    "had84_ef": dict(grad_bits_intra=8, grad_hadamard=True, error_feedback=True),
    "had_ef_xown": dict(grad_hadamard=True, error_feedback=True, grad_exact_own_rows=True),
    "plain84_ef": dict(grad_bits_intra=8, error_feedback=True),
}


def _qgz_worker(topo):
    n, me = topo.dp.size, topo.dp.rank
    rails = rails_of(topo)
    out = {}
    for name, kw in CASES.items():
        cfg = ZeroConfig(quantized_gradients=True, block_size=BLOCK, grad_chunk=CHUNK,
                         **{"grad_code": "linear", **kw})
        red = QuantizedGradReducer.for_topology(topo, cfg)
        calls = EF_CALLS if cfg.error_feedback else 1
        err2 = norm2 = 0.0
        zeroed = nonzero = 0  # elements that are non-zero in the exact sum but arrive as 0
        worst = 0.0  # the largest per-group error / bound
        comm.STATS.reset()
        for u, S in enumerate(SHARDS):
            g = _grads(u, n, S)
            acc = torch.zeros(S)
            for _ in range(calls):
                red.start_reduce(f"u{u}", g[me], acc).finish()
            mine = g.reshape(n, n, S)[:, me].double()  # every rank's contribution to my shard
            exact = calls * mine.sum(0) / n
            err = acc.double() - exact
            err2 += float((err ** 2).sum())
            norm2 += float((exact ** 2).sum())
            zeroed += int(((acc == 0) & (exact != 0)).sum())
            nonzero += int((exact != 0).sum())
            # the qgZ bound (docs/ZEROPP.md "Error bounds") in the domain that is quantized:
            # per element of the padded shard, (1/n) sum_r M_r c, M_r the block absmax of
            # rank r's (transformed) shard; H^T keeps each group's 2-norm, so the error
            # of a group is at most the 2-norm of the bound over it, plus the transforms'
            # fp32 rounding (12u per call, relative to sum_r ||g_r||_2 / n).
            pad = torch.zeros(n, padded(S, BLOCK), dtype=torch.float32)
            pad[:, :S] = mine.float()
            dom = ops.hadamard(pad) if cfg.grad_hadamard else pad
            bound = (_block_absmax(dom.double()).sum(0) / n * _qgz_coef(rails, cfg, cfg.error_feedback)
                     * (1 + SLACK))
            group_bound = _groups(bound).norm(dim=1)
            rnd = 16 * U * calls * _groups(pad.double().abs()).norm(dim=1).reshape(n, -1).sum(0) / n
            e = torch.zeros(padded(S, BLOCK), dtype=torch.float64)
            e[:S] = err
            group_err = _groups(e).norm(dim=1)
            worst = max(worst, float((group_err / (group_bound + rnd)).max()))
        out[name] = {"rel": math.sqrt(err2 / norm2), "worst": worst, "zeroed": zeroed / nonzero,
                     "bytes": world_totals(comm.per_node_totals(topo.world)).get("grad_reduce")}
    out["rails"] = (rails.k, rails.m)
    return out


def _check_qgz(results, layout):
    import os
    if os.environ.get("MEGAQ_HADAMARD_REPORT"):  # the figures in docs/ZEROPP.md
        for name in CASES:
            print(f"[hadamard] k,m={layout} {name}: relative L2 error "
                  f"{max(r[name]['rel'] for r in results):.4f}, worst / bound "
                  f"{max(r[name]['worst'] for r in results):.3f}, zeroed "
                  f"{max(r[name]['zeroed'] for r in results):.3f}")
    for rank, res in enumerate(results):
        assert res["rails"] == layout, res["rails"]
        for name in CASES:
            assert res[name]["worst"] <= 1.0, (rank, name, res[name])
        # the transform helps where the tail is heavy: in H's domain the int4 step is set
        # by a near-Gaussian group, not by the block's largest element. Linear int4: about
        # half the error (measured 0.12 vs 0.27 per quantization offline), and nothing
        # sent as 0; the square code already keeps small values: a small gain (measured 0.18 vs 0.19).
        for plain, had, gain in (("plain", "had", 0.6), ("plain84", "had84", 0.6), ("plain_sq", "had_sq", 1.0)):
            assert res[had]["rel"] < gain * res[plain]["rel"], (rank, plain, had, res[plain], res[had])
        assert res["plain"]["zeroed"] > 0.1 and res["had"]["zeroed"] < 0.01, (rank, res["plain"], res["had"])
        # error feedback in H's domain: the residuals telescope, so the 6-call sum errs by
        # about one residual, not 6 calls' errors (relative to 6x the gradient: ~1/6)
        assert res["had84_ef"]["rel"] < res["had84"]["rel"] / 2, (rank, res["had84_ef"], res["had84"])
    # the same bytes on every link as plain qgZ with the same bits
    b = results[0]
    assert b["had"]["bytes"] == b["plain"]["bytes"] == b["had_sq"]["bytes"] == b["had_xown"]["bytes"]
    assert b["had84"]["bytes"] == b["plain84"]["bytes"]
    assert b["had84_ef"]["bytes"] == b["plain84_ef"]["bytes"]
    if layout[0] > 1:
        assert b["had"]["bytes"][INTER] > 0


@pytest.mark.parametrize("world, per_node", [
    (4, 2),  # 2 nodes x 2: both hops
    (2, 1),  # one rank per node: the first quantization goes straight into the cross-node layout
    (2, 2),  # one node: the in-node hop's rows are final
])
def test_hadamard_qgz_protocol(world, per_node):
    layout = (world // per_node, per_node)
    _check_qgz(run_on_ranks(_qgz_worker, world, ranks_per_node=per_node, timeout=600), layout)


# ------------------------------------------------------------------ inside the engine
def test_hadamard_training_tracks_zero3_with_the_same_bytes():
    """2 nodes x 2 (DP=4), bf16, 4 steps: ZeRO-3, ZeRO++ (qwZ + qgZ) with the transform,
    and qgZ with the transform, SDP4Bit's 8-bit in-node / 4-bit cross-node split, error
    feedback and exact own rows. Losses within MARGIN (0.5%) of ZeRO-3 (the protocol
    tests bound the gradient error; a wrong inverse, a transform left out on one side or
    a misplaced group moves the loss by far more); the first step's bytes per phase and
    link equal those of the same settings without the transform."""
    z3 = dict(block_size=64, gather_dtype=torch.bfloat16)
    zpp = dict(z3, quantized_weights=True, quantized_gradients=True)
    split = dict(z3, quantized_gradients=True, grad_bits_intra=8, error_feedback=True,
                 grad_exact_own_rows=True)
    res = run_on_ranks(_scenarios, 4, ranks_per_node=2, timeout=600, args=({
        "zero3": (z3, 4, None, False),
        "zeropp": (zpp, 1, None, True),
        "zeropp_had": (dict(zpp, grad_hadamard=True), 4, None, True),
        "split_had": (dict(split, grad_hadamard=True), 4, None, False),
    },))
    r = res[0]
    base = r["zero3"]["losses"]
    assert base[-1] < base[0]  # it learns
    for name in ("zeropp_had", "split_had"):
        for a, b in zip(base, r[name]["losses"]):
            assert abs(a - b) <= MARGIN * abs(a), (name, base, r[name]["losses"])
    assert world_totals(r["zeropp_had"]["traffic"]) == world_totals(r["zeropp"]["traffic"])
