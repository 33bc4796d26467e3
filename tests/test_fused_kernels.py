"""Fused model kernels (kernels/fused_*.py): Triton vs the torch references, forward and
backward, on tiny shapes with awkward sizes (non-power-of-2 widths, strided inputs,
vocab padding). Compiled on CUDA when a GPU is visible (TRITON_INTERPRET=0 python -m
pytest tests/test_fused_kernels.py on a GPU host), else under the Triton interpreter on
the CPU (the test command hides GPUs).

Tolerances: fp32 inputs -> both sides compute in fp32 with different reduction
orders, so relative error ~1e-6; we allow 1e-5. bf16 inputs -> the Triton kernels
keep fp32 inside and round once while the references round intermediates to bf16
(silu, the rotated halves), so the two differ by a few bf16 ulps: 2e-2 relative
norm error (bf16 has 8 bits of mantissa, one ulp ~ 4e-3).
"""

import pytest
import torch

from megaq.kernels import fused_cross_entropy as fce
from megaq.kernels import fused_rmsnorm as frn
from megaq.kernels import fused_rope as frp
from megaq.kernels import fused_swiglu as fsw
from megaq.kernels import transpose as ktr
from megaq.kernels.tuning import Tuning


DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _triton_backend(monkeypatch):
    if DEV == "cpu":  # the kernels modules are imported inside the ops, so this reaches them
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("MEGAQ_KERNELS", "triton")


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def run_both(fn_fused, fn_ref, inputs, grad_out_like=None, seed=0):
    """Forward both on cloned leaves; backward with the same random grad; return outs, grads."""
    results = []
    g = torch.Generator().manual_seed(seed)
    dout = None
    for fn in (fn_fused, fn_ref):
        leaves = [t.detach().to(DEV, copy=True).requires_grad_(t.is_floating_point()) for t in inputs]
        out = fn(*leaves)
        if dout is None:
            dout = torch.randn(out.shape, generator=g).to(DEV, out.dtype)
        out.backward(dout)
        results.append((out.detach().cpu(), [t.grad.cpu() for t in leaves if t.is_floating_point()]))
    return results


# The interpreter evaluates both sides of tl.where, so exp(-inf - -inf) warns there
# (the NaN lane is discarded); the compiled kernel never sees it.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_matches_reference(dtype, faithful_interpreter):
    x = torch.randn(3, 5, 40).to(dtype)  # 15 rows, width 40 (not a power of two)
    w = (1 + 0.1 * torch.randn(40)).to(dtype)
    (yf, gf), (yr, gr) = run_both(lambda a, b: frn.rms_norm(a, b, 1e-5),
                                  lambda a, b: frn.rms_norm_reference(a, b, 1e-5), [x, w])
    assert yf.dtype == dtype and yf.shape == x.shape
    assert rel(yf, yr) < TOL[dtype]
    assert rel(gf[0], gr[0]) < TOL[dtype]
    assert rel(gf[1], gr[1]) < TOL[dtype]


@pytest.mark.parametrize("per_batch_positions", [False, True])
def test_rope_matches_reference_on_strided_input(per_batch_positions):
    s, b, heads, d = 6, 2, 3, 8
    base = torch.randn(s, b, heads, 2 * d)
    x = base[..., :d]  # a strided view, like k and v sliced out of the fused QKV output
    pos = torch.randint(0, 50, (s, b if per_batch_positions else 1)).float()
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = pos[..., None] * inv
    emb = torch.cat([freqs, freqs], -1).unsqueeze(2)
    cos, sin = emb.cos().to(DEV), emb.sin().to(DEV)
    (yf, gf), (yr, gr) = run_both(lambda t: frp.apply_rotary(t, cos, sin),
                                  lambda t: frp.apply_rotary_reference(t, cos, sin), [x])
    assert rel(yf, yr) < 1e-5
    assert rel(gf[0], gr[0]) < 1e-5


def test_rope_bf16():
    s, b, heads, d = 4, 2, 2, 8
    x = torch.randn(s, b, heads, d).bfloat16()
    freqs = torch.arange(s).float()[:, None, None] * torch.rand(d // 2)
    emb = torch.cat([freqs, freqs], -1).unsqueeze(2).to(DEV)
    (yf, gf), (yr, gr) = run_both(lambda t: frp.apply_rotary(t, emb.cos(), emb.sin()),
                                  lambda t: frp.apply_rotary_reference(t, emb.cos(), emb.sin()), [x])
    assert rel(yf, yr) < TOL[torch.bfloat16] and rel(gf[0], gr[0]) < TOL[torch.bfloat16]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_matches_reference(dtype):
    y = torch.randn(4, 3, 2 * 37).to(dtype)  # f = 37: masked tail
    (of, gf), (orf, gr) = run_both(fsw.swiglu, fsw.swiglu_reference, [y])
    assert of.shape == (4, 3, 37)
    assert rel(of, orf) < TOL[dtype]
    assert rel(gf[0], gr[0]) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_backward_kernel_matches_its_reference_and_autograd(dtype):
    """The backward kernel that compiled blocks launch (a triton_op): equal to its fp32
    reference within the fp32 ordering tolerance (both round once at the end), and to
    autograd's derivative of silu(gate) * up (which rounds intermediates in bf16)."""
    g = torch.Generator().manual_seed(1)
    y = torch.randn(5, 3, 2 * 37, generator=g).to(dtype)  # f = 37: masked tail
    do = torch.randn(5, 3, 37, generator=g).to(dtype)
    dy = fsw.swiglu_backward_reference(do, y)
    kernel = fsw.SWIGLU_BACKWARD.triton_function()(do.to(DEV), y.to(DEV)).cpu()
    assert kernel.dtype == dtype and kernel.shape == y.shape
    assert rel(kernel, dy) < 1e-5 if dtype == torch.float32 else rel(kernel, dy) < 8e-3
    leaf = y.clone().requires_grad_(True)
    fsw.swiglu_reference(leaf).backward(do)
    assert rel(dy, leaf.grad) < TOL[dtype]


FP8_DTYPES = [torch.float8_e5m2, torch.float8_e4m3fn]


def _fp8_rounding_cases(dtype) -> torch.Tensor:
    """fp32 values at every rounding case of the FP8 `dtype`: each finite value, the
    midpoints between neighbours (ties, to even), one fp32 ulp either side of them,
    beyond the max, infinities, signed zeros, underflow, and random values over the
    whole range (subnormals included)."""
    vals = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    vals = vals[torch.isfinite(vals)].unique()
    mids = (vals[1:] + vals[:-1]) / 2  # exact in fp32
    fmax, inf = torch.finfo(dtype).max, torch.tensor(float("inf"))
    g = torch.Generator().manual_seed(3)
    spread = torch.randn(2000, generator=g) * torch.exp2(torch.randint(-24, 18, (2000,), generator=g).float())
    edges = torch.tensor([fmax * 1.01, fmax * 4, -fmax * 4, inf, -inf, 0.0, -0.0, 1e-30, -1e-30])
    return torch.cat([vals, mids, torch.nextafter(mids, inf), torch.nextafter(mids, -inf), edges, spread])


@pytest.fixture(params=["int", "gpu"])
def fp8_cast(request, monkeypatch):
    """Each of the fused FP8 backward's two conversions: rounding in integers
    (kernels/fused_swiglu_triton._fp8_code: the CPU interpreter, GPUs before sm_89, fp32
    inputs) and the GPU's instruction (_fp8_cvt: 16-bit inputs on sm_89 on, so only there)."""
    from megaq.kernels import fused_swiglu_triton as mod  # the module the op dispatches to
    if request.param == "gpu":
        if DEV == "cpu" or torch.cuda.get_device_capability() < mod.HW_CAST_CAPABILITY:
            pytest.skip("the GPU's FP8 conversion needs an sm_89 or later GPU")
    else:
        monkeypatch.setattr(mod, "HW_CAST_CAPABILITY", (99, 0))
    on = mod.uses_hw_cast(torch.empty(0, device=DEV, dtype=torch.bfloat16))
    assert on == (request.param == "gpu") and not mod.uses_hw_cast(torch.empty(0, device=DEV))
    return mod if request.param == "gpu" else None


@pytest.mark.parametrize("fp8", FP8_DTYPES, ids=str)
def test_swiglu_backward_fp8_casts_every_rounding_case_as_torch(fp8, fp8_cast, monkeypatch):
    """The fused kernel's FP8 cast (either conversion, `fp8_cast`) gives torch's bytes for
    every case: with gate 0 and up 2, dgate is dOut exactly, so the first half of Q is dOut
    cast; a NaN stays NaN. Q^T is Q transposed, byte for byte. (The values are fp32: the
    GPU's instruction is let take them here, on one row, where it is exact; fp32 inputs
    over several rows round in integers, see HW_CAST_DTYPES.)"""
    if fp8_cast is not None:
        monkeypatch.setattr(fp8_cast, "HW_CAST_DTYPES", (torch.float32,))
    v = _fp8_rounding_cases(fp8)
    n = v.numel()
    y = torch.cat([torch.zeros(1, n), torch.full((1, n), 2.0)], dim=1)
    do = torch.cat([v, torch.tensor([float("nan")])])[None]
    y = torch.cat([y[:, :n], torch.zeros(1, 1), y[:, n:], torch.full((1, 1), 2.0)], dim=1)
    q, qt, _ = fsw.SWIGLU_BACKWARD_FP8.triton_function()(do.to(DEV), y.to(DEV), torch.tensor(1.0, device=DEV), fp8)
    fmax = torch.finfo(fp8).max
    want = v.clamp(-fmax, fmax).to(fp8).view(torch.uint8)
    assert torch.equal(q[0, :n].cpu().view(torch.uint8), want)
    assert torch.isnan(q[0, n].float())
    assert torch.equal(qt.cpu().view(torch.uint8), q.cpu().view(torch.uint8).t().contiguous())


def _within_one_code(q, rq, amax, ramax, dtype):
    """A fused FP8 backward's bytes against its reference's: every byte within one code
    with the same sign, few off (fp32 inputs: almost none), the amax within an fp32 /
    bf16 rounding."""
    codes = q.view(torch.uint8).int(), rq.view(torch.uint8).int()
    off = codes[0] != codes[1]
    assert ((codes[0] - codes[1]).abs() <= 1).all() and (q.float().sign() == rq.float().sign()).all()
    if dtype == torch.float32:
        assert off.float().mean() < 1e-3 and torch.allclose(amax, ramax, rtol=1e-6)
    else:
        assert off.float().mean() < 0.05 and torch.allclose(amax, ramax, rtol=2 ** -7)


@pytest.mark.parametrize("fp8", FP8_DTYPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_backward_fp8_kernel_matches_its_reference(dtype, fp8, fp8_cast):
    """One pass that writes fc1's FP8 dY, its transpose and |dY|'s max, against the
    reference (autograd's backward, megaq.parallel.fp8's cast and amax), on a tile-ragged
    shape with a scale that saturates some values. fp32: the same bytes but at the odd
    element one code off (the two sigmoids differ in the last bit, which can move dY
    across a rounding boundary). bf16:
    the reference rounds dY to bf16 twice, as autograd does, the kernel once: every byte
    within one code of it, few of them off, and the amax within one bf16 ulp."""
    g = torch.Generator().manual_seed(2)
    y = torch.randn(300, 2 * 70, generator=g).to(dtype)  # 300 tokens, F = 70: ragged tiles
    do = torch.randn(300, 70, generator=g).to(dtype)
    scale = torch.tensor(torch.finfo(fp8).max / 3.0)  # |dY| reaches ~8: some saturate
    q, qt, amax = [t.cpu() for t in fsw.SWIGLU_BACKWARD_FP8.triton_function()(
        do.to(DEV), y.to(DEV), scale.to(DEV), fp8)]
    rq, _, ramax = fsw.swiglu_backward_fp8_reference(do, y, scale, fp8)
    from megaq.parallel import fp8 as mfp8  # the reference is fp8.cast and fp8.tensor_amax
    dy = fsw.swiglu_backward_reference(do, y)
    assert torch.equal(rq.view(torch.uint8), mfp8.cast(dy, scale, fp8).view(torch.uint8))
    assert torch.equal(ramax, mfp8.tensor_amax(dy))
    assert q.shape == rq.shape and qt.shape == rq.t().shape and amax.shape == ()
    assert torch.equal(qt.view(torch.uint8), q.view(torch.uint8).t().contiguous())
    _within_one_code(q, rq, amax, ramax, dtype)


@pytest.mark.parametrize("fp8", FP8_DTYPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_batch_positions", [False, True])
def test_qkv_rope_backward_fp8_kernel_matches_its_reference(dtype, fp8, per_batch_positions, fp8_cast):
    """One pass from attention's dq, dk, dv (dq strided as attention's backward hands it:
    [b, heads, s, d] memory seen as [s, b, heads, d]) to the fused QKV layer's FP8 dY, its
    transpose and |dY|'s max: GQA (3 query heads a group, 2 groups), a token count that
    leaves a ragged tile, a scale that saturates some values. fp32: the reference's bytes.
    bf16: both compute RoPE's backward in fp32 and round once (the reference through
    apply_rotary's kernel, MEGAQ_KERNELS=triton here), so every byte within one code and
    the amax within a bf16 ulp. (Against autograd's roundings of the torch reference,
    twice, a byte can move further where q's two products cancel: the model test
    test_fp8.py::test_rope_epilogue_matches_rope_after_the_gemm compares like with like.)"""
    g = torch.Generator().manual_seed(3)
    S, B, G, P, D = 37, 3, 2, 3, 16
    dq = torch.randn(B, G * P, S, D, generator=g).to(dtype).permute(2, 0, 1, 3)
    dk, dv = (torch.randn(S, B, G, D, generator=g).to(dtype) for _ in range(2))
    ang = torch.randn(S, B if per_batch_positions else 1, 1, D // 2, generator=g)
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    scale = torch.tensor(torch.finfo(fp8).max / 3.0)
    q, qt, amax = [t.cpu() for t in frp.QKV_ROPE_BACKWARD_FP8.triton_function()(
        *(t.to(DEV) for t in (dq, dk, dv, cos, sin, scale)), fp8)]
    rq, rqt, ramax = [t.cpu() for t in frp.qkv_rope_backward_fp8_reference(
        *(t.to(DEV) for t in (dq, dk, dv, cos, sin, scale)), fp8)]
    assert q.shape == (S * B, G * (P + 2) * D) and qt.shape == q.t().shape and amax.shape == ()
    assert torch.equal(qt.view(torch.uint8), q.view(torch.uint8).t().contiguous())
    assert torch.equal(rqt.view(torch.uint8), rq.view(torch.uint8).t().contiguous())
    from megaq.parallel import fp8 as mfp8  # the reference is fp8.cast and fp8.tensor_amax
    dy = frp.qkv_rope_backward(dq.to(DEV), dk.to(DEV), dv.to(DEV), cos.to(DEV), sin.to(DEV)).cpu()
    assert torch.equal(rq.view(torch.uint8), mfp8.cast(dy, scale, fp8).view(torch.uint8))
    assert torch.equal(ramax, mfp8.tensor_amax(dy))
    # v's columns are dv itself, cast: the same bytes on every path
    v_cols = q.view(S, B, G, P + 2, D)[:, :, :, -1]
    assert torch.equal(v_cols.contiguous().view(torch.uint8), mfp8.cast(dv, scale, fp8).view(torch.uint8))
    _within_one_code(q, rq, amax, ramax, dtype)


def test_compiled_swiglu_is_one_graph_with_the_kernels_backward(monkeypatch):
    """Under torch.compile (fullgraph) where the kernel runs (CUDA; forced here on the
    CPU), swiglu traces the reference forward and the triton_op backward: one graph,
    the reference's output bit for bit and its gradient within the fp32 tolerance. (On
    the CPU the op's trace records its reference, as a fake tensor never goes to the
    interpreter; on a GPU it records the kernel.)"""
    monkeypatch.setattr(fsw, "use_triton", lambda t, under_compile: True)
    y = torch.randn(4, 2 * 24, device=DEV)
    do = torch.randn(4, 24, device=DEV)
    leaf = y.clone().requires_grad_(True)
    out = torch.compile(fsw.swiglu, backend="aot_eager", fullgraph=True)(leaf)
    out.backward(do)
    ref_leaf = y.clone().requires_grad_(True)
    ref = fsw.swiglu_reference(ref_leaf)
    ref.backward(do)
    assert torch.equal(out, ref)
    assert rel(leaf.grad, ref_leaf.grad) < TOL[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cross_entropy_matches_reference_and_ignores_padding(dtype, faithful_interpreter):
    s, b, V, V_pad = 5, 3, 100, 128
    logits = (3 * torch.randn(s, b, V_pad)).to(dtype)
    logits[..., V:] = 50.0  # padded columns would dominate the softmax if counted
    labels = torch.randint(0, V, (s, b))
    (lf, gf), (lr, gr) = run_both(lambda t: fce.cross_entropy(t, labels.to(DEV), V),
                                  lambda t: fce.cross_entropy_reference(t, labels.to(DEV), V), [logits])
    assert lf.dtype == torch.float32 and lf.shape == (s, b)
    assert rel(lf, lr) < 1e-5  # fp32 math on both sides from identical inputs
    assert rel(gf[0][..., :V], gr[0][..., :V]) < TOL[dtype]
    assert gf[0].dtype == dtype
    assert torch.all(gf[0][..., V:] == 0)
    # against the plain definition on the unpadded logits
    plain = torch.nn.functional.cross_entropy(logits[..., :V].float().reshape(-1, V),
                                              labels.reshape(-1), reduction="none")
    assert rel(lf.reshape(-1), plain) < 1e-5


def test_cross_entropy_large_vocab_streams_chunks(faithful_interpreter):
    """V larger than one block: the online max / sum must combine chunks, and padding
    that is not a whole block must still be excluded."""
    from megaq.kernels import fused_cross_entropy_triton as k

    chunks = Tuning(ce_fwd_block=16, ce_bwd_block=32)  # 5 chunks forward, 3 backward
    logits = torch.randn(4, 70) * 5
    logits[0, 3] = 40.0  # a max in the first chunk, then much smaller values
    labels = torch.tensor([3, 66, 0, 17])
    (lf, gf), (lr, gr) = run_both(lambda t: k.cross_entropy(t, labels.to(DEV), 67, tuning=chunks),
                                  lambda t: fce.cross_entropy_reference(t, labels.to(DEV), 67), [logits])
    assert rel(lf, lr) < 1e-5 and rel(gf[0][:, :67], gr[0][:, :67]) < 1e-5
    assert torch.all(gf[0][:, 67:] == 0)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8])
@pytest.mark.parametrize("shape", [(300, 130), (128, 256), (1, 17)])
def test_fp8_transpose_copies_every_byte(dtype, shape):
    """The FP8 operands' transposed copy (partial tiles at both edges, a single row):
    a byte move, so equal bit for bit to x.t().contiguous(), and contiguous."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g).view(dtype)
    y = ktr.transpose(x.to(DEV)).cpu()
    assert y.dtype == dtype and y.is_contiguous() and y.shape == shape[::-1]
    assert torch.equal(y.view(torch.uint8), ktr.transpose_reference(x).view(torch.uint8))


def test_fp8_transpose_is_one_op_in_a_compiled_graph():
    """Traced by torch.compile without a graph break, with the right output shape."""
    fn = torch.compile(lambda a: ktr.transpose(a.to(torch.float8_e5m2)).float() * 2,
                       backend="aot_eager", fullgraph=True)
    a = torch.randn(64, 48, device=DEV)
    assert torch.equal(fn(a), a.to(torch.float8_e5m2).float().t() * 2)
    with pytest.raises(ValueError, match="1-byte elements"):
        ktr.transpose(a)


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="odd"):
        fsw.swiglu(torch.randn(2, 5))
    with pytest.raises(ValueError, match="vocab_size"):
        fce.cross_entropy(torch.randn(2, 8), torch.zeros(2, dtype=torch.long), 9)
    with pytest.raises(ValueError, match="rotary tables"):
        frp.apply_rotary(torch.randn(2, 1, 1, 4), torch.randn(3, 1, 1, 4), torch.randn(3, 1, 1, 4))


def test_model_with_triton_kernels_matches_references(monkeypatch, faithful_interpreter):
    """The whole Llama-style model (RMSNorm, RoPE, SwiGLU, fused CE) on the Triton
    kernels equals the model on the references: loss and every weight gradient."""
    from megaq.model import GPTConfig, GPTModel

    cfg = GPTConfig.llama(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                          vocab_size=50, make_vocab_size_divisible_by=16, seq_length=8)
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(1))
    labels = torch.roll(ids, -1, 1)
    out = {}
    for backend in ("triton", "torch"):
        monkeypatch.setenv("MEGAQ_KERNELS", backend)
        model = GPTModel(cfg).to(DEV)
        loss = model(ids.to(DEV), labels=labels.to(DEV))
        loss.mean().backward()
        out[backend] = (loss.detach().cpu(), {n: p.grad.cpu() for n, p in model.named_parameters()})
    assert rel(out["triton"][0], out["torch"][0]) < 1e-5
    for name, g in out["torch"][1].items():
        assert rel(out["triton"][1][name], g) < 1e-4, name  # fp32; grads pass through 2 layers
