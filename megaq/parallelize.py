"""Parallelism applied to the plain GPT model, in one place and in one order.

megaq.model builds a plain PyTorch model from tensor-parallel layers; everything else
that makes it train at scale is applied here, from outside, by :func:`parallelize`
(as torchtitan's ``parallelize_llama`` keeps TP -> AC -> compile -> FSDP apart from
its model). Each step is a small function of its own, for callers that need one
alone (tests, benchmarks).
"""

from __future__ import annotations

import torch
from torch import nn

from megaq.kernels.dispatch import register_compiled_ops
from megaq.model.attention import SelfAttention
from megaq.model.config import GPTConfig
from megaq.model.gpt import GPTModel
from megaq.model.mlp import MLP
from megaq.model.recompute import RecomputedLayers, layer_groups, recomputed_in_training
from megaq.parallel.fp8 import FP8GEMM, FP8Recipe
from megaq.parallel.fp8_delayed import AmaxState
from megaq.parallel.pipeline.split import build_stage_chunks
from megaq.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megaq.zero import ZeroConfig, ZeroEngine, build_engine


def parallelize(config: GPTConfig, topo, zero: ZeroConfig | None = None, *, optimizer=None,
                vp_size: int | None = None, device: torch.device | str | None = None,
                chunks: list[GPTModel] | None = None) -> tuple[list[GPTModel], ZeroEngine | None]:
    """This rank's GPT model chunks with parallelism applied, and their ZeRO engine.

    The steps, in this order:

    1. Stage split (PP, virtual PP): the chunks of this rank's pipeline stage, one per
       virtual stage (megaq.parallel.pipeline.split), each a GPTModel of its global
       layers. Every parameter is drawn from a generator seeded by (seed, global layer,
       name) on its full shape, so the split never changes a weight.
    2. TP / SP: the chunks are built from TP layers with ``topo.tp`` and
       ``config.sequence_parallel``: tensor parallelism is what the model's building
       blocks are, not a wrapper put on later. Each layer draws its full initial weight
       and keeps its shard, so every TP size starts from the weights of one process
       while a rank holds only its shards (and one full weight at a time).
    3. FP8 GEMMs (``config.fp8``): the linear layers of the transformer blocks compute
       in FP8 (:func:`apply_fp8`); the embedding, the output layer and the norms stay
       in the params dtype. Before compile, so the compiled blocks trace the FP8
       GEMMs; before the engine, which finds the FP8 layers for its FP8 weight gathers.
    4. Activation recompute (``config.recompute_*``, :func:`apply_recompute`).
       Before compile: the selective form checkpoints the attention core inside a
       block's compiled forward; the full form checkpoints whole blocks around it.
       Non-reentrant checkpoints: the engine recognises a recomputed forward as one
       that runs inside backward (its hooks then neither release weights nor hook
       outputs).
    5. Compile (``config.compile_blocks``, :func:`compile_blocks`): each block's
       ``forward``, not the module call, so the hooks of step 7 stay eager.
    6. Device: the chunks move to ``device`` (construction draws the weights on the
       CPU, deterministically); None leaves them where they are.
    7. ZeRO engine (``zero``): built last, on the finished chunks: it flattens their
       parameters into partitions and registers its hooks (megaq.zero); ``optimizer``
       is its update rule (a run's OptimizerConfig; None: megaq.zero.OptimizerSettings()).
       ``zero=None`` builds none (returned as None), for callers that drive the
       gradients themselves.

    ``chunks``: this rank's plain chunks when already built (steps 1-2 done;
    tools/bench/bench_train.py initialises one CPU model per size and copies it).
    """
    if chunks is None:
        def gpt_chunk(layer_start, layer_end, pre_process, post_process):
            return GPTModel(config, topo.tp, pre_process=pre_process, post_process=post_process,
                            layer_start=layer_start, layer_end=layer_end)
        chunks = build_stage_chunks(gpt_chunk, config.num_layers, topo, vp_size)
    for chunk in chunks:
        if config.fp8 is not None:
            apply_fp8(chunk.layers, config.fp8)
        apply_recompute(chunk, config.recompute_granularity, config.recompute_method,
                        config.recompute_num_layers)
        if config.compile_blocks:
            compile_blocks(chunk)
        if device is not None:
            chunk.to(device)
    engine = build_engine(chunks, topo, zero, optimizer) if zero is not None else None
    return chunks, engine


def apply_fp8(module: nn.Module, recipe: FP8Recipe) -> nn.Module:
    """Step 3: every column- and row-parallel layer under `module` with a weight of its
    own computes its GEMMs in FP8: a megaq.parallel.fp8.FP8GEMM in its ``gemm`` slot,
    with the delayed recipe's amax state (megaq.parallel.fp8_delayed) on the weight's
    device. parallelize passes the transformer blocks only.

    A SwiGLU MLP's fc1 (without bias) takes the activation into its FP8 GEMM, which then
    returns silu(gate) * up, and the MLP's own activation is turned off: SwiGLU's
    backward then writes fc1's FP8 dY directly (megaq.parallel.fp8, ``swiglu``). Likewise
    attention's fused QKV layer (without bias or q/k norms) takes RoPE and the q, k, v
    split into its FP8 GEMM, given RoPE's tables (megaq.model.attention.rope_in_gemm):
    RoPE's backward then writes its FP8 dY (``rope_per_group``)."""
    layers = [m for m in module.modules()
              if isinstance(m, (ColumnParallelLinear, RowParallelLinear)) and m.weight is not None]
    fused = {id(m.linear_fc1) for m in module.modules()
             if isinstance(m, MLP) and m.swiglu and m.activation is not None
             and m.linear_fc1.bias is None and m.linear_fc1.weight is not None}
    rope = {id(m.linear_qkv): m.heads_per_group for m in module.modules()
            if isinstance(m, SelfAttention) and m.q_layernorm is None
            and m.linear_qkv.bias is None and m.linear_qkv.weight is not None}
    for layer in layers:
        amax = AmaxState(recipe).to(layer.weight.device) if recipe.delayed else None
        parallel = "column" if isinstance(layer, ColumnParallelLinear) else "row"
        layer.gemm = FP8GEMM(recipe, layer.tp_group, parallel, amax, swiglu=id(layer) in fused,
                             rope_per_group=rope.get(id(layer), 0))
    for m in module.modules():
        if isinstance(m, MLP) and id(m.linear_fc1) in fused:
            m.activation = None
    return module


def apply_recompute(chunk: GPTModel, granularity: str | None, method: str | None,
                    num_layers: int | None) -> GPTModel:
    """Step 4, Megatron's --recompute-granularity / --recompute-method (megaq.model.recompute):
    selective wraps each block's attention core, full runs the chunk's blocks in
    checkpointed groups; None changes nothing."""
    if granularity == "selective":
        for block in chunk.layers:
            attention = block.self_attention
            attention.core_attention = recomputed_in_training(attention.core_attention)
    elif granularity == "full":
        chunk.run_layers = RecomputedLayers(layer_groups(len(chunk.layers), granularity,
                                                         method, num_layers))
    elif granularity is not None:
        raise ValueError(f"recompute granularity {granularity!r}: use full or selective")
    return chunk


def compile_blocks(chunk: GPTModel, **compile_kwargs) -> GPTModel:
    """Step 5: torch.compile each transformer block's forward in place. Only `forward` is
    compiled, not the module call, so forward hooks (the ZeRO engine's gathers and
    releases) stay eager and every block reuses one compiled graph. Inside the compiled
    region the fused ops trace their torch references, which inductor fuses itself, and
    the kernels it must not fuse into are registered as ops first."""
    register_compiled_ops()
    compile_kwargs.setdefault("dynamic", False)
    for layer in chunk.layers:
        if not getattr(layer, "_megaq_compiled", False):
            layer.forward = torch.compile(layer.forward, **compile_kwargs)
            layer._megaq_compiled = True
    return chunk


__all__ = ["parallelize", "apply_fp8", "apply_recompute", "compile_blocks"]
