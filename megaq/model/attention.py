"""Causal self-attention with heads (and GQA query groups) split over TP."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from megaq.kernels.fused_rope import split_qkv
from megaq.model.config import GPTConfig
from megaq.model.init import ParamInit
from megaq.model.layers import apply_rotary, build_norm
from megaq.parallel.comm import Group
from megaq.parallel.tensor_parallel import (ColumnParallelLinear, RowParallelLinear,
                                            get_rng_tracker)


def core_attention(q, k, v, dropout_p: float, repeat_kv: bool = False) -> torch.Tensor:
    """Causal SDPA on [b, heads, s, d] (k, v may have fewer heads: GQA).

    GQA either through SDPA's enable_gqa or (repeat_kv=True) by repeating the k/v
    heads first; both reach the flash kernel on CUDA (GPTConfig.attention_repeat_kv,
    docs/MODEL.md says which measured faster). The heads are split over TP, so the
    dropout mask comes from the model-parallel RNG stream (independent per TP rank).
    """
    if repeat_kv and k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    with get_rng_tracker().fork() if dropout_p > 0 else contextlib.nullcontext():
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True,
                                              enable_gqa=k.shape[1] != q.shape[1])


class SelfAttention(nn.Module):
    """linear_qkv (column-parallel) -> [q/k norm] -> RoPE -> SDPA -> linear_proj (row-parallel).

    The fused QKV weight is laid out by query group, [group][q heads..., k, v][d],
    as in Megatron, so a contiguous row split gives each rank whole groups.
    """

    def __init__(self, config: GPTConfig, tp_group: Group, init: ParamInit):
        super().__init__()
        tp = tp_group.size
        self.head_dim = config.kv_channels
        self.heads_per_group = config.num_attention_heads // config.num_query_groups
        self.groups_per_rank = config.num_query_groups // tp
        self.heads_per_rank = config.num_attention_heads // tp
        self.attention_dropout = config.attention_dropout
        self.repeat_kv = config.attention_repeat_kv
        # the s x s part; megaq.parallelize wraps it for --recompute-granularity selective
        # (its activations, the softmax and dropout mask under the math kernel, are then
        # recomputed in backward: megaq.model.recompute)
        self.core_attention = core_attention
        q_size = config.num_attention_heads * self.head_dim
        kv_size = config.num_query_groups * self.head_dim
        common = dict(bias=config.add_bias_linear, sequence_parallel=config.sequence_parallel,
                      params_dtype=config.params_dtype)
        self.linear_qkv = ColumnParallelLinear(
            config.hidden_size, q_size + 2 * kv_size, tp_group,
            init_weight=init.normal("self_attention.linear_qkv.weight"), **common)
        self.linear_proj = RowParallelLinear(
            q_size, config.hidden_size, tp_group,
            init_weight=init.normal("self_attention.linear_proj.weight", scaled=True), **common)
        # --qk-layernorm: one norm over the head dim shared by all query heads, one by all
        # key heads, applied before RoPE (megatron-core's q_layernorm / k_layernorm)
        self.q_layernorm = build_norm(config, per_head=True) if config.qk_layernorm else None
        self.k_layernorm = build_norm(config, per_head=True) if config.qk_layernorm else None

    @property
    def rope_in_gemm(self) -> bool:
        """Does linear_qkv's GEMM apply RoPE and split q, k, v (an FP8 GEMM given that
        epilogue by megaq.parallelize.apply_fp8)?"""
        return bool(getattr(self.linear_qkv.gemm, "rope_per_group", 0))

    def forward(self, x: torch.Tensor, rotary=None) -> torch.Tensor:
        if rotary is not None and self.rope_in_gemm:
            # the FP8 GEMM rotates q and k itself (megaq.parallelize.apply_fp8), so that its
            # backward takes dq, dk and dv and writes its FP8 dY from them in one pass
            q, k, v = self.linear_qkv(x, rotary=rotary)
        else:
            qkv = self.linear_qkv(x)  # [s, b, groups/tp * (heads_per_group + 2) * d]; s is full
            q, k, v = split_qkv(qkv, self.heads_per_group, self.head_dim)
            if self.q_layernorm is not None:
                q, k = self.q_layernorm(q), self.k_layernorm(k)
            if rotary is not None:
                q, k = apply_rotary(q, rotary), apply_rotary(k, rotary)
            if rotary is not None or self.q_layernorm is not None:
                # q and k are new tensors: v alone would keep the whole QKV output alive for
                # attention's backward, 3x its own bytes (MHA); its own copy keeps only v
                v = v.contiguous()
        s, b = q.shape[:2]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads, s, d]
        dropout = self.attention_dropout if self.training else 0.0
        out = self.core_attention(q, k, v, dropout, self.repeat_kv)
        out = out.permute(2, 0, 1, 3).reshape(s, b, self.heads_per_rank * self.head_dim)
        return self.linear_proj(out)
