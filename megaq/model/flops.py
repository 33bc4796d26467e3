"""Analytic model FLOPs per iteration (Megatron's formula), for TFLOP/s log lines.

Counted: every matmul of forward + backward (backward = 2 x forward), 2 FLOPs per
multiply-add. Not counted: activation recomputation (so TFLOP/s is comparable with
and without --recompute-activations), norms, softmax, elementwise ops. Causal
attention is counted as full s x s, as Megatron does.

Per layer and token, with h hidden, q = heads x kv_channels (query projection),
kv = query groups x kv_channels, f = ffn hidden size, s = seq length:

    forward  = 2 (h q + 2 h kv + q h)      QKV and output projections
             + 2 (2 s q)                    scores Q K^T and probs x V
             + 2 (m h f)                    MLP, m = 3 with SwiGLU (gate, up, down) else 2
    head     = 2 h V_padded                 logits, once per token
    total    = 3 x (num_layers x forward + head) x tokens

which is Megatron's  12 B s L h^2 [ (1 + kv/q + s/h) q/h + (f/h)(m/2) + V/(2 L h) ].
"""

from __future__ import annotations

from megaq.model.config import GPTConfig


def num_flops(config: GPTConfig, batch_tokens: int, tp_size: int = 1) -> float:
    """Model FLOPs of one iteration over `batch_tokens` tokens (global batch x seq length),
    summed over every GPU; divide by the GPU count and the step time for TFLOP/s/GPU.
    tp_size only sets the vocab padding of the logit layer, as in Megatron."""
    h, s, layers = config.hidden_size, config.seq_length, config.num_layers
    q = config.num_attention_heads * config.kv_channels
    kv = config.num_query_groups * config.kv_channels
    mlp_matrices = 3 if config.swiglu else 2
    per_layer_fwd = (2 * (h * q + 2 * h * kv + q * h)
                     + 2 * (2 * s * q)
                     + 2 * mlp_matrices * h * config.ffn_hidden_size)
    head_fwd = 2 * h * config.padded_vocab_size(tp_size)
    return 3.0 * (layers * per_layer_fwd + head_fwd) * batch_tokens
