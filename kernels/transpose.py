"""Transposed copy of an FP8 GEMM operand, as one op that torch.compile does not fuse.

torch._scaled_mm on Hopper reads both FP8 operands K-major (A row-major, B column-major),
so the weight-gradient GEMM dW = dY^T X needs dY and X with the token dimension
contiguous: transposed copies of the FP8 tensors the other GEMMs read. Left to
inductor, the copy of dY is fused into the kernel that produces dY (the SwiGLU, RoPE
or norm backward with the cast and its amax reduction): that kernel iterates rows for
the reduction, so the transposed store writes one byte per row, 16 KiB apart, and the
fused kernel ran about 2.5x slower than its bytes need (docs/PERFORMANCE.md, FP8).
:func:`transpose` is a custom op instead (inductor calls it, never fuses into it): the
producer writes dY once, row-major, and this kernel copies it in 128 x 128 tiles, whole
lines read and written. `transpose_reference` (``x.t().contiguous()``) is the torch
definition; both move bytes, so they agree bit for bit.

It is a `torch.library.triton_op` (a dispatch.CompiledOp): inductor sees the Triton
kernel inside and launches it from its generated code like its own kernels (never
fusing into it), where a plain custom op goes through the dispatcher and Triton's Python
launcher on every call. Eager makes three of these copies per FP8 linear and micro-batch
(576 for a 24-layer model with two micro-batches); a compiled block fewer, since it casts a
bf16 weight and a row-parallel input straight into the GEMM's layout
(megaq.parallel.fp8.recast_col_major). As a custom op their host time held a 307M
model's FP8 step at 66K tokens/s, against 92K as a triton_op (docs/PERFORMANCE.md, "Host
time of the transpose op").
"""

from __future__ import annotations

import torch

from .dispatch import CompiledOp, Op


def transpose_reference(x: torch.Tensor) -> torch.Tensor:
    return x.t().contiguous()


# CUDA: the Triton kernel, also while inductor traces the op (under_compile="triton":
# inductor must not see the reference, which it would fuse into dY's producer). The
# interpreter (MEGAQ_KERNELS=triton on the CPU) runs only on real tensors; a trace there
# records the reference, the same bytes.
TRANSPOSE = Op("transpose", transpose_reference, "transpose_triton.transpose", under_compile="triton")


def _transpose_body(x: torch.Tensor) -> torch.Tensor:
    return TRANSPOSE.pick(x)(x)


_transpose_op = CompiledOp("transpose_1byte", _transpose_body, transpose_reference)


def transpose(x: torch.Tensor) -> torch.Tensor:
    """x [M, N] (contiguous, 1-byte elements: FP8) -> a contiguous [N, M] copy of x.t()."""
    if x.dim() != 2 or x.element_size() != 1 or not x.is_contiguous():
        raise ValueError(f"transpose wants a contiguous 2-D tensor of 1-byte elements, got "
                         f"{x.dtype} of shape {tuple(x.shape)} and strides {x.stride()}")
    return _transpose_op(x)
