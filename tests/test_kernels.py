"""Blockwise quantization kernels: error bounds, packing, reorder placement, the qgZ
two-hop pipeline, and Triton == torch reference bit for bit.

Triton runs on CUDA when there is a GPU, else on CPU under the Triton interpreter
(TRITON_INTERPRET must be set before the kernels module is imported: triton.jit reads
it when it decorates).
"""

import importlib
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from megaq.kernels import ops, reference as ref  # noqa: E402
from megaq.kernels.format import QMAX, TINY, packed_len  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Relative slack on "half a quantization step": y = x * inv is off from x / scale by a
# few fp32 ulps (inv and scale are each rounded once), and floor(|y| + 0.5) is taken
# on a rounded sum; together < 2^-16 of a step. The dequantized product and the input
# add one fp32 rounding each (2^-22 relative to |x|).
STEP_SLACK = 2.0 ** -16
REL_SLACK = 2.0 ** -22


@pytest.fixture(scope="module")
def tq():
    """The Triton module, runnable on DEV (interpreted on CPU)."""
    pytest.importorskip("triton")
    from megaq.kernels import quant

    if DEV == "cpu":
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("no GPU and TRITON_INTERPRET is not 1")
        from triton.runtime.interpreter import InterpretedFunction

        if not isinstance(quant._quantize_kernel, InterpretedFunction):
            quant = importlib.reload(quant)  # imported earlier without the interpreter
    return quant


def _scales(packed, L, bits, block):
    return packed[..., L * bits // 8:].contiguous().view(torch.float32)


def _blocks(t, block):
    return t.reshape(*t.shape[:-1], t.shape[-1] // block, block)


def _assert_within_half_step(x, deq, scales, block):
    xb, db = _blocks(x.double(), block), _blocks(deq.double(), block)
    bound = scales.double().unsqueeze(-1) * (0.5 + STEP_SLACK) + xb.abs() * REL_SLACK
    assert ((xb - db).abs() <= bound).all()


def test_packed_len_and_bad_input():
    assert packed_len(4096, 8, 2048) == 4096 + 8
    assert packed_len(4096, 4, 2048) == 2048 + 8
    with pytest.raises(ValueError, match="multiple of the block size"):
        ref.quantize(torch.randn(100), 8, 64)
    with pytest.raises(ValueError, match="bits=3"):
        ref.quantize(torch.randn(128), 3, 64)
    with pytest.raises(ValueError, match="even"):
        ref.quantize(torch.randn(99), 8, 33)
    with pytest.raises(ValueError, match="expected"):
        ref.dequantize(torch.zeros(10, dtype=torch.uint8), 128, 8, 64)
    with pytest.raises(ValueError, match="pad the gradient"):
        ref.reorder_quantize(torch.randn(8 * 96), 2, 4, 4, 64)
    with pytest.raises(ValueError, match="dtype"):
        ref.quantize(torch.ones(128, dtype=torch.int32), 8, 64)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_error_within_half_step(bits, dtype):
    torch.manual_seed(bits)
    block = 64
    # blocks of very different magnitudes, including values outside fp16's range for
    # bf16/fp32 (a bf16 tensor misread as fp16 would blow up here)
    mags = torch.tensor([1e-3, 1.0, 30.0, 1e6 if dtype != torch.float16 else 1e3])
    x = (torch.randn(2, 4, block) * mags.view(1, 4, 1)).reshape(2, 4 * block).to(dtype)
    packed = ref.quantize(x, bits, block)
    deq = ref.dequantize(packed, x.shape[-1], bits, block, torch.float32)
    _assert_within_half_step(x.float(), deq, _scales(packed, x.shape[-1], bits, block), block)
    absmax = _blocks(x.float(), block).abs().amax(-1)
    assert torch.allclose(_scales(packed, x.shape[-1], bits, block), absmax / QMAX[bits], rtol=1e-6)
    # dequantizing into the input dtype is one rounding of the fp32 result
    deq_native = ref.dequantize(packed, x.shape[-1], bits, block, dtype)
    assert deq_native.dtype == dtype and torch.equal(deq_native, deq.to(dtype))


def test_int4_nibble_layout_round_trip():
    # absmax 7 -> scale 1, so q equals the integer input exactly
    q = torch.tensor([-7, 7, 3, -1, 0, -4, 5, 2] * 8, dtype=torch.float32)
    packed = ref.quantize(q, 4, 64)
    nib = q.to(torch.int8).view(torch.uint8) & 0xF
    assert torch.equal(packed[:32], nib[0::2] | (nib[1::2] << 4))
    assert _scales(packed, 64, 4, 64).item() == 1.0
    assert torch.equal(ref.dequantize(packed, 64, 4, 64), q)


def test_zero_and_tiny_blocks():
    x = torch.randn(4, 64)
    x[1] = 0.0
    x[2] = TINY / 4  # below the threshold: stored as a zero block
    x = x.reshape(-1)
    for bits in (8, 4):
        packed = ref.quantize(x, bits, 64)
        scales = _scales(packed, x.numel(), bits, 64)
        assert scales[1] == 0 and scales[2] == 0
        deq = ref.dequantize(packed, x.numel(), bits, 64)
        assert torch.isfinite(deq).all() and (deq[64:192] == 0).all()


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("block", [64, 96])  # 96: a block that is not a power of two
def test_triton_quantize_dequantize_bit_identical(tq, bits, block):
    torch.manual_seed(block + bits)
    for dtype in DTYPES:
        x = torch.randn(2, 3, 4 * block, dtype=dtype, device=DEV) * 3
        x[0, 1, :block] = 0  # zero block
        x[1, 2, block:2 * block] *= 1e-3
        a, b = ref.quantize(x, bits, block), tq.quantize(x, bits, block)
        assert torch.equal(a, b), (dtype, (a != b).sum())
        for out_dtype in {dtype, torch.float32}:  # into its own dtype, and fp32
            da = ref.dequantize(a, x.shape[-1], bits, block, out_dtype)
            db = tq.dequantize(a, x.shape[-1], bits, block, out_dtype)
            assert db.dtype == out_dtype and torch.equal(da, db), (dtype, out_dtype)


@pytest.mark.parametrize("bits", [8, 4])
def test_triton_fused_kernels_bit_identical(tq, bits):
    torch.manual_seed(bits)
    k, m, S, block = 2, 3, 128, 64
    grad = torch.randn(k * m * S, dtype=torch.bfloat16, device=DEV)
    a, b = ref.reorder_quantize(grad, k, m, bits, block), tq.reorder_quantize(grad, k, m, bits, block)
    assert torch.equal(a, b)
    res_a = torch.randn(grad.numel(), device=DEV) * 0.01
    res_b = res_a.clone()
    a = ref.reorder_quantize(grad, k, m, bits, block, res_a)
    b = tq.reorder_quantize(grad, k, m, bits, block, res_b)
    assert torch.equal(a, b) and torch.equal(res_a, res_b)
    for bits_out in (8, 4):
        c = ref.dequant_reduce_quantize(a, k, S, bits, bits_out, block)
        assert torch.equal(c, tq.dequant_reduce_quantize(a, k, S, bits, bits_out, block)), bits_out
    for out in (None, torch.randn(S, device=DEV)):
        e = ref.dequant_reduce(c, S, 4, block, 0.125, None if out is None else out.clone())
        f = tq.dequant_reduce(c, S, 4, block, 0.125, None if out is None else out.clone())
        assert torch.equal(e, f)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_reorder_places_every_chunk(tq, backend):
    mod = ref if backend == "torch" else tq
    block, S = 32, 64
    for k in (1, 2, 4):
        for m in (1, 2, 3, 4):
            n = k * m
            # chunk c holds values around 100 * (c + 1): a misplaced chunk is off by >= 100
            grad = (torch.arange(n, device=DEV).repeat_interleave(S) + 1.0) * 100 + torch.rand(n * S, device=DEV)
            packed = mod.reorder_quantize(grad, k, m, 8, block)
            assert packed.shape == (m, packed_len(k * S, 8, block))
            deq = ref.dequantize(packed, k * S, 8, block).view(m, k, S)
            for j in range(m):
                for a in range(k):
                    c = a * m + j
                    assert (deq[j, a] - grad[c * S:(c + 1) * S]).abs().max() < 1.0, (k, m, j, a)


def _simulate_qgz(mod, grads, k, m, S, bits1, bits2, block):
    """Run the qgZ pipeline for n = k*m ranks in one process; return each rank's shard
    and the per-element error bound implied by the scales actually used."""
    n = k * m
    sent = [mod.reorder_quantize(g, k, m, bits1, block) for g in grads]  # rank r = a*m + j
    shards, bounds = [], []
    hop2 = {}
    for a in range(k):
        for j in range(m):
            recv = torch.stack([sent[a * m + jj][j] for jj in range(m)])  # in-node all-to-all
            hop2[(a, j)] = mod.dequant_reduce_quantize(recv, k, S, bits1, bits2, block)
    for a in range(k):
        for j in range(m):
            recv = torch.stack([hop2[(aa, j)][a] for aa in range(k)])  # cross-node all-to-all
            shards.append(mod.dequant_reduce(recv, S, bits2, block, scale=1.0 / n))
            # hop 1 error: half a step of each of the n senders' scales for this chunk's
            # blocks; hop 2: half a step of each node's requantization scale
            s1 = torch.zeros(S // block, device=grads[0].device)
            for aa in range(k):
                for jj in range(m):
                    s1 += _scales(sent[aa * m + jj][j], k * S, bits1, block).view(k, -1)[a]
            s2 = _scales(recv, S, bits2, block).sum(0)
            bounds.append(((s1 + s2) * (0.5 + STEP_SLACK) / n).repeat_interleave(block))
    return shards, bounds


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_qgz_pipeline_matches_exact_mean(tq, backend):
    mod = ref if backend == "torch" else tq
    torch.manual_seed(0)
    block, S = 32, 64
    for k, m in ((1, 4), (2, 2), (2, 4)):
        n = k * m
        grads = [(torch.randn(n * S, device=DEV) * (1 + r)).to(torch.bfloat16) for r in range(n)]
        exact = torch.stack([g.double() for g in grads]).mean(0).view(n, S)
        shards, bounds = _simulate_qgz(mod, grads, k, m, S, 4, 4, block)
        for r in range(n):
            err = (shards[r].double() - exact[r]).abs()
            # fp32 sums of <= n + k terms of size <= max|g|: a few ulps each
            slack = 1e-6 * max(g.float().abs().max().item() for g in grads)
            assert (err <= bounds[r].double() + slack).all(), (k, m, r, (err - bounds[r]).max())
            # and the bound is tight enough to mean something: int4 steps, not garbage
            assert err.mean() < 0.5 * exact.abs().mean()


def test_error_feedback_cancels_bias():
    torch.manual_seed(1)
    k, m, S, block, steps = 1, 2, 64, 64, 20
    grad = torch.randn(k * m * S)
    residual = torch.zeros_like(grad)
    total_fb = torch.zeros_like(grad)
    total_plain = torch.zeros_like(grad)
    for _ in range(steps):
        with_fb = ref.reorder_quantize(grad, k, m, 4, block, residual)
        total_fb += ref.dequantize(with_fb, k * S, 4, block).view(-1)
        total_plain += ref.dequantize(ref.reorder_quantize(grad, k, m, 4, block), k * S, 4, block).view(-1)
    # with feedback the running sum is off by the current residual only (<= one step);
    # without it the per-step rounding error accumulates linearly
    err_fb = (total_fb - steps * grad).abs().max()
    err_plain = (total_plain - steps * grad).abs().max()
    assert err_fb <= residual.abs().max() + 1e-4
    assert err_fb * 5 < err_plain


def test_dequant_reduce_adds_into_out():
    x = torch.randn(3, 128)
    packed = ref.quantize(x, 8, 64)
    out = torch.ones(128)
    res = ref.dequant_reduce(packed, 128, 8, 64, scale=0.5, out=out)
    assert res is out
    expect = 1 + 0.5 * ref.dequantize(packed, 128, 8, 64).sum(0)
    assert torch.allclose(out, expect, atol=1e-6)


def test_ops_dispatch(tq, monkeypatch):
    assert ops.backend_for(torch.randn(4)) is ref  # CPU tensors take the reference
    x = torch.randn(128, device=DEV)
    monkeypatch.setenv("MEGAQ_KERNELS", "triton")
    assert ops.backend_for(x).__name__.endswith("quant")
    assert torch.equal(ops.quantize(x, 8, 64), ref.quantize(x, 8, 64))
    monkeypatch.setenv("MEGAQ_KERNELS", "torch")
    assert ops.backend_for(x) is ref
    monkeypatch.setenv("MEGAQ_KERNELS", "bogus")
    with pytest.raises(ValueError, match="MEGAQ_KERNELS"):
        ops.quantize(x, 8, 64)
