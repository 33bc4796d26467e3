"""Triton: add (or copy) a low-precision gradient into an fp32 accumulator."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import CachedLauncher


@triton.jit
def _accumulate(DST, SRC, n, ADD: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(SRC + offs, mask=mask).to(tl.float32)
    if ADD:
        g = tl.load(DST + offs, mask=mask) + g
    tl.store(DST + offs, g, mask=mask)


BLOCK = 4096
_launch = CachedLauncher(_accumulate)


def accumulate(dst: torch.Tensor, src: torch.Tensor, add: bool) -> None:
    n = src.numel()
    _launch((triton.cdiv(n, BLOCK),), dst, src, n, ADD=add, BLOCK=BLOCK, num_warps=8)
