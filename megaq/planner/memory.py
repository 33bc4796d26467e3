"""Bytes one GPU holds at its peak, by part.

The persistent parts are what the ZeRO engine allocates (megaq.zero): the weight
shard in the gather dtype, the fp32 master (when the shard is not fp32 itself), the
optimizer's moments, the fp32 gradient accumulators (16-bit gradients at DP = 1 with
one micro-batch: megaq.zero.grads), and the ZeRO++ state (hpZ's
secondary slices, qwZ's packed shards, weight deltas' references, qgZ's residuals,
FP8 shards). Stage 0 replicates all of them; stages 1 and 2 shard them as stage 3
does and add the whole weights, resident. The transient parts are the gathered
units in flight ((1 + prefetch) sites, plus a tied embedding kept between its two
uses; stages 1 and 2: the resident weights), the reduce buckets in flight (stage 1
and --zero-grad-sync last_microbatch: the full fp32 gradients kept over the step), and
the activations the pipeline schedule keeps (by recompute mode). The allocator's slack
is a fraction on top.

When they are held matters as much as their size: the engine hands the fp32 gradient
accumulators' storage back at the start of a step and takes it again at their first
write in backward (megaq.zero.grads). The peak is then the larger of two moments:
backward's start, with every activation the schedule keeps and no accumulator yet
(unless a later micro-batch's forward runs after an earlier one's backward, as in
1F1B's steady state or plain gradient accumulation), and backward's end, with every
accumulator and only the last layer's saved tensors (or its recomputation) left.
Between the two, backward frees activations as it allocates accumulators. Gradients
reduced once per step hold the full fp32 gradients instead, from the first backward to
finish_grad_sync, which hands them over to the accumulators one unit at a time.

The activations are what megaq's block saves for backward, tensor by tensor
(megaq.testing.saved_bytes counts them on the CPU; tests/test_planner.py checks the count
against it): FP8 blocks keep no bf16 copy of a GEMM input that backward can recompute
(the norms' outputs, the FC2 input), and keep FP8 copies only where their code says.
"""

from __future__ import annotations

from dataclasses import dataclass

from megaq.kernels.format import packed_len
from megaq.model.config import GPTConfig
from megaq.zero.config import ZeroConfig

from .shapes import FP8_WEIGHTS_PER_LAYER, UnitShape

GIB = 2 ** 30


@dataclass(frozen=True)
class EngineBytes:
    """What megaq.zero.ZeroEngine.memory_report() reports, before any gather."""
    params: int      # weight shards (replicated weights under stage 0, those of FP8 GEMMs
    #                  in E4M3 where megaq.zero.fp8_resident keeps them; stages 1 and 2
    #                  add the resident whole weights, reported as gathered)
    grads: int       # fp32 accumulators (or the step's 16-bit gradients: grad_elem)
    optimizer: int   # moments + fp32 master
    zeropp: dict     # hpz_secondary, qwz_packed_shards, weight_delta_own_reference, ...
    full_grads: int = 0  # the full fp32 gradients ZeroConfig.grads_reduced_once keeps over
    #                      the micro-batches, from the step's first backward to
    #                      finish_grad_sync (memory_report adds them to grads)


def engine_bytes(units: list[UnitShape], dp: int, cfg: ZeroConfig, elem: int,
                 *, optimizer: str = "adam", steady: bool = True, grad_elem: int = 4) -> EngineBytes:
    """The engine's allocations for these units on one rank. `steady`: between a
    forward and its backward, when hpZ's slices and qwZ's packed shards exist.
    `grad_elem`: bytes of a held gradient element (4: the fp32 accumulators; the gather
    dtype's where the engine keeps 16-bit gradients: PlanInput.grad_elem)."""
    B = cfg.block_size
    if cfg.stage == 0:
        shard = sum(u.numel for u in units)
        numels = [u.numel for u in units]
        # weights kept in E4M3 (megaq.zero.fp8_resident): 1 byte and a 16-byte scale slot
        e4m3 = sum(u.fp8_numel * (elem - 1) - 16 * FP8_WEIGHTS_PER_LAYER * u.layers
                   for u in units if u.fp8_numel)
    else:
        numels = [u.shard_numel(dp, B) for u in units]
        shard = sum(numels)
        e4m3 = 0
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
    full = sum(flat_numels(units, dp, cfg)) if cfg.grads_reduced_once else 0
    return EngineBytes(params=shard * elem - e4m3, grads=grad_elem * shard, optimizer=master + moments,
                       zeropp=zeropp, full_grads=4 * full)


def flat_numels(units: list[UnitShape], dp: int, cfg: ZeroConfig) -> list[int]:
    """Each unit's whole flat buffer (megaq.zero.partition): padded to the DP group's blocks
    when sharded (stages 1-3), the bare parameters when replicated (stage 0)."""
    if cfg.stage == 0:
        return [u.numel for u in units]
    return [u.padded_numel(dp, cfg.block_size) for u in units]


def activation_bytes_per_layer(cfg: GPTConfig, tokens: int, tp: int, sp: bool, *,
                                fp8: bool = False, compiled: bool = True) -> float:
    """Bytes one layer saves for backward for one micro-batch of `tokens` tokens, on one
    TP rank, without recomputation: what the block's code keeps (megaq.model,
    megaq.parallel.fp8), flash attention's output and per-row statistic, not the s x s
    scores.

    16-bit: the block's input, the two norms' outputs (the QKV and FC1 inputs) and the
    residual between them (the residual stream: split over TP under sequence
    parallelism); q and k after RoPE and a copy of v (not the whole QKV output);
    attention's output (the output projection's input); FC1's output and the FC2 input;
    each block's own 16-bit RoPE tables (per position). fp32: attention's log-sum-exp per head and each
    norm's statistics (mean and) reciprocal RMS.

    FP8 (every recipe): the norms' outputs and the FC2 input are kept by nothing but
    their GEMM, which keeps an FP8 copy instead (eager), or none at all (a compiled
    block: inductor recomputes the input from what the norm and SwiGLU backward keep
    and casts it again), except a column-parallel layer's input at TP > 1, which comes
    out of a collective and is kept as its FP8 copy. megaq.testing.saved_bytes's
    default partitioner-only backend also keeps an FP8 copy of attention's output,
    which inductor's own passes (the GPU's compile) drop: `tools/dev/saved_bytes.py
    --size 1.3B` gives 17.93 GiB, with --backend inductor 17.18, this count (17.02 here:
    the tool charges the per-position RoPE tables per token)."""
    h, f = cfg.hidden_size, cfg.ffn_hidden_size
    d = cfg.kv_channels
    q = cfg.num_attention_heads * d // tp
    kv = cfg.num_query_groups * d // tp
    hs = h / tp if sp and tp > 1 else h
    fc1 = (2 * f if cfg.swiglu else f) / tp
    # cos and sin: per position, not per token (one copy for the micro-batch's sequences)
    rope = 2 * 2 * d * cfg.seq_length if cfg.position_embedding_type == "rope" else 0
    # block input, residual; q, k, v; attention output; FC1 output
    wide = 2 * hs + (q + 2 * kv) + q + fc1
    gemm_inputs = 2 * hs + f / tp            # QKV input, FC1 input, FC2 input
    norm_stats = 1 if cfg.normalization == "RMSNorm" else 2
    fp32 = cfg.num_attention_heads // tp + 2 * norm_stats
    if not fp8:
        fp8_bytes, bf16 = 0.0, wide + gemm_inputs
    else:
        bf16 = wide
        column_inputs = 2 * h  # the QKV and FC1 inputs as the GEMM sees them (gathered)
        if not compiled:
            fp8_bytes = column_inputs + q + f / tp
        else:
            fp8_bytes = column_inputs if tp > 1 else 0.0
    masks = 2 * hs / 2 if cfg.hidden_dropout else 0  # two 1-byte dropout masks
    return tokens * (2 * bf16 + fp8_bytes + 4 * fp32 + 2 * masks) + rope


def layer_input_bytes(cfg: GPTConfig, tokens: int, tp: int, sp: bool) -> float:
    """A checkpointed layer keeps only its input."""
    return tokens * 2 * (cfg.hidden_size / tp if sp and tp > 1 else cfg.hidden_size)


def chunk_activation_bytes(cfg: GPTConfig, tokens: int, tp: int, sp: bool, layers: int, *,
                           fp8: bool = False, compiled: bool = True) -> tuple[float, float, float]:
    """(kept per micro-batch in flight, extra while one micro-batch's backward
    recomputes, left at the end of backward) for a chunk of `layers` blocks, by
    --recompute-granularity. What is left at the end is the first layer's saved
    tensors while its backward runs (recomputed ones under full recompute)."""
    full = activation_bytes_per_layer(cfg, tokens, tp, sp, fp8=fp8, compiled=compiled)
    inp = layer_input_bytes(cfg, tokens, tp, sp)
    if cfg.recompute_granularity != "full":
        return layers * full, 0.0, full
    n = cfg.recompute_num_layers
    if cfg.recompute_method == "block":
        r = min(n, layers)
        return r * inp + (layers - r) * full, full, full
    groups = -(-layers // n)
    return groups * inp, n * full, n * full


def head_activation_bytes(cfg: GPTConfig, tokens: int, tp: int) -> float:
    """The logits (16-bit) the loss keeps, and their gradient while backward runs."""
    return 2 * 2.0 * tokens * cfg.padded_vocab_size(tp) / tp
