"""FLOPs and HBM bytes of one micro-batch through one model chunk, and their time.

The FLOP count is megaq.model.flops.num_flops (Megatron's formula: 2 FLOPs per
multiply-add, backward twice forward, causal attention counted as full s x s); it is
split here into the GEMMs of the blocks, the attention core and the logit layer, which
run at different efficiencies. Recomputation adds forward FLOPs that num_flops does not
count (it reports model FLOPs). Element-wise work (norms, RoPE, SwiGLU / GeLU, residual
adds, the loss, FP8 casts) is counted in bytes moved through HBM.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megaq.model.config import GPTConfig
from megaq.model.flops import num_flops

from .calibration import Calibration
from .hardware import GPU, gpu_preset
from .shapes import layer_params, norm_params


@dataclass(frozen=True)
class FlopSplit:
    """Model FLOPs (forward + backward) of `tokens` tokens through the whole model."""
    gemm: float        # the blocks' linear layers
    attention: float   # Q K^T and probs x V
    head: float        # the logit layer

    @property
    def total(self) -> float:
        return self.gemm + self.attention + self.head


def flop_split(cfg: GPTConfig, tokens: int, tp: int = 1) -> FlopSplit:
    """num_flops(cfg, tokens, tp), split by kind (the split's sum is num_flops)."""
    total = num_flops(cfg, tokens, tp)
    q = cfg.num_attention_heads * cfg.kv_channels
    attention = 3.0 * cfg.num_layers * 2 * (2 * cfg.seq_length * q) * tokens
    head = 3.0 * 2 * cfg.hidden_size * cfg.padded_vocab_size(tp) * tokens
    return FlopSplit(total - attention - head, attention, head)


def model_flops_per_token(cfg: GPTConfig) -> float:
    """6 N + 12 L h s, N the non-embedding parameters: the count bench_train.py (and the
    planner's TFLOP/s per GPU and MFU) use."""
    per_layer, _ = layer_params(cfg, 1)
    n = cfg.num_layers * per_layer + norm_params(cfg)
    return 6.0 * n + 12.0 * cfg.num_layers * cfg.hidden_size * cfg.seq_length


def recompute_fraction(cfg: GPTConfig, layers_in_chunk: int) -> tuple[float, float]:
    """(share of the chunk's layers whose whole forward is recomputed, share whose
    attention core is): full uniform recomputes every layer, full block the first
    --recompute-num-layers of each chunk, selective the attention core of every layer."""
    g = cfg.recompute_granularity
    if g == "full":
        if cfg.recompute_method == "block":
            return min(cfg.recompute_num_layers, layers_in_chunk) / layers_in_chunk, 0.0
        return 1.0, 0.0
    if g == "selective":
        return 0.0, 1.0
    return 0.0, 0.0


def elementwise_bytes_per_token_layer(cfg: GPTConfig, tp: int, sp: bool, fp8: bool,
                                      fused_swiglu_fp8: bool = False,
                                      fused_rope_fp8: bool = False) -> float:
    """HBM bytes of the non-GEMM kernels of one layer, forward + backward, per token on one
    TP rank (16-bit activations). Backward reads what forward wrote and writes gradients:
    about twice forward. `fused_swiglu_fp8`: SwiGLU's backward writes fc1's FP8 dY and its
    transpose in one kernel, which saves 5 bytes per dY element (2f per token): dY's 16-bit
    write and read-back (2 + 2) and the transpose's read of the FP8 copy (1).
    `fused_rope_fp8`: RoPE's backward writes the QKV layer's FP8 dY and its transpose in
    one kernel, which saves the transpose's read of the FP8 copy (1 byte per dY element:
    inductor already fused the rest into the cast)."""
    h, f = cfg.hidden_size, cfg.ffn_hidden_size
    q = cfg.num_attention_heads * cfg.kv_channels // tp
    kv = cfg.num_query_groups * cfg.kv_channels // tp
    hs = h / tp if sp and tp > 1 else h  # the residual stream's share
    fwd = (2 * 2 * hs                 # two norms: read x, write y
           + 2 * 3 * hs               # two residual adds: read 2, write 1
           + (2 * (q + kv) if cfg.position_embedding_type == "rope" else 0)  # RoPE on q, k
           + (3 * f / tp if cfg.swiglu else 2 * f / tp))  # SwiGLU reads 2f writes f; GeLU
    if cfg.hidden_dropout:
        fwd += 2 * 2 * hs
    if fp8:  # casts of the four GEMMs' inputs (read 16-bit, write 8-bit): x, attn, x, act
        fwd += 1.5 * (h + q + h + f / tp)
    total = 2.0 * 3 * fwd  # bytes (16-bit), forward + backward (2x)
    if fp8 and fused_swiglu_fp8 and cfg.swiglu:
        total -= 5 * 2 * f / tp
    if fp8 and fused_rope_fp8 and cfg.position_embedding_type == "rope":
        total -= 1 * (q + 2 * kv)
    return total


def head_bytes_per_token(cfg: GPTConfig, tp: int) -> float:
    """The loss over this rank's logits: forward reads them, backward reads and writes."""
    return 2.0 * 3 * cfg.padded_vocab_size(tp) / tp


def gemm_efficiency(cal: Calibration, dtype: str, dims: tuple[int, ...]) -> float:
    return cal.gemm(dtype, min(dims))


@dataclass(frozen=True)
class ChunkCompute:
    """Seconds of one micro-batch through one model chunk on one GPU."""
    fwd_s: float
    bwd_s: float          # backward, including recomputed forwards
    recompute_s: float    # of which recomputation
    flops_fwd: float      # model FLOPs, forward, this GPU
    flops_bwd: float

    def scaled(self, k: float) -> "ChunkCompute":
        return dataclasses.replace(self, fwd_s=self.fwd_s * k, bwd_s=self.bwd_s * k,
                                   recompute_s=self.recompute_s * k)


def elementwise_rate(gpu: GPU, cal: Calibration, mode: str) -> float:
    """Bytes per second of the fused element-wise kernels of forward and backward.

    On the reference GPU they run at its HBM rate over the fitted byte scale (2.8 TB/s
    compiled on the H200, where 4.1 would be HBM-bound). The shortfall is not bytes: an
    H100 (3.35 TB/s HBM against 4.8, the same SMs, clocks and L2) runs the same forward
    and backward in the same time (docs/PLANNING.md, "Another GPU"). So the reference's
    rate is a ceiling carried unchanged, and a GPU whose HBM is slower than it is
    HBM-bound."""
    hbm_bound = gpu.hbm_gb_per_s * 1e9 * cal.hbm_efficiency
    scale = cal.elementwise_bytes_scale[mode]
    if scale <= 1.0:  # no shortfall on the reference (the calibration's search starts at 0)
        return hbm_bound
    reference = gpu_preset(cal.reference_gpu)
    return min(hbm_bound, reference.hbm_gb_per_s * 1e9 * cal.hbm_efficiency / scale)


def chunk_compute(cfg: GPTConfig, gpu: GPU, cal: Calibration, *, layers: int, tp: int,
                  sp: bool, micro_batch: int, has_head: bool, fp8: bool,
                  compiled: bool, fused_swiglu_fp8: bool = False,
                  fused_rope_fp8: bool = False) -> ChunkCompute:
    """One micro-batch of `micro_batch` sequences through `layers` blocks (+ the head);
    `fused_swiglu_fp8`, `fused_rope_fp8`: see elementwise_bytes_per_token_layer."""
    tokens = micro_batch * cfg.seq_length
    whole = flop_split(cfg, tokens, tp)
    per_layer_gemm = whole.gemm / cfg.num_layers / tp
    per_layer_attn = whole.attention / cfg.num_layers / tp
    h, f = cfg.hidden_size, cfg.ffn_hidden_size
    q = cfg.num_attention_heads * cfg.kv_channels
    block_dtype = "fp8" if fp8 else "bf16"
    block_peak = (gpu.peak_fp8_tflops if fp8 else gpu.peak_bf16_tflops) * 1e12
    eff = gemm_efficiency(cal, block_dtype, (tokens, h, q // tp, f // tp))
    t_gemm = per_layer_gemm / (block_peak * eff)
    t_attn = per_layer_attn / (gpu.peak_bf16_tflops * 1e12 * cal.attention_efficiency)
    mode = "compiled" if compiled else "eager"
    hbm = gpu.hbm_gb_per_s * 1e9 * cal.hbm_efficiency
    t_elem = (elementwise_bytes_per_token_layer(cfg, tp, sp, fp8, fused_swiglu_fp8, fused_rope_fp8) * tokens
              / elementwise_rate(gpu, cal, mode))
    t_layer = t_gemm + t_attn + t_elem + cal.layer_overhead_s[mode]
    full, core = recompute_fraction(cfg, layers)
    recompute = layers * (full * (t_gemm + t_attn + t_elem) / 3 + core * t_attn / 3)
    fwd = layers * t_layer / 3
    bwd = layers * t_layer * 2 / 3 + recompute
    flops_fwd = layers * (per_layer_gemm + per_layer_attn) / 3
    if has_head:
        head_flops = whole.head / tp
        t_head = (head_flops / (gpu.peak_bf16_tflops * 1e12
                                * gemm_efficiency(cal, "bf16", (tokens, h, cfg.padded_vocab_size(tp) // tp)))
                  + head_bytes_per_token(cfg, tp) * tokens / hbm)
        fwd += t_head / 3
        bwd += t_head * 2 / 3
        flops_fwd += head_flops / 3
    return ChunkCompute(fwd, bwd, recompute, flops_fwd, 2 * flops_fwd)
