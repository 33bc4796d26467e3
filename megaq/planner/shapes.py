"""The parameters one GPU holds, unit by unit, as megaq's model and ZeRO engine lay them out.

A *unit* is what the ZeRO engine gathers and releases together (megaq.zero.units): per
model chunk the embedding, each transformer layer, and the head (final norm, plus the
output layer when untied); a tied embedding split over pipeline stages is a unit of its
own on the first and the last stage. Sizes are per TP rank (megaq.model's
column/row-parallel splits), so they are exact without building a model.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from megaq.model.config import GPTConfig
from megaq.parallel.pipeline.split import chunk_layer_range
from megaq.zero.partition import padded


@dataclass(frozen=True)
class UnitShape:
    name: str
    numel: int           # parameters of this TP rank in the unit
    fp8_numel: int = 0   # of which weights of FP8 GEMM layers held in E4M3 (laid out first)
    layers: int = 0      # transformer layers in it (1 for a layer unit)

    def padded_numel(self, dp: int, block: int) -> int:
        """The flat buffer's length under ZeRO-3 (megaq.zero.partition)."""
        return padded(self.numel, dp * block)

    def shard_numel(self, dp: int, block: int) -> int:
        return self.padded_numel(dp, block) // dp


# the FP8 GEMM layers of a transformer layer (QKV, attention output, FC1, FC2): each
# holds one E4M3 weight with one inverse scale when weights are kept in E4M3
FP8_WEIGHTS_PER_LAYER = 4


def norm_params(cfg: GPTConfig) -> int:
    return cfg.hidden_size * (2 if cfg.normalization == "LayerNorm" else 1)


def layer_params(cfg: GPTConfig, tp: int) -> tuple[int, int]:
    """(parameters, of which FP8 GEMM weights) of one transformer layer on one TP rank."""
    h, f = cfg.hidden_size, cfg.ffn_hidden_size
    q = cfg.num_attention_heads * cfg.kv_channels
    kv = cfg.num_query_groups * cfg.kv_channels
    fc1 = 2 * f if cfg.swiglu else f
    weights = (q + 2 * kv) // tp * h + h * (q // tp) + fc1 // tp * h + h * (f // tp)
    biases = ((q + 2 * kv) // tp + h + fc1 // tp + h) if cfg.add_bias_linear else 0
    return 2 * norm_params(cfg) + weights + biases, weights


def embedding_params(cfg: GPTConfig, tp: int) -> tuple[int, int]:
    """(word embedding rows x h on this TP rank, learned positions or 0)."""
    word = cfg.padded_vocab_size(tp) // tp * cfg.hidden_size
    pos = cfg.max_position_embeddings * cfg.hidden_size \
        if cfg.position_embedding_type == "learned_absolute" else 0
    return word, pos


@functools.lru_cache(maxsize=512)
def stage_units(cfg: GPTConfig, tp: int, pp: int, vp: int, stage: int,
                e4m3_weights: bool = False) -> tuple[UnitShape, ...]:
    """The units of pipeline stage `stage` on one TP rank, in forward order per chunk
    (`e4m3_weights`: the FP8 GEMMs' weights are held in E4M3: each layer's fp8_numel)."""
    per_layer, fp8 = layer_params(cfg, tp)
    fp8 = fp8 if e4m3_weights else 0
    word, pos = embedding_params(cfg, tp)
    tied = cfg.tie_embeddings
    units = []
    for c in range(vp):
        lo, hi = chunk_layer_range(cfg.num_layers, pp, vp, stage, c)
        first = stage == 0 and c == 0
        last = stage == pp - 1 and c == vp - 1
        prefix = f"chunk{c}." if vp > 1 else ""
        if first:
            if tied and not last:  # the word embedding is the shared unit; positions alone
                if pos:
                    units.append(UnitShape(prefix + "embedding", pos))
                units.append(UnitShape(prefix + "shared_embedding", word))
            else:
                units.append(UnitShape(prefix + "embedding", word + pos))
        units += [UnitShape(f"{prefix}layers.{i}", per_layer, fp8, 1) for i in range(hi - lo)]
        if last:
            head = norm_params(cfg)
            if tied and not first:
                units.append(UnitShape(prefix + "head", head))
                units.append(UnitShape(prefix + "shared_embedding", word))
            else:
                units.append(UnitShape(prefix + "head", head + (0 if tied else word)))
    return tuple(units)


def total_params(cfg: GPTConfig) -> int:
    """Parameters of the whole model (TP 1, the tied embedding counted once)."""
    per_layer, _ = layer_params(cfg, 1)
    word, pos = embedding_params(cfg, 1)
    return (cfg.num_layers * per_layer + word + pos + norm_params(cfg)
            + (0 if cfg.tie_embeddings else word))
