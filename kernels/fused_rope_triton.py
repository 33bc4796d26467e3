"""Triton rotary embedding ("rotate half" layout) over x [s, b, heads, d].

One program per (s, b) position handles every head: cos/sin are read once per
position, x through its strides (a strided view of the fused QKV output needs no
copy), the output is written contiguous. backward=True applies the transpose
(rotation by -angle when the two halves of cos/sin agree). `apply_rotary` is the
autograd op with the signature of kernels/fused_rope.apply_rotary_reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

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
