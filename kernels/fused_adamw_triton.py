"""Triton AdamW step over flat fp32 buffers (the gradient fp32 or 16-bit), writing the
model's copy and the new weights' max |p| per range (fused_adamw.Segments) in the same
pass."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _adamw_step(P, G, M, V, OUT, COEF, n, decay, beta1, one_minus_beta1, beta2,
                one_minus_beta2, step_size, inv_bc2_sqrt, eps, SEG_FIRST, SEG_LAST, SEG_START,
                SEG_END, AMAX, HAS_COEF: tl.constexpr, WRITE_OUT: tl.constexpr,
                OUT_BF16: tl.constexpr, HAS_AMAX: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    p = tl.load(P + offs, mask=mask, other=0.0)
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)  # 16-bit grads: exact
    m = tl.load(M + offs, mask=mask, other=0.0)
    v = tl.load(V + offs, mask=mask, other=0.0)
    if HAS_COEF:
        g = g * tl.load(COEF)
    p = p - decay * p
    m = beta1 * m + one_minus_beta1 * g
    v = beta2 * v + one_minus_beta2 * g * g
    denom = tl.sqrt_rn(v) * inv_bc2_sqrt + eps
    p = p - tl.div_rn(step_size * m, denom)
    tl.store(P + offs, p, mask=mask)
    tl.store(M + offs, m, mask=mask)
    tl.store(V + offs, v, mask=mask)
    if OUT_BF16:  # round to nearest even on the bits (the interpreter's cast truncates)
        bits = p.to(tl.uint32, bitcast=True)
        half = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        half = tl.where(p != p, 0x7FC0, half)  # NaN stays NaN
        tl.store(OUT + offs, half.to(tl.int16), mask=mask)
    elif WRITE_OUT:
        tl.store(OUT + offs, p.to(OUT.dtype.element_ty), mask=mask)
    if HAS_AMAX:
        # |p| as its bits: for non-negative floats the integer order is the float order,
        # and a NaN's bits exceed inf's, so a NaN wins the max (as torch's amax)
        bits = tl.where(mask, tl.abs(p).to(tl.int32, bitcast=True), 0)
        for s in range(tl.load(SEG_FIRST + pid), tl.load(SEG_LAST + pid) + 1):
            inside = (offs >= tl.load(SEG_START + s)) & (offs < tl.load(SEG_END + s))
            tl.atomic_max(AMAX + s, tl.max(tl.where(inside, bits, 0), axis=0))


BLOCK = 2048


def adamw_step(param, grad, exp_avg, exp_avg_sq, out, coef, scalars, segments=None) -> None:
    n = param.numel()
    if segments is not None:
        first, last = segments.block_table(n, BLOCK)
        amax = segments.amax.zero_().view(torch.int32)  # atomic max on the bits
        seg = (first, last, segments.starts, segments.ends, amax)
    else:
        seg = (param,) * 5  # not read
    bf16 = out is not None and out.dtype == torch.bfloat16
    if out is None:
        out = param  # not written (WRITE_OUT False)
    elif bf16:
        out = out.view(torch.int16)  # the kernel writes the rounded bits
    _adamw_step[(triton.cdiv(n, BLOCK),)](
        param, grad, exp_avg, exp_avg_sq, out, coef if coef is not None else param, n, *scalars,
        *seg, HAS_COEF=coef is not None, WRITE_OUT=out is not param, OUT_BF16=bf16,
        HAS_AMAX=segments is not None, BLOCK=BLOCK,
        num_warps=8,
        enable_fp_fusion=False)  # no FMA contraction: the same roundings as the reference
