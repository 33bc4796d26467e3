"""One-GPU training-step benchmark: megaq against a plain PyTorch loop, same run.

In one process on one GPU, on identical random token batches (seq 2048, vocab 32000),
for Llama-style models of about 125M, 350M and 1.3B parameters, it times:

  megaq-s0        GPTModel (bf16 weights and activations, fused Triton kernels) +
                  megaq.zero.build_engine(stage 0) at DP=1: fp32 master weights and
                  grads, megaq's one-pass AdamW (kernels/fused_adamw: the update and the
                  bf16 weight write in one kernel)
  megaq-s0-comp   the same with megaq.parallelize.compile_blocks (torch.compile per block)
  megaq-s3-comp   the compiled model under the ZeRO-3 engine (stage 3) at DP=1
  ref-eager       a nanoGPT-style Llama written here: fp32 weights, bf16 autocast,
                  SDPA, torch fused AdamW
  ref-comp        the same under torch.compile
  megaq-fp8tw-comp  megaq-s0-comp with FP8 GEMMs in the blocks (--fp8-format hybrid
                  --fp8-recipe tensorwise: E4M3 forward, E5M2 grads, per-tensor scales)
  megaq-fp8rw-comp  the same with --fp8-format e4m3 --fp8-recipe rowwise
  megaq-fp8dl-comp  the same with --fp8-format hybrid --fp8-recipe delayed (x and dY
                  scaled from a 16-step amax history, amax taken in the casting pass)
  megaq-s3-fp8tw-comp       megaq-s3-comp with the tensorwise FP8 GEMMs (bf16 weight gathers)
  megaq-s3-fp8tw-fp8g-comp  the same with FP8 weight gathers (--zero-quantized-weights fp8:
                  the engine casts each weight to E4M3 once per step, the GEMMs read the
                  gathered E4M3 weights; no bf16 copy of the block weights)
  megaq-s3-fp8dl-fp8g-comp  the same with the delayed recipe
  megaq-s0-f32g-comp, megaq-fp8dl-f32g-comp  megaq-s0-comp / megaq-fp8dl-comp with the
                  step's gradients upcast into fp32 accumulators, as before the engine kept
                  them bf16 at DP=1 (megaq.zero.grads, keep_16bit): that change's A/B
  megaq-s0-isw-comp, megaq-fp8dl-isw-comp  the same with inductor's SwiGLU backward (the
                  reference traced and fused), as before compiled blocks launched the
                  hand kernel (kernels/fused_swiglu.py): that change's A/B
  megaq-fp8dl-nse-comp  megaq-fp8dl-comp with SwiGLU after fc1's FP8 GEMM rather than in
                  it (no fused backward writing fc1's FP8 dY): that change's A/B
  megaq-s0-cdt-comp, megaq-fp8dl-cdt-comp  megaq-s0-comp / megaq-fp8dl-comp with inductor's
                  coordinate-descent tuning of its own Triton kernels (block sizes tried per
                  kernel at compile time): an A/B of that setting
  megaq-s0-cg-comp, megaq-s3-cg-comp, megaq-fp8dl-cg-comp  megaq-s0-comp / megaq-s3-comp /
                  megaq-fp8dl-comp with each compiled block replayed as CUDA graphs
                  (inductor's triton.cudagraphs): an A/B of that setting
  megaq-fp8dl-otr-comp  megaq-fp8dl-comp with backward casting the weight and the
                  row-parallel inputs and then copying their transposes (megaq's transpose
                  op), as before it cast them straight into the GEMM's layout
                  (megaq.parallel.fp8.recast_col_major): that change's A/B
  megaq-fp8dl-nre-comp  megaq-fp8dl-comp with RoPE and the q, k, v split after the QKV
                  layer's FP8 GEMM rather than in it (no one-pass backward writing its
                  FP8 dY from dq, dk, dv): that change's A/B
  megaq-fp8dl-rma-comp  megaq-fp8dl-comp with the E4M3 weights' refresh reading the
                  masters for their amaxes, as before the one-pass AdamW step took them in
                  its own pass (megaq.zero.fp8_resident): that change's A/B
  ao-tw-comp      ref-comp with its block linears converted by torchao's
  ao-rw-comp      convert_to_float8_training (recipe "tensorwise" / "rowwise"; the
                  output head stays bf16 as in megaq), needs torchao (setup.py extra fp8)

Every step clips the global grad norm to 1.0 and has no host synchronisation.
Reports tokens/s, model TFLOP/s with 6 x non-embedding params + 12 x layers x hidden
x seq FLOPs per token (recompute not counted), MFU against 989 TFLOP/s, peak memory.
A second table times the ZeRO++ kernels (megaq.kernels.ops) on the 1.3B model's real
parameter sizes as a fraction of the measured megaq step. Optional extras: CUDA
checks of the fused kernels (--check), kernel and GQA micro-benchmarks (--micro),
profiler tables (--profile SIZE:VARIANT).

    python tools/bench/bench_train.py --out docs/results/bench_train_h200.json --check --micro
    python tools/bench/bench_train.py --sizes 125M --variants megaq-s0 ref-eager --steps 3   # quick
    python tools/bench/bench_train.py --sizes 1.3B 3B --variants megaq-s0-comp megaq-fp8tw-comp \
        megaq-fp8rw-comp ao-tw-comp ao-rw-comp --fp8-check --out docs/results/bench_fp8_h200.json
    python tools/bench/bench_train.py --sizes 1.3B --variants megaq-s3-comp megaq-s3-fp8tw-comp \
        megaq-s3-fp8tw-fp8g-comp megaq-s0-comp megaq-fp8tw-comp --no-zeropp --out fp8_gather.json
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import sys
import time
from unittest import mock

import torch
import torch.utils.checkpoint
import torch.nn.functional as F
from torch import nn

import _checkout  # noqa: E402  (a link to tools/_checkout.py: the checkout's megaq first)

_checkout.use_checkout()

PEAK_TFLOPS = 989.0  # H100/H200 SXM dense bf16
SEQ, VOCAB = 2048, 32000
# name: (layers, hidden, heads, micro-batch)
SIZES = {"125M": (12, 768, 12, 16), "350M": (24, 1024, 16, 16), "1.3B": (24, 2048, 16, 8),
         "3B": (28, 3072, 24, 4)}
VARIANTS = ["megaq-s0", "megaq-s0-comp", "megaq-s3-comp", "ref-eager", "ref-comp",
            "megaq-fp8tw-comp", "megaq-fp8rw-comp", "ao-tw-comp", "ao-rw-comp",
            "megaq-s3-fp8tw-comp", "megaq-s3-fp8tw-fp8g-comp", "megaq-fp8dl-comp",
            "megaq-s3-fp8dl-fp8g-comp", "megaq-s0-f32g-comp", "megaq-fp8dl-f32g-comp",
            "megaq-s0-isw-comp", "megaq-fp8dl-isw-comp", "megaq-fp8dl-nse-comp",
            "megaq-s0-cdt-comp", "megaq-fp8dl-cdt-comp", "megaq-s0-cg-comp", "megaq-fp8dl-cg-comp",
            "megaq-s3-cg-comp", "megaq-fp8dl-otr-comp", "megaq-fp8dl-rma-comp",
            "megaq-fp8dl-nre-comp"]
DEFAULT_VARIANTS = VARIANTS[:5]
# variant tag -> (--fp8-format, --fp8-recipe) for megaq, torchao recipe name for the reference;
# megaq's pair mirrors torchao's recipe of the same name (tensorwise: E5M2 grads, rowwise: E4M3)
FP8_VARIANTS = {"fp8tw": ("hybrid", "tensorwise"), "fp8rw": ("e4m3", "rowwise"),
                "fp8dl": ("hybrid", "delayed")}
AO_VARIANTS = {"ao-tw": "tensorwise", "ao-rw": "rowwise"}


def ffn_size(h: int) -> int:
    return (int(4 * h * 2 / 3) // 64) * 64  # Megatron's SwiGLU default, used by both models


# ----------------------------------------------------------------- reference model
class RefRMSNorm(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(h))

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, 1e-5)


def ref_rope(x, cos, sin):  # x [B, T, nh, d]; cos/sin [T, 1, d]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class RefBlock(nn.Module):
    def __init__(self, h, nh):
        super().__init__()
        self.nh, self.d = nh, h // nh
        self.norm1, self.norm2 = RefRMSNorm(h), RefRMSNorm(h)
        self.qkv = nn.Linear(h, 3 * h, bias=False)
        self.proj = nn.Linear(h, h, bias=False)
        self.fc1 = nn.Linear(h, 2 * ffn_size(h), bias=False)
        self.fc2 = nn.Linear(ffn_size(h), h, bias=False)

    def forward(self, x, cos, sin):
        B, T, C = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, T, 3, self.nh, self.d).unbind(2)
        q, k = ref_rope(q, cos, sin), ref_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        gate, up = self.fc1(self.norm2(x)).chunk(2, dim=-1)
        return x + self.fc2(F.silu(gate) * up)


class RefLlama(nn.Module):
    """nanoGPT-style Llama: batch-first, untied head, RoPE, RMSNorm, SwiGLU."""

    def __init__(self, layers, h, nh):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, h)
        self.blocks = nn.ModuleList(RefBlock(h, nh) for _ in range(layers))
        self.norm = RefRMSNorm(h)
        self.head = nn.Linear(h, VOCAB, bias=False)
        d = h // nh
        inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
        freqs = torch.arange(SEQ).float()[:, None] * inv
        emb = torch.cat([freqs, freqs], -1)[:, None, :]
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)
        # nanoGPT's init, which megaq's (Megatron's) matches: std 0.02, and 0.02 / sqrt(2L)
        # for the projections into the residual stream. With plain 0.02 there the
        # reference's loss fell much faster over the bench's few steps (lr 3e-4, no
        # warm-up), which read like a megaq bug: copying the reference's weights into
        # megaq gives identical losses (CPU fp32 check), so it was the init.
        for name, p in self.named_parameters():
            if p.dim() == 2:
                scaled = name.endswith(("proj.weight", "fc2.weight"))
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * layers) if scaled else 0.02)

    def forward(self, idx, targets):
        x = self.wte(idx)
        for blk in self.blocks:
            if getattr(self, "recompute", False):  # full recompute: keep each block's input
                x = torch.utils.checkpoint.checkpoint(blk, x, self.cos, self.sin,
                                                      use_reentrant=False)
            else:
                x = blk(x, self.cos, self.sin)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


# ----------------------------------------------------------------- builders
def megaq_config(size, **kw):
    from megaq.model import GPTConfig

    L, h, nh, _ = SIZES[size]
    return GPTConfig.llama(num_layers=L, hidden_size=h, num_attention_heads=nh, vocab_size=VOCAB,
                           seq_length=SEQ, params_dtype=torch.bfloat16, **kw)


def nonembedding_params(size) -> int:
    cfg = megaq_config(size)
    h, q = cfg.hidden_size, cfg.num_attention_heads * cfg.kv_channels
    kv = cfg.num_query_groups * cfg.kv_channels
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * cfg.ffn_hidden_size + 2 * h
    return cfg.num_layers * per_layer + h


def flops_per_token(size, with_head: bool = False) -> float:
    """6 N + 12 L h s; with_head also counts the untied output layer's matmul (6 h V),
    which the non-embedding count leaves out."""
    L, h, _, _ = SIZES[size]
    head = 6.0 * h * VOCAB if with_head else 0.0
    return 6.0 * nonembedding_params(size) + 12.0 * L * h * SEQ + head


_CPU_MODELS: dict = {}
_PARAM_SIZES: dict = {}  # size -> (per-parameter numels, per-site numels) for the ZeRO++ table


def cpu_megaq_model(size):
    """Built once per size on the CPU (the deterministic init draws on the full shapes)."""
    from megaq.model import GPTModel

    if size not in _CPU_MODELS:
        _CPU_MODELS.clear()
        model = _CPU_MODELS[size] = GPTModel(megaq_config(size))
        per_site = [sum(p.numel() for p in blk.parameters()) for blk in model.layers]
        per_site += [model.embedding.word_embeddings.weight.numel(),
                     model.output_layer.weight.numel() + model.final_norm.weight.numel()]
        _PARAM_SIZES[size] = ([p.numel() for p in model.parameters()], per_site)
    return _CPU_MODELS[size]


RECOMPUTE_FULL = dict(recompute_granularity="full", recompute_method="uniform",
                      recompute_num_layers=1)


def device_megaq_model(config, dev):
    """A model of `config` initialised on `dev` (std 0.02; norms 1), for sizes whose CPU
    init would take minutes: built on the meta device, its buffers (RoPE's inverse
    frequencies) taken from a one-layer CPU build. Speed and memory as the CPU-initialised
    model's; not its exact weights."""
    import dataclasses

    from megaq.model import GPTModel

    with torch.device("meta"):
        model = GPTModel(config)
    model = model.to_empty(device=dev)
    small = dict(GPTModel(dataclasses.replace(config, num_layers=1, vocab_size=128)).named_buffers())
    with torch.no_grad():
        for name, buf in model.named_buffers():  # layer i's buffer is layer 0's
            parts = name.split(".")
            if parts[0] == "layers":
                parts[1] = "0"
            src = small.get(".".join(parts))
            if src is not None:
                buf.copy_(src)
        for p in model.parameters():
            p.normal_(0.0, 0.02) if p.dim() >= 2 else p.fill_(1.0)
    return model


def build_megaq(size, stage, compiled, dev, fp8=None, fp8_gathers=False, recompute=False,
                init_on_device=False, fp32_grads=False, swiglu_epilogue=True):
    """The megaq variants: a copy of the size's CPU model on `dev` (or one initialised there:
    init_on_device), with parallelism applied as pretrain_gpt.py applies it
    (megaq.parallelize: FP8 GEMMs, compiled blocks, engine); recompute: full, per layer;
    fp32_grads: fp32 gradient accumulators where the engine would keep bf16 gradients;
    swiglu_epilogue False: FP8's fc1 without SwiGLU in its GEMM (the MLP applies it)."""
    import copy

    from megaq.parallel.topology import Layout, build_topology
    from megaq.parallelize import parallelize
    from megaq.zero import OptimizerSettings, ZeroConfig

    fp8_kw = dict(fp8_format=fp8[0], fp8_recipe=fp8[1]) if fp8 else {}
    config = megaq_config(size, compile_blocks=compiled, **fp8_kw,
                          **(RECOMPUTE_FULL if recompute else {}))
    model = (device_megaq_model(megaq_config(size), dev) if init_on_device
             else copy.deepcopy(cpu_megaq_model(size)).to(dev))
    topo = build_topology(Layout(world_size=1), 0)
    (model,), engine = parallelize(
        config, topo, ZeroConfig(stage=stage, gather_dtype=torch.bfloat16, fp8_weights=fp8_gathers),
        optimizer=OptimizerSettings(lr=3e-4, adam_beta2=0.95, weight_decay=0.1), chunks=[model])
    if fp32_grads:
        engine.grads.keep_16bit = False
    if not swiglu_epilogue:  # before the blocks' first (tracing) call
        from megaq.kernels.fused_swiglu import swiglu
        for block in model.layers:
            block.mlp.linear_fc1.gemm.swiglu, block.mlp.activation = False, swiglu

    def fwd_bwd(ids, labels):
        engine.zero_grad()
        loss = model(ids, labels=labels).mean()
        loss.backward()
        return loss

    def opt_step():
        engine.finish_grad_sync()
        engine.clip_grad_norm(1.0)
        engine.step(3e-4)  # its post-step hook rolls delayed FP8 scaling's histories

    return (model, engine), fwd_bwd, opt_step, getattr(engine.optimizer, "kind", "?")


def free_gpu() -> None:
    gc.collect()
    torch._dynamo.reset()
    gc.collect()
    torch.cuda.empty_cache()


def build_ref(size, compiled, dev, ao_recipe=None, recompute=False, init_on_device=False):
    L, h, nh, _ = SIZES[size]
    if init_on_device:
        with torch.device(dev):
            model = RefLlama(L, h, nh)
    else:
        model = RefLlama(L, h, nh).to(dev)
    model.recompute = recompute
    if ao_recipe:  # torchao's own FP8 training, on the blocks' linears (the head stays bf16)
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(ao_recipe),
                                   module_filter_fn=lambda mod, fqn: fqn.startswith("blocks."))
    if compiled and recompute:  # each block compiled (one graph for all), as megaq's
        for blk in model.blocks:  # compile_blocks: compiling 40 checkpointed blocks as one
            blk.compile()         # graph takes minutes
        run = model
    else:
        run = torch.compile(model) if compiled else model
    params = list(model.parameters())
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=3e-4, betas=(0.9, 0.95), fused=True)

    def fwd_bwd(ids, labels):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = run(ids, labels)
        loss.backward()
        return loss

    def opt_step():
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return (model, opt), fwd_bwd, opt_step, "torch fused AdamW"


def build(size, variant, dev, **kw):
    """kw: recompute, init_on_device (see build_megaq)."""
    if variant.startswith("megaq"):
        fp8 = next((v for k, v in FP8_VARIANTS.items() if f"-{k}" in variant), None)
        return build_megaq(size, 3 if "-s3" in variant else 0, variant.endswith("comp"), dev, fp8,
                           fp8_gathers="-fp8g" in variant, fp32_grads="-f32g" in variant,
                           swiglu_epilogue="-nse" not in variant, **kw)
    ao = next((v for k, v in AO_VARIANTS.items() if variant.startswith(k)), None)
    return build_ref(size, variant.endswith("comp"), dev, ao, **kw)


# ----------------------------------------------------------------- timing
def make_batches(size, dev, n=4):
    mb = SIZES[size][3]
    g = torch.Generator().manual_seed(1234)
    data = torch.randint(0, VOCAB, (n, mb, SEQ + 1), generator=g)
    return [(d[:, :-1].contiguous().to(dev), d[:, 1:].contiguous().to(dev)) for d in data]


def variant_switches(variant: str) -> contextlib.ExitStack:
    """What the bench-only A/B variants switch, in place while the variant is built, traced
    and timed. megaq's code paths turned back: -isw, swiglu records its reference, forward
    and backward, for inductor to fuse; -otr, backward casts the weight and row-parallel
    inputs, then copies their transposes with megaq's op; -rma, stage 0's E4M3 weights
    take their amaxes from a pass over the masters, not from the AdamW step's; -nre,
    attention applies RoPE after the QKV GEMM, not the GEMM in its FP8 epilogue. Inductor's
    settings (used while
    the blocks compile, the first steps): -cdt, coordinate-descent tuning of its Triton
    kernels' block sizes; -cg, each compiled block's forward and backward replayed as CUDA
    graphs (inductor's cudagraph trees, as torch.compile's mode="reduce-overhead"; the
    steps are marked by graph_steps)."""
    import torch._inductor.config as inductor_config

    from megaq.kernels import fused_swiglu
    from megaq.parallel import fp8

    stack = contextlib.ExitStack()
    if "-isw" in variant:
        stack.enter_context(mock.patch.object(fused_swiglu, "use_triton", lambda t, under_compile: False))
    if "-otr" in variant:
        stack.enter_context(mock.patch.object(fp8, "cast_transposed_in_backward", lambda device: False))
    if "-nre" in variant:
        from megaq.model.attention import SelfAttention
        stack.enter_context(mock.patch.object(SelfAttention, "rope_in_gemm", False))
    if "-rma" in variant:
        from megaq.zero.optimizer import ShardedAdamW
        stack.enter_context(mock.patch.object(ShardedAdamW, "_update_amax", False))
    inductor = {"coordinate_descent_tuning": True} if "-cdt" in variant else {}
    if "-cg" in variant:
        inductor["triton.cudagraphs"] = True
    if inductor:
        stack.enter_context(inductor_config.patch(inductor))
    return stack


def graph_steps(fwd_bwd):
    """-cg variants: each step starts a new generation of inductor's CUDA graph trees
    (torch.compiler.cudagraph_mark_step_begin), so a block's forward may replay while
    the last step's graphs' outputs are dead but not yet freed by Python: without it the
    trees leave their fast path ("pending, uninvoked backwards")."""
    def step(ids, labels):
        torch.compiler.cudagraph_mark_step_begin()
        return fwd_bwd(ids, labels)

    return step


def time_variant(size, variant, dev, steps, warmup, profile_dir=None, **build_kw):
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t0 = time.time()
    breaks0 = sum(torch._dynamo.utils.counters["graph_break"].values())
    keep, fwd_bwd, opt_step, opt_kind = build(size, variant, dev, **build_kw)
    if "-cg" in variant:
        fwd_bwd = graph_steps(fwd_bwd)
    batches = make_batches(size, dev)
    for i in range(warmup):
        fwd_bwd(*batches[i % len(batches)])
        opt_step()
    torch.cuda.synchronize()
    setup_s = time.time() - t0
    ev = [[torch.cuda.Event(enable_timing=True) for _ in range(3)] for _ in range(steps)]
    losses = []
    for i in range(steps):
        ev[i][0].record()
        losses.append(fwd_bwd(*batches[i % len(batches)]).detach())
        ev[i][1].record()
        opt_step()
        ev[i][2].record()
    torch.cuda.synchronize()
    # a graph break in a compiled block costs more than FP8 gains: say so in the results
    graph_breaks = sum(torch._dynamo.utils.counters["graph_break"].values()) - breaks0
    if graph_breaks:
        print(f"WARNING {size} {variant}: {graph_breaks} graph breaks "
              f"{dict(torch._dynamo.utils.counters['graph_break'])}", flush=True)
    profile = busy = None
    if profile_dir is not None:
        profile, busy = profile_steps(size, variant, fwd_bwd, opt_step, batches, profile_dir)
    step_ms = sorted(e[0].elapsed_time(e[2]) for e in ev)[steps // 2]
    fb_ms = sorted(e[0].elapsed_time(e[1]) for e in ev)[steps // 2]
    opt_ms = sorted(e[1].elapsed_time(e[2]) for e in ev)[steps // 2]
    tokens = SIZES[size][3] * SEQ
    tps = tokens / (step_ms / 1e3)
    tflops = tps * flops_per_token(size) / 1e12
    res = dict(size=size, variant=variant, micro_batch=SIZES[size][3], seq=SEQ,
               step_ms=step_ms, fwd_bwd_ms=fb_ms, optimizer_ms=opt_ms, tokens_per_s=tps,
               tflops=tflops, mfu=tflops / PEAK_TFLOPS,
               mfu_with_head=tps * flops_per_token(size, True) / 1e12 / PEAK_TFLOPS,
               peak_mem_gib=(torch.cuda.max_memory_allocated() - base) / 2**30,
               setup_s=setup_s, optimizer=opt_kind, base_mem_gib=base / 2**30,
               loss_first=float(losses[0]), loss_last=float(losses[-1]), graph_breaks=graph_breaks)
    if hasattr(keep[1], "grads"):  # megaq: bytes per gradient element held (megaq.zero.grads)
        res["grad_bytes"] = keep[1].grads.memory_bytes() // sum(
            p.shard_numel for p in keep[1].partitions)
        # fc1's FP8 backward took SwiGLU's gradient from the fused kernel (the planner's
        # replay of this row: megaq.planner.bench_rows)
        # (and the QKV layer's from RoPE's fused kernel: attention hands the GEMM its tables)
        from megaq.model.attention import SelfAttention
        from megaq.parallel.fp8 import fp8_gemm_layers
        delayed = [m.gemm for m in fp8_gemm_layers(keep[0]) if m.gemm.recipe.delayed]
        res["fused_swiglu_fp8"] = any(g.swiglu for g in delayed)
        res["fused_rope_fp8"] = any(a.rope_in_gemm and a.linear_qkv.gemm in delayed
                                    for a in keep[0].modules() if isinstance(a, SelfAttention))
        # stage 0's E4M3 weights took their amaxes from the AdamW step's own pass (the
        # planner's replay: megaq.planner.bench_rows)
        res["fp8_amax_from_step"] = keep[1].fp8_resident.amax_from_step
    if profile:
        res["profile_ms_per_step_by_kind"] = profile
    if busy:
        res["profile_device_per_step"] = busy
    del keep, fwd_bwd, opt_step, batches, losses
    free_gpu()
    return res


def profile_steps(size, variant, fwd_bwd, opt_step, batches, out_dir):
    """Profile two more steps of an already warmed-up variant; top kernels by GPU time
    (profile_SIZE_VARIANT.txt by total, profile_SIZE_VARIANT_self.txt by self time)."""
    from torch.profiler import ProfilerActivity, profile

    from megaq.runtime.profiling import (SMALL_GAP_US, device_time_by, gap_report, idle_gaps,
                                         trace_busy, trace_events)

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(2):
            fwd_bwd(*batches[i % len(batches)])
            opt_step()
        torch.cuda.synchronize()
    trace = os.path.join(out_dir, f"profile_{size}_{variant}.trace.json")
    prof.export_chrome_trace(trace)
    events = trace_events(trace)
    busy = trace_busy(events)
    # the results file keeps the busy summary (the printed lines may be lost): per step,
    # but the wait for the first kernel, once in the two steps' window
    device = None if busy is None else {
        "busy_ms": busy["busy_us"] / 2e3, "idle_ms": busy["idle_us"] / 2e3,
        "small_gaps_ms": busy["small_gaps_us"] / 2e3, "small_gaps": busy["small_gaps"] / 2,
        "before_first_kernel_ms": busy["before_first_kernel_us"] / 1e3,
        # JSON has no infinity: the last bucket's open end is null
        "gaps_by_size": [{"from_us": b["from_us"],
                          "to_us": None if b["to_us"] == float("inf") else b["to_us"],
                          "gaps": b["gaps"] / 2, "idle_ms": b["idle_us"] / 2e3}
                         for b in busy["gaps_by_size"]]}
    if device:
        print(f"profile {size} {variant}: device busy {device['busy_ms']:.1f} ms per step "
              f"({100 * busy['busy_fraction']:.1f}%), idle {device['idle_ms']:.1f} ms "
              f"({device['before_first_kernel_ms']:.1f} ms of the two steps before the "
              f"first kernel; {device['small_gaps_ms']:.1f} ms per step in "
              f"{device['small_gaps']:.0f} gaps under {SMALL_GAP_US:g} us)")
        print("  gaps between kernels by size, per step: " + ", ".join(
            f"[{b['from_us']:g}, {b['to_us'] or float('inf'):g}) us: {b['gaps']:.0f} gaps, "
            f"{b['idle_ms']:.2f} ms" for b in device["gaps_by_size"]))
        print("\n".join(gap_report(idle_gaps(events), top=8)), flush=True)
    # two tables: by total GPU time (an op with its kernels), and by self GPU time (each
    # kernel, and each op with the kernels it launched itself: rows overlap, so the kinds
    # below are summed from the trace instead)
    paths = []
    for suffix, sort_by, rows, width in (("", "cuda_time_total", 40, 90),
                                         ("_self", "self_cuda_time_total", 60, 110)):
        table = prof.key_averages().table(sort_by=sort_by, row_limit=rows, max_name_column_width=width)
        paths.append(os.path.join(out_dir, f"profile_{size}_{variant}{suffix}.txt"))
        with open(paths[-1] + ".tmp", "w") as f:
            f.write(table)
        os.replace(paths[-1] + ".tmp", paths[-1])
    cats = {k: us / 2e3 for k, us in device_time_by(events, kernel_category).items()}  # ms/step
    summary = ", ".join(f"{k} {v:.1f}" for k, v in sorted(cats.items(), key=lambda kv: -kv[1]))
    print(f"profile {size} {variant} -> {', '.join(paths)}\n  GPU ms per step by kind: {summary}")
    return cats, device


def kernel_category(name: str) -> str:
    n = name.lower()
    if any(t in n for t in ("flash", "fmha", "cudnn", "attention", "sdpa")):
        return "attention"
    if any(t in n for t in ("gemm", "nvjet", "cutlass", "xmma", "sm90_")):
        return "matmul"
    if any(t in n for t in ("adam", "multi_tensor", "foreach")):
        return "optimizer"
    if n.startswith("triton_") or "_kernel" in n and "triton" in n:
        return "inductor triton"
    if n.startswith("_"):
        return "megaq triton"
    if any(t in n for t in ("elementwise", "vectorized", "reduce", "copy", "fill", "cat")):
        return "torch elementwise/copy/reduce"
    return "other"


# ----------------------------------------------------------------- extras
def bench_ms(fn, reps=20):
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=reps * 10, return_mode="median")


def check_fused_kernels(dev):
    """Triton vs reference on CUDA at the 1.3B model's shapes (fp32 reference math)."""
    from megaq.kernels import fused_cross_entropy as fce
    from megaq.kernels import fused_rmsnorm as frn
    from megaq.kernels import fused_rope as frp
    from megaq.kernels import fused_swiglu as fsw

    def rel(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm()).item()

    s, b, h, nh, d, f = SEQ, 8, 2048, 16, 128, ffn_size(2048)
    out = {}
    x = torch.randn(s, b, h, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w = (1 + 0.1 * torch.randn(h, device=dev)).bfloat16().requires_grad_()
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device=dev).float() / d))
    emb = torch.cat([torch.arange(s, device=dev).float()[:, None] * inv] * 2, -1)[:, None, None, :]
    cos, sin = emb.cos(), emb.sin()
    qk = torch.randn(s, b, nh, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    y = torch.randn(s, b, 2 * f, device=dev, dtype=torch.bfloat16, requires_grad=True)
    logits = (2 * torch.randn(s * b // 4, VOCAB, device=dev)).bfloat16().requires_grad_()
    labels = torch.randint(0, VOCAB, (s * b // 4,), device=dev)
    cases = {
        "rmsnorm": (lambda: frn.rms_norm(x, w, 1e-5),
                    lambda: frn.rms_norm_reference(x.float(), w.float(), 1e-5), [x, w]),
        "rope": (lambda: frp.apply_rotary(qk, cos, sin),
                 lambda: frp.apply_rotary_reference(qk.float(), cos, sin), [qk]),
        "swiglu": (lambda: fsw.swiglu(y), lambda: fsw.swiglu_reference(y.float()), [y]),
        "cross_entropy": (lambda: fce.cross_entropy(logits, labels),
                          lambda: fce.cross_entropy_reference(logits.float(), labels), [logits]),
    }
    for name, (fused, ref, leaves) in cases.items():
        o_f = fused()
        g = torch.randn_like(o_f)
        gf = torch.autograd.grad(o_f, leaves, g)
        o_r = ref()
        gr = torch.autograd.grad(o_r, leaves, g.to(o_r.dtype))
        errs = [rel(o_f, o_r)] + [rel(a, c) for a, c in zip(gf, gr)]
        ok = all(math.isfinite(e) and e < 1e-2 for e in errs)  # bf16 output vs fp32 reference
        out[name] = {"rel_err_out_and_grads": errs, "ok": ok}
        print(f"check {name:14s} {'ok ' if ok else 'BAD'} rel errors {['%.2e' % e for e in errs]}")
    out.update(check_byte_kernels(dev))
    return out


def check_byte_kernels(dev):
    """The one-pass AdamW step and the FP8 operand transpose: Triton equals the torch
    reference bit for bit on CUDA (both are exact by construction), and what each moves
    per second (the 1.3B model's parameter count; the fc1 dY of a 1.3B step)."""
    from megaq.kernels import fused_adamw
    from megaq.kernels import fused_adamw_triton as fat
    from megaq.kernels import transpose as ktr

    out = {}
    g = torch.Generator(device=dev).manual_seed(3)
    n = 1_340_000_000 // 4  # a quarter of the 1.3B model: room for both copies
    bufs = [torch.randn(n, device=dev, generator=g), 1e-2 * torch.randn(n, device=dev, generator=g),
            1e-3 * torch.randn(n, device=dev, generator=g), 1e-5 * torch.rand(n, device=dev, generator=g)]
    ref = [t.clone() for t in bufs]
    o_k, o_r = torch.empty(n, device=dev, dtype=torch.bfloat16), torch.empty(n, device=dev, dtype=torch.bfloat16)
    coef, sc = torch.tensor(0.5, device=dev), fused_adamw.step_scalars(3e-4, 0.1, (0.9, 0.95), 1e-8, 7)
    fat.adamw_step(*bufs, o_k, coef, sc)
    fused_adamw.adamw_step_reference(*ref, o_r, coef, sc)
    exact = all(torch.equal(a, b) for a, b in zip(bufs + [o_k], ref + [o_r]))
    ms = bench_ms(lambda: fat.adamw_step(*bufs, o_k, coef, sc), reps=10)
    out["adamw_onepass"] = {"bit_identical": exact, "elements": n, "ms": ms,
                            "GB_per_s": 30 * n / ms / 1e6}  # 7 fp32 reads+writes, 1 bf16 write
    del ref, o_r
    x = torch.randint(0, 256, (SEQ * 8, 2 * ffn_size(2048)), device=dev, dtype=torch.uint8,
                      generator=g).view(torch.float8_e5m2)
    y = ktr.transpose(x)
    exact_t = torch.equal(y.view(torch.uint8), ktr.transpose_reference(x).view(torch.uint8))
    ms_t = bench_ms(lambda: ktr.transpose(x), reps=10)
    out["fp8_transpose"] = {"bit_identical": exact_t, "shape": list(x.shape), "ms": ms_t,
                            "GB_per_s": 2 * x.numel() / ms_t / 1e6}
    for name in ("adamw_onepass", "fp8_transpose"):
        r = out[name]
        print(f"check {name:14s} {'ok ' if r['bit_identical'] else 'BAD'} bit-identical to the "
              f"reference; {r['ms']:.3f} ms, {r['GB_per_s']:.0f} GB/s")
    return out


def micro_benchmarks(dev):
    """Fused kernels vs their eager references (fwd+bwd), and GQA through SDPA."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from megaq.kernels import fused_cross_entropy as fce
    from megaq.kernels import fused_rmsnorm as frn
    from megaq.kernels import fused_rope as frp
    from megaq.kernels import fused_swiglu as fsw

    s, b, h, nh, d, f = SEQ, 8, 2048, 16, 128, ffn_size(2048)
    res = {}
    x = torch.randn(s, b, h, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(h, device=dev, dtype=torch.bfloat16, requires_grad=True)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device=dev).float() / d))
    emb = torch.cat([torch.arange(s, device=dev).float()[:, None] * inv] * 2, -1)[:, None, None, :]
    cos, sin = emb.cos(), emb.sin()
    qk = torch.randn(s, b, nh, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    y = torch.randn(s, b, 2 * f, device=dev, dtype=torch.bfloat16, requires_grad=True)
    logits = torch.randn(s * b, VOCAB, device=dev, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, VOCAB, (s * b,), device=dev)
    comp_ref = {}
    ops = {
        "rmsnorm [16384x2048]": (lambda: frn.rms_norm(x, w, 1e-5), frn.rms_norm_reference, (x, w, 1e-5)),
        "rope q [2048x8x16x128]": (lambda: frp.apply_rotary(qk, cos, sin), frp.apply_rotary_reference,
                                   (qk, cos, sin)),
        "swiglu [16384x10880]": (lambda: fsw.swiglu(y), fsw.swiglu_reference, (y,)),
        "cross_entropy [16384x32000]": (lambda: fce.cross_entropy(logits, labels),
                                        fce.cross_entropy_reference, (logits, labels)),
    }
    for name, (fused, ref, args) in ops.items():
        def fb(fn):
            out = fn()
            out.backward(torch.ones_like(out))
        comp_ref[name] = torch.compile(ref)
        row = {"triton_ms": bench_ms(lambda: fb(fused)),
               "eager_ref_ms": bench_ms(lambda: fb(lambda: ref(*args))),
               "compiled_ref_ms": bench_ms(lambda: fb(lambda: comp_ref[name](*args)))}
        res[name] = row
        print(f"micro {name:28s} fwd+bwd triton {row['triton_ms']:.3f} ms  eager ref "
              f"{row['eager_ref_ms']:.3f}  compiled ref {row['compiled_ref_ms']:.3f}")
    # GQA: 16 query heads, 4 kv groups, head dim 128 (a 1.3B-shaped layer), fwd+bwd
    q = torch.randn(b, nh, s, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    kv = [torch.randn(b, 4, s, d, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(2)]
    full = [torch.randn(b, nh, s, d, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(2)]

    def attn(kind):
        if kind == "enable_gqa":
            o = F.scaled_dot_product_attention(q, kv[0], kv[1], is_causal=True, enable_gqa=True)
        elif kind == "repeat_interleave":
            o = F.scaled_dot_product_attention(q, kv[0].repeat_interleave(4, 1),
                                               kv[1].repeat_interleave(4, 1), is_causal=True)
        else:
            o = F.scaled_dot_product_attention(q, full[0], full[1], is_causal=True)
        o.backward(torch.ones_like(o))

    gqa = {}
    for kind in ("enable_gqa", "repeat_interleave", "mha"):
        gqa[kind] = {"auto_ms": bench_ms(lambda: attn(kind))}
        for label, backend in (("flash", SDPBackend.FLASH_ATTENTION),
                               ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            try:
                with sdpa_kernel(backend):
                    gqa[kind][f"{label}_only_ms"] = bench_ms(lambda: attn(kind))
            except RuntimeError as e:
                gqa[kind][f"{label}_only_ms"] = None
                gqa[kind][f"{label}_error"] = str(e).splitlines()[0][:200]
        print(f"gqa {kind:18s} default {gqa[kind]['auto_ms']:.3f} ms  flash only "
              f"{gqa[kind]['flash_only_ms']}  cudnn only {gqa[kind]['cudnn_only_ms']}")
    res["gqa_sdpa_fwd_bwd"] = gqa
    return res


def zeropp_kernel_table(dev, step_ms):
    """ZeRO++ kernels on the 1.3B model's parameters, one rank's work per step."""
    try:
        from megaq.kernels import ops
        from megaq.zero import ZeroConfig
        for name in ("quantize", "dequantize", "reorder_quantize", "dequant_reduce_quantize",
                     "dequant_reduce"):
            getattr(ops, name)
    except (ImportError, AttributeError) as e:
        print(f"ZeRO++ kernel table skipped: the kernels are not there yet ({e})")
        return None
    block = ZeroConfig().block_size
    k_nodes, m_ranks = 2, 4  # qgZ over 2 nodes x 4 ranks
    n = k_nodes * m_ranks
    if "1.3B" not in _PARAM_SIZES:
        cpu_megaq_model("1.3B")
    sizes, layer_sizes = _PARAM_SIZES["1.3B"]
    g = torch.Generator(device=dev).manual_seed(0)
    weights = [torch.randn(-(-s // block) * block, device=dev, generator=g).bfloat16() for s in sizes]
    packed = [ops.quantize(wt, 8, block) for wt in weights]
    flats = [torch.randn(-(-s // block) * block, device=dev, generator=g).bfloat16() for s in layer_sizes]
    flat_packed = [ops.quantize(wt, 8, block) for wt in flats]
    grads = [torch.randn(-(-s // (n * block)) * n * block, device=dev, generator=g).bfloat16()
             for s in layer_sizes]

    def quant(tensors):  # int8 quantize of each tensor, one call each
        return lambda: [ops.quantize(wt, 8, block) for wt in tensors]

    def dequant(packs, tensors):
        return lambda: [ops.dequantize(p, wt.numel(), 8, block, torch.bfloat16)
                        for p, wt in zip(packs, tensors)]

    def grad_path():
        for gr in grads:
            S = gr.numel() // n
            rq = ops.reorder_quantize(gr, k_nodes, m_ranks, 4, block)   # [m, packed(k S)]
            drq = ops.dequant_reduce_quantize(rq, k_nodes, S, 4, 4, block)  # [k, packed(S)]
            ops.dequant_reduce(drq, S, 4, block, 1.0 / n)

    rows = {}
    named = (("quantize int8, all weights, one call per parameter", quant(weights)),
             ("dequantize int8, all weights, one call per parameter", dequant(packed, weights)),
             ("qgZ grad path (reorder_quantize -> dequant_reduce_quantize -> dequant_reduce), "
              "one call per site's flat grad", grad_path),
             ("quantize int8, all weights, one call per site's flat buffer", quant(flats)),
             ("dequantize int8, all weights, one call per site's flat buffer",
              dequant(flat_packed, flats)))
    for name, fn in named:
        ms = bench_ms(fn, reps=5)
        rows[name] = {"ms": ms, "fraction_of_step": ms / step_ms}
    for label, keys in (("total, per-parameter calls", [0, 1, 2]), ("total, per-site calls", [3, 4, 2])):
        total = sum(rows[named[i][0]]["ms"] for i in keys)
        rows[label] = {"ms": total, "fraction_of_step": total / step_ms}
    # bytes a perfect kernel must move (bf16 in, int8 + fp32 scales out): a floor to compare with
    n_el = sum(wt.numel() for wt in weights)
    rows_floor = {"quantize_min_bytes": n_el * 2 + n_el + 4 * n_el // block}
    return {"block": block, "params": sum(sizes), "k_nodes": k_nodes, "m_ranks": m_ranks,
            "step_ms": step_ms, "rows": rows, **rows_floor}


@contextlib.contextmanager
def fp8_emulated():
    """megaq's FP8 GEMMs through the fp32 emulation even where FP8 tensor cores exist
    (megaq.parallel.fp8.scaled_mm asks fp8_gemm_available at each call; eager only)."""
    from megaq.parallel import fp8

    saved = fp8.fp8_gemm_available
    fp8.fp8_gemm_available = lambda device: False
    try:
        yield
    finally:
        fp8.fp8_gemm_available = saved


def fp8_check(dev, tokens=2048):
    """FP8 GEMMs (torch._scaled_mm) against the fp32 emulation that the CPU tests use, on the
    1.3B model's linear shapes, forward and both backward GEMMs of megaq.parallel.fp8.linear:
    GPU FP8 vs the emulation on the GPU and on the CPU (same FP8 operands, so the gap is
    accumulation order, fast accumulation in forward and the bf16 output rounding), and
    FP8 vs bf16 for scale (the FP8 rounding itself)."""
    from megaq.parallel import fp8
    from megaq.parallel.tensor_parallel import single_rank_group

    def rel(a, b):
        return ((a.double().cpu() - b.double().cpu()).norm() / b.double().cpu().norm()).item()

    h, f = 2048, ffn_size(2048)
    shapes = {"qkv": (h, 3 * h), "proj": (h, h), "fc1": (h, 2 * f), "fc2": (f, h)}
    g = torch.Generator(device=dev).manual_seed(7)
    out = {"fp8_gemm_available": fp8.fp8_gemm_available(dev)}
    group = single_rank_group()
    for fmt, recipe in FP8_VARIANTS.values():
        if recipe == "delayed":  # the tensorwise cast and GEMMs with a history's scale
            continue
        rec = fp8.FP8Recipe(fmt, recipe)
        for name, (k, n) in shapes.items():
            x = torch.randn(tokens, k, device=dev, generator=g).bfloat16()
            x[::97, ::13] *= 8  # some outlier structure, as activations have
            w = (0.02 * torch.randn(n, k, device=dev, generator=g)).bfloat16()
            dy = (1e-3 * torch.randn(tokens, n, device=dev, generator=g)).bfloat16()

            def run(device, emulate, fp8_on=True):
                xx = x.detach().clone().to(device).requires_grad_()
                ww = w.detach().clone().to(device).requires_grad_()
                ctx = fp8_emulated() if emulate else contextlib.nullcontext()
                with ctx:
                    y = fp8.linear(xx, ww, None, rec if fp8_on else None, group, "column")
                    y.backward(dy.to(device))
                return y.detach(), xx.grad, ww.grad

            gpu, emu, cpu = run(dev, False), run(dev, True), run("cpu", True)
            bf16 = run(dev, False, fp8_on=False)
            row = {}
            for i, t in enumerate(("y", "dx", "dw")):
                row[t] = {"gpu_vs_gpu_emulation": rel(gpu[i], emu[i]),
                          "gpu_vs_cpu_emulation": rel(gpu[i], cpu[i]),
                          "fp8_vs_bf16": rel(gpu[i], bf16[i])}
            xq_gpu, _ = fp8.quantize(x, rec.forward_dtype, -1 if rec.rowwise else None, rec.rowwise)
            xq_cpu, _ = fp8.quantize(x.cpu(), rec.forward_dtype, -1 if rec.rowwise else None, rec.rowwise)
            row["input_cast_bit_identical_gpu_cpu"] = bool(torch.equal(xq_gpu.cpu().view(torch.uint8),
                                                                       xq_cpu.view(torch.uint8)))
            out[f"{fmt}-{recipe} {name} [{tokens}x{k}]x[{k}x{n}]"] = row
            print(f"fp8-check {fmt:6s} {recipe:10s} {name:4s} " + "  ".join(
                f"{t}: gpu~emu {row[t]['gpu_vs_gpu_emulation']:.1e} gpu~cpu {row[t]['gpu_vs_cpu_emulation']:.1e}"
                f" fp8~bf16 {row[t]['fp8_vs_bf16']:.1e}" for t in ("y", "dx", "dw"))
                + f"  cast bits equal: {row['input_cast_bit_identical_gpu_cpu']}", flush=True)
    return out


def train_check(dev, steps=30, shape=(4, 512, 8, 8), seq=512):
    """Does the megaq step learn on the GPU like the reference? A small Llama (4 x 512,
    seq 512) trains `steps` steps on two fixed batches with the Triton kernels, with
    the torch references (MEGAQ_KERNELS=torch), as the plain reference loop, and with
    FP8 GEMMs (megaq's and torchao's, each recipe, eager); plus
    SDPA on megaq's [s, b, heads, d]-strided layout against the math backend."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    global SEQ
    saved_seq, SEQ = SEQ, seq
    SIZES["check"] = shape
    out = {}
    try:
        batches = make_batches("check", dev, n=2)
        for label, variant, env in (("megaq triton", "megaq-s0", "auto"),
                                    ("megaq torch refs", "megaq-s0", "torch"),
                                    ("reference", "ref-eager", None),
                                    ("megaq fp8 tensorwise", "megaq-s0-fp8tw", "auto"),
                                    ("megaq fp8 rowwise", "megaq-s0-fp8rw", "auto"),
                                    ("megaq fp8 delayed", "megaq-s0-fp8dl", "auto"),
                                    ("torchao tensorwise", "ao-tw-eager", None),
                                    ("torchao rowwise", "ao-rw-eager", None)):
            os.environ["MEGAQ_KERNELS"] = env or "auto"
            _CPU_MODELS.clear()
            keep, fwd_bwd, opt_step, _ = build("check", variant, dev)
            losses = []
            for i in range(steps):
                losses.append(fwd_bwd(*batches[i % 2]).detach())
                opt_step()
            out[label] = [float(x) for x in losses]
            print(f"train-check {label:16s} " + " ".join(f"{x:.3f}" for x in out[label][::3]))
            del keep, fwd_bwd, opt_step
            free_gpu()
    finally:
        os.environ["MEGAQ_KERNELS"] = "auto"
        SEQ = saved_seq
        _CPU_MODELS.clear()
    s, b, nh, d = seq, shape[3], shape[2], shape[1] // shape[2]
    qkv = torch.randn(s, b, nh, 3, d, device=dev, dtype=torch.bfloat16)
    q, k, v = (qkv[:, :, :, i].permute(1, 2, 0, 3) for i in range(3))
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    with sdpa_kernel(SDPBackend.MATH):
        o_ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    out["sdpa_strided_rel_err"] = ((o.float() - o_ref).norm() / o_ref.norm()).item()
    print(f"train-check sdpa on megaq's strided layout: rel err {out['sdpa_strided_rel_err']:.2e}")
    return out


# ----------------------------------------------------------------- report
def print_tables(results, zpp):
    print("\n| size | variant | micro-batch | step ms (fwd+bwd / opt) | tokens/s | TFLOP/s | MFU | "
          "MFU incl. head | peak GiB | vs ref-comp | vs megaq-s0-comp | vs torchao same recipe |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")

    def ratio(r, variant):
        other = next((x for x in results if x["size"] == r["size"] and x["variant"] == variant), None)
        return f"{r['tokens_per_s'] / other['tokens_per_s']:.2f}x" if other else "-"

    for r in results:
        # delayed scaling is compared with torchao's per-tensor (current scaling) recipe
        ao = {"megaq-fp8tw-comp": "ao-tw-comp", "megaq-fp8rw-comp": "ao-rw-comp",
              "megaq-fp8dl-comp": "ao-tw-comp"}.get(r["variant"])
        print(f"| {r['size']} | {r['variant']} | {r['micro_batch']} | {r['step_ms']:.1f} "
              f"({r['fwd_bwd_ms']:.1f} / {r['optimizer_ms']:.1f}) | {r['tokens_per_s'] / 1e3:.1f}K | "
              f"{r['tflops']:.0f} | {100 * r['mfu']:.1f}% | {100 * r['mfu_with_head']:.1f}% | "
              f"{r['peak_mem_gib']:.1f} | {ratio(r, 'ref-comp')} | {ratio(r, 'megaq-s0-comp')} | "
              f"{ratio(r, ao) if ao else '-'} |")
    for size in dict.fromkeys(r["size"] for r in results):
        tps = {r["variant"]: r for r in results if r["size"] == size}
        rows = [v for v in ("megaq-s3-comp", "megaq-s3-fp8tw-comp", "megaq-s3-fp8tw-fp8g-comp",
                            "megaq-s3-fp8dl-fp8g-comp") if v in tps]
        if len(rows) > 1:  # the FP8 weight gathers against bf16 and FP8 GEMMs, same engine
            base = tps[rows[0]]["tokens_per_s"]
            print(f"\nZeRO-3 at {size}: " + ", ".join(
                f"{v} {tps[v]['tokens_per_s'] / 1e3:.1f}K tok/s ({tps[v]['tokens_per_s'] / base:.2f}x, "
                f"peak {tps[v]['peak_mem_gib']:.1f} GiB)" for v in rows))
    if zpp:
        print(f"\nZeRO++ kernels, 1.3B ({zpp['params'] / 1e9:.2f}B params, block {zpp['block']}, "
              f"qgZ k={zpp['k_nodes']} x m={zpp['m_ranks']}), step {zpp['step_ms']:.1f} ms")
        print("| kernel work per step | ms | fraction of step |\n|---|---|---|")
        for name, r in zpp["rows"].items():
            print(f"| {name} | {r['ms']:.2f} | {100 * r['fraction_of_step']:.2f}% |")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="*", default=["1.3B", "350M", "125M"], choices=list(SIZES))
    p.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, choices=VARIANTS)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default=None, help="JSON results (written after every variant)")
    p.add_argument("--check", action="store_true", help="check the fused kernels on CUDA first")
    p.add_argument("--micro", action="store_true", help="kernel and GQA micro-benchmarks")
    p.add_argument("--train-check", action="store_true",
                   help="first train a small model briefly (megaq Triton / references / plain loop)")
    p.add_argument("--no-zeropp", action="store_true", help="skip the ZeRO++ kernel table")
    p.add_argument("--fp8-check", action="store_true",
                   help="first compare FP8 GEMMs (torch._scaled_mm) with the fp32 emulation, on the "
                        "GPU and on the CPU, at the 1.3B model's layer shapes")
    p.add_argument("--profile", nargs="*", default=[], metavar="SIZE:VARIANT",
                   help="also profile two steps of these variants (tables by total and by self GPU time next to --out)")
    p.add_argument("--micro-batch", nargs="*", default=[], metavar="SIZE:MB",
                   help="override a size's micro-batch, e.g. 1.3B:16")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_train.py needs a CUDA GPU (it times training steps on one device)")
    for item in args.micro_batch:
        size, mb = item.split(":")
        L, h, nh, _ = SIZES[size]
        SIZES[size] = (L, h, nh, int(mb))
    dev = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "peak_tflops": PEAK_TFLOPS, "seq": SEQ, "vocab": VOCAB,
              "flops_per_token": "6 x non-embedding params + 12 x layers x hidden x seq",
              "command": " ".join([os.path.basename(sys.argv[0])] + (argv or sys.argv[1:])),
              "results": []}

    def save():
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out + ".tmp", "w") as f:
                json.dump(report, f, indent=1)
            os.replace(args.out + ".tmp", args.out)

    if args.check:
        report["kernel_checks"] = check_fused_kernels(dev)
        save()
    if args.train_check:
        report["train_check"] = train_check(dev)
        save()
    if args.micro:
        report["micro"] = micro_benchmarks(dev)
        save()
    if args.fp8_check:
        report["fp8_check"] = fp8_check(dev)
        save()
    for size in args.sizes:
        for variant in args.variants:
            try:
                prof_dir = (os.path.dirname(os.path.abspath(args.out or "."))
                            if f"{size}:{variant}" in args.profile else None)
                with variant_switches(variant):
                    r = time_variant(size, variant, dev, args.steps, args.warmup, prof_dir)
            except Exception as e:  # noqa: BLE001 - report the failure, keep measuring the rest
                r = {"size": size, "variant": variant, "error": f"{type(e).__name__}: {e}"[:500]}
                print(f"FAILED {size} {variant}: {r['error']}")
                free_gpu()
                report.setdefault("failures", []).append(r)
                save()
                continue
            report["results"].append(r)
            print(f"{size} {variant}: {r['tokens_per_s'] / 1e3:.1f}K tok/s, {100 * r['mfu']:.1f}% MFU, "
                  f"step {r['step_ms']:.1f} ms (fwd+bwd {r['fwd_bwd_ms']:.1f}, opt {r['optimizer_ms']:.1f}), "
                  f"peak {r['peak_mem_gib']:.1f} GiB, setup {r['setup_s']:.0f} s, "
                  f"loss {r['loss_first']:.3f}->{r['loss_last']:.3f}", flush=True)
            save()
    zpp = None
    megaq_13 = [r for r in report["results"] if r["size"] == "1.3B" and r["variant"].startswith("megaq")]
    if not args.no_zeropp and megaq_13:
        try:
            zpp = zeropp_kernel_table(dev, min(r["step_ms"] for r in megaq_13))
        except Exception as e:  # noqa: BLE001 - keep the step table
            print(f"ZeRO++ kernel table failed: {type(e).__name__}: {e}")
            zpp = {"error": f"{type(e).__name__}: {e}"[:500]}
        report["zeropp_kernels"] = zpp
        save()
        zpp = zpp if zpp and "rows" in zpp else None
    print_tables(report["results"], zpp)
    save()


if __name__ == "__main__":
    main()
