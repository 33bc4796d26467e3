"""ZeroConfig: every knob of the data-parallel engine, validated once.

Stage 0 is plain data parallelism (replicated weights, all-reduced gradients);
stage 3 shards weights, gradients and optimizer state over the DP group.
The ZeRO++ switches (qwZ, hpZ, qgZ) are implemented in megaq.zero.zeropp; the
engine refuses them until that module provides them (see collectives.make_gatherer).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megaq.zero.zeropp.config import DEFAULT_GRAD_CHUNK

GRAD_SYNC_MODES = ("per_microbatch", "last_microbatch")


class ZeroConfigError(ValueError):
    """A bad engine setting; the message names the setting and the fix."""


@dataclass
class ZeroConfig:
    stage: int = 3  # 0: plain DP (all-reduce), 3: ZeRO-3
    # Quantization block (elements). Flat buffers are padded to a multiple of
    # dp_size * block_size so every DP shard and every block is aligned.
    block_size: int = 2048
    # How many sites (units gathered together) ahead to all-gather while the
    # current one computes; 0 = no prefetch. Live gathered memory is bounded by
    # (1 + prefetch) sites plus a borrowed tied embedding.
    prefetch: int = 1
    # Bytes of full-size gradient buffers allowed in flight (reduce launched,
    # not finished) before backward waits for the oldest reduction.
    reduce_bucket_size: int = 500_000_000
    gather_dtype: torch.dtype = torch.float32  # weights as gathered / as the model sees them
    # Parameters with fewer elements than this stay replicated on every DP rank
    # (fp32 master + AdamW state replicated, grads all-reduced, tag 'dp_misc').
    # 0 = shard everything. Tied / shared embeddings are always sharded.
    param_persistence_threshold: int = 0
    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    # per_microbatch: reduce-scatter each micro-batch's grads into the fp32 shard
    #   accumulator as they become ready (lowest memory; DeepSpeed's behaviour).
    # last_microbatch: keep full fp32 grads across micro-batches and reduce once
    #   in finish_grad_sync (one grad reduction per step, full-size grad memory).
    grad_sync: str = "per_microbatch"
    use_apex: bool | None = None  # None: apex FusedAdam when importable
    # torch's fused AdamW (when apex is not used); None: on CUDA only (CPU: foreach)
    fused_adamw: bool | None = None
    # ---- ZeRO++ (implemented by megaq.zero.zeropp) ----
    quantized_weights: bool = False     # qwZ: int8 blockwise forward all-gather
    hpz_partition_size: int = 1         # hpZ: secondary in-node shard for backward gathers
    quantized_gradients: bool = False   # qgZ: two-hop quantized all-to-all reduce
    grad_bits_intra: int = 4
    grad_bits_inter: int = 4
    error_feedback: bool = False
    grad_chunk: int = DEFAULT_GRAD_CHUNK  # qgZ: shard elements per chunk (hops of chunks overlap)
    grad_exact_own_rows: bool = True    # qgZ: a rank's own all-to-all row stays fp32 (no link)

    def __post_init__(self):
        if self.stage not in (0, 3):
            raise ZeroConfigError(f"zero stage {self.stage} is not supported; use 0 (plain DP) or 3")
        if self.block_size < 1 or self.block_size % 2:
            raise ZeroConfigError(f"block_size {self.block_size} must be a positive even number "
                                  f"(int4 packs two values per byte); e.g. 2048")
        if self.prefetch < 0:
            raise ZeroConfigError(f"prefetch {self.prefetch} must be >= 0")
        if self.reduce_bucket_size < 1:
            raise ZeroConfigError(f"reduce_bucket_size {self.reduce_bucket_size} must be >= 1 byte")
        if self.gather_dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ZeroConfigError(f"gather_dtype {self.gather_dtype} unsupported; use "
                                  f"torch.float32 or torch.bfloat16")
        if self.grad_sync not in GRAD_SYNC_MODES:
            raise ZeroConfigError(f"grad_sync {self.grad_sync!r} unknown; use one of {GRAD_SYNC_MODES}")
        if self.hpz_partition_size < 1:
            raise ZeroConfigError(f"hpz_partition_size {self.hpz_partition_size} must be >= 1")
        if self.stage == 0 and self.zeropp_enabled:
            raise ZeroConfigError("ZeRO++ switches need --zero-stage 3 (they change how ZeRO-3 "
                                  "gathers weights and reduces gradients)")

    @property
    def zeropp_enabled(self) -> bool:
        return self.quantized_weights or self.hpz_partition_size > 1 or self.quantized_gradients

    @property
    def weights_need_zeropp(self) -> bool:
        return self.quantized_weights or self.hpz_partition_size > 1
