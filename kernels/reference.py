"""Plain-torch reference of every kernel (same signatures as kernels/quant.py).

CPU runs use these; the Triton kernels must match them bit for bit. Rounding rule
(docs/KERNELS.md): per block, absmax = max |x| in fp32; if absmax < TINY the block
is all zeros with scale 0; else scale = absmax / qmax and inv = qmax / absmax, both
IEEE round-to-nearest fp32 divisions; y = x * inv (fp32); q = trunc(y + 0.5 *
sign(y)) with that add in fp32 (round half away from zero; |q| <= qmax always, see
docs/KERNELS.md). Dequantize: q * scale in
fp32, then one cast to the requested dtype. Sums run over rows in order 0, 1, ...
starting from +0.0, one fp32 add per row.

Note: never write `qmax / tensor`: torch computes a python-scalar numerator as
reciprocal(tensor) * qmax, which is not the IEEE quotient.
"""

import torch

from .format import (
    DEFAULT_BLOCK,
    QMAX,
    TINY,
    check_float_input,
    check_format,
    check_packed,
    check_reorder,
    packed_len,
)

__all__ = [
    "packed_len",
    "quantize",
    "dequantize",
    "reorder_quantize",
    "dequant_reduce_quantize",
    "dequant_reduce",
]


def _quantize_fp32(xf: torch.Tensor, bits: int, block: int) -> torch.Tensor:
    """xf: fp32 [..., L] -> packed uint8 [..., packed_len]."""
    lead, L = xf.shape[:-1], xf.shape[-1]
    blocks = xf.reshape(*lead, L // block, block)
    absmax = blocks.abs().amax(dim=-1)
    is_zero = absmax < TINY
    qmax = torch.full_like(absmax, float(QMAX[bits]))
    safe = torch.where(is_zero, torch.ones_like(absmax), absmax)
    scale = torch.where(is_zero, torch.zeros_like(absmax), torch.div(safe, qmax))
    inv = torch.where(is_zero, torch.zeros_like(absmax), torch.div(qmax, safe))
    y = blocks * inv.unsqueeze(-1)
    # round half away from zero: truncate y + 0.5 * sign(y) (float -> int truncates);
    # no clamp needed: |y| <= absmax * inv <= qmax * (1 + 2^-23) < qmax + 0.5
    half = torch.where(y < 0, -0.5, 0.5)
    q = (y + half).to(torch.int8).reshape(*lead, L)
    if bits == 8:
        payload = q.view(torch.uint8)
    else:
        nib = q.view(torch.uint8) & 0xF
        payload = nib[..., 0::2] | (nib[..., 1::2] << 4)
    scale_bytes = scale.contiguous().view(torch.uint8)
    return torch.cat([payload, scale_bytes], dim=-1)


def _dequantize_fp32(packed: torch.Tensor, L: int, bits: int, block: int) -> torch.Tensor:
    """packed uint8 [..., P] -> fp32 [..., L] (q * scale, one fp32 multiply)."""
    nbytes = L * bits // 8
    payload = packed[..., :nbytes]
    scale = packed[..., nbytes:].contiguous().view(torch.float32)
    if bits == 8:
        q = payload.view(torch.int8)
    else:
        lo = (payload << 4).view(torch.int8) >> 4
        hi = payload.view(torch.int8) >> 4
        q = torch.stack([lo, hi], dim=-1).flatten(-2)
    lead = packed.shape[:-1]
    qf = q.to(torch.float32).reshape(*lead, L // block, block)
    return (qf * scale.unsqueeze(-1)).reshape(*lead, L)


def _sum_rows(rows: torch.Tensor) -> torch.Tensor:
    """Sum over dim 0 in row order from +0.0: the order the Triton kernels use."""
    acc = torch.zeros_like(rows[0])
    for r in range(rows.shape[0]):
        acc = acc + rows[r]
    return acc


def quantize(x: torch.Tensor, bits: int = 8, block: int = DEFAULT_BLOCK) -> torch.Tensor:
    """x [..., L] (bf16/fp16/fp32) -> uint8 [..., packed_len(L, bits, block)]."""
    check_float_input(x)
    check_format(x.shape[-1] if x.dim() else 0, bits, block)
    return _quantize_fp32(x.to(torch.float32), bits, block)


def dequantize(
    packed: torch.Tensor, L: int, bits: int = 8, block: int = DEFAULT_BLOCK, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """uint8 [..., packed_len(L)] -> [..., L] of `dtype` (rounded once from fp32)."""
    check_packed(packed, L, bits, block)
    return _dequantize_fp32(packed, L, bits, block).to(dtype)


def reorder_quantize(
    grad: torch.Tensor,
    k: int,
    m: int,
    bits: int = 4,
    block: int = DEFAULT_BLOCK,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """grad [n*S] (n = k*m chunks; chunk a*m + j belongs to node a, local rank j)
    -> uint8 [m, packed_len(k*S)]: row j holds chunks j, m + j, ..., (k-1)*m + j.

    residual (optional, fp32 [n*S], error feedback): grad + residual is quantized
    and residual is overwritten in place with (grad + residual) - dequant(q).
    """
    check_float_input(grad)
    S = check_reorder(grad.numel(), k, m, block)
    x = grad.reshape(-1).to(torch.float32)
    if residual is not None:
        _check_residual(residual, grad)
        x = x + residual
    xr = x.reshape(k, m, S).transpose(0, 1).reshape(m, k * S)
    packed = _quantize_fp32(xr, bits, block)
    if residual is not None:
        err = xr - _dequantize_fp32(packed, k * S, bits, block)
        residual.copy_(err.reshape(m, k, S).transpose(0, 1).reshape(-1))
    return packed


def _check_residual(residual: torch.Tensor, grad: torch.Tensor) -> None:
    if residual.dtype != torch.float32 or residual.numel() != grad.numel() or not residual.is_contiguous():
        raise ValueError(
            f"residual must be a contiguous float32 tensor of {grad.numel()} elements "
            f"(got {residual.dtype}, {residual.numel()} elements)"
        )


def dequant_reduce_quantize(
    recv: torch.Tensor, k: int, S: int, bits_in: int = 4, bits_out: int = 4, block: int = DEFAULT_BLOCK
) -> torch.Tensor:
    """recv uint8 [m, packed_len(k*S, bits_in)] -> uint8 [k, packed_len(S, bits_out)]:
    dequantize the m rows, sum them in fp32, requantize each of the k chunks of S."""
    check_format(S, bits_out, block)
    check_packed(recv, k * S, bits_in, block)
    rows = _dequantize_fp32(recv.reshape(-1, recv.shape[-1]), k * S, bits_in, block)
    return _quantize_fp32(_sum_rows(rows).reshape(k, S), bits_out, block)


def dequant_reduce(
    recv: torch.Tensor,
    S: int,
    bits: int = 4,
    block: int = DEFAULT_BLOCK,
    scale: float = 1.0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """recv uint8 [k, packed_len(S)] -> fp32 [S] = scale * sum of the k rows.
    With `out` (fp32 [S]) the result is ADDED into out (gradient accumulation)."""
    check_packed(recv, S, bits, block)
    rows = _dequantize_fp32(recv.reshape(-1, recv.shape[-1]), S, bits, block)
    res = _sum_rows(rows) * float(scale)  # fp32 tensor * python float: fp32(scale) multiply
    if out is None:
        return res
    _check_out(out, S)
    return out.add_(res)


def _check_out(out: torch.Tensor, S: int) -> None:
    if out.dtype != torch.float32 or out.numel() != S or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous float32 tensor of {S} elements (got {out.dtype}, {out.numel()})")
