"""SwiGLU activation: y [..., 2f] = [gate | up] -> silu(gate) * up [..., f].

The fused Triton version (kernels/fused_swiglu_triton.swiglu) reads y once and keeps
silu(gate) out of memory; backward recomputes it from the saved y. `swiglu_reference`
is the torch definition; `swiglu` dispatches (kernels/dispatch.py).

Under torch.compile on CUDA the forward stays the reference, which inductor fuses with
its consumer (fc2's FP8 cast and amax, or nothing in bf16) and can recompute in
backward, but the backward is `swiglu_backward`, a triton_op inductor launches and never
fuses into. Left to inductor, autograd's derivative of ``silu(gate) * up`` becomes one
kernel over the concatenated [dgate | dup] that loads each input once per output half
(and, with FP8, also casts and reduces the amax): 412 us per 1.3B layer in bf16 and 584
with FP8 on the H200, where the bytes need ~190 (docs/PERFORMANCE.md). The hand kernel
reads gate, up and dOut once and writes both halves.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.library import triton_op

from .dispatch import Op, use_triton


def swiglu_reference(y: torch.Tensor) -> torch.Tensor:
    gate, up = y.chunk(2, dim=-1)
    return F.silu(gate) * up


def swiglu_backward_reference(do: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """[dgate | dup] for the output gradient `do`: fp32 math, as the kernel."""
    gate, up = y.float().chunk(2, dim=-1)
    do, sig = do.float(), torch.sigmoid(gate)
    dgate = do * up * sig * (1.0 + gate * (1.0 - sig))
    return torch.cat([dgate, do * gate * sig], dim=-1).to(y.dtype)


SWIGLU = Op("swiglu", swiglu_reference, "fused_swiglu_triton.swiglu", under_compile="reference")
# the Triton kernel also while inductor traces it (a triton_op: launched, not fused)
SWIGLU_BACKWARD = Op("swiglu_backward", swiglu_backward_reference,
                     "fused_swiglu_triton.swiglu_backward", under_compile="triton")


@triton_op("megaq::swiglu_backward", mutates_args=())
def _swiglu_backward_op(do: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return SWIGLU_BACKWARD.pick(y)(do, y)


class _SwiGLUTraced(torch.autograd.Function):
    """Compiled blocks: the reference forward, the kernel's backward."""

    @staticmethod
    def forward(ctx, y):
        ctx.save_for_backward(y)
        return swiglu_reference(y)

    @staticmethod
    def backward(ctx, do):
        (y,) = ctx.saved_tensors
        return _swiglu_backward_op(do.contiguous(), y)


def swiglu(y: torch.Tensor) -> torch.Tensor:
    if y.shape[-1] % 2:
        raise ValueError(f"swiglu input's last dim {y.shape[-1]} is odd; it must hold [gate | up]")
    if torch.compiler.is_compiling() and use_triton(y, SWIGLU_BACKWARD.under_compile):
        return _SwiGLUTraced.apply(y)
    return SWIGLU.pick(y)(y)
