"""Blockwise quantization kernels: error bounds, packing, reorder placement, the qgZ
two-hop pipeline, and Triton == torch reference bit for bit.

Triton runs on CUDA when there is a GPU, else on CPU under the Triton interpreter
(TRITON_INTERPRET must be set before the kernels module is imported: triton.jit reads
it when it decorates).
"""

import functools
import os
from types import SimpleNamespace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from megaq.kernels import ops, reference as ref  # noqa: E402
from megaq.kernels.format import KERNEL_API, QMAX, SCALE_BITS, SCALE_DROP, TINY, packed_len  # noqa: E402
from megaq.kernels.tuning import Tuning  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Relative slack on "half a quantization step": y = x * inv is off from x / scale by a
# few fp32 ulps (inv and scale are each rounded once), and floor(|y| + 0.5) is taken
# on a rounded sum; together < 2^-16 of a step. The dequantized product and the input
# add one fp32 rounding each (2^-22 relative to |x|).
STEP_SLACK = 2.0 ** -16
REL_SLACK = 2.0 ** -22


@pytest.fixture(scope="module")
def tq(request):
    """The Triton module, runnable on DEV (interpreted on CPU)."""
    pytest.importorskip("triton")
    if DEV == "cpu":
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("no GPU and TRITON_INTERPRET is not 1")
        request.getfixturevalue("faithful_interpreter")
    return request.getfixturevalue("quant_kernels")


def _launched(tq, tuning):
    """The Triton ops of `tq`, each launched with `tuning` (the API of tq and ref)."""
    return SimpleNamespace(**{name: functools.partial(getattr(tq, name), tuning=tuning)
                              for name in KERNEL_API if name != "packed_len"})


def _scales(packed, L, bits, block):
    return packed[..., L * bits // 8:].contiguous().view(torch.float32)


def _blocks(t, block):
    return t.reshape(*t.shape[:-1], t.shape[-1] // block, block)


def _assert_within_half_step(x, deq, scales, block):
    xb, db = _blocks(x.double(), block), _blocks(deq.double(), block)
    bound = scales.double().unsqueeze(-1) * (0.5 + STEP_SLACK) + xb.abs() * REL_SLACK
    assert ((xb - db).abs() <= bound).all()


def _assert_scale_rule(scales, exact):
    """Scales are absmax / qmax rounded up to SCALE_BITS significant bits: never below
    the quotient (beyond its own fp32 rounding), at most 2^-(SCALE_BITS-1) above it, and
    their low 24 - SCALE_BITS mantissa bits are zero."""
    assert ((scales.contiguous().view(torch.int32) & SCALE_DROP) == 0).all()
    s = scales.double()
    assert (s >= exact * (1 - 2.0 ** -24)).all()
    assert (s <= exact * (1 + 2.0 ** -(SCALE_BITS - 1))).all()


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
    scales = _scales(packed, x.shape[-1], bits, block)
    _assert_scale_rule(scales, absmax.double() / QMAX[bits])
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


def _spy_quantize_launches(tq, monkeypatch, what):
    """Launch the quantize kernel as before, recording what(plan keyword arguments) of
    every launch in the returned list."""
    seen, real = [], tq.kt.QUANTIZE

    class Spy:
        def launch(self, plan, *tensors):
            seen.append(what(plan.kwargs))
            return real.launch(plan, *tensors)

    monkeypatch.setattr(tq.kt, "QUANTIZE", Spy())
    return seen


def test_quantize_evict_hint_by_size(tq, monkeypatch):
    """Below Tuning.evict_first_below[bits] elements (2^25 for int8, 2^26 for int4 in
    production) the quantize kernel's loads are marked evict-first (per call on the H200:
    a win at 16M elements for int8, at 16M and 32M for int4; a loss from 64M), from there
    on they are not; the reorder (qgZ) quantize follows the same rule by its whole input;
    a cache hint only: the same bytes either way."""
    seen = _spy_quantize_launches(tq, monkeypatch, lambda kw: kw["EVICT"])
    small = Tuning(evict_first_below={8: 2048, 4: 4096})  # the rule at test sizes
    x = torch.randn(8192, generator=torch.Generator().manual_seed(3)).to(DEV)
    for bits in (8, 4):
        for t in (x[:1024], x[:2048], x[:4096]):
            assert torch.equal(tq.quantize(t, bits, 256, tuning=small).cpu(), ref.quantize(t.cpu(), bits, 256))
    assert seen == ["evict_first", "", "", "evict_first", "evict_first", ""]
    for n, want in ((2048, "evict_first"), (4096, "")):  # k * m * S elements in all
        r = tq.reorder_quantize(x[:n], 2, 2, 4, 256, tuning=small)
        assert torch.equal(r.cpu(), ref.reorder_quantize(x[:n].cpu(), 2, 2, 4, 256)) and seen[-1] == want
    # a setting of the benchmark's sweep wins over the size rule
    tq.quantize(x[:1024], 8, 256, tuning=Tuning(evict="", evict_first_below={8: 2048, 4: 4096}))
    assert seen[-1] == ""
    tq.quantize(x[:1024], 8, 256)  # the production threshold: 1024 elements are far below it
    assert seen[-1] == "evict_first"


def test_quantize8_launch_shape_by_size(tq, monkeypatch):
    """Below Tuning.bulk_copies_from elements the int8 quantize (linear, no residual)
    launches in DeepSpeed's shape, 16 elements a thread, one block a program, registers
    capped at QUANTIZE8_SMALL_REGS (per call on the H200 ~1% ahead at 16M-32M); from there
    on, and for int4, with a residual, or in a shape the Tuning sets, at 64 a thread, two
    blocks a program, uncapped (a 32-register cap would spill there). Same bytes every way."""
    seen = _spy_quantize_launches(tq, monkeypatch, lambda kw: (kw["num_warps"], kw["NB"], kw.get("maxnreg")))
    monkeypatch.setattr(tq, "_has_bulk_copies", lambda device: False)
    rule = Tuning(bulk_copies_from=8192)  # the size rule at test sizes
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(16384, generator=g) * 3).to(DEV)
    small, large = (2, 1, tq.QUANTIZE8_SMALL_REGS), (1, 2, None)  # 1024-blocks: 16 or 64 a thread
    for t, bits, want in ((x[:4096], 8, small), (x, 8, large), (x[:4096], 4, large)):
        assert torch.equal(tq.quantize(t, bits, 1024, tuning=rule).cpu(),
                           ref.quantize(t.cpu(), bits, 1024)), (t.numel(), bits)
        assert seen[-1] == want, (t.numel(), bits)
    r1 = (torch.randn(4096, generator=g) * 0.01).to(DEV)
    r2 = r1.clone().cpu()
    assert torch.equal(tq.reorder_quantize(x[:4096], 2, 2, 8, 1024, r1, tuning=rule).cpu(),
                       ref.reorder_quantize(x[:4096].cpu(), 2, 2, 8, 1024, r2))
    assert torch.equal(r1.cpu(), r2) and seen[-1] == (1, 1, None)  # chunks of one block: one a program
    for fields, want in (({"warps": 4, "nb": 2}, (4, 2, None)), ({"regs": 0}, (2, 1, None)),
                         ({"warps": 4, "nb": 1, "regs": 40}, (4, 1, 40))):
        tuning = Tuning(bulk_copies_from=8192, **fields)
        assert torch.equal(tq.quantize(x[:4096], 8, 1024, tuning=tuning).cpu(),
                           ref.quantize(x[:4096].cpu(), 8, 1024))
        assert seen[-1] == want, fields


@pytest.mark.parametrize("block", [64, 192])  # 192: 3 groups of 64 per block, padded to 4
def test_quantize_chunk_tiles_bit_identical(tq, monkeypatch, block):
    """The quantize kernel's other layout (every 64-group as 8 chunk tiles: the fused
    Hadamard transform's, Tuning.chunked) with evict-first loads writes the
    reference's bytes and residual, in both int4 codes and int8."""
    chunked = Tuning(chunked=True, evict="evict_first")
    g = torch.Generator().manual_seed(block)
    k, m, S = 2, 2, 2 * block
    x = torch.randn(k * m * S, generator=g) * torch.exp(torch.randn(k * m * S, generator=g))
    x[:block] = 0  # a zero block
    for dtype in (torch.bfloat16,) if block == 64 else (torch.float32,):  # both input widths, half the time
        xd = x.to(dtype).to(DEV)
        for bits, code in ((8, "linear"), (4, "linear"), (4, "square")):
            assert torch.equal(tq.quantize(xd.reshape(4, S), bits, block, code, tuning=chunked),
                               ref.quantize(xd.reshape(4, S), bits, block, code)), (dtype, bits, code)
            r1 = (torch.randn(x.numel(), generator=g) * 0.01).to(DEV)
            r2 = r1.clone()
            assert torch.equal(tq.reorder_quantize(xd, k, m, bits, block, r1, code, tuning=chunked),
                               ref.reorder_quantize(xd, k, m, bits, block, r2, code)), (dtype, bits, code)
            assert torch.equal(r1, r2)


def test_quantize_bulk_copies_bit_identical(tq, monkeypatch):
    """The int8 quantize of one row through bulk tensor copies (Tuning.tma: TMA on the
    GPU, the interpreter's tensor descriptors on CPU) writes the reference's bytes, at
    one and at two blocks per program, and leaves other calls to the register path."""
    g = torch.Generator().manual_seed(6)
    x = (torch.randn(8 * 256, generator=g) * 3).to(DEV)
    x[256:512] = 0  # a zero block
    for nb in (1, 2):
        bulk = Tuning(tma=True, nb=nb)
        for dtype in (torch.float32, torch.bfloat16):
            xd = x.to(dtype)
            assert torch.equal(tq.quantize(xd, 8, 256, tuning=bulk).cpu(), ref.quantize(xd.cpu(), 8, 256)), (nb, dtype)
        r1 = (torch.randn(x.numel(), generator=g) * 0.01).to(DEV)
        r2 = r1.clone().cpu()
        assert torch.equal(tq.reorder_quantize(x, 2, 2, 8, 256, r1, tuning=bulk).cpu(),
                           ref.reorder_quantize(x.cpu(), 2, 2, 8, 256, r2)), nb
        assert torch.equal(r1.cpu(), r2)


def test_quantize_bulk_copies_by_size(tq, monkeypatch):
    """From Tuning.bulk_copies_from elements (2^26 in production), where the device has
    bulk tensor copies (Hopper), the int8 quantize of one contiguous row takes them;
    smaller inputs, int4, several rows, another device or Tuning.tma=False do not. The
    bytes are the same either way."""
    seen, real = [], tq._quantize8_tma
    monkeypatch.setattr(tq, "_quantize8_tma", lambda *a: (seen.append(a[0].numel()), real(*a)))
    monkeypatch.setattr(tq, "_has_bulk_copies", lambda device: True)
    rule = Tuning(bulk_copies_from=2048)  # the size rule at test sizes
    x = torch.randn(4096, generator=torch.Generator().manual_seed(4)).to(DEV)
    for t, bits, rows in ((x, 8, 1), (x[:1024], 8, 1), (x, 4, 1), (x, 8, 2)):
        t = t.reshape(rows, -1)
        assert torch.equal(tq.quantize(t, bits, 256, tuning=rule).cpu(), ref.quantize(t.cpu(), bits, 256))
    assert seen == [4096]
    tq.quantize(x, 8, 256)  # the production threshold: 4096 elements are below it
    tq.quantize(x, 8, 256, tuning=Tuning(tma=False, bulk_copies_from=2048))
    monkeypatch.setattr(tq, "_has_bulk_copies", lambda device: False)
    tq.quantize(x, 8, 256, tuning=rule)
    assert seen == [4096]


@pytest.mark.parametrize("bits", [8, 4])
def test_triton_fused_kernels_bit_identical(tq, bits):
    torch.manual_seed(bits)
    k, m, S, block = 2, 3, 128, 64
    grad = torch.randn(k * m * S, dtype=torch.bfloat16, device=DEV)
    a, b = ref.reorder_quantize(grad, k, m, bits, block), tq.reorder_quantize(grad, k, m, bits, block)
    assert torch.equal(a, b)
    # one node (k = 1): the kernel's plain-rows addressing, with and without feedback
    res_a = torch.randn(grad.numel(), device=DEV) * 0.01
    res_b = res_a.clone()
    assert torch.equal(ref.reorder_quantize(grad, 1, k * m, bits, block, res_a),
                       tq.reorder_quantize(grad, 1, k * m, bits, block, res_b)) and torch.equal(res_a, res_b)
    assert torch.equal(ref.reorder_quantize(grad, 1, k * m, bits, block),
                       tq.reorder_quantize(grad, 1, k * m, bits, block))
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


def _hop_input(m, k, S, block, seed):
    """Received int4 rows [m, packed_len(k*S, 4)] with random q in [-8, 7] (every
    nibble) and scales that exercise the hop's edge cases, block by block: scales spread
    over 2^+-40 with more than 20 bits (the hop truncates them), 0: an all-zero block,
    1: a row 2^-110 below the largest (flushed), 2: two rows that cancel exactly,
    3: q = 0 everywhere, 4 / 5: huge and tiny scales."""
    g = torch.Generator().manual_seed(seed)
    nb = k * S // block
    q = torch.randint(-8, 8, (m, k * S), dtype=torch.int8, generator=g)
    scales = torch.exp2(torch.randint(-40, 40, (m, nb), generator=g).float()) * (1 + torch.rand(m, nb, generator=g))
    scales[:, 0] = 0.0
    scales[1, 1] = scales[:, 1].max() * 2.0 ** -110
    b2 = slice(2 * block, 3 * block)
    q[0, b2] = torch.randint(-7, 8, (block,), dtype=torch.int8, generator=g)
    q[1, b2] = -q[0, b2]
    scales[1, 2] = scales[0, 2]
    scales[2:, 2] = 0.0
    q[:, 3 * block:4 * block] = 0
    scales[:, 4] = 1e30
    scales[:, 5] = 1e-25
    return ref._pack(q, scales, 4)


@pytest.mark.parametrize("words", [True, False])  # the word kernel, and the byte kernel
@pytest.mark.parametrize("block", [64, 96])  # 96: W = 12 words, padded to 16
def test_int4_hop_bit_identical_and_within_bound(tq, words, block):
    tq = _launched(tq, Tuning(words=bool(words)))
    m, k, S = 4, 2, block * 4
    recv = _hop_input(m, k, S, block, seed=block + words)
    exact = ref._dequantize_fp32(recv, k * S, 4, block).double().sum(0).reshape(k, S)
    # besides half a step: truncating the input scales to 20 bits (2^-19 of |q| s <= 8 s
    # per row) and the fp32 rounding of the biased sums (~2^-20 of 8 * sum of scales)
    in_scales = _scales(recv, k * S, 4, block).double().reshape(m, k, S // block)
    slack = (in_scales.sum(0) * 2.0 ** -14).repeat_interleave(block, -1)
    for bits_out in (4, 8):
        a = ref.dequant_reduce_quantize(recv, k, S, 4, bits_out, block)
        assert torch.equal(a, tq.dequant_reduce_quantize(recv.to(DEV), k, S, 4, bits_out, block).cpu())
        got = ref._dequantize_fp32(a, S, bits_out, block).double()
        out_scales = _scales(a, S, bits_out, block)
        bound = out_scales.double().repeat_interleave(block, -1) * (0.5 + STEP_SLACK) + slack
        assert ((got - exact).abs() <= bound).all(), (bits_out, ((got - exact).abs() - bound).max())
        # zero blocks: all-zero input and two rows that cancel exactly (their biased sums
        # cancel exactly too); with q = 0 everywhere the sum is rounding noise of the
        # bias, 2^-14 of the scales at most (the bound above), not necessarily 0
        zero = out_scales == 0
        assert zero[0, 0] and zero[0, 2] and not zero[1, 2]
        assert (got[0, 3 * block:4 * block].abs() <= slack[0, 3 * block:4 * block]).all()
        nz = ~zero & (torch.arange(S // block) != 3)
        assert ((out_scales[nz].view(torch.int32) & SCALE_DROP) == 0).all()  # 20-bit scales
        ratio = out_scales[nz].double() * QMAX[bits_out] / _blocks(exact, block).abs().amax(-1)[nz]
        assert ((ratio - 1).abs() < 2.0 ** -12).all()
        # the flushed row (block 1, row 1) changes no bit: the same as without that row
        without = ref.dequant_reduce_quantize(recv[[0, 2, 3]], k, S, 4, bits_out, block)
        blk = slice(block * bits_out // 8, 2 * block * bits_out // 8)
        assert torch.equal(a[0, blk], without[0, blk]) and out_scales[0, 1] == _scales(without, S, bits_out, block)[0, 1]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_reorder_places_every_chunk(tq, backend):
    mod = ref if backend == "torch" else tq
    block, S = 32, 64
    for k in (1, 2, 4):
        for m in (1, 2, 3, 4):
            n = k * m
            # chunk c holds values in 100 * (c + 1) + [0, 1): a misplaced chunk is off by > 99,
            # a placed one by at most half an int8 step (< 3.2 here)
            grad = (torch.arange(n, device=DEV).repeat_interleave(S) + 1.0) * 100 + torch.rand(n * S, device=DEV)
            packed = mod.reorder_quantize(grad, k, m, 8, block)
            assert packed.shape == (m, packed_len(k * S, 8, block))
            deq = ref.dequantize(packed, k * S, 8, block).view(m, k, S)
            for j in range(m):
                for a in range(k):
                    c = a * m + j
                    assert (deq[j, a] - grad[c * S:(c + 1) * S]).abs().max() < 10.0, (k, m, j, a)


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
    monkeypatch.delenv("MEGAQ_KERNELS", raising=False)
    assert ops.QUANTIZE.pick(torch.randn(4)) is ref.quantize  # CPU tensors take the reference
    x = torch.randn(128, device=DEV)
    monkeypatch.setenv("MEGAQ_KERNELS", "triton")
    assert ops.QUANTIZE.pick(x) is tq.quantize
    assert torch.equal(ops.quantize(x, 8, 64), ref.quantize(x, 8, 64))
    monkeypatch.setenv("MEGAQ_KERNELS", "torch")
    assert ops.QUANTIZE.pick(x) is ref.quantize
    monkeypatch.setenv("MEGAQ_KERNELS", "bogus")
    with pytest.raises(ValueError, match="MEGAQ_KERNELS"):
        ops.quantize(x, 8, 64)


# ----------------------------------------------------------- the square-law int4 code
SQ_LEVELS = torch.tensor([c * c for c in range(8)], dtype=torch.float64)


def _square_nearest(x, inv):
    """The definition, in fp64: c = the level c^2 nearest to y = |x| * inv (exact),
    ties to the larger; q = sign(x) c."""
    y = x.double().abs() * inv.double().unsqueeze(-1)
    d = (y.unsqueeze(-1) - SQ_LEVELS).abs()
    # ties to the larger level: among equal distances argmin picks the first, so flip
    c = 7 - d.flip(-1).argmin(-1)
    return torch.where(x < 0, -c, c)


def _near_thresholds(block, seed):
    """[4, block] fp32: each row's absmax 49 * 2^e, the other values a few ulps around
    every threshold t^2 + t + 1/2 of y = |x| * inv, so that the fp32 product rn(y) lands
    on a threshold from below (the case reference and Triton settle with an fma)."""
    from megaq.kernels.format import SQUARE_THRESHOLDS

    g = torch.Generator().manual_seed(seed)
    rows = []
    for e in (-3, 0, 5, 8):  # absmax below fp16's largest value
        s = torch.tensor(2.0 ** e * (1 + torch.rand(1, generator=g).item()))
        absmax = (s * 49).float()
        _, inv = ref._scale_rule(absmax.view(1), torch.zeros(1, dtype=torch.bool), 4, True)
        vals = [absmax]
        while len(vals) < block:
            t = SQUARE_THRESHOLDS[len(vals) % 7]
            base = torch.tensor(t, dtype=torch.float32) / inv[0]  # ~ T * s, fp32
            step = int(torch.randint(-3, 4, (1,), generator=g))
            v = torch.nextafter(base, torch.tensor(float("inf") if step > 0 else 0.0)) if step else base
            for _ in range(abs(step) - 1):
                v = torch.nextafter(v, torch.tensor(float("inf") if step > 0 else 0.0))
            vals.append(v * (1 if len(vals) % 2 else -1))
        rows.append(torch.stack(vals))
    return torch.stack(rows).float()


def test_square_code_is_the_nearest_level_and_within_its_bound():
    from megaq.kernels.format import SQUARE_SCALE_DROP, max_error_over_absmax

    torch.manual_seed(22)
    block = 64
    mags = torch.tensor([1e-3, 1.0, 30.0, 1e6])
    x = (torch.randn(2, 4, block) * torch.exp(torch.randn(2, 4, block)) * mags.view(1, 4, 1)).reshape(2, -1)
    x = torch.cat([x, _near_thresholds(block, 1).reshape(2, -1)], -1)
    L = x.shape[-1]
    packed = ref.quantize(x, 4, block, "square")
    assert packed.shape[-1] == packed_len(L, 4, block)  # the same bytes as linear int4
    scales = _scales(packed, L, 4, block)
    absmax = _blocks(x, block).abs().amax(-1).double()
    assert ((scales.view(torch.int32) & SQUARE_SCALE_DROP) == 0).all()  # 18-bit scales
    assert (scales.double() >= absmax / 49 * (1 - 2.0 ** -24)).all()
    assert (scales.double() <= absmax / 49 * (1 + 2.0 ** -17)).all()
    # q is the nearest level (the definition, evaluated in fp64)
    inv = 1 / scales
    nib = torch.stack([(packed[..., :L // 2] << 4).view(torch.int8) >> 4,
                       packed[..., :L // 2].view(torch.int8) >> 4], -1).reshape(2, -1)
    assert torch.equal(_blocks(nib.long(), block), _square_nearest(_blocks(x, block), inv))
    # dequantize: q |q| * scale, exact (every level is an fp32 number)
    deq = ref.dequantize(packed, L, 4, block, code="square")
    levels = _blocks(deq.double(), block) / scales.double().unsqueeze(-1)
    assert torch.equal(levels.abs(), levels.abs().round()) and set(levels.abs().unique().tolist()) <= set(
        SQ_LEVELS.tolist())
    # the error bound (docs/ZEROPP.md): <= 6.5 s, and near zero <= sqrt(|x| s) + s / 2
    err = (_blocks(x, block).double() - _blocks(deq, block).double()).abs()
    assert (err <= absmax.unsqueeze(-1) * max_error_over_absmax(4, "square")).all()
    s = scales.double().unsqueeze(-1)
    assert (err <= ((_blocks(x, block).double().abs() * s).sqrt() + s / 2) * (1 + 2.0 ** -16)).all()
    # values down to absmax / 98 survive; the linear code zeroes everything below absmax / 14
    small = _blocks(x, block).abs().double() >= absmax.unsqueeze(-1) / 98 * (1 + 2.0 ** -16)
    assert (_blocks(deq, block)[small] != 0).all()


def test_square_q_table_equals_the_seven_comparisons():
    """The reference's table look-up (_square_q) against its definition: count the
    thresholds t^2 + t + 1/2 that y = |x| * inv (exact, fp64) reaches, sign of x. Inputs
    a few ulps around every threshold, random values, +-0, NaN and +-inf (a NaN or inf
    element makes y NaN: q = 0 either way)."""
    from megaq.kernels.format import SQUARE_THRESHOLDS

    torch.manual_seed(3)
    block = 64
    x = torch.cat([_near_thresholds(block, 5).reshape(-1),
                   torch.randn(4 * block) * torch.exp(3 * torch.randn(4 * block)),
                   torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf"), 1e-30, -1e-30]
                                + [1.0] * (block - 7))]).reshape(-1, block)
    blocks = x.float()
    absmax = blocks.abs().amax(-1)
    _, inv = ref._scale_rule(absmax, absmax < TINY, 4, True)
    inv[-1] = 3.0   # the last row's absmax is inf: give its finite elements a real inv too
    y = blocks.abs().double() * inv.double().unsqueeze(-1)
    c = sum((y >= thr).to(torch.int8) for thr in SQUARE_THRESHOLDS)
    want = torch.where(blocks < 0, -c, c)
    got = ref._square_q(blocks, inv)
    assert got.dtype == torch.int8 and torch.equal(got, want)
    assert set(got.unique().tolist()) == set(range(-7, 8))   # every level was exercised


def test_square_code_bad_name():
    with pytest.raises(ValueError, match="int4 code 'cube'"):
        ref.quantize(torch.randn(128), 4, 64, "cube")
    with pytest.raises(ValueError, match="int4 code"):
        ops.dequant_reduce(torch.zeros(2, packed_len(64, 4, 64), dtype=torch.uint8), 64, 4, 64, code="log")


@pytest.mark.parametrize("block", [64, 96])
def test_square_triton_quantize_dequantize_bit_identical(tq, block):
    torch.manual_seed(block)
    ties = 0
    for dtype in DTYPES:
        x = torch.randn(2, 3, 4 * block) * 3
        x[0, 1, :block] = 0  # zero block
        x[1, 2, block:2 * block] *= 1e-3
        x[1, 0] = _near_thresholds(block, block).reshape(-1)
        x = x.to(dtype).to(DEV)
        a, b = ref.quantize(x, 4, block, "square"), tq.quantize(x, 4, block, "square")
        assert torch.equal(a.cpu(), b.cpu()), (dtype, (a.cpu() != b.cpu()).sum())
        # the tie case of the Triton argument was exercised: rn(|x| * inv) on a threshold
        # with the exact product below it
        xs = _blocks(x[1, 0].float().cpu(), block)
        inv = 1 / _scales(a[1, 0].cpu(), 4 * block, 4, block).unsqueeze(-1)
        y32, y64 = xs.abs() * inv, xs.abs().double() * inv.double()
        thr = torch.tensor([t * t + t + 0.5 for t in range(7)])
        ties += int(((y32.unsqueeze(-1) == thr) & (y64.unsqueeze(-1) < thr.double())).sum())
        for out_dtype in {dtype, torch.float32}:
            da = ref.dequantize(a, x.shape[-1], 4, block, out_dtype, "square")
            db = tq.dequantize(a, x.shape[-1], 4, block, out_dtype, "square")
            assert db.dtype == out_dtype and torch.equal(da, db), (dtype, out_dtype)
    assert ties > 0


@pytest.mark.parametrize("words", [True, False])  # the word kernels, and the byte kernel
@pytest.mark.parametrize("block", [64, 96])  # 96: W = 12 words, padded to 16
def test_square_triton_fused_kernels_bit_identical(tq, words, block):
    tq = _launched(tq, Tuning(words=bool(words)))
    torch.manual_seed(5)
    k, m, S = 2, 3, 2 * block
    grad = (torch.randn(k * m * S) * torch.exp(torch.randn(k * m * S))).to(torch.bfloat16).to(DEV)
    a = ref.reorder_quantize(grad, k, m, 4, block, code="square")
    assert torch.equal(a, tq.reorder_quantize(grad, k, m, 4, block, code="square"))
    res_a = torch.randn(grad.numel(), device=DEV) * 0.01
    res_b = res_a.clone()
    a = ref.reorder_quantize(grad, k, m, 4, block, res_a, "square")
    b = tq.reorder_quantize(grad, k, m, 4, block, res_b, "square")
    assert torch.equal(a, b) and torch.equal(res_a, res_b)
    a8 = ref.reorder_quantize(grad, k, m, 8, block, code="square")  # int8 stays linear
    assert torch.equal(a8, ref.reorder_quantize(grad, k, m, 8, block))
    for recv, bits_in in ((a, 4), (a8, 8)):
        for bits_out in (8, 4):
            c = ref.dequant_reduce_quantize(recv, k, S, bits_in, bits_out, block, "square")
            d = tq.dequant_reduce_quantize(recv, k, S, bits_in, bits_out, block, "square")
            assert torch.equal(c, d), (bits_in, bits_out)
    # the hop on the edge cases of the linear hop's test (scales of any width over 2^+-40,
    # zero, flushed-size and cancelling rows; nibble -8, which the code never writes)
    edge = _hop_input(4, k, 4 * block, block, seed=block + words)
    for bits_out in (8, 4):
        assert torch.equal(ref.dequant_reduce_quantize(edge, k, 4 * block, 4, bits_out, block, "square"),
                           tq.dequant_reduce_quantize(edge.to(DEV), k, 4 * block, 4, bits_out, block,
                                                      "square").cpu())
    for out in (None, torch.randn(S, device=DEV)):
        e = ref.dequant_reduce(c, S, 4, block, 0.125, None if out is None else out.clone(), "square")
        f = tq.dequant_reduce(c, S, 4, block, 0.125, None if out is None else out.clone(), "square")
        assert torch.equal(e, f)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_square_qgz_pipeline_within_bound(tq, backend):
    """Two square hops: each errs by at most 6.5 of its scales per element (docs/ZEROPP.md)."""
    mod = ref if backend == "torch" else tq
    torch.manual_seed(3)
    block, S = 32, 64
    for k, m in ((1, 4), (2, 2)):
        n = k * m
        grads = [(torch.randn(n * S, device=DEV) * (1 + r)).to(torch.bfloat16) for r in range(n)]
        exact = torch.stack([g.double() for g in grads]).mean(0).view(n, S)
        sent = [mod.reorder_quantize(g, k, m, 4, block, code="square") for g in grads]
        hop2 = {(a, j): mod.dequant_reduce_quantize(torch.stack([sent[a * m + jj][j] for jj in range(m)]),
                                                    k, S, 4, 4, block, "square")
                for a in range(k) for j in range(m)}
        for a in range(k):
            for j in range(m):
                recv = torch.stack([hop2[(aa, j)][a] for aa in range(k)])
                got = mod.dequant_reduce(recv, S, 4, block, 1.0 / n, code="square").double()
                s1 = sum(_scales(sent[aa * m + jj][j], k * S, 4, block).view(k, -1)[a]
                         for aa in range(k) for jj in range(m))
                s2 = _scales(recv, S, 4, block).sum(0)
                bound = ((s1 + s2).double() * 6.5 * (1 + 2.0 ** -16) / n).repeat_interleave(block)
                slack = 1e-6 * max(g.float().abs().max().item() for g in grads)
                err = (got - exact[a * m + j]).abs()
                assert (err <= bound + slack).all(), (k, m, a, j, (err - bound).max())


# ------------------------------------------------ the Hadamard transform (qgZ option)
def _bits_equal(a, b):
    return torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


# a power of two, and a padded tile (192 -> 256 lanes); int4 float output in the 32-bit-word
# kernel (the default) and in the byte kernel
@pytest.mark.slow  # 7-17 s each in Triton's interpreter
@pytest.mark.parametrize("block, words", [(64, True), (192, True), (64, False)])
def test_hadamard_triton_bit_identical(tq, block, words):
    """The transform, alone and fused into reorder_quantize (with and without a residual)
    and the final dequant_reduce, is bit-identical to the reference: the same fp32 adds
    in the same butterfly order, exact sign flips and an exact 1/8."""
    tq = _launched(tq, Tuning(words=bool(words)))
    g = torch.Generator().manual_seed(21)
    k, m, S = 2, 2, 2 * block
    x = (torch.randn(k * m * S, generator=g) * torch.rand(k * m * S, generator=g) ** 4).to(DEV)
    for inverse in (False, True):
        assert _bits_equal(tq.hadamard(x.reshape(-1, 64), inverse), ref.hadamard(x.reshape(-1, 64), inverse))
    assert _bits_equal(tq.hadamard(x.bfloat16()), ref.hadamard(x.bfloat16()))
    for bits, code in ((4, "linear"), (8, "linear"), (4, "square")):
        assert torch.equal(tq.reorder_quantize(x, k, m, bits, block, code=code, hadamard=True),
                           ref.reorder_quantize(x, k, m, bits, block, code=code, hadamard=True))
        r1 = torch.randn(x.numel(), generator=g).to(DEV) * 0.01
        r2 = r1.clone()
        assert torch.equal(tq.reorder_quantize(x, k, m, bits, block, r1, code, hadamard=True),
                           ref.reorder_quantize(x, k, m, bits, block, r2, code, hadamard=True))
        assert _bits_equal(r1, r2)
        packed = ref.quantize(x.reshape(k * m, S), bits, block, code)
        assert _bits_equal(tq.dequant_reduce(packed, S, bits, block, 0.25, code=code, hadamard=True),
                           ref.dequant_reduce(packed, S, bits, block, 0.25, code=code, hadamard=True))
        o1 = torch.randn(S, generator=g).to(DEV)
        o2 = o1.clone()
        tq.dequant_reduce(packed, S, bits, block, 0.25, o1, code, hadamard=True)
        ref.dequant_reduce(packed, S, bits, block, 0.25, o2, code, hadamard=True)
        assert _bits_equal(o1, o2)
    assert torch.equal(tq.quantize(x.reshape(4, S), 4, block, hadamard=True),
                       ref.quantize(x.reshape(4, S), 4, block, hadamard=True))
    # the option does something: a different payload than plain quantization
    assert not torch.equal(ref.quantize(x.reshape(4, S), 4, block, hadamard=True),
                           ref.quantize(x.reshape(4, S), 4, block))
    with pytest.raises(ValueError, match="multiple of 64"):
        ref.reorder_quantize(torch.randn(4 * 96), 2, 2, 4, 96, hadamard=True)
    with pytest.raises(ValueError, match="multiple of 64"):
        tq.hadamard(torch.randn(96).to(DEV))
