"""A parameter's gradient into its fp32 accumulator: ``dst = src`` or ``dst += src``,
upcasting bf16 / fp16 to fp32 (megaq.zero.grads, DP = 1 and the first micro-batch's
write of every step).

torch's ``copy_`` / ``add_`` between two dtypes runs its generic, unvectorised
element-wise kernel (about 1.8 TB/s on an H200 for bf16 -> fp32, measured in the 1.3B
step's profile); this kernel reads and writes whole 16-byte vectors. The upcast is
exact and the add one fp32 rounding on both paths, so the results are bit-identical
to the reference (tests/test_fused_adamw.py, bench_train --check).
"""

from __future__ import annotations

import torch

from .fused_common import use_triton


def accumulate_reference(dst: torch.Tensor, src: torch.Tensor, add: bool) -> None:
    if add:
        dst.add_(src)
    else:
        dst.copy_(src)


def accumulate(dst: torch.Tensor, src: torch.Tensor, add: bool) -> None:
    """dst (flat contiguous fp32) = src, or += src with `add` (flat contiguous, same length)."""
    if (dst.dtype != torch.float32 or dst.dim() != 1 or src.shape != dst.shape
            or not dst.is_contiguous() or not src.is_contiguous()):
        raise ValueError("accumulate wants a flat contiguous fp32 dst and a src of its shape")
    if use_triton(dst) and src.dtype in (torch.bfloat16, torch.float16):
        from . import grad_accumulate_triton as k

        k.accumulate(dst, src, add)
    else:
        accumulate_reference(dst, src, add)
