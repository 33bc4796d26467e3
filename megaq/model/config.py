"""GPTConfig: the model's hyper-parameters under Megatron's argument names."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megaq.parallel.fp8 import FP8Recipe
from megaq.parallel.tensor_parallel import pad_vocab_size


@dataclass
class GPTConfig:
    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    vocab_size: int = 256
    seq_length: int = 32
    ffn_hidden_size: int | None = None          # default 4h (SwiGLU: ~8h/3, multiple of 64)
    num_query_groups: int | None = None         # GQA; default = num_attention_heads (MHA)
    kv_channels: int | None = None              # head dim; default hidden / heads
    max_position_embeddings: int | None = None  # default seq_length
    position_embedding_type: str = "learned_absolute"  # or "rope"
    rotary_base: int = 10000
    normalization: str = "LayerNorm"            # or "RMSNorm"
    layernorm_epsilon: float = 1e-5
    swiglu: bool = False
    add_bias_linear: bool = True                # Megatron's --disable-bias-linear sets False
    untie_embeddings_and_output_weights: bool = False
    attention_dropout: float = 0.1
    hidden_dropout: float = 0.1
    init_method_std: float = 0.02
    make_vocab_size_divisible_by: int = 128
    sequence_parallel: bool = False
    recompute_activations: bool = False
    params_dtype: torch.dtype = field(default=torch.float32)
    seed: int = 1234
    # ---- speed knobs (no effect on the math beyond rounding; see docs/MODEL.md) ----
    compile_blocks: bool = False       # torch.compile each block's forward (hooks stay eager)
    attention_repeat_kv: bool = False  # GQA by repeating k/v heads instead of enable_gqa
    # ---- FP8 GEMMs in the blocks' linear layers (megaq.parallel.fp8; docs/MODEL.md) ----
    fp8_format: str | None = None      # None: bf16/fp32 GEMMs; "e4m3" or "hybrid" (E5M2 grads)
    fp8_recipe: str = "tensorwise"     # scaling: "tensorwise" or "rowwise"

    def __post_init__(self):
        h, heads = self.hidden_size, self.num_attention_heads
        if self.num_query_groups is None:
            self.num_query_groups = heads
        if self.kv_channels is None:
            if h % heads:
                raise ValueError(f"--hidden-size {h} is not divisible by --num-attention-heads "
                                 f"{heads}; pick sizes that divide or set --kv-channels")
            self.kv_channels = h // heads
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = (int(4 * h * 2 / 3) // 64) * 64 if self.swiglu else 4 * h
            self.ffn_hidden_size = max(self.ffn_hidden_size, 1)
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        if heads % self.num_query_groups:
            raise ValueError(f"--num-attention-heads {heads} is not divisible by --num-query-groups "
                             f"{self.num_query_groups}; each query group needs a whole number of heads")
        if self.position_embedding_type not in ("learned_absolute", "rope"):
            raise ValueError(f"--position-embedding-type {self.position_embedding_type!r} is not "
                             f"supported; use learned_absolute or rope")
        if self.normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"--normalization {self.normalization!r} is not supported; "
                             f"use LayerNorm or RMSNorm")
        if self.fp8_format is not None:
            FP8Recipe(self.fp8_format, self.fp8_recipe)  # raises on an unknown format / recipe
        if (self.position_embedding_type == "learned_absolute"
                and self.seq_length > self.max_position_embeddings):
            raise ValueError(f"--seq-length {self.seq_length} exceeds --max-position-embeddings "
                             f"{self.max_position_embeddings}; raise the latter")

    @property
    def fp8(self) -> FP8Recipe | None:
        """The FP8 recipe of the transformer blocks' linear layers, or None. The embedding,
        the output layer, norms and attention's softmax stay in the params dtype."""
        if self.fp8_format is None:
            return None
        return FP8Recipe(self.fp8_format, self.fp8_recipe)

    @property
    def tie_embeddings(self) -> bool:
        return not self.untie_embeddings_and_output_weights

    def padded_vocab_size(self, tp_size: int) -> int:
        return pad_vocab_size(self.vocab_size, self.make_vocab_size_divisible_by, tp_size)

    @classmethod
    def gpt2(cls, **kw) -> "GPTConfig":
        """GPT-2 family: learned positions, LayerNorm, GELU, biases, tied embeddings."""
        return cls(**kw)

    @classmethod
    def llama(cls, **kw) -> "GPTConfig":
        """Llama family: RoPE, RMSNorm, SwiGLU, no biases, untied embeddings (GQA via
        num_query_groups)."""
        base = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                    add_bias_linear=False, untie_embeddings_and_output_weights=True,
                    attention_dropout=0.0, hidden_dropout=0.0)
        base.update(kw)
        return cls(**base)
