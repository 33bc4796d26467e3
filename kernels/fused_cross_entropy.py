"""Per-token cross-entropy from (unsharded) logits without materialising fp32 logits.

`cross_entropy(logits, labels, vocab_size=None)`: logits [..., V_padded] in any float
dtype, labels [...] (token ids < vocab_size); returns fp32 losses [...]. Columns at or
beyond vocab_size (vocab padding) are excluded from the softmax and receive no
gradient. Dispatches (kernels/dispatch.py) to kernels/fused_cross_entropy_triton.
cross_entropy or to `cross_entropy_reference`, the torch definition with the same
signature (it upcasts to fp32, which is what the Triton version avoids: it reads the
bf16 logits twice, forward and backward, and writes the bf16 gradient once).

Tensor parallelism: this op needs the whole vocabulary on one rank. Under TP > 1 the
model keeps megaq.parallel.tensor_parallel.vocab_parallel_cross_entropy (fp32 math on
the local shard, three [s, b] all-reduces).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .dispatch import Op


def cross_entropy_reference(logits: torch.Tensor, labels: torch.Tensor,
                            vocab_size: int | None = None) -> torch.Tensor:
    V = logits.shape[-1] if vocab_size is None else vocab_size
    lf = logits[..., :V].float()
    return F.cross_entropy(lf.reshape(-1, V), labels.reshape(-1), reduction="none").view(labels.shape)


CROSS_ENTROPY = Op("cross_entropy", cross_entropy_reference, "fused_cross_entropy_triton.cross_entropy",
                   under_compile="reference")


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor,
                  vocab_size: int | None = None) -> torch.Tensor:
    V = logits.shape[-1] if vocab_size is None else vocab_size
    if not 0 < V <= logits.shape[-1]:
        raise ValueError(f"vocab_size {V} must be in 1..{logits.shape[-1]} (the logits' last dim)")
    if labels.shape != logits.shape[:-1]:
        raise ValueError(f"labels {tuple(labels.shape)} must have the logits' leading shape "
                         f"{tuple(logits.shape[:-1])}")
    return CROSS_ENTROPY.pick(logits)(logits, labels, V)
