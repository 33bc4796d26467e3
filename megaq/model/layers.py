"""Small pieces shared by the blocks: normalisation and rotary position embeddings."""

from __future__ import annotations

import torch
from torch import nn

from megaq.model.config import GPTConfig
from megaq.parallel.tensor_parallel import set_tp_attributes


def build_norm(config: GPTConfig) -> nn.Module:
    """LayerNorm or RMSNorm over the hidden dim. Replicated over TP; under sequence
    parallelism each rank normalises only its sequence chunk, so its grads are partial."""
    cls = nn.LayerNorm if config.normalization == "LayerNorm" else nn.RMSNorm
    norm = cls(config.hidden_size, eps=config.layernorm_epsilon, dtype=config.params_dtype)
    for p in norm.parameters():
        set_tp_attributes(p, False, sequence_parallel=config.sequence_parallel)
    return norm


class RotaryEmbedding(nn.Module):
    """RoPE tables (Megatron / Llama "rotate half" layout, full head dim rotated)."""

    def __init__(self, head_dim: int, base: int = 10000):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, seq_len: int, position_ids: torch.Tensor | None = None):
        """(cos, sin), each [s, 1, 1, d] (or [s, b, 1, d] for explicit position_ids [b, s])."""
        if position_ids is None:
            pos = torch.arange(seq_len, device=self.inv_freq.device, dtype=torch.float32)[:, None]
        else:
            pos = position_ids.t().to(torch.float32)  # [s, b]
        freqs = pos[..., None] * self.inv_freq  # [s, b|1, d/2]
        emb = torch.cat([freqs, freqs], dim=-1).unsqueeze(2)  # [s, b|1, 1, d]
        return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x: torch.Tensor, cos_sin) -> torch.Tensor:
    """x: [s, b, heads, d]."""
    cos, sin = cos_sin
    return (x * cos.to(x.dtype)) + (_rotate_half(x) * sin.to(x.dtype))
