"""Per-token cross-entropy from (unsharded) logits without materialising fp32 logits.

`cross_entropy(logits, labels, vocab_size=None)`: logits [..., V_padded] in any float
dtype, labels [...] (token ids < vocab_size); returns fp32 losses [...]. Columns at or
beyond vocab_size (vocab padding) are excluded from the softmax and receive no
gradient. Dispatches (kernels.fused_common); `cross_entropy_reference` is the torch
definition (it upcasts to fp32, which is what the Triton version avoids: it reads the
bf16 logits twice, forward and backward, and writes the bf16 gradient once).

Tensor parallelism: this op needs the whole vocabulary on one rank. Under TP > 1 the
model keeps megaq.parallel.tensor_parallel.vocab_parallel_cross_entropy (fp32 math on
the local shard, three [s, b] all-reduces).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .fused_common import use_triton


def cross_entropy_reference(logits: torch.Tensor, labels: torch.Tensor,
                            vocab_size: int | None = None) -> torch.Tensor:
    V = logits.shape[-1] if vocab_size is None else vocab_size
    lf = logits[..., :V].float()
    return F.cross_entropy(lf.reshape(-1, V), labels.reshape(-1), reduction="none").view(labels.shape)


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, vocab_size):
        from . import fused_cross_entropy_triton as k

        logits2 = logits.reshape(-1, logits.shape[-1])
        if logits2.stride(-1) != 1:
            logits2 = logits2.contiguous()
        labels1 = labels.reshape(-1).contiguous()
        loss, lse = k.ce_fwd(logits2, labels1, vocab_size)
        ctx.save_for_backward(logits2, labels1, lse)
        ctx.vocab_size, ctx.shape = vocab_size, logits.shape
        return loss.view(labels.shape)

    @staticmethod
    def backward(ctx, dloss):
        from . import fused_cross_entropy_triton as k

        logits2, labels1, lse = ctx.saved_tensors
        dlogits = k.ce_bwd(logits2, labels1, lse, dloss.reshape(-1).float().contiguous(),
                           ctx.vocab_size)
        return dlogits.view(ctx.shape), None, None


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor,
                  vocab_size: int | None = None) -> torch.Tensor:
    V = logits.shape[-1] if vocab_size is None else vocab_size
    if not 0 < V <= logits.shape[-1]:
        raise ValueError(f"vocab_size {V} must be in 1..{logits.shape[-1]} (the logits' last dim)")
    if labels.shape != logits.shape[:-1]:
        raise ValueError(f"labels {tuple(labels.shape)} must have the logits' leading shape "
                         f"{tuple(logits.shape[:-1])}")
    if use_triton(logits):
        return _CrossEntropy.apply(logits, labels, V)
    return cross_entropy_reference(logits, labels, V)
