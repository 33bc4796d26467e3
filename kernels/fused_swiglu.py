"""SwiGLU activation: y [..., 2f] = [gate | up] -> silu(gate) * up [..., f].

The fused Triton version reads y once and keeps silu(gate) out of memory; backward
recomputes it from the saved y. `swiglu_reference` is the torch definition.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .fused_common import rows_view, use_triton


def swiglu_reference(y: torch.Tensor) -> torch.Tensor:
    gate, up = y.chunk(2, dim=-1)
    return F.silu(gate) * up


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y):
        from . import fused_swiglu_triton as k

        y2 = rows_view(y)
        ctx.save_for_backward(y2)
        ctx.shape = y.shape
        return k.swiglu_fwd(y2).view(*y.shape[:-1], y.shape[-1] // 2)

    @staticmethod
    def backward(ctx, do):
        from . import fused_swiglu_triton as k

        (y2,) = ctx.saved_tensors
        return k.swiglu_bwd(rows_view(do), y2).view(ctx.shape)


def swiglu(y: torch.Tensor) -> torch.Tensor:
    if y.shape[-1] % 2:
        raise ValueError(f"swiglu input's last dim {y.shape[-1]} is odd; it must hold [gate | up]")
    if use_triton(y):
        return _SwiGLU.apply(y)
    return swiglu_reference(y)
