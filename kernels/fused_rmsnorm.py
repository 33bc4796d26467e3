"""Fused RMSNorm: y = x / sqrt(mean(x^2) + eps) * weight, fp32 math, output in x's dtype.

`rms_norm(x, weight, eps)` dispatches (kernels/dispatch.py) to the Triton op
(kernels/fused_rmsnorm_triton.rms_norm) or to `rms_norm_reference`, the plain-torch
definition with the same signature.
"""

from __future__ import annotations

import torch

from .dispatch import Op


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


RMS_NORM = Op("rms_norm", rms_norm_reference, "fused_rmsnorm_triton.rms_norm", under_compile="reference")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return RMS_NORM.pick(x)(x, weight, eps)
