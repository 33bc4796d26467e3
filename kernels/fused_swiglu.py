"""SwiGLU activation: y [..., 2f] = [gate | up] -> silu(gate) * up [..., f].

The fused Triton version (kernels/fused_swiglu_triton.swiglu) reads y once and keeps
silu(gate) out of memory; backward recomputes it from the saved y. `swiglu_reference`
is the torch definition; `swiglu` dispatches (kernels/dispatch.py).

Under torch.compile on CUDA the forward stays the reference, which inductor fuses with
its consumer (fc2's FP8 cast and amax, or nothing in bf16) and can recompute in
backward, but the backward is `swiglu_backward`, a triton_op inductor launches and never
fuses into (a dispatch.CompiledOp). Left to inductor, autograd's derivative of
``silu(gate) * up`` becomes one kernel over the concatenated [dgate | dup] that loads
each input once per output half (and, with FP8, also casts and reduces the amax): 412
us per 1.3B layer in bf16 and 584 with FP8 on the H200, where the bytes need ~190
(docs/PERFORMANCE.md). The hand kernel reads gate, up and dOut once and writes both
halves.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .dispatch import CompiledOp, Op, use_triton


def swiglu_reference(y: torch.Tensor) -> torch.Tensor:
    gate, up = y.chunk(2, dim=-1)
    return F.silu(gate) * up


def swiglu_backward_reference(do: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """[dgate | dup] for the output gradient `do`: the ops, and so the bits, of autograd's
    derivative of swiglu_reference (the kernel computes in fp32 and rounds once)."""
    gate, up = y.chunk(2, dim=-1)
    return torch.cat([torch.ops.aten.silu_backward(do * up, gate), do * F.silu(gate)], dim=-1)


def swiglu_backward_fp8_reference(do: torch.Tensor, y: torch.Tensor, scale: torch.Tensor,
                                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The SwiGLU backward as fc1's FP8 backward GEMMs take it (delayed scaling: the
    scale is known before dY): dY [N, 2F] cast with `scale` to the FP8 `dtype`, that
    cast transposed ([2F, N], the weight-gradient GEMM's operand) and |dY|'s max (fp32,
    0-d: the amax history's entry). The cast and the max are megaq.parallel.fp8's cast
    and tensor_amax, written out here (kernels sit below megaq.parallel);
    tests/test_fused_kernels.py holds the two to the same bytes."""
    dy = swiglu_backward_reference(do, y).reshape(-1, y.shape[-1])
    fmax = torch.finfo(dtype).max
    q = (dy.float() * scale).clamp(-fmax, fmax).to(dtype)
    return q, q.t().contiguous(), dy.abs().amax(dim=-1).amax().float()


SWIGLU = Op("swiglu", swiglu_reference, "fused_swiglu_triton.swiglu", under_compile="reference")
# the Triton kernel also while inductor traces it (a triton_op: launched, not fused)
SWIGLU_BACKWARD = Op("swiglu_backward", swiglu_backward_reference,
                     "fused_swiglu_triton.swiglu_backward", under_compile="triton")
SWIGLU_BACKWARD_FP8 = Op("swiglu_backward_fp8", swiglu_backward_fp8_reference,
                         "fused_swiglu_triton.swiglu_backward_fp8", under_compile="triton")


def _swiglu_backward_body(do: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return SWIGLU_BACKWARD.pick(y)(do, y)


_swiglu_backward_op = CompiledOp("swiglu_backward", _swiglu_backward_body,
                                 swiglu_backward_reference)


def swiglu_backward(do: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """[dgate | dup] for `do`: the kernel where it runs (launched, in a compiled block,
    as the triton_op), else swiglu_backward_reference."""
    return _swiglu_backward_op(do.contiguous(), y)


def _swiglu_backward_fp8_body(do: torch.Tensor, y: torch.Tensor, scale: torch.Tensor,
                              dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return SWIGLU_BACKWARD_FP8.pick(y)(do, y, scale, dtype)


_swiglu_backward_fp8_op = CompiledOp("swiglu_backward_fp8", _swiglu_backward_fp8_body,
                                     swiglu_backward_fp8_reference)


def swiglu_backward_fp8(do: torch.Tensor, y: torch.Tensor, scale: torch.Tensor,
                        dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """swiglu_backward_fp8_reference's result: one kernel where it runs (a fused pass in
    place of the backward, the cast with its amax and the transpose: three passes over
    dY), else the reference."""
    return _swiglu_backward_fp8_op(do.contiguous(), y, scale, dtype)


class _SwiGLUTraced(torch.autograd.Function):
    """Compiled blocks: the reference forward, the kernel's backward."""

    @staticmethod
    def forward(ctx, y):
        ctx.save_for_backward(y)
        return swiglu_reference(y)

    @staticmethod
    def backward(ctx, do):
        (y,) = ctx.saved_tensors
        return swiglu_backward(do, y)


def swiglu(y: torch.Tensor) -> torch.Tensor:
    if y.shape[-1] % 2:
        raise ValueError(f"swiglu input's last dim {y.shape[-1]} is odd; it must hold [gate | up]")
    if torch.compiler.is_compiling() and use_triton(y, SWIGLU_BACKWARD.under_compile):
        return _SwiGLUTraced.apply(y)
    return SWIGLU.pick(y)(y)
