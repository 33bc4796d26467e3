"""SwiGLU activation: y [..., 2f] = [gate | up] -> silu(gate) * up [..., f].

The fused Triton version (kernels/fused_swiglu_triton.swiglu) reads y once and keeps
silu(gate) out of memory; backward recomputes it from the saved y. `swiglu_reference`
is the torch definition; `swiglu` dispatches (kernels/dispatch.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .dispatch import Op


def swiglu_reference(y: torch.Tensor) -> torch.Tensor:
    gate, up = y.chunk(2, dim=-1)
    return F.silu(gate) * up


SWIGLU = Op("swiglu", swiglu_reference, "fused_swiglu_triton.swiglu", under_compile="reference")


def swiglu(y: torch.Tensor) -> torch.Tensor:
    if y.shape[-1] % 2:
        raise ValueError(f"swiglu input's last dim {y.shape[-1]} is odd; it must hold [gate | up]")
    return SWIGLU.pick(y)(y)
