"""ZeroConfig: every setting of the data-parallel engine and its ZeRO++ part, validated once;
OptimizerSettings: the sharded optimizer's update rule, passed to the engine beside it.

Stage 0 is plain data parallelism (replicated weights, all-reduced gradients);
stage 1 shards the optimizer state (fp32 master and moments) over the DP group,
stage 2 the gradients too, stage 3 the weights too (docs/ZERO.md "Stages"). The ZeRO++
settings (qwZ, hpZ, qgZ; implemented in megaq.zero.zeropp) are fields of the same
frozen dataclass, each with one name and one default; docs/ZERO.md lists them all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from megaq.config.flags import flag, switch
from megaq.kernels.format import HADAMARD_SIZE, INT4_CODES, QMAX

GRAD_SYNC_MODES = ("per_microbatch", "last_microbatch")
OPTIMIZER_NAMES = ("adam", "sgd")  # --optimizer (megaq.zero.optimizer.OPTIMIZERS)

# Elements per quantization block: the ZeRO-3 flat buffers are padded to a multiple
# of dp_size * block_size, and qwZ / qgZ keep one fp32 scale per block. The one default
# block (--zero-quantization-block-size overrides it): the kernels have none, every call
# names its block, and the kernel benchmarks pass their own (4096) explicitly.
DEFAULT_BLOCK_SIZE = 2048

# Elements of each rank's shard per qgZ chunk: big enough that one chunk's collectives
# outweigh their fixed per-call cost, small enough that a large unit gives several
# chunks whose hops overlap. Measured on 2 H200s split into 2 "nodes" over NCCL's socket
# transport (1.1B model, docs/PERFORMANCE.md "Several GPUs"): 2^20 -> 476 ms per step,
# 2^22 -> 408 ms, 2^24 -> 405 ms. A chunk never exceeds the unit's shard, so a larger
# value costs no memory beyond the unit's own gradient.
DEFAULT_GRAD_CHUNK = 1 << 22


class ZeroConfigError(ValueError):
    """A bad engine setting; the message names the setting and the fix."""


@dataclass(frozen=True)
class ZeroConfig:
    """Fields made with flag()/switch() are pretrain_gpt.py's --zero-* flags (DeepSpeed's
    names; their --help section is FLAG_GROUP). The two others are derived by
    megaq.config.run.RunConfig.from_flags: fp8_weights from --zero-quantized-weights fp8,
    gather_dtype from the training dtype (--bf16 / --fp16: the weights the model computes
    with, which the engine gathers and writes). The optimizer's values, its kernel choice
    included, are not here: the engine takes them beside this
    (build_engine(chunks, topo, zero, optimizer=...))."""

    FLAG_GROUP: ClassVar[str] = "ZeRO / ZeRO++ (data parallelism)"

    stage: int = flag(  # 0: plain DP (all-reduce), 1: + optimizer sharded, 2: + grads, 3: + weights
        "--zero-stage", "what is sharded over DP: 0 nothing (plain DP, all-reduce); 1 the "
        "optimizer state (Megatron's --use-distributed-optimizer); 2 the optimizer state and "
        "the gradients (reduce-scattered); 3 also the weights (ZeRO-3, the default). Under 1 "
        "and 2 the weights are whole on every rank, all-gathered once after each step",
        3, value=lambda ns: 3 if ns.zero_stage is None else ns.zero_stage,
        type=int, choices=[0, 1, 2, 3])
    # How many sites (units gathered together) ahead to all-gather while the
    # current one computes; 0 = no prefetch. Live gathered memory is bounded by
    # (1 + prefetch) sites plus a borrowed tied embedding.
    prefetch: int = flag(
        "--zero-prefetch", "sites (units gathered together) whose weight all-gather starts "
        "while the current one computes; 0 = none. Live gathered weights are at most "
        "1 + this many sites. DeepSpeed's nearest key, stage3_prefetch_bucket_size, counts "
        "elements instead (docs/TRAINING.md 'Coming from DeepSpeed')", 1, type=int,
        metavar="SITES")
    # Bytes of full-size gradient buffers allowed in flight (reduce launched,
    # not finished) before backward waits for the oldest reduction. The flag counts
    # elements, as DeepSpeed's reduce_bucket_size and Megatron-DeepSpeed's flag do; the
    # buffers hold the training dtype (RunConfig.from_flags converts).
    reduce_bucket_size: int = flag(
        "--zero-reduce-bucket-size", "gradient elements whose reduction may be in flight "
        "(launched, not finished) before backward waits for the oldest; DeepSpeed's "
        "reduce_bucket_size (default: 500 MB of buckets, 250M elements in bf16, 125M in fp32)",
        500_000_000, value=lambda ns: ns.zero_reduce_bucket_size, type=int,
        metavar="ELEMENTS")
    gather_dtype: torch.dtype = torch.float32  # weights as gathered / as the model sees them
    # Parameters with fewer elements than this stay replicated on every DP rank
    # (fp32 master + AdamW state replicated, grads all-reduced, tag 'dp_misc').
    # 0 = shard everything. Tied / shared embeddings are always sharded.
    param_persistence_threshold: int = flag(
        "--zero-param-persistence-threshold", "parameters with fewer elements stay "
        "replicated on every DP rank (weights, AdamW state; gradients all-reduced) instead of "
        "sharded; 0 = shard all; tied embeddings are always sharded. DeepSpeed's "
        "stage3_param_persistence_threshold (whose own default is 1e5)", 0, type=int,
        metavar="ELEMENTS")
    # per_microbatch: reduce-scatter each micro-batch's grads into the fp32 shard
    #   accumulator as they become ready (lowest memory; DeepSpeed's behaviour).
    # last_microbatch: keep full fp32 grads across micro-batches and reduce once
    #   in finish_grad_sync (one grad reduction per step, full-size grad memory).
    grad_sync: str = flag(
        "--zero-grad-sync", "per_microbatch: reduce each micro-batch's gradients as backward "
        "produces them (least memory; DeepSpeed's behaviour, which has no key for it); "
        "last_microbatch: accumulate full fp32 gradients over the micro-batches and reduce "
        "once per step (fewer bytes with gradient accumulation, full-size gradient memory)",
        "per_microbatch", choices=list(GRAD_SYNC_MODES))
    # ---- ZeRO++ (megaq.zero.zeropp; DeepSpeed's switch names, docs/ZEROPP.md) ----
    # (in the order of their --help lines)
    quantized_weights: bool = flag(  # qwZ: blockwise-quantized forward all-gather
        "--zero-quantized-weights", "qwZ: quantized forward weight all-gather. int8 (the "
        "default when given without a value): blockwise int8, dequantized to bf16 for bf16 "
        "GEMMs; fp8 (needs --fp8-format, tensorwise): the FP8 GEMM layers' weights travel as "
        "E4M3 with the GEMM's scale and feed the FP8 GEMMs directly (docs/ZEROPP.md)",
        False, value=lambda ns: ns.zero_quantized_weights == "int8",
        nargs="?", const="int8", choices=["int8", "fp8"])
    weight_bits: int = flag(  # qwZ: bits per weight (8 or 4)
        "--zero-quantized-weights-bits", "qwZ (int8 mode of --zero-quantized-weights): bits "
        "per weight of the quantized gather, 8 or 4 (4: half the bytes, coarser weights; "
        "DeepSpeed's ZeRO++ has int8 only)", 8, type=int, choices=[4, 8])
    # FP8 weight gathers (--zero-quantized-weights fp8, with FP8 GEMMs): the weights of the
    # FP8 GEMM layers travel as E4M3 with the GEMM's per-tensor scale and feed the GEMMs
    # as they arrive (megaq.zero.zeropp.fp8_weights); other weights travel as before.
    fp8_weights: bool = False
    hpz_partition_size: int = flag(  # hpZ (> 1): secondary in-node shard for later gathers
        "--zero-hpz-partition-size",
        "hpZ: secondary weight shard over this many in-node DP ranks (1 = off)", 1, type=int)
    quantized_gradients: bool = switch(  # qgZ: two-hop quantized all-to-all reduce
        "--zero-quantized-gradients", "qgZ: quantized two-hop all-to-all gradient reduce-scatter")
    grad_bits_inter: int = flag(  # qgZ: bits of the cross-node hop (8 or 4)
        "--zero-quantized-gradients-bits", "qgZ bits per value of the cross-node hop (and of "
        "the in-node hop unless --zero-quantized-gradients-intra-bits is given)",
        4, type=int, choices=[4, 8])
    grad_bits_intra: int = flag(  # qgZ: bits of the in-node hop (8 or 4)
        "--zero-quantized-gradients-intra-bits", "qgZ bits of the in-node hop only (in-node "
        "bytes, never cross-node; docs/ZEROPP.md 'Fidelity' has the trade-off); default: "
        "--zero-quantized-gradients-bits", 4,
        value=lambda ns: ns.zero_quantized_gradients_intra_bits or ns.zero_quantized_gradients_bits,
        type=int, choices=[4, 8])
    # qgZ: the int4 code of the gradient hops (int8 hops are always linear): "linear", a
    # nibble q means q * absmax/7, rounds every value below absmax/14 of its block to 0;
    # "square", q |q| * absmax/49, keeps values down to absmax/98 (same bytes;
    # docs/ZEROPP.md "The square-law code"). qwZ's int4 weights are always linear.
    # Square is the default: the linear code's dead zone cost +1.4-1.7% loss against
    # ZeRO-3 in the harness, the square code's about 0 (docs/PERFORMANCE.md).
    grad_code: str = flag(
        "--zero-quantized-gradients-code", "qgZ: the int4 code of the gradient hops (int8 hops "
        "are linear): linear, a nibble q means q*absmax/7 (values below absmax/14 of their "
        "block arrive as 0); square, q|q|*absmax/49 (levels 0,1,4,...,49; values down to "
        "absmax/98 survive; the default). Same bytes; docs/ZEROPP.md 'The square-law code'",
        "square", choices=["linear", "square"])
    # qgZ: quantize each rank's gradient after a blockwise randomized Hadamard transform
    # (64 elements, fixed signs; the inverse after the final reduce) that spreads outliers
    # over their group, so the block's absmax wastes less of the int4 range. Same bytes.
    grad_hadamard: bool = switch(
        "--zero-hadamard-gradients", "qgZ: quantize each rank's gradient after a blockwise "
        "randomized Hadamard transform (groups of 64, fixed signs; the inverse after the final "
        "reduce) that spreads outliers over their group; same bytes; needs "
        "--zero-quantized-gradients and a block size multiple of 64 (docs/ZEROPP.md "
        "'Hadamard-smoothed gradients')")
    # Quantization block (elements). Flat buffers are padded to a multiple of
    # dp_size * block_size so every DP shard and every block is aligned.
    block_size: int = flag("--zero-quantization-block-size", "elements per quantization block",
                           DEFAULT_BLOCK_SIZE, type=int)
    # qgZ: a rank's own all-to-all row stays fp32 (no link, no bytes). Opt-in: with it the
    # in-node hop runs an unfused dequant_reduce + quantize instead of the fused kernel
    # (H200 time: tools/bench/bench_qgz_paths.py), and its gain is the share of the own
    # rows, 1/m and 1/k of the contributions: large at 2 nodes x 2, small at scale.
    grad_exact_own_rows: bool = switch(
        "--zero-quantized-gradients-exact-own-rows",
        "qgZ: keep the all-to-all row a rank keeps for itself exact (fp32, no bytes; its "
        "gain is the own rows' share, 1/m in-node and 1/k cross-node; docs/ZEROPP.md 'Fidelity')")
    error_feedback: bool = switch(  # qgZ: carry each quantization's residual forward
        "--zero-gradient-error-feedback", "qgZ: carry the quantization residual into the next "
        "step (an fp32 residual as large as each unit's full gradient on every rank: 4 bytes "
        "per parameter per rank; docs/ZEROPP.md 'Fidelity')")
    grad_chunk: int = flag(  # qgZ: shard elements per chunk (hops of chunks overlap)
        "--zero-quantized-gradients-chunk", "qgZ: elements of each rank's gradient shard per "
        "chunk; the two all-to-all hops of consecutive chunks overlap (larger chunks mean fewer, "
        "bigger collectives)", DEFAULT_GRAD_CHUNK, type=int)
    # Weight deltas (megaq.zero.zeropp.deltas, needs hpZ): hpZ's secondary slices live
    # across steps as the reference weights; after a step only each shard's quantized
    # difference to its reference crosses nodes, and every gather runs in-node.
    weight_deltas: bool = switch(
        "--zero-weight-deltas", "weight gathers that send only each shard's quantized "
        "difference to the previous step's weights across nodes (needs "
        "--zero-hpz-partition-size N > 1: hpZ's in-node slices become the persistent "
        "reference weights, error-fed; every gather then runs in-node; docs/ZEROPP.md "
        "'Weight deltas')")
    weight_delta_bits: int = flag(  # bits per element of a difference (4 or 8)
        "--zero-weight-delta-bits", "bits per element of the weight differences "
        "(--zero-weight-deltas)", 4, type=int, choices=[4, 8])

    def __post_init__(self):
        if self.stage not in (0, 1, 2, 3):
            raise ZeroConfigError(f"zero stage {self.stage} is not supported; use 0 (plain DP), "
                                  f"1, 2 or 3")
        if self.block_size < 1 or self.block_size % 2:
            raise ZeroConfigError(f"block_size {self.block_size} (--zero-quantization-block-size) must "
                                  f"be a positive even number (int4 packs two values per byte); "
                                  f"e.g. {DEFAULT_BLOCK_SIZE}")
        if self.prefetch < 0:
            raise ZeroConfigError(f"prefetch {self.prefetch} (--zero-prefetch) must be >= 0 sites "
                                  f"(0 = no prefetch)")
        if self.reduce_bucket_size < 1:
            raise ZeroConfigError(f"reduce_bucket_size {self.reduce_bucket_size} bytes "
                                  f"(--zero-reduce-bucket-size, in elements) must be >= 1")
        if self.param_persistence_threshold < 0:
            raise ZeroConfigError(f"--zero-param-persistence-threshold "
                                  f"{self.param_persistence_threshold} must be >= 0 elements "
                                  f"(0 = shard every parameter)")
        if self.gather_dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ZeroConfigError(f"gather_dtype {self.gather_dtype} unsupported; use "
                                  f"torch.float32 or torch.bfloat16")
        if self.grad_sync not in GRAD_SYNC_MODES:
            raise ZeroConfigError(f"grad_sync {self.grad_sync!r} unknown; use one of {GRAD_SYNC_MODES}")
        for name in ("weight_bits", "grad_bits_intra", "grad_bits_inter", "weight_delta_bits"):
            if getattr(self, name) not in QMAX:
                raise ZeroConfigError(f"ZeRO++ {name}={getattr(self, name)} is not supported; "
                                      f"use 8 or 4")
        if self.weight_bits != 8 and not self.quantized_weights:
            raise ZeroConfigError(f"--zero-quantized-weights-bits {self.weight_bits} sets the "
                                  f"bits of qwZ's quantized gather, which is off; add "
                                  f"--zero-quantized-weights (its int8 mode)")
        if self.grad_code not in INT4_CODES:
            raise ZeroConfigError(f"grad_code {self.grad_code!r} (--zero-quantized-gradients-code) "
                                  f"is not supported; use one of {', '.join(INT4_CODES)}")
        if self.hpz_partition_size < 1:
            raise ZeroConfigError(f"hpz_partition_size {self.hpz_partition_size} "
                                  f"(--zero-hpz-partition-size) must be >= 1 (1 = off)")
        if self.grad_chunk < 1:
            raise ZeroConfigError(f"--zero-quantized-gradients-chunk {self.grad_chunk} must be >= 1 "
                                  f"element (e.g. {DEFAULT_GRAD_CHUNK})")
        if self.error_feedback and not self.quantized_gradients:
            raise ZeroConfigError("error_feedback (--zero-gradient-error-feedback) needs "
                                  "quantized_gradients (--zero-quantized-gradients)")
        if self.grad_hadamard and not self.quantized_gradients:
            raise ZeroConfigError("--zero-hadamard-gradients transforms qgZ's quantized gradient "
                                  "hops; add --zero-quantized-gradients")
        if self.grad_hadamard and self.block_size % HADAMARD_SIZE:
            raise ZeroConfigError(f"--zero-hadamard-gradients transforms groups of {HADAMARD_SIZE} "
                                  f"elements inside each quantization block: --zero-quantization-"
                                  f"block-size {self.block_size} must be a multiple of {HADAMARD_SIZE}")
        if self.fp8_weights and self.quantized_weights:
            raise ZeroConfigError("FP8 weight gathers and int8 qwZ both quantize the weight "
                                  "gather; choose one: --zero-quantized-weights fp8 (FP8 GEMMs) "
                                  "or --zero-quantized-weights (int8, bf16 GEMMs)")
        if self.stage != 3 and (self.hpz or self.weight_deltas or self.fp8_weights):
            given = [f for f, on in (("--zero-hpz-partition-size", self.hpz),
                                     ("--zero-weight-deltas", self.weight_deltas),
                                     ("--zero-quantized-weights fp8", self.fp8_weights)) if on]
            raise ZeroConfigError(f"{' and '.join(given)}: ZeRO-3's per-layer weight gathers, "
                                  f"which --zero-stage {self.stage} does not have (its weights "
                                  f"stay whole on every rank): use --zero-stage 3 or drop "
                                  f"{given[0]}")
        if self.weight_deltas and not self.hpz:
            raise ZeroConfigError("--zero-weight-deltas keeps hpZ's in-node secondary partition "
                                  "as the reference weights; add --zero-hpz-partition-size N "
                                  "(N > 1 DP ranks of a node, e.g. the DP ranks per node)")
        if self.weight_deltas and (self.quantized_weights or self.fp8_weights):
            raise ZeroConfigError("--zero-weight-deltas replaces the quantized weight gather "
                                  "(it sends quantized differences instead); drop "
                                  "--zero-quantized-weights")
        if self.stage == 0 and self.zeropp_enabled:
            raise ZeroConfigError("ZeRO++ switches need --zero-stage 1, 2 or 3 (they quantize "
                                  "the sharded stages' weight gathers and gradient "
                                  "reduce-scatters; stage 0 all-reduces)")

    @property
    def weights_resident(self) -> bool:
        """Stages 1 and 2: weights whole on every rank (sharded for the optimizer only),
        all-gathered once after each step instead of per site."""
        return self.stage in (1, 2)

    @property
    def grads_reduced_once(self) -> bool:
        """Full fp32 gradients kept across micro-batches and reduce-scattered once per
        step: stage 1 (its gradients are not sharded during the step, as Megatron's
        distributed optimizer's grad buffer) and grad_sync='last_microbatch'."""
        return self.stage == 1 or self.grad_sync == "last_microbatch"

    @property
    def hpz(self) -> bool:
        return self.hpz_partition_size > 1

    @property
    def weights_need_zeropp(self) -> bool:
        """qwZ, FP8 gathers or hpZ: the ZeRO++ weight gatherer replaces the plain all-gather."""
        return self.quantized_weights or self.fp8_weights or self.hpz

    @property
    def zeropp_enabled(self) -> bool:
        return self.weights_need_zeropp or self.quantized_gradients


@dataclass(frozen=True)
class OptimizerSettings:
    """The sharded optimizer's update rule (megaq.zero.optimizer), passed to the engine
    beside its ZeroConfig. The attribute names are those of megaq.config.run's
    OptimizerConfig (the --optimizer, --lr, --weight-decay, --adam-* and --sgd-momentum
    flags), which a run passes itself, so no value is copied; this class is the engine's
    own default for library callers, tools and tests (weight decay off). Its last three
    fields, AdamW's kernel, have no flag and are read only from here."""

    optimizer: str = "adam"  # "adam" (AdamW) or "sgd" (megaq.zero.optimizer.OPTIMIZERS)
    lr: float = 1e-4  # the initial learning rate; each step passes its own (engine.step)
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.9  # sgd only
    # AdamW's kernel, which no flag picks (a run's OptimizerConfig has none of these three:
    # the device decides, as with None here); tests and benchmarks pin one:
    # megaq's one-pass AdamW (megaq.kernels.fused_adamw): the update and the write of the
    # gather-dtype weights in one kernel; None: on CUDA unless use_apex=True
    fused_step: bool | None = None
    use_apex: bool | None = None  # without fused_step; None: apex FusedAdam when importable
    # torch's fused AdamW (without fused_step, when apex is not used); None: on CUDA only
    # (CPU: foreach)
    fused_adamw: bool | None = None

    def __post_init__(self):
        if self.optimizer not in OPTIMIZER_NAMES:
            raise ZeroConfigError(f"optimizer {self.optimizer!r} (--optimizer) is not supported; "
                                  f"use one of {', '.join(OPTIMIZER_NAMES)}")
        if not self.sgd_momentum >= 0:
            raise ZeroConfigError(f"--sgd-momentum {self.sgd_momentum} must be >= 0")


def check_fp8_weight_gathers(fp8_recipe, cfg: ZeroConfig) -> None:
    """The rules joining the model's FP8 recipe (GPTConfig.fp8: an FP8Recipe or None)
    and the weight gather (RunConfig checks them; the engine again on its model)."""
    if cfg.fp8_weights and fp8_recipe is None:
        raise ZeroConfigError("--zero-quantized-weights fp8 gathers the weights that FP8 GEMMs "
                              "read, and the model has none: add --fp8-format (e4m3 or hybrid), "
                              "or use --zero-quantized-weights (int8) for bf16 GEMMs")
    if cfg.fp8_weights and fp8_recipe.rowwise:
        raise ZeroConfigError("--zero-quantized-weights fp8 gathers one scale per weight tensor "
                              "but --fp8-recipe rowwise scales per row: use --fp8-recipe "
                              "tensorwise or delayed with FP8 weight gathers")
    if cfg.quantized_weights and fp8_recipe is not None:
        raise ZeroConfigError("int8 qwZ (--zero-quantized-weights) dequantizes to bf16, which the "
                              "FP8 GEMMs (--fp8-format) would cast again: use "
                              "--zero-quantized-weights fp8 with FP8 GEMMs")


def fp8_weights_kept_in_e4m3(stage: int, weight_bytes: int, fp8_scaling: str | None) -> bool:
    """Does the engine keep the FP8 GEMMs' weights in E4M3 only, cast from the fp32
    masters once per step (megaq.zero.fp8_resident)? Under stage 0 (every weight whole
    on every rank, never gathered), with 16-bit weights (`weight_bytes` 2: an fp32 one is
    its own master) and a per-tensor weight scale (`fp8_scaling`: GPTConfig.fp8_recipe,
    None without FP8 GEMMs; rowwise scales the weight per row, differently forward and
    backward). The engine and the planner's memory model both ask this."""
    return stage == 0 and weight_bytes == 2 and fp8_scaling in ("tensorwise", "delayed")
