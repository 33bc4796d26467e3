"""Fused RMSNorm: y = x / sqrt(mean(x^2) + eps) * weight, fp32 math, output in x's dtype.

`rms_norm(x, weight, eps)` dispatches (kernels.fused_common); `rms_norm_reference`
is the plain-torch definition with the same signature.
"""

from __future__ import annotations

import torch

from .fused_common import rows_view, use_triton


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        from . import fused_rmsnorm_triton as k

        x2 = rows_view(x)
        y, rstd = k.rmsnorm_fwd(x2, weight.contiguous(), eps)
        ctx.save_for_backward(x2, weight, rstd)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        from . import fused_rmsnorm_triton as k

        x2, weight, rstd = ctx.saved_tensors
        dx, dw = k.rmsnorm_bwd(rows_view(dy), x2, weight.contiguous(), rstd)
        return dx.view(dy.shape), dw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if use_triton(x):
        return _RMSNorm.apply(x, weight, eps)
    return rms_norm_reference(x, weight, eps)
