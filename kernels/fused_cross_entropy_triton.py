"""Triton cross-entropy over bf16/fp16/fp32 logits [N, V] without an fp32 copy.

Forward: one program per row streams the row in BLOCK-wide chunks with an online
max / sum-of-exps (fp32 registers), stores loss and logsumexp (fp32, [N]).
Backward: a 2-D grid (row, chunk) recomputes softmax from the logits and the saved
logsumexp and writes (softmax - onehot) * dloss in the logits' dtype. Columns at or
beyond `vocab_size` (vocab padding) are outside the softmax and get zero gradient.
`cross_entropy` is the autograd op with the signature of
kernels/fused_cross_entropy.cross_entropy_reference; Tuning.ce_fwd_block and
ce_bwd_block set the chunks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .tuning import DEFAULT_TUNING, Tuning


@triton.jit
def _ce_fwd(LOGITS, LABELS, LOSS, LSE, stride, V, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = LOGITS + row * stride
    offs = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + offs
        x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        # lanes still at -inf (only masked tail so far) contribute 0, never NaN
        alpha = tl.where(m_new == float("-inf"), 0.0, tl.exp(m - m_new))
        s = s * alpha + tl.where(x == float("-inf"), 0.0, tl.exp(x - m_new))
        m = m_new
    m_row = tl.max(m, axis=0)
    s_row = tl.sum(tl.where(m == float("-inf"), 0.0, s * tl.exp(m - m_row)), axis=0)
    lse = m_row + tl.log(s_row)
    label = tl.load(LABELS + row)
    x_label = tl.load(base + label).to(tl.float32)
    tl.store(LOSS + row, lse - x_label)
    tl.store(LSE + row, lse)


@triton.jit
def _ce_bwd(LOGITS, LABELS, LSE, DLOSS, DLOGITS, stride_l, stride_d, V, V_total,
            BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(LOGITS + row * stride_l + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    lse = tl.load(LSE + row)
    dloss = tl.load(DLOSS + row)
    label = tl.load(LABELS + row)
    p = tl.exp(x - lse)
    p = tl.where(cols == label, p - 1.0, p)
    tl.store(DLOGITS + row * stride_d + cols, (p * dloss).to(DLOGITS.dtype.element_ty),
             mask=cols < V_total)


def ce_fwd(logits2: torch.Tensor, labels1: torch.Tensor, vocab_size: int, tuning: Tuning):
    N = logits2.shape[0]
    loss = torch.empty(N, dtype=torch.float32, device=logits2.device)
    lse = torch.empty(N, dtype=torch.float32, device=logits2.device)
    block = min(tuning.ce_fwd_block, triton.next_power_of_2(vocab_size))
    _ce_fwd[(N,)](logits2, labels1, loss, lse, logits2.stride(0), vocab_size, BLOCK=block,
                  num_warps=8 if block >= 2048 else 4, enable_fp_fusion=tuning.fp_fusion)
    return loss, lse


def ce_bwd(logits2, labels1, lse, dloss1, vocab_size: int, tuning: Tuning):
    N, V_total = logits2.shape
    dlogits = torch.empty((N, V_total), dtype=logits2.dtype, device=logits2.device)
    block = min(tuning.ce_bwd_block, triton.next_power_of_2(V_total))
    _ce_bwd[(N, triton.cdiv(V_total, block))](logits2, labels1, lse, dloss1, dlogits,
                                              logits2.stride(0), dlogits.stride(0), vocab_size,
                                              V_total, BLOCK=block,
                                              num_warps=8 if block >= 2048 else 4,
                                              enable_fp_fusion=tuning.fp_fusion)
    return dlogits


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, vocab_size, tuning):
        logits2 = logits.reshape(-1, logits.shape[-1])
        if logits2.stride(-1) != 1:
            logits2 = logits2.contiguous()
        labels1 = labels.reshape(-1).contiguous()
        loss, lse = ce_fwd(logits2, labels1, vocab_size, tuning)
        ctx.save_for_backward(logits2, labels1, lse)
        ctx.vocab_size, ctx.shape, ctx.tuning = vocab_size, logits.shape, tuning
        return loss.view(labels.shape)

    @staticmethod
    def backward(ctx, dloss):
        logits2, labels1, lse = ctx.saved_tensors
        dlogits = ce_bwd(logits2, labels1, lse, dloss.reshape(-1).float().contiguous(), ctx.vocab_size,
                         ctx.tuning)
        return dlogits.view(ctx.shape), None, None, None


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int | None = None, *,
                  tuning: Tuning = DEFAULT_TUNING) -> torch.Tensor:
    V = logits.shape[-1] if vocab_size is None else vocab_size
    return _CrossEntropy.apply(logits, labels, V, tuning)
