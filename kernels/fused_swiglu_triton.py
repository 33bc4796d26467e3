"""Triton SwiGLU: y [N, 2F] = [gate | up] -> silu(gate) * up [N, F]; fp32 math."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fused_common import LAUNCH


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


def swiglu_fwd(y2: torch.Tensor) -> torch.Tensor:
    N, F2 = y2.shape
    F = F2 // 2
    out = torch.empty((N, F), dtype=y2.dtype, device=y2.device)
    _swiglu_fwd[(N, triton.cdiv(F, BLOCK))](y2, out, y2.stride(0), out.stride(0), F,
                                            BLOCK=BLOCK, num_warps=4, **LAUNCH)
    return out


def swiglu_bwd(do2: torch.Tensor, y2: torch.Tensor) -> torch.Tensor:
    N, F2 = y2.shape
    F = F2 // 2
    dy = torch.empty((N, F2), dtype=y2.dtype, device=y2.device)
    _swiglu_bwd[(N, triton.cdiv(F, BLOCK))](do2, y2, dy, do2.stride(0), y2.stride(0), dy.stride(0),
                                            F, BLOCK=BLOCK, num_warps=4, **LAUNCH)
    return dy
