"""GPT-2 / Llama-style decoder built from tensor-parallel layers.

Read top to bottom: Embedding -> TransformerBlock (attention + MLP) -> GPTModel.
Activations are sequence-first [s, b, h]; under sequence parallelism every tensor
between the TP layers is the rank's chunk [s/tp, b, h]. The model knows nothing of
data or pipeline parallelism: a pipeline stage is a GPTModel holding blocks
layer_start..layer_end, with pre_process (embedding) on the first stage and
post_process (final norm, output layer, loss) on the last.

The constructor builds the model and nothing else: FP8 GEMMs, activation recompute,
torch.compile and the ZeRO engine are applied from outside, by megaq.parallelize.
"""

from __future__ import annotations

import torch
from torch import nn

from megaq.kernels.fused_cross_entropy import cross_entropy as fused_cross_entropy
from megaq.model.attention import SelfAttention
from megaq.model.config import GPTConfig
from megaq.model.init import ParamInit
from megaq.model.layers import RotaryEmbedding, build_norm
from megaq.model.mlp import MLP
from megaq.parallel.comm import Group
from megaq.parallel.tensor_parallel import (ColumnParallelLinear, TPDropout, VocabParallelEmbedding,
                                            ensure_rng_seeded, set_tp_attributes,
                                            single_rank_group, vocab_parallel_cross_entropy)
from megaq.parallel.topology import check_model_fits_tp

EMBEDDING_KEY = "embedding"        # init key of the word embedding (and its tied copy)
WORD_EMBEDDING_NAME = "word_embeddings.weight"
OUTPUT_KEY = "output"


class Embedding(nn.Module):
    """Word embedding (vocab split over TP) + learned absolute positions (replicated)."""

    def __init__(self, config: GPTConfig, tp_group: Group, padded_vocab_size: int):
        super().__init__()
        self.tp_group, self.sequence_parallel = tp_group, config.sequence_parallel
        init = ParamInit(config.seed, config.init_method_std, config.num_layers, EMBEDDING_KEY)
        self.word_embeddings = VocabParallelEmbedding(
            padded_vocab_size, config.hidden_size, tp_group,
            init_weight=init.normal(WORD_EMBEDDING_NAME, valid_rows=config.vocab_size),
            sequence_parallel=config.sequence_parallel, params_dtype=config.params_dtype)
        self.position_embeddings = None
        if config.position_embedding_type == "learned_absolute":
            full = init.normal("position_embeddings.weight")((config.max_position_embeddings,
                                                              config.hidden_size))
            self.position_embeddings = nn.Embedding.from_pretrained(
                full.to(config.params_dtype), freeze=False)
            # Under sequence parallelism each rank adds positions only to its chunk.
            set_tp_attributes(self.position_embeddings.weight, False,
                              sequence_parallel=config.sequence_parallel)
        self.dropout = TPDropout(config.hidden_dropout, split=config.sequence_parallel)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None):
        x = self.word_embeddings(input_ids)  # [s, b, h], or [s/tp, b, h]
        if self.position_embeddings is not None:
            s = input_ids.shape[1]
            if position_ids is None:
                pos = self.position_embeddings.weight[:s].unsqueeze(1)  # [s, 1, h]
            else:
                pos = self.position_embeddings(position_ids).transpose(0, 1)  # [s, b, h]
            if self.sequence_parallel and self.tp_group.size > 1:
                chunk = s // self.tp_group.size
                pos = pos[self.tp_group.rank * chunk:(self.tp_group.rank + 1) * chunk]
            x = x + pos
        return self.dropout(x)


class TransformerBlock(nn.Module):
    """Pre-norm block: x + drop(attn(norm(x))), then x + drop(mlp(norm(x)))."""

    def __init__(self, config: GPTConfig, tp_group: Group, layer_number: int):
        super().__init__()
        self.layer_number = layer_number  # global index, 0-based
        init = ParamInit(config.seed, config.init_method_std, config.num_layers, layer_number)
        self.input_layernorm = build_norm(config)
        self.self_attention = SelfAttention(config, tp_group, init)
        self.pre_mlp_layernorm = build_norm(config)
        self.mlp = MLP(config, tp_group, init)
        # The residual stream is replicated over TP, or split along s under SP.
        self.hidden_dropout = TPDropout(config.hidden_dropout, split=config.sequence_parallel)

    def forward(self, x: torch.Tensor, rotary=None) -> torch.Tensor:
        x = x + self.hidden_dropout(self.self_attention(self.input_layernorm(x), rotary))
        return x + self.hidden_dropout(self.mlp(self.pre_mlp_layernorm(x)))


class GPTModel(nn.Module):
    """Embedding (first stage) -> blocks layer_start..layer_end -> final norm, output
    layer and vocab-parallel loss (last stage). See docs/MODEL.md."""

    def __init__(self, config: GPTConfig, tp_group: Group | None = None, pre_process: bool = True,
                 post_process: bool = True, layer_start: int = 0, layer_end: int | None = None):
        super().__init__()
        tp_group = tp_group or single_rank_group()
        layer_end = config.num_layers if layer_end is None else layer_end
        if not 0 <= layer_start <= layer_end <= config.num_layers:
            raise ValueError(f"layers {layer_start}..{layer_end} are not a range of the model's "
                             f"{config.num_layers} layers; pass 0 <= layer_start <= layer_end <= num_layers")
        check_model_fits_tp(tp_group.size, config.num_attention_heads, config.num_query_groups)
        if config.sequence_parallel and config.seq_length % tp_group.size:
            raise ValueError(f"--seq-length {config.seq_length} is not divisible by "
                             f"--tensor-model-parallel-size {tp_group.size}, which --sequence-parallel needs")
        ensure_rng_seeded(config.seed, tp_group.rank)
        self.config, self.tp_group = config, tp_group
        self.pre_process, self.post_process = pre_process, post_process
        self.layer_start, self.layer_end = layer_start, layer_end
        self.padded_vocab_size = config.padded_vocab_size(tp_group.size)
        tied = config.tie_embeddings

        self.embedding = Embedding(config, tp_group, self.padded_vocab_size) if pre_process else None
        self.rotary = (RotaryEmbedding(config.kv_channels, config.rotary_base,
                                       config.rope_scaling_factor if config.use_rope_scaling
                                       else None)
                       if config.position_embedding_type == "rope" else None)
        self.layers = nn.ModuleList(TransformerBlock(config, tp_group, i)
                                    for i in range(layer_start, layer_end))
        self.final_norm = build_norm(config) if post_process else None
        self.output_layer = None
        if post_process:
            # Tied: the head reuses the word embedding; on a last stage without the
            # embedding it holds a copy initialised identically (grads synced by PP).
            if tied:
                init = ParamInit(config.seed, config.init_method_std, config.num_layers, EMBEDDING_KEY)
                init_fn = init.normal(WORD_EMBEDDING_NAME, valid_rows=config.vocab_size)
            else:
                init = ParamInit(config.seed, config.init_method_std, config.num_layers, OUTPUT_KEY)
                init_fn = init.normal("output_layer.weight", valid_rows=config.vocab_size)
            self.output_layer = ColumnParallelLinear(
                config.hidden_size, self.padded_vocab_size, tp_group, init_weight=init_fn, bias=False,
                sequence_parallel=config.sequence_parallel, skip_weight=tied and pre_process,
                params_dtype=config.params_dtype)
        if tied and pre_process != post_process:  # the two halves of a tied pair live apart
            copy = self.embedding.word_embeddings.weight if pre_process else self.output_layer.weight
            copy.shared_embedding = True
        # how the blocks run: in order; megaq.parallelize swaps in checkpointed groups for
        # --recompute-granularity full (megaq.model.recompute.RecomputedLayers)
        self.run_layers = run_layers

    def global_param_name(self, name: str) -> str:
        """'layers.0.mlp...' on a stage starting at layer 4 -> 'layers.4.mlp...' (a name
        that does not depend on the pipeline split, for checkpoints)."""
        if name.startswith("layers."):
            index, rest = name[len("layers."):].split(".", 1)
            return f"layers.{int(index) + self.layer_start}.{rest}"
        return name

    def forward(self, input_ids=None, hidden_states=None, labels=None, position_ids=None):
        """input_ids [b, s] (first stage) or hidden_states [s, b, h] (later stages).

        Returns hidden states [s, b, h] (not the last stage), per-token fp32 losses
        [b, s] (last stage with labels), else this rank's logit shard [b, s, V_padded/tp].
        """
        x = self.embedding(input_ids, position_ids) if self.pre_process else hidden_states
        rotary = None
        if self.rotary is not None:
            seq = x.shape[0] * (self.tp_group.size if self.config.sequence_parallel else 1)
            rotary = self.rotary(seq, position_ids)
        x = self.run_layers(self.layers, x, rotary)
        if not self.post_process:
            return x
        x = self.final_norm(x)
        head_weight = self.embedding.word_embeddings.weight if self.output_layer.weight is None else None
        logits = self.output_layer(x, head_weight)  # [s, b, V_padded/tp]
        if labels is None:
            return logits.transpose(0, 1)
        if self.tp_group.size == 1:
            # whole vocabulary here: the fused kernel (Triton on CUDA) reads the bf16
            # logits without an fp32 copy; same math as the vocab-parallel path
            loss = fused_cross_entropy(logits, labels.t(), self.config.vocab_size)
        else:
            loss = vocab_parallel_cross_entropy(logits, labels.t(), self.tp_group, self.config.vocab_size)
        return loss.t()


def run_layers(layers, x: torch.Tensor, rotary) -> torch.Tensor:
    """The blocks `layers` in order, each on the previous one's output."""
    for layer in layers:
        x = layer(x, rotary)
    return x
