"""Triton SwiGLU: y [N, 2F] = [gate | up] -> silu(gate) * up [N, F]; fp32 math. `swiglu`
is the autograd op with the signature of kernels/fused_swiglu.swiglu_reference (eager);
`swiglu_backward` the backward alone, launched through `wrap_triton` (the triton_op that
compiled blocks call: kernels/fused_swiglu.py)."""

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
