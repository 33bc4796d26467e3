"""Triton SwiGLU: y [N, 2F] = [gate | up] -> silu(gate) * up [N, F]; fp32 math. `swiglu`
is the autograd op with the signature of kernels/fused_swiglu.swiglu_reference (eager);
`swiglu_backward` the backward alone, launched through `wrap_triton` (the triton_op that
compiled blocks call: kernels/fused_swiglu.py); `swiglu_backward_fp8` the backward with
the FP8 cast of its output for the GEMMs of fc1's backward (megaq.parallel.fp8)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from .fused_common import rows_view
from .launch import interpreted
from .tuning import DEFAULT_TUNING, Tuning


@triton.jit
def _swiglu_fwd(Y, OUT, stride_y, stride_o, F, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < F
    g = tl.load(Y + row * stride_y + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(Y + row * stride_y + F + cols, mask=mask, other=0.0).to(tl.float32)
    out = g * tl.sigmoid(g) * u
    tl.store(OUT + row * stride_o + cols, out.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd(DO, Y, DY, stride_do, stride_y, stride_dy, F, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < F
    do = tl.load(DO + row * stride_do + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(Y + row * stride_y + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(Y + row * stride_y + F + cols, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    dg = do * u * sig * (1.0 + g * (1.0 - sig))
    du = do * g * sig
    tl.store(DY + row * stride_dy + cols, dg.to(DY.dtype.element_ty), mask=mask)
    tl.store(DY + row * stride_dy + F + cols, du.to(DY.dtype.element_ty), mask=mask)


BLOCK = 1024


def swiglu_fwd(y2: torch.Tensor, tuning: Tuning) -> torch.Tensor:
    N, F2 = y2.shape
    F = F2 // 2
    out = torch.empty((N, F), dtype=y2.dtype, device=y2.device)
    _swiglu_fwd[(N, triton.cdiv(F, BLOCK))](y2, out, y2.stride(0), out.stride(0), F,
                                            BLOCK=BLOCK, num_warps=4, enable_fp_fusion=tuning.fp_fusion)
    return out


def swiglu_bwd(do2: torch.Tensor, y2: torch.Tensor, tuning: Tuning) -> torch.Tensor:
    N, F2 = y2.shape
    F = F2 // 2
    dy = torch.empty((N, F2), dtype=y2.dtype, device=y2.device)
    _swiglu_bwd[(N, triton.cdiv(F, BLOCK))](do2, y2, dy, do2.stride(0), y2.stride(0), dy.stride(0),
                                            F, BLOCK=BLOCK, num_warps=4, enable_fp_fusion=tuning.fp_fusion)
    return dy


def swiglu_backward(do: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """d(silu(gate) * up) / d[gate | up] for the output gradient `do` [..., F] and the
    input `y` [..., 2F]: kernels/fused_swiglu.swiglu_backward_reference's signature."""
    y2, do2 = rows_view(y), rows_view(do)
    N, F2 = y2.shape
    F = F2 // 2
    dy = torch.empty((N, F2), dtype=y2.dtype, device=y2.device)
    # the interpreter's kernel is launched as it is (torch 2.11's wrap_triton refuses it)
    kernel = _swiglu_bwd if interpreted(_swiglu_bwd) else wrap_triton(_swiglu_bwd)
    kernel[(N, triton.cdiv(F, BLOCK))](do2, y2, dy, do2.stride(0), y2.stride(0), dy.stride(0), F,
                                       BLOCK=BLOCK, num_warps=4)
    return dy.view(y.shape)


@triton.jit
def _fp8_code(v, M: tl.constexpr, BIAS: tl.constexpr, FMAX: tl.constexpr):
    # torch's `(v * scale).clamp(-FMAX, FMAX).to(float8)` for v already scaled, as the
    # format's byte: saturate, round to nearest even, NaN stays NaN. In integer operations
    # rather than Triton's cast, whose CPU interpreter does not carry a rounding into the
    # exponent (448-512 became 256 in E5M2); exact on both, tests compare every byte
    bits = v.to(tl.int32, bitcast=True)
    sign = ((bits >> 31) & 1) << 7
    a = tl.minimum(tl.abs(v), FMAX)
    SH: tl.constexpr = 23 - M
    ab = a.to(tl.int32, bitcast=True)
    r = ab + ((1 << (SH - 1)) - 1) + ((ab >> SH) & 1)  # the mantissa rounded to M bits
    normal = (r >> SH) - ((127 - BIAS) << M)  # fp32's exponent rebiased
    # below the smallest normal: multiples of 2^(1 - BIAS - M), rounded by the fp32 adder
    QUANTA: tl.constexpr = 2.0 ** (BIAS + M - 1)
    small = tl.minimum(a, 2.0 ** (1 - BIAS))
    sub = ((small * QUANTA + 8388608.0) - 8388608.0).to(tl.int32)
    code = tl.where(a < 2.0 ** (1 - BIAS), sub, normal) | sign
    return tl.where(v != v, 0x7F, code).to(tl.uint8)


@triton.jit
def _fp8_cvt(v, M: tl.constexpr):
    # the same bytes by the GPU's conversion (sm_89 on): cvt rounds fp32 straight to FP8,
    # nearest even; satfinite saturates to the max finite (infinities too) and keeps NaN,
    # which is torch's clamp-then-cast in one instruction (Triton's `.to(float8)` goes
    # through fp16 on Ada, rounding twice). Two values per instruction: $1 the low byte
    if M == 2:
        q = tl.inline_asm_elementwise("cvt.rn.satfinite.e5m2x2.f32 $0, $2, $1;", "=h,f,f", [v],
                                      dtype=tl.uint8, is_pure=True, pack=2)
    else:
        q = tl.inline_asm_elementwise("cvt.rn.satfinite.e4m3x2.f32 $0, $2, $1;", "=h,f,f", [v],
                                      dtype=tl.uint8, is_pure=True, pack=2)
    return q


@triton.jit
def _cast_pair_fp8(a, b, DTYPE: tl.constexpr, AMAX, SCALE, M: tl.constexpr, BIAS: tl.constexpr,
                   FMAX: tl.constexpr, HW_CAST: tl.constexpr):
    # two fp32 tiles of a 16-bit gradient (a fused backward's two halves) rounded to DTYPE
    # (the values a 16-bit dY holds), their max |x| folded into AMAX, then scaled by SCALE
    # and cast to FP8 (M mantissa bits): by the GPU's instruction (HW_CAST) or in integers
    a = a.to(DTYPE).to(tl.float32)
    b = b.to(DTYPE).to(tl.float32)
    tl.atomic_max(AMAX, tl.max(tl.maximum(tl.abs(a), tl.abs(b))))
    scale = tl.load(SCALE)
    if HW_CAST:
        return _fp8_cvt(a * scale, M), _fp8_cvt(b * scale, M)
    return _fp8_code(a * scale, M, BIAS, FMAX), _fp8_code(b * scale, M, BIAS, FMAX)


@triton.jit
def _swiglu_bwd_fp8(DO, Y, Q, QT, AMAX, SCALE, N, F, stride_do, stride_y, M: tl.constexpr,
                    BIAS: tl.constexpr, FMAX: tl.constexpr, BM: tl.constexpr, BF: tl.constexpr,
                    HW_CAST: tl.constexpr):
    # a [BM tokens, BF features] tile of dgate and of dup: computed in fp32, rounded to
    # y's dtype (the values a 16-bit dY holds), scaled and cast; stored row-major into Q
    # [N, 2F] and transposed into QT [2F, N]
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rf = tl.program_id(1) * BF + tl.arange(0, BF)
    mask = (rm[:, None] < N) & (rf[None, :] < F)
    rows = rm[:, None].to(tl.int64)
    do = tl.load(DO + rows * stride_do + rf[None, :], mask=mask, other=0.0).to(tl.float32)
    g = tl.load(Y + rows * stride_y + rf[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(Y + rows * stride_y + F + rf[None, :], mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    dg = do * u * sig * (1.0 + g * (1.0 - sig))
    du = do * g * sig
    qg, qu = _cast_pair_fp8(dg, du, Y.dtype.element_ty, AMAX, SCALE, M, BIAS, FMAX, HW_CAST)
    tl.store(Q + rows * (2 * F) + rf[None, :], qg, mask=mask)
    tl.store(Q + rows * (2 * F) + F + rf[None, :], qu, mask=mask)
    cols = rf[:, None].to(tl.int64)
    tmask = (rf[:, None] < F) & (rm[None, :] < N)
    tl.store(QT + cols * N + rm[None, :], tl.trans(qg), mask=tmask)
    tl.store(QT + (cols + F) * N + rm[None, :], tl.trans(qu), mask=tmask)


# the FP8 formats' mantissa bits and exponent bias (what _fp8_code needs)
FP8_FORMATS = {torch.float8_e5m2: (2, 15), torch.float8_e4m3fn: (3, 7)}
# 64 x 64 tiles, 4 warps: the fastest of eight shapes with either conversion (1.3B's dY: 0.47
# ms on an H200 rounding in integers, against 0.73 at 128 x 64 and 8 warps; 0.39 on an H100
# with the GPU's instruction; docs/PERFORMANCE.md, "SwiGLU's backward")
BM_FP8, BF_FP8, WARPS_FP8 = 64, 64, 4
# where the kernel converts with the GPU's instruction (_fp8_cvt): sm_89 on (Ada, Hopper),
# 16-bit inputs (training's). Elsewhere, and for fp32 inputs, it rounds in integers
# (_fp8_code): on an H100 with Triton 3.6 every hardware conversion (this one, an impure
# asm, Triton's own cast) wrote wrong bytes for fp32 inputs at tiles of several rows, while
# 16-bit inputs gave the integer form's bytes (docs/PERFORMANCE.md, "SwiGLU's backward")
HW_CAST_CAPABILITY = (8, 9)
HW_CAST_DTYPES = (torch.bfloat16, torch.float16)


def uses_hw_cast(y: torch.Tensor) -> bool:
    """Whether the fused FP8 backward converts with the GPU's instruction for input `y`."""
    return (y.is_cuda and y.dtype in HW_CAST_DTYPES and not interpreted(_swiglu_bwd_fp8)
            and torch.cuda.get_device_capability(y.device) >= HW_CAST_CAPABILITY)


def swiglu_backward_fp8(do: torch.Tensor, y: torch.Tensor, scale: torch.Tensor,
                        dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """kernels/fused_swiglu.swiglu_backward_fp8_reference's signature: one pass over
    `do` and `y` writing dY's FP8 copy, its transpose and |dY|'s max."""
    return swiglu_backward_fp8_at(do, y, scale, dtype, (BM_FP8, BF_FP8, WARPS_FP8),
                                  uses_hw_cast(y))


def swiglu_backward_fp8_at(do: torch.Tensor, y: torch.Tensor, scale: torch.Tensor,
                           dtype: torch.dtype, tiles: tuple[int, int, int], hw_cast: bool
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """swiglu_backward_fp8 at given tiles (BM, BF, warps) and conversion (the benchmark's
    sweep, tools/bench/bench_swiglu_fp8.py)."""
    bm, bf, warps = tiles
    y2, do2 = rows_view(y), rows_view(do)
    N, F2 = y2.shape
    F = F2 // 2
    q = torch.empty((N, F2), dtype=dtype, device=y.device)
    qt = torch.empty((F2, N), dtype=dtype, device=y.device)
    amax = torch.zeros((), dtype=torch.float32, device=y.device)
    kernel = _swiglu_bwd_fp8 if interpreted(_swiglu_bwd_fp8) else wrap_triton(_swiglu_bwd_fp8)
    m, bias = FP8_FORMATS[dtype]
    kernel[(triton.cdiv(N, bm), triton.cdiv(F, bf))](
        do2, y2, q.view(torch.uint8), qt.view(torch.uint8), amax, scale, N, F, do2.stride(0),
        y2.stride(0), M=m, BIAS=bias, FMAX=torch.finfo(dtype).max, BM=bm, BF=bf,
        HW_CAST=hw_cast, num_warps=warps)
    return q, qt, amax


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, tuning):
        y2 = rows_view(y)
        ctx.save_for_backward(y2)
        ctx.shape, ctx.tuning = y.shape, tuning
        return swiglu_fwd(y2, tuning).view(*y.shape[:-1], y.shape[-1] // 2)

    @staticmethod
    def backward(ctx, do):
        (y2,) = ctx.saved_tensors
        return swiglu_bwd(rows_view(do), y2, ctx.tuning).view(ctx.shape), None


def swiglu(y: torch.Tensor, *, tuning: Tuning = DEFAULT_TUNING) -> torch.Tensor:
    return _SwiGLU.apply(y, tuning)
