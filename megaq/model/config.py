"""GPTConfig: the model's hyper-parameters under Megatron's argument names."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import ClassVar

import torch

from megaq.config.flags import flag, flag_name, set_derived, switch
from megaq.parallel.fp8 import FP8Recipe
from megaq.parallel.tensor_parallel import pad_vocab_size


class ModelConfigError(ValueError):
    """An impossible model shape; the message names the flag and the fix."""


@dataclass(frozen=True)
class GPTConfig:
    """The model's hyper-parameters (Megatron's TransformerConfig names); the fields made
    with flag()/switch() are also pretrain_gpt.py's model flags (megaq.config.flags)."""

    FLAG_GROUP: ClassVar[str] = "model"

    num_layers: int = flag("--num-layers", "transformer layers", 2, type=int, required=True)
    hidden_size: int = flag("--hidden-size", "model width", 64, type=int, required=True)
    ffn_hidden_size: int | None = flag(
        "--ffn-hidden-size", "MLP width (default 4 x hidden, or Megatron's 2/3 of that rounded "
        "to 64 with --swiglu)", type=int)
    num_attention_heads: int = flag("--num-attention-heads", "attention (query) heads", 4,
                                    type=int, required=True)
    group_query_attention: bool = switch(
        "--group-query-attention", "grouped-query attention (needs --num-query-groups)")
    # GQA; default = num_attention_heads (MHA). The flag counts only with --group-query-attention.
    num_query_groups: int | None = flag(
        "--num-query-groups", "KV heads for GQA", type=int,
        value=lambda a: a.num_query_groups if a.group_query_attention else None)
    kv_channels: int | None = flag("--kv-channels", "head dim (default hidden / heads)", type=int)
    seq_length: int = flag("--seq-length", "tokens per sample", 32, type=int, required=True)
    max_position_embeddings: int | None = flag(
        "--max-position-embeddings",
        "positions of the learned embedding table (default --seq-length)", type=int)
    position_embedding_type: str = flag(
        "--position-embedding-type", "learned absolute positions (GPT-2) or rotary (Llama)",
        "learned_absolute", choices=["learned_absolute", "rope"])
    rotary_base: int = flag("--rotary-base", "RoPE base", 10000, type=int)
    use_rope_scaling: bool = switch(
        "--use-rope-scaling", "Llama 3.1's RoPE frequency scaling (low_freq_factor 1, "
        "high_freq_factor 4, original_max_position_embeddings 8192, as megatron-core)")
    rope_scaling_factor: float = flag(
        "--rope-scaling-factor", "with --use-rope-scaling: the factor long wavelengths are "
        "divided by", 8.0, type=float)
    qk_layernorm: bool = switch(
        "--qk-layernorm", "a norm (--normalization) over each head's query and key, before RoPE")
    normalization: str = flag("--normalization", "norm layer type", "LayerNorm",
                              choices=["LayerNorm", "RMSNorm"])
    layernorm_epsilon: float = flag("--norm-epsilon", "epsilon of the norm layers", 1e-5,
                                    type=float)
    swiglu: bool = switch("--swiglu", "SwiGLU MLP (Llama style)")
    untie_embeddings_and_output_weights: bool = switch(
        "--untie-embeddings-and-output-weights",
        "separate output layer instead of reusing the word embedding")
    add_bias_linear: bool = flag(
        "--disable-bias-linear", "no biases in linear layers (Llama style)", True,
        action="store_true", value=lambda a: not a.disable_bias_linear)
    attention_dropout: float = flag("--attention-dropout", "dropout on attention probabilities",
                                    0.1, type=float)
    hidden_dropout: float = flag("--hidden-dropout", "dropout on the residual branches", 0.1,
                                 type=float)
    init_method_std: float = flag("--init-method-std",
                                  "std of the normal weight initialisation", 0.02, type=float)
    make_vocab_size_divisible_by: int = flag(
        "--make-vocab-size-divisible-by", "pad the vocab to a multiple of this x TP", 128,
        type=int)
    # ---- activation recomputation (Megatron's flags; megaq.model.recompute) ----
    recompute_activations: bool = switch(
        "--recompute-activations",
        "Megatron's older spelling of --recompute-granularity selective")
    recompute_granularity: str | None = flag(
        "--recompute-granularity", "recompute activations in backward (not counted in TFLOP/s): "
        "full = whole transformer layers (see --recompute-method), selective = the attention "
        "core only (softmax(QK^T)V, the large s x s part)", choices=["full", "selective"])
    recompute_method: str | None = flag(
        "--recompute-method", "with --recompute-granularity full: uniform = checkpoint groups of "
        "--recompute-num-layers layers (only each group's input is kept); block = checkpoint "
        "the first --recompute-num-layers layers of each pipeline stage (model chunk), one by "
        "one, and none of the others", choices=["uniform", "block"])
    recompute_num_layers: int | None = flag(
        "--recompute-num-layers", "with --recompute-granularity full: layers per group "
        "(uniform) or layers recomputed per stage (block)", type=int)
    # ---- speed knobs (no effect on the math beyond rounding; see docs/MODEL.md) ----
    compile_blocks: bool = switch(
        "--compile-blocks", "torch.compile each transformer block's forward (the ZeRO hooks "
        "stay eager); pays off on GPU, costs compile time on CPU")
    attention_repeat_kv: bool = switch(
        "--attention-repeat-kv", "GQA by repeating k/v heads instead of SDPA's enable_gqa")
    # ---- FP8 GEMMs in the blocks' linear layers (megaq.parallel.fp8; docs/MODEL.md) ----
    fp8_format: str | None = flag(
        "--fp8-format", "FP8 GEMMs in the transformer blocks' linear layers (torch._scaled_mm on "
        "Hopper, an exact-cast fp32 emulation elsewhere): e4m3 everywhere, or hybrid (E5M2 "
        "output gradients); embedding, output layer, norms stay bf16", choices=["e4m3", "hybrid"])
    fp8_recipe: str = flag(
        "--fp8-recipe", "FP8 scaling with --fp8-format: one dynamic scale per tensor, or per row "
        "(power-of-two scales), or delayed (per tensor, inputs and gradients scaled from an "
        "amax history: fewer passes over the activations)", "tensorwise",
        choices=["tensorwise", "rowwise", "delayed"])
    fp8_amax_history_len: int = flag(
        "--fp8-amax-history-len", "--fp8-recipe delayed: steps of amax history per tensor", 16,
        type=int)
    fp8_amax_compute_algo: str = flag(
        "--fp8-amax-compute-algo", "--fp8-recipe delayed: scale from the history's max or its "
        "most recent step", "max", choices=["max", "most_recent"])
    # as Megatron: with TP = 1 there is nothing to split the sequence over
    sequence_parallel: bool = switch(
        "--sequence-parallel", "split LayerNorm/dropout activations over TP (ignored when TP = 1)",
        value=lambda ns: ns.sequence_parallel and ns.tensor_model_parallel_size > 1)
    # the run's one seed: the weights' initialisation here, and (megaq.pretrain) dropout's
    # RNG streams and the data order
    seed: int = flag("--seed", "seed of weights, dropout and data order", 1234, type=int)
    # ---- set by the run, not by model flags ----
    vocab_size: int | None = 256  # the tokenizer's (None: not known yet)
    params_dtype: torch.dtype = field(default=torch.float32)  # --bf16 (TrainingConfig)

    # The settings of a model that recomputes nothing (dataclasses.replace(cfg, **NO_RECOMPUTE)).
    NO_RECOMPUTE: ClassVar[dict] = {"recompute_activations": False, "recompute_granularity": None,
                                    "recompute_method": None, "recompute_num_layers": None}

    # Fields that define parameter shapes or meaning: a checkpoint whose values differ
    # is refused (megaq.checkpoint).
    ARCHITECTURE: ClassVar[tuple[str, ...]] = (
        "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
        "num_query_groups", "kv_channels", "max_position_embeddings", "position_embedding_type",
        "rotary_base", "use_rope_scaling", "rope_scaling_factor", "qk_layernorm",
        "normalization", "layernorm_epsilon", "swiglu",
        "untie_embeddings_and_output_weights", "add_bias_linear", "vocab_size")

    def __post_init__(self):
        if not 0 <= self.seed < 2**31:  # numpy takes 32-bit seeds; ranks add small offsets
            raise ModelConfigError(f"--seed must be between 0 and 2^31 - 1 (got {self.seed})")
        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
            if getattr(self, name) < 1:
                raise ModelConfigError(f"{flag_name(GPTConfig, name)} must be >= 1 "
                                       f"(got {getattr(self, name)})")
        # (None: a configuration read from a checkpoint that predates the field)
        for name in ("attention_dropout", "hidden_dropout"):
            if getattr(self, name) is not None and not 0 <= getattr(self, name) <= 1:
                raise ModelConfigError(f"{flag_name(GPTConfig, name)} must be in [0, 1] "
                                       f"(got {getattr(self, name)})")
        if self.init_method_std is not None and not self.init_method_std >= 0:
            raise ModelConfigError(f"--init-method-std must be >= 0 (got {self.init_method_std})")
        h, heads = self.hidden_size, self.num_attention_heads
        if self.kv_channels is None and h % heads:
            raise ModelConfigError(f"--hidden-size {h} is not divisible by --num-attention-heads "
                                   f"{heads}; change one or set --kv-channels")
        if self.group_query_attention and not self.num_query_groups:
            raise ModelConfigError("--group-query-attention needs --num-query-groups N "
                                   "(N dividing the heads)")
        groups = self.num_query_groups or heads
        if heads % groups:
            raise ModelConfigError(f"--num-query-groups {groups} does not divide "
                                   f"--num-attention-heads {heads}; use a divisor")
        ffn = self.ffn_hidden_size
        if ffn is None:  # Megatron's SwiGLU default keeps the parameter count of a 4h GeLU MLP
            ffn = max((int(4 * h * 2 / 3) // 64) * 64, 1) if self.swiglu else 4 * h
        set_derived(self, num_query_groups=groups, kv_channels=self.kv_channels or h // heads,
                    ffn_hidden_size=ffn,
                    max_position_embeddings=self.max_position_embeddings or self.seq_length)
        if self.position_embedding_type not in ("learned_absolute", "rope"):
            raise ModelConfigError(f"--position-embedding-type {self.position_embedding_type!r} "
                                   f"is not supported; use learned_absolute or rope")
        if self.use_rope_scaling and self.position_embedding_type != "rope":
            raise ModelConfigError("--use-rope-scaling scales rotary embeddings; add "
                                   "--position-embedding-type rope or drop it")
        if self.use_rope_scaling and not (self.rope_scaling_factor or 0) >= 1:
            raise ModelConfigError(f"--rope-scaling-factor must be >= 1 "
                                   f"(got {self.rope_scaling_factor})")
        if not self.use_rope_scaling:  # unused: kept out of the architecture comparison
            set_derived(self, rope_scaling_factor=None)
        if self.normalization not in ("LayerNorm", "RMSNorm"):
            raise ModelConfigError(f"--normalization {self.normalization!r} is not supported; "
                                   f"use LayerNorm or RMSNorm")
        if self.fp8_format is not None:
            try:
                self.fp8  # noqa: B018 - builds the recipe, which checks its settings
            except ValueError as e:
                raise ModelConfigError(str(e)) from None
        self._check_recompute()
        if (self.position_embedding_type == "learned_absolute"
                and self.seq_length > self.max_position_embeddings):
            raise ModelConfigError(
                f"--seq-length {self.seq_length} exceeds --max-position-embeddings "
                f"{self.max_position_embeddings}; raise the latter or use "
                f"--position-embedding-type rope")

    def _check_recompute(self) -> None:
        """Megatron's rules: --recompute-activations is --recompute-granularity selective;
        full needs a method and a layer count, selective takes neither."""
        granularity = self.recompute_granularity
        if self.recompute_activations:
            if granularity == "full":
                raise ModelConfigError("--recompute-activations means --recompute-granularity "
                                       "selective (as in Megatron); it contradicts "
                                       "--recompute-granularity full: pass only one")
            granularity = "selective"
        if granularity not in (None, "full", "selective"):
            raise ModelConfigError(f"--recompute-granularity {granularity!r} is not supported; "
                                   f"use full or selective")
        method, n = self.recompute_method, self.recompute_num_layers
        if granularity == "full":
            if method not in ("uniform", "block") or n is None:
                raise ModelConfigError("--recompute-granularity full needs --recompute-method "
                                       "uniform|block and --recompute-num-layers N (as in "
                                       "Megatron)")
            if not 1 <= n <= self.num_layers:
                raise ModelConfigError(f"--recompute-num-layers {n} must be between 1 and the "
                                       f"layers per pipeline stage")
        elif method is not None or n is not None:
            raise ModelConfigError("--recompute-method and --recompute-num-layers apply to "
                                   "--recompute-granularity full only; drop them (selective "
                                   "recomputes the attention core of every layer)")
        set_derived(self, recompute_granularity=granularity,
                    recompute_activations=granularity == "selective")

    @classmethod
    def from_dict(cls, d: dict) -> "GPTConfig":
        """Inverse of megaq.config.flags.to_dict (a checkpoint's stored model configuration)."""
        kw = {f.name: d[f.name] for f in fields(cls) if f.name in d}
        if isinstance(kw.get("params_dtype"), str):
            kw["params_dtype"] = getattr(torch, kw["params_dtype"].rsplit(".", 1)[-1])
        return cls(**kw)

    @property
    def fp8(self) -> FP8Recipe | None:
        """The FP8 recipe of the transformer blocks' linear layers, or None. The embedding,
        the output layer, norms and attention's softmax stay in the params dtype."""
        if self.fp8_format is None:
            return None
        return FP8Recipe(self.fp8_format, self.fp8_recipe, self.fp8_amax_history_len,
                         self.fp8_amax_compute_algo)

    @property
    def tie_embeddings(self) -> bool:
        return not self.untie_embeddings_and_output_weights

    def padded_vocab_size(self, tp_size: int) -> int:
        if self.vocab_size is None:
            raise ModelConfigError("the vocabulary size is not known yet (set by the tokenizer)")
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
