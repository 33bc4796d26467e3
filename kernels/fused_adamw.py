"""AdamW step fused with the write of the model's low-precision weights.

A mixed-precision optimizer step reads the fp32 gradient, master weight and the two
moments, writes the three back, then (as a separate pass) rounds the new master into
the model's bf16 weights. :func:`adamw_step` does both in one pass over flat buffers:
28 + 2 bytes per element instead of 28 + 4 + 2, and no second launch per buffer.

The update is decoupled AdamW (torch.optim.AdamW's arithmetic, in fp32):

    g  = grad * coef                          (coef: the clip factor, optional)
    p  = p - lr * weight_decay * p
    m  = beta1 * m + (1 - beta1) * g
    v  = beta2 * v + (1 - beta2) * g * g
    p  = p - (lr / (1 - beta1^t)) * m / (sqrt(v) * (1 / sqrt(1 - beta2^t)) + eps)
    out = p rounded to out's dtype (round to nearest even)

The scalar factors are computed once in double precision on the host and rounded to
fp32 (:func:`step_scalars`); the element-wise arithmetic is fp32 with correctly rounded
division and square root, no fused multiply-adds, and no division by a scalar (torch
on CUDA turns ``tensor / scalar`` into a multiply by the reciprocal, so the reference
multiplies by a host-computed reciprocal itself): the Triton kernel and
:func:`adamw_step_reference` give the same bits on the CPU (tests/test_fused_adamw.py)
and on CUDA (bench_train --check). Against torch's own AdamW the order of a few
roundings differs (lerp for m, a division by sqrt(1 - beta2^t)): about one fp32 ulp
per step.

The same pass can also take the max |p| of the new weights over given ranges
(:class:`Segments`): stage 0's E4M3-only weights are cast from the masters after the
step with a scale from that amax (megaq.zero.fp8_resident), which otherwise reads every
master once more only to find it (4 bytes a weight element).
"""

from __future__ import annotations

import math

import torch

from .dispatch import Op


def _f32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32))


def step_scalars(lr: float, weight_decay: float, betas: tuple[float, float], eps: float,
                 step: int) -> tuple[float, ...]:
    """The kernel's scalar arguments for optimizer step `step` (1-based), each an fp32
    value: (lr * wd, beta1, 1 - beta1, beta2, 1 - beta2, lr / bc1, 1 / sqrt(bc2), eps)."""
    if step < 1:
        raise ValueError(f"AdamW step {step}: steps count from 1")
    beta1, beta2 = betas
    bc1, bc2 = 1.0 - beta1 ** step, 1.0 - beta2 ** step
    return tuple(_f32(x) for x in (lr * weight_decay, beta1, 1.0 - beta1, beta2, 1.0 - beta2,
                                   lr / bc1, 1.0 / math.sqrt(bc2), eps))


class Segments:
    """Ranges ``[start, end)`` of a flat buffer (sorted, disjoint) whose max |p| an
    :func:`adamw_step` writes into ``amax`` (fp32, one per range), taken of the new
    weights as it writes them. Built once per buffer layout; the kernel's per-block
    lookup tables (:meth:`block_table`) are kept for reuse."""

    def __init__(self, ranges: list[tuple[int, int]], amax: torch.Tensor):
        if any(a > b for a, b in ranges) or any(ranges[i][1] > ranges[i + 1][0]
                                                for i in range(len(ranges) - 1)):
            raise ValueError(f"amax segments must be sorted, disjoint [start, end) ranges: {ranges}")
        if amax.dtype != torch.float32 or amax.shape != (len(ranges),) or not amax.is_contiguous():
            raise ValueError("amax segments want one contiguous fp32 amax per range")
        self.ranges, self.amax = list(ranges), amax
        self.starts = torch.tensor([a for a, _ in ranges], dtype=torch.int64, device=amax.device)
        self.ends = torch.tensor([b for _, b in ranges], dtype=torch.int64, device=amax.device)
        self._tables: dict = {}

    def block_table(self, n: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """For each block of `block` elements of an `n`-element buffer, the first and last
        range it meets (int32; first > last where it meets none)."""
        key = (n, block)
        if key not in self._tables:
            lo = torch.arange(0, n, block, dtype=torch.int64, device=self.amax.device)
            hi = torch.clamp(lo + block, max=n)
            first = torch.searchsorted(self.ends, lo, right=True)  # ranges ending by lo: before
            last = torch.searchsorted(self.starts, hi) - 1  # ranges starting before hi
            self._tables[key] = (first.to(torch.int32), last.to(torch.int32))
        return self._tables[key]


def adamw_step_reference(param, grad, exp_avg, exp_avg_sq, out, coef, scalars,
                         segments: Segments | None = None) -> None:
    """The torch definition of the fused step (in place on flat fp32 buffers)."""
    decay, beta1, omb1, beta2, omb2, step_size, inv_bc2_sqrt, eps = scalars
    grad = grad.float()  # a 16-bit gradient upcast exactly (an fp32 one is itself)
    g = grad * coef if coef is not None else grad
    p = param - decay * param
    m = beta1 * exp_avg + omb1 * g
    v = beta2 * exp_avg_sq + omb2 * g * g
    # torch's CPU fp32 sqrt is not always correctly rounded; via float64 it is (as the
    # kernel's sqrt_rn and numpy's, which the Triton interpreter uses)
    denom = v.double().sqrt().float() * inv_bc2_sqrt + eps
    p = p - (step_size * m) / denom
    param.copy_(p)
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
    if out is not None:
        out.copy_(p)
    if segments is not None:
        for i, (a, b) in enumerate(segments.ranges):
            segments.amax[i] = p[a:b].abs().max() if b > a else 0.0


# the optimizer's step runs outside compiled code; a trace would record the reference
ADAMW_STEP = Op("adamw_step", adamw_step_reference, "fused_adamw_triton.adamw_step", under_compile="reference")


def adamw_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
               exp_avg_sq: torch.Tensor, out: torch.Tensor | None, coef: torch.Tensor | None,
               scalars: tuple[float, ...], segments: Segments | None = None) -> None:
    """One AdamW step on flat, contiguous fp32 buffers of equal length, in place; `grad`
    may be 16-bit (bf16 or fp16: read upcast, so the same bits as its fp32 copy, at half
    the bytes); `out` (any float dtype, same length) receives the new weights; `coef`
    (0-d fp32 tensor) multiplies the gradient first; `segments.amax` receives the max
    |p| of the new weights in each of its ranges (a NaN where one holds a NaN). Triton on
    CUDA, the reference elsewhere (kernels/dispatch.py)."""
    bufs = (param, grad, exp_avg, exp_avg_sq)
    if any(not t.is_contiguous() or t.shape != param.shape or t.dim() != 1 for t in bufs) \
            or any(t.dtype != torch.float32 for t in (param, exp_avg, exp_avg_sq)) \
            or grad.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError("adamw_step wants flat contiguous fp32 param and moments and an "
                         "fp32, bf16 or fp16 grad, all of one length")
    if out is not None and (out.shape != param.shape or not out.is_contiguous()):
        raise ValueError("adamw_step's out must be flat, contiguous and as long as param")
    if segments is not None and (segments.amax.device != param.device
                                 or (segments.ranges and segments.ranges[-1][1] > param.numel())):
        raise ValueError("adamw_step's amax segments must lie in param, on its device")
    ADAMW_STEP.pick(param)(param, grad, exp_avg, exp_avg_sq, out, coef, scalars, segments)
