"""Triton RMSNorm forward/backward; `rms_norm` is the autograd op with the signature of
kernels/fused_rmsnorm.rms_norm_reference (imported on first use by its Op).

Forward: one program per row; fp32 math; stores y in x's dtype and 1/rms (fp32).
Backward: each program walks a contiguous run of rows, writes dx and accumulates
its partial dw in fp32; the partials are summed with one torch reduction.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fused_common import rows_view
from .tuning import DEFAULT_TUNING, Tuning


@triton.jit
def _rmsnorm_fwd(X, W, Y, RSTD, stride_x, stride_y, H, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / H + eps)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, (x * rstd * w).to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + row, rstd)


@triton.jit
def _rmsnorm_bwd(DY, X, W, RSTD, DX, DW_PART, stride_dy, stride_x, stride_dx, N, H,
                 rows_per_prog, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    start = pid.to(tl.int64) * rows_per_prog  # int64: row * stride may pass 2**31
    end = tl.minimum(start + rows_per_prog, N)
    for row in range(start, end):
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row)
        xhat = x * rstd
        wdy = w * dy
        c = tl.sum(xhat * wdy, axis=0) / H
        tl.store(DX + row * stride_dx + cols, ((wdy - xhat * c) * rstd).to(DX.dtype.element_ty),
                 mask=mask)
        dw += dy * xhat
    tl.store(DW_PART + pid * H + cols, dw, mask=mask)


def _launch_cfg(H: int):
    block = triton.next_power_of_2(H)
    return block, min(max(block // 256, 1), 16)


def rmsnorm_fwd(x2: torch.Tensor, weight: torch.Tensor, eps: float, tuning: Tuning):
    N, H = x2.shape
    y = torch.empty((N, H), dtype=x2.dtype, device=x2.device)
    rstd = torch.empty(N, dtype=torch.float32, device=x2.device)
    block, warps = _launch_cfg(H)
    _rmsnorm_fwd[(N,)](x2, weight, y, rstd, x2.stride(0), y.stride(0), H, eps,
                       BLOCK=block, num_warps=warps, enable_fp_fusion=tuning.fp_fusion)
    return y, rstd


def rmsnorm_bwd(dy2: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, tuning: Tuning):
    N, H = x2.shape
    dx = torch.empty((N, H), dtype=x2.dtype, device=x2.device)
    if x2.is_cuda:
        progs = min(N, 4 * torch.cuda.get_device_properties(x2.device).multi_processor_count)
    else:
        progs = min(N, 4)
    progs = max(progs, 1)
    rows_per_prog = triton.cdiv(N, progs)
    progs = triton.cdiv(N, rows_per_prog) if N else 1
    dw_part = torch.zeros((progs, H), dtype=torch.float32, device=x2.device)
    block, warps = _launch_cfg(H)
    _rmsnorm_bwd[(progs,)](dy2, x2, weight, rstd, dx, dw_part, dy2.stride(0), x2.stride(0),
                           dx.stride(0), N, H, rows_per_prog, BLOCK=block, num_warps=warps,
                           enable_fp_fusion=tuning.fp_fusion)
    return dx, dw_part.sum(0).to(weight.dtype)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, tuning):
        x2 = rows_view(x)
        y, rstd = rmsnorm_fwd(x2, weight.contiguous(), eps, tuning)
        ctx.save_for_backward(x2, weight, rstd)
        ctx.tuning = tuning
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, rstd = ctx.saved_tensors
        dx, dw = rmsnorm_bwd(rows_view(dy), x2, weight.contiguous(), rstd, ctx.tuning)
        return dx.view(dy.shape), dw, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, tuning: Tuning = DEFAULT_TUNING) -> torch.Tensor:
    return _RMSNorm.apply(x, weight, eps, tuning)
