"""Triton rotary embedding ("rotate half" layout) over x [s, b, heads, d].

One program per (s, b) position handles every head: cos/sin are read once per
position, x through its strides (a strided view of the fused QKV output needs no
copy), the output is written contiguous. backward=True applies the transpose
(rotation by -angle when the two halves of cos/sin agree). `apply_rotary` is the
autograd op with the signature of kernels/fused_rope.apply_rotary_reference.
`qkv_rope_backward_fp8` is kernels/fused_rope.qkv_rope_backward_fp8_reference's pass
(launched through `wrap_triton`: that op is a triton_op).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from torch.library import wrap_triton

from .fused_swiglu_triton import FP8_FORMATS, _cast_pair_fp8, uses_hw_cast
from .launch import interpreted
from .tuning import DEFAULT_TUNING, Tuning


@triton.jit
def _rope(X, COS, SIN, Y, B, NH, sx_s, sx_b, sx_h, sc_s, sc_b, D2,
          BLOCK_H: tl.constexpr, BLOCK_D2: tl.constexpr, BACKWARD: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    s = pid // B
    b = pid % B
    heads = tl.arange(0, BLOCK_H)[:, None]
    half = tl.arange(0, BLOCK_D2)[None, :]
    mask = (heads < NH) & (half < D2)
    hmask = half < D2
    xp = X + s * sx_s + b * sx_b + heads * sx_h + half
    x1 = tl.load(xp, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(xp + D2, mask=mask, other=0.0).to(tl.float32)
    cp = COS + s * sc_s + b * sc_b + half
    sp = SIN + s * sc_s + b * sc_b + half
    c1 = tl.load(cp, mask=hmask, other=0.0).to(tl.float32)
    c2 = tl.load(cp + D2, mask=hmask, other=0.0).to(tl.float32)
    s1 = tl.load(sp, mask=hmask, other=0.0).to(tl.float32)
    s2 = tl.load(sp + D2, mask=hmask, other=0.0).to(tl.float32)
    if BACKWARD:
        o1 = x1 * c1 + x2 * s2
        o2 = x2 * c2 - x1 * s1
    else:
        o1 = x1 * c1 - x2 * s1
        o2 = x2 * c2 + x1 * s2
    yp = Y + (pid * NH + heads) * (2 * D2) + half
    tl.store(yp, o1.to(Y.dtype.element_ty), mask=mask)
    tl.store(yp + D2, o2.to(Y.dtype.element_ty), mask=mask)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool, tuning: Tuning) -> torch.Tensor:
    """x [S, B, NH, D] with x.stride(-1) == 1; cos, sin [S, 1 or B, 1, D], same strides."""
    S, B, NH, D = x.shape
    y = torch.empty((S, B, NH, D), dtype=x.dtype, device=x.device)
    sc_b = 0 if cos.shape[1] == 1 else cos.stride(1)
    block_h = triton.next_power_of_2(NH)
    block_d2 = triton.next_power_of_2(D // 2)
    warps = 4 if block_h * block_d2 >= 1024 else 1
    _rope[(S * B,)](x, cos, sin, y, B, NH, x.stride(0), x.stride(1), x.stride(2),
                    cos.stride(0), sc_b, D // 2, BLOCK_H=block_h, BLOCK_D2=block_d2,
                    BACKWARD=backward, num_warps=warps, enable_fp_fusion=tuning.fp_fusion)
    return y


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin, tuning):
        x = x if x.stride(-1) == 1 else x.contiguous()
        cos, sin = cos.contiguous(), sin.contiguous()
        ctx.save_for_backward(cos, sin)
        ctx.tuning = tuning
        return rope(x, cos, sin, False, tuning)

    @staticmethod
    def backward(ctx, g):
        cos, sin = ctx.saved_tensors
        g = g if g.stride(-1) == 1 else g.contiguous()
        return rope(g, cos, sin, True, ctx.tuning), None, None, None


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
                 tuning: Tuning = DEFAULT_TUNING) -> torch.Tensor:
    return _Rotary.apply(x, cos, sin, tuning)


def apply_rotary_backward(g: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
                          tuning: Tuning = DEFAULT_TUNING) -> torch.Tensor:
    """apply_rotary's gradient for the output gradient `g` (its autograd backward)."""
    g = g if g.stride(-1) == 1 else g.contiguous()
    return rope(g, cos.contiguous(), sin.contiguous(), True, tuning)


@triton.jit
def _qkv_rope_bwd_fp8(DQ, DK, DV, COS, SIN, Q, QT, AMAX, SCALE, T, B, P, N, D2,
                      sq_s, sq_b, sq_h, sk_s, sk_b, sk_h, sv_s, sv_b, sv_h, sc_s, sc_b,
                      M: tl.constexpr, BIAS: tl.constexpr, FMAX: tl.constexpr,
                      BM: tl.constexpr, BD2: tl.constexpr, HW_CAST: tl.constexpr):
    # BM tokens of one head's slot of the QKV output ([group][q heads..., k, v][d]): its
    # gradient from dq (slot j < P of the group), dk (j = P) or dv (j = P + 1), RoPE's
    # transpose for q and k in fp32 rounded once to the gradients' dtype (the values a
    # 16-bit dY holds), scaled and cast; stored row-major into Q [T, N] and transposed
    # into QT [N, T]; the tile's max |dY| into AMAX
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    slot = tl.program_id(1)
    g = slot // (P + 2)
    j = slot % (P + 2)
    t = rm.to(tl.int64)
    s = t // B
    b = t % B
    half = tl.arange(0, BD2)
    mask = (rm[:, None] < T) & (half[None, :] < D2)
    if j < P:
        src = DQ + (s * sq_s + b * sq_b + (g * P + j) * sq_h)[:, None] + half[None, :]
    elif j == P:
        src = DK + (s * sk_s + b * sk_b + g * sk_h)[:, None] + half[None, :]
    else:
        src = DV + (s * sv_s + b * sv_b + g * sv_h)[:, None] + half[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + D2, mask=mask, other=0.0).to(tl.float32)
    if j <= P:  # q or k: dx = dy cos + rotate_half^T(dy sin)
        cp = (s * sc_s + b * sc_b)[:, None] + half[None, :]
        c1 = tl.load(COS + cp, mask=mask, other=0.0)
        c2 = tl.load(COS + cp + D2, mask=mask, other=0.0)
        s1 = tl.load(SIN + cp, mask=mask, other=0.0)
        s2 = tl.load(SIN + cp + D2, mask=mask, other=0.0)
        o1 = x1 * c1 + x2 * s2
        o2 = x2 * c2 - x1 * s1
    else:
        o1 = x1
        o2 = x2
    q1, q2 = _cast_pair_fp8(o1, o2, DQ.dtype.element_ty, AMAX, SCALE, M, BIAS, FMAX, HW_CAST)
    col = slot * (2 * D2) + half
    rows = rm[:, None].to(tl.int64)
    tl.store(Q + rows * N + col[None, :], q1, mask=mask)
    tl.store(Q + rows * N + D2 + col[None, :], q2, mask=mask)
    cols = col[:, None].to(tl.int64)
    tmask = (half[:, None] < D2) & (rm[None, :] < T)
    tl.store(QT + cols * T + rm[None, :], tl.trans(q1), mask=tmask)
    tl.store(QT + (cols + D2) * T + rm[None, :], tl.trans(q2), mask=tmask)


# 64 tokens a program and 4 warps: the fused SwiGLU backward's tile (its sweep,
# kernels/fused_swiglu_triton.BM_FP8), whose loads and stores this kernel shares
BM_QKV, WARPS_QKV = 64, 4


def qkv_rope_backward_fp8(dq, dk, dv, cos, sin, scale: torch.Tensor, dtype: torch.dtype
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """kernels/fused_rope.qkv_rope_backward_fp8_reference's signature (dq, dk, dv: unit
    last stride)."""
    S, B, H, D = dq.shape
    G = dk.shape[2]
    P = H // G
    T, N = S * B, G * (P + 2) * D
    q = torch.empty((T, N), dtype=dtype, device=dq.device)
    qt = torch.empty((N, T), dtype=dtype, device=dq.device)
    amax = torch.zeros((), dtype=torch.float32, device=dq.device)
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    sc_b = 0 if cos.shape[1] == 1 else cos.stride(1)
    kernel = _qkv_rope_bwd_fp8 if interpreted(_qkv_rope_bwd_fp8) else wrap_triton(_qkv_rope_bwd_fp8)
    m, bias = FP8_FORMATS[dtype]
    kernel[(triton.cdiv(T, BM_QKV), G * (P + 2))](
        dq, dk, dv, cos, sin, q.view(torch.uint8), qt.view(torch.uint8), amax, scale, T, B, P,
        N, D // 2, dq.stride(0), dq.stride(1), dq.stride(2), dk.stride(0), dk.stride(1),
        dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2), cos.stride(0), sc_b,
        M=m, BIAS=bias, FMAX=torch.finfo(dtype).max, BM=BM_QKV,
        BD2=triton.next_power_of_2(D // 2), HW_CAST=uses_hw_cast(dq), num_warps=WARPS_QKV)
    return q, qt, amax
