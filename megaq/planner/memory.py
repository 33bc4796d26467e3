"""Bytes one GPU holds at its peak, by part.

The persistent parts are what the ZeRO engine allocates (megaq.zero): the weight
shard in the gather dtype, the fp32 master (when the shard is not fp32 itself), the
optimizer's moments, the fp32 gradient accumulators, and the ZeRO++ state (hpZ's
secondary slices, qwZ's packed shards, weight deltas' references, qgZ's residuals,
FP8 shards). Stage 0 replicates all of them; stages 1 and 2 shard them as stage 3
does and add the whole weights, resident. The transient parts are the gathered
units in flight ((1 + prefetch) sites, plus a tied embedding kept between its two
uses; stages 1 and 2: the resident weights), the reduce buckets in flight (stage 1:
the full fp32 gradients kept over the step), and the activations the pipeline schedule keeps
(by recompute mode). The allocator's slack is a fraction on top.
"""

from __future__ import annotations

from dataclasses import dataclass

from megaq.kernels.format import packed_len
from megaq.model.config import GPTConfig
from megaq.zero.config import ZeroConfig

from .shapes import UnitShape

GIB = 2 ** 30


@dataclass(frozen=True)
class EngineBytes:
    """What megaq.zero.ZeroEngine.memory_report() reports, before any gather."""
    params: int      # weight shards (replicated weights under stage 0; stages 1 and 2
    #                  add the resident whole weights, reported as gathered)
    grads: int       # fp32 accumulators
    optimizer: int   # moments + fp32 master
    zeropp: dict     # hpz_secondary, qwz_packed_shards, weight_delta_own_reference, ...


def engine_bytes(units: list[UnitShape], dp: int, cfg: ZeroConfig, elem: int,
                 *, optimizer: str = "adam", steady: bool = True) -> EngineBytes:
    """The engine's allocations for these units on one rank. `steady`: between a
    forward and its backward, when hpZ's slices and qwZ's packed shards exist."""
    B = cfg.block_size
    if cfg.stage == 0:
        shard = sum(u.numel for u in units)
        numels = [u.numel for u in units]
    else:
        numels = [u.shard_numel(dp, B) for u in units]
        shard = sum(numels)
    master = 0 if elem == 4 else 4 * shard
    moments = (2 if optimizer == "adam" else 1) * 4 * shard
    zeropp: dict[str, int] = {}
    if cfg.stage == 3 and steady or cfg.weights_resident:  # 1, 2: packed shards kept
        h = cfg.hpz_partition_size
        if cfg.hpz:
            zeropp["hpz_secondary"] = sum(u.padded_numel(dp, B) // h for u in units) * elem
        if cfg.quantized_weights:
            zeropp["qwz_packed_shards"] = sum(packed_len(s, cfg.weight_bits, B) for s in numels)
        if cfg.weight_deltas:
            zeropp["weight_delta_own_reference"] = shard * elem
        if cfg.fp8_weights:
            zeropp["fp8_shards"] = sum(u.shard_numel(dp, B) for u in units if u.fp8_numel)
    if cfg.error_feedback:
        zeropp["qgz_error_feedback"] = 4 * sum(u.padded_numel(dp, B) for u in units)
    return EngineBytes(params=shard * elem, grads=4 * shard, optimizer=master + moments,
                       zeropp=zeropp)


def activation_bytes_per_layer(cfg: GPTConfig, tokens: int, tp: int, sp: bool) -> float:
    """Bytes one layer saves for backward for one micro-batch of `tokens` tokens, on one
    TP rank, without recomputation (16-bit activations; flash attention saves its
    output and a per-row statistic, not the s x s scores)."""
    h, f = cfg.hidden_size, cfg.ffn_hidden_size
    q = cfg.num_attention_heads * cfg.kv_channels // tp
    kv = cfg.num_query_groups * cfg.kv_channels // tp
    hs = h / tp if sp and tp > 1 else h
    fc1 = (2 * f if cfg.swiglu else f) / tp
    # norm inputs (2), QKV input, FC1 input: the residual stream (SP: split over TP)
    elems = 4 * hs + (q + 2 * kv) + q + fc1 + f / tp
    masks = 2 * hs / 2 if cfg.hidden_dropout else 0  # two 1-byte dropout masks
    return tokens * (2 * elems + 2 * masks)


def layer_input_bytes(cfg: GPTConfig, tokens: int, tp: int, sp: bool) -> float:
    """A checkpointed layer keeps only its input."""
    return tokens * 2 * (cfg.hidden_size / tp if sp and tp > 1 else cfg.hidden_size)


def chunk_activation_bytes(cfg: GPTConfig, tokens: int, tp: int, sp: bool, layers: int,
                           scale: float) -> tuple[float, float]:
    """(kept per micro-batch in flight, extra while one micro-batch's backward
    recomputes) for a chunk of `layers` blocks, by --recompute-granularity."""
    full = activation_bytes_per_layer(cfg, tokens, tp, sp) * scale
    inp = layer_input_bytes(cfg, tokens, tp, sp)
    if cfg.recompute_granularity != "full":
        return layers * full, 0.0
    n = cfg.recompute_num_layers
    if cfg.recompute_method == "block":
        r = min(n, layers)
        return r * inp + (layers - r) * full, full
    groups = -(-layers // n)
    return groups * inp, n * full


def head_activation_bytes(cfg: GPTConfig, tokens: int, tp: int) -> float:
    """The logits (16-bit) the loss keeps, and their gradient while backward runs."""
    return 2 * 2.0 * tokens * cfg.padded_vocab_size(tp) / tp
