"""Small pieces shared by the blocks: normalisation and rotary position embeddings."""

from __future__ import annotations

import math

import torch
from torch import nn

from megaq.kernels.fused_rmsnorm import rms_norm
from megaq.kernels.fused_rope import apply_rotary as _apply_rotary
from megaq.model.config import GPTConfig
from megaq.parallel.tensor_parallel import set_tp_attributes


class RMSNorm(nn.Module):
    """RMSNorm with fp32 math whatever the activation dtype; the fused Triton kernel
    on CUDA, the torch reference elsewhere (kernels.fused_rmsnorm). Same parameter
    name (`weight`) as torch.nn.RMSNorm."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def build_norm(config: GPTConfig, per_head: bool = False) -> nn.Module:
    """LayerNorm or RMSNorm (--normalization) over the hidden dim, or with per_head over
    one attention head's dim (--qk-layernorm's q/k norms). Replicated over TP. Its grads
    are partial per TP rank, and summed over TP by the ZeRO engine (the parameter's
    `sequence_parallel` attribute), when each rank sees only part of the input: its
    sequence chunk under sequence parallelism, or (per_head, TP > 1) its own heads."""
    size = config.kv_channels if per_head else config.hidden_size
    if config.normalization == "LayerNorm":
        norm = nn.LayerNorm(size, eps=config.layernorm_epsilon, dtype=config.params_dtype)
    else:
        norm = RMSNorm(size, config.layernorm_epsilon, config.params_dtype)
    for p in norm.parameters():
        set_tp_attributes(p, False, sequence_parallel=per_head or config.sequence_parallel)
    return norm


# Llama 3.1's RoPE scaling constants; megatron-core fixes them and takes only the factor
LLAMA3_LOW_FREQ_FACTOR, LLAMA3_HIGH_FREQ_FACTOR, LLAMA3_ORIGINAL_CONTEXT = 1.0, 4.0, 8192


def llama3_scaled_inv_freq(inv_freq: torch.Tensor, factor: float) -> torch.Tensor:
    """Llama 3.1's frequency scaling: wavelengths above the original context / low factor
    are divided by `factor`, those below context / high factor kept, the band between
    interpolated smoothly (megatron-core's apply_rope_scaling, HF's "llama3" rope type)."""
    context = LLAMA3_ORIGINAL_CONTEXT
    low, high = LLAMA3_LOW_FREQ_FACTOR, LLAMA3_HIGH_FREQ_FACTOR
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > context / low, inv_freq / factor, inv_freq)
    smooth = (context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= context / high) & (wavelen <= context / low)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """RoPE tables (Megatron / Llama "rotate half" layout, full head dim rotated);
    rope_scaling_factor: Llama 3.1's scaling of the frequencies (None: none)."""

    def __init__(self, head_dim: int, base: int = 10000, rope_scaling_factor: float | None = None):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        if rope_scaling_factor is not None:
            inv_freq = llama3_scaled_inv_freq(inv_freq, rope_scaling_factor)
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


def apply_rotary(x: torch.Tensor, cos_sin) -> torch.Tensor:
    """x: [s, b, heads, d] (any strides with a unit last stride); returns a new tensor.
    Triton on CUDA, the torch reference elsewhere (kernels.fused_rope)."""
    cos, sin = cos_sin
    return _apply_rotary(x, cos, sin)
