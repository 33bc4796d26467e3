"""qgZ fidelity: error feedback over a fixed sequence of different gradients.

4 gloo ranks posing as 2 nodes x 2, so both hops quantize (int4 / int4). Each rank's
gradient at step t is a fixed, seeded function of (rank, t): per 64-element block one
element of magnitude 1 (it sets the scale, int4 step 1/7) and the rest small and of
persistent sign, from 1.5e-4 to 2.5e-4 (far below half a step, 1/14), each scaled by a
few that change every step. Round to nearest sends the small ones as 0 every time:
without feedback their sum is lost, T steps of it. With feedback the residual carries
them until they cross half a step; the error of the T-step sum is then the final
residuals, at most one step's feedback bound (docs/ZEROPP.md "Error bounds") however
large T is.

The small values are also chosen so that a residual kept in bf16 loses them: near the
threshold (|residual| in [1/16, 1/14)) bf16's half-ulp is 2^-12 = 2.4e-4, so adding
2e-4 to a bf16 residual rounds back to the same residual and the element stalls for
good; its error then grows by 2e-4 a step. The test runs that variant and no feedback
(the residual dropped), and checks that both break the bound the real implementation
meets: the check can fail.
"""

from __future__ import annotations

import torch

from megaq.kernels.format import max_error_over_absmax
from megaq.testing.ranks import run_on_ranks
from megaq.zero import ZeroConfig
from megaq.zero.zeropp import QuantizedGradReducer, rails_of

BLOCK, S, STEPS = 64, 64, 800
SLACK = 1e-5  # relative: fp32 rounding of scales and sums


def _grad(rank: int, t: int, n: int) -> torch.Tensor:
    """Rank `rank`'s full flat gradient at step t, [n * S] bf16. Per block: element 0
    is 1 (the scale), the odd elements are persistent small values of fixed sign in
    [1.9e-4, 2.3e-4], the other even ones change every step, uniform in [-0.05, 0.05]."""
    g = torch.Generator().manual_seed(12345)  # the same on every rank: their losses add up
    x = 1.9e-4 + 4e-5 * torch.rand(n * S, generator=g)
    x *= torch.where(torch.rand(n * S, generator=g) < 0.5, -1.0, 1.0)
    step = torch.Generator().manual_seed(777 + 1000 * rank + t)
    x[0::2] = 0.1 * torch.rand(n * S // 2, generator=step) - 0.05
    x[::BLOCK] = 1.0
    return x.to(torch.bfloat16)


class _Bf16Residuals(QuantizedGradReducer):
    """Mutant: residuals rounded to bf16 after every call (a bf16 store)."""

    def start_reduce(self, key, full_grad_flat, out):
        reduction = super().start_reduce(key, full_grad_flat, out)
        reduction.finish()
        for store in (self._res1, self._res2):
            for r in store.values():
                r.copy_(r.to(torch.bfloat16).to(torch.float32))
        return reduction


def _worker(topo):
    n, me = topo.dp.size, topo.dp.rank
    rails = rails_of(topo)
    # The linear int4 code, whatever the default: the sequence is built around its dead
    # zone (1/14 of the absmax, above the ~0.05 where a bf16 residual of 2e-4 steps
    # stops growing, so the bf16 mutant stalls). The square code's dead zone, 1/98, is
    # below that, so this sequence cannot catch a bf16 residual under it; the residual
    # store is the same code for both.
    cfg_on = ZeroConfig(quantized_gradients=True, error_feedback=True, block_size=BLOCK,
                        grad_exact_own_rows=True, grad_code="linear")
    cfg_off = ZeroConfig(quantized_gradients=True, error_feedback=False, block_size=BLOCK,
                         grad_exact_own_rows=True, grad_code="linear")
    variants = {"feedback": (QuantizedGradReducer, cfg_on), "off": (QuantizedGradReducer, cfg_off),
                "bf16_residual": (_Bf16Residuals, cfg_on)}
    grads = [[_grad(r, t, n) for r in range(n)] for t in range(STEPS)]
    exact = torch.zeros(S, dtype=torch.float64)
    absmax = torch.zeros(n, S, dtype=torch.float64)  # per rank, of each element's block
    for step in grads:
        for r in range(n):
            mine = step[r].double().reshape(n, S)[me]
            exact += mine / n
            blocks = mine.abs().reshape(-1, BLOCK).amax(-1).repeat_interleave(BLOCK)
            absmax[r] = torch.maximum(absmax[r], blocks)
    # One step's feedback bound (docs/ZEROPP.md "Error bounds"), int4 both hops, with
    # each rank's own rows exact: hop 1 quantizes the rows of the ranks whose local
    # index is not mine, hop 2 the partial sums of the nodes that are not mine.
    # c = the code's worst error / absmax per hop (1/14 for linear int4, 6.5/49 for the
    # square code); with feedback c/(1-c) for hop 1, c/(1-c)^2 for hop 2 (for linear:
    # 1/(2q-1) and (2q/(2q-1))/(2q-1), docs/ZEROPP.md "Error bounds").
    c, m = max_error_over_absmax(4, cfg_on.grad_code), rails.m
    a, j = me // m, me % m
    hop1 = sum(absmax[r] for r in range(n) if r % m != j) * c / (1 - c)
    hop2 = sum(absmax[r] for r in range(n) if r // m != a) * c / (1 - c) ** 2
    bound = (hop1 + hop2) / n * (1 + SLACK)
    out = {"k": rails.k, "m": rails.m}
    for name, (cls, cfg) in variants.items():
        red = cls.for_topology(topo, cfg)
        acc = torch.zeros(S, dtype=torch.float32)
        for t in range(STEPS):
            red.start_reduce("unit", grads[t][me], acc).finish()
        err = (acc.double() - exact).abs()
        out[name] = {"mean": float(err.mean()), "max_over_bound": float((err / bound).max())}
    return out


def test_error_feedback_reduces_accumulated_error_of_a_gradient_sequence():
    results = run_on_ranks(_worker, 4, ranks_per_node=2, timeout=600)
    for rank, res in enumerate(results):
        assert (res["k"], res["m"]) == (2, 2)
        fb, off, bf16 = res["feedback"], res["off"], res["bf16_residual"]
        # The T-step sum errs by at most one step's feedback bound ...
        assert fb["max_over_bound"] <= 1.0, (rank, fb)
        # ... and far less than without feedback, i.e. with the residual dropped
        # (every small element lost: ~2e-4 x T each vs at most a residual of ~1/14).
        assert off["max_over_bound"] > 1.0 and fb["mean"] < off["mean"] / 2, (rank, fb, off)
        # A residual kept in bf16 stalls and breaks the bound the same way.
        assert bf16["max_over_bound"] > 1.0 and fb["mean"] < bf16["mean"] / 1.5, (rank, fb, bf16)


# ------------------------------------------------------- the convergence harness
def _harness():
    import importlib.util
    import os
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "tools", "bench", "convergence.py")
    spec = importlib.util.spec_from_file_location("bench_convergence", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_harness_configs_reach_the_intended_settings():
    """Each configuration name of tools/bench/convergence.py parses into the ZeRO++
    settings it claims (the decomposition table is only as good as this mapping)."""
    import pytest
    from megaq.config.arguments import parse_config
    cv = _harness()
    a = cv.parse(["--iters", "20", "--tail", "5"])

    def settings(name):
        z = parse_config(cv.model_argv(a, 1234, "bf16") + cv.config_flags(name, 2),
                         world_size=4, ranks_per_node=2).zero
        return (z.quantized_weights, z.hpz_partition_size, z.quantized_gradients,
                z.error_feedback, not z.grad_exact_own_rows, z.grad_bits_intra,
                z.grad_bits_inter, z.block_size)

    assert settings("zero3") == (False, 1, False, False, True, 4, 4, 2048)
    # the shipped defaults: own rows quantized (the 5th field), no error feedback
    assert settings("zeropp") == (True, 2, True, False, True, 4, 4, 2048)
    assert settings("qgz") == (False, 1, True, False, True, 4, 4, 2048)
    assert settings("zeropp+xown+ef") == (True, 2, True, True, False, 4, 4, 2048)
    assert settings("qgz+ef") == (False, 1, True, True, True, 4, 4, 2048)
    assert settings("qgz+i8+b512") == (False, 1, True, False, True, 8, 4, 512)
    assert settings("qgz+b512+b1024") == (False, 1, True, False, True, 4, 4, 1024)  # later wins
    with pytest.raises(cv.ConfigError):
        cv.config_flags("qwz+ef", 2)  # a qgZ option without qgZ
    with pytest.raises(cv.ConfigError):
        cv.config_flags("qwz+xown", 2)
    with pytest.raises(cv.ConfigError):
        cv.config_flags("qgz+x7", 2)
    # weight deltas: hpZ references + int4 (or d8: int8) differences
    for name, bits in (("deltas", 4), ("deltas+d8", 8), ("hpz+wd", 4)):
        z = parse_config(cv.model_argv(a, 1234, "bf16") + cv.config_flags(name, 2),
                         world_size=4, ranks_per_node=2).zero
        assert (z.weight_deltas, z.weight_delta_bits, z.hpz_partition_size) == (True, bits, 2)
        assert z.quantized_gradients == name.startswith("deltas") and not z.quantized_weights
    with pytest.raises(cv.ConfigError):
        cv.config_flags("qgz+wd", 2)  # weight deltas without hpZ
    with pytest.raises(cv.ConfigError):
        cv.config_flags("hpz+d8", 2)  # a delta option without weight deltas
    # Hadamard-smoothed qgZ, with weight deltas and with SDP4Bit's 8-bit in-node hop
    for name, intra, deltas in (("deltas+had", 4, True), ("zeropp+had+i8", 8, False)):
        z = parse_config(cv.model_argv(a, 1234, "bf16") + cv.config_flags(name, 2),
                         world_size=4, ranks_per_node=2).zero
        assert z.grad_hadamard and z.quantized_gradients and z.weight_deltas == deltas
        assert (z.grad_bits_intra, z.grad_bits_inter) == (intra, 4)
    assert not parse_config(cv.model_argv(a, 1234, "bf16") + cv.config_flags("zeropp", 2),
                            world_size=4, ranks_per_node=2).zero.grad_hadamard
    with pytest.raises(cv.ConfigError):
        cv.config_flags("qwz+had", 2)  # the transform without qgZ


def test_harness_interval_is_students_t():
    cv = _harness()
    st = cv.mean_ci([0.01, 0.02, 0.03])
    # mean 0.02, sd 0.01, t(0.975, 2 df) = 4.303: half-width 4.303 * 0.01 / sqrt(3)
    assert abs(st["mean"] - 0.02) < 1e-12 and abs(st["sd"] - 0.01) < 1e-12
    half = 4.303 * 0.01 / 3 ** 0.5
    assert abs(st["ci95"][0] - (0.02 - half)) < 1e-9 and abs(st["ci95"][1] - (0.02 + half)) < 1e-9
    assert cv.mean_ci([0.5])["ci95"] is None


def test_exact_own_row_is_left_out_of_the_quantized_sum_at_every_position():
    """_reduce_rows drops row `mine` (first, middle or last: the slices that replaced a
    list index, which cost a host-to-device copy and broke CUDA-graph capture) and adds
    the exact row instead; the result equals summing the other rows one by one."""
    from megaq.kernels import ops
    from megaq.zero.zeropp.grads import _reduce_rows

    L, bits, block = 128, 4, 64
    own = torch.full((L,), 0.25)
    for code in ("linear", "square"):
        recv = ops.quantize(torch.randn(4, L, generator=torch.Generator().manual_seed(3)), bits, block, code)
        for mine in range(4):
            want = torch.zeros(L)
            for r in range(4):
                if r != mine:  # the fused kernel's order: rows in index order from +0.0
                    want = want + ops.dequantize(recv[r], L, bits, block, code=code)
            assert torch.equal(_reduce_rows(recv, mine, L, bits, block, own, code), want + own), (code, mine)
