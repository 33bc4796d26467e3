"""Triton transpose of a 2-D tensor of 1-byte elements (FP8 operands), in 2-D tiles
(launched through `wrap_triton`: kernels/transpose.py's op is a triton_op)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from .launch import interpreted


@triton.jit
def _transpose(X, Y, M, N, BM: tl.constexpr, BN: tl.constexpr):
    # a [BM, BN] tile of X [M, N] read along N, written transposed along M into Y [N, M]
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    tile = tl.load(X + rm[:, None].to(tl.int64) * N + rn[None, :],
                   mask=(rm[:, None] < M) & (rn[None, :] < N))
    tl.store(Y + rn[:, None].to(tl.int64) * M + rm[None, :], tl.trans(tile),
             mask=(rn[:, None] < N) & (rm[None, :] < M))


BM = BN = 128  # 16 KiB tiles: every row of a tile is one 128-byte line, read and written


def transpose(x: torch.Tensor) -> torch.Tensor:
    M, N = x.shape
    y = torch.empty((N, M), dtype=x.dtype, device=x.device)
    # the interpreter's kernel is launched as it is: the op never runs it under a trace
    # (kernels/transpose.py), and torch 2.11's wrap_triton refuses it (2.13 passes it through)
    kernel = _transpose if interpreted(_transpose) else wrap_triton(_transpose)
    kernel[(triton.cdiv(M, BM), triton.cdiv(N, BN))](
        x.view(torch.uint8), y.view(torch.uint8), M, N, BM=BM, BN=BN, num_warps=8)
    return y
