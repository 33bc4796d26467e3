"""megaq.parallelize: the model constructor builds a plain model; parallelize applies the
configuration's FP8 GEMMs, recompute, compile and ZeRO engine, in its documented order.

One process, a 2-layer Llama. Tolerance 1e-5 (norm-relative, fp32): the compiled blocks
(aot_eager backend: no code generation) and the recomputed forward run the same ops on
the same values, and the ZeRO-3 engine at DP=1 gathers fp32 weights unchanged, so only
the order of the fp32 sums in the grad norm may move (measured: losses equal, norms
8e-8). A step left out shows: the plain model's fp32 GEMMs give per-token losses
3e-4 and a grad norm 2e-3 away from the FP8 model's (measured).
"""

import pytest
import torch

from megaq.model import GPTConfig, GPTModel
from megaq.model import gpt
from megaq.model.attention import core_attention
from megaq.model.recompute import RecomputedLayers
from megaq.parallel.fp8 import FP8GEMM, fp8_gemm_layers
from megaq.parallel.topology import Layout, build_topology
from megaq.parallelize import apply_fp8, parallelize
from megaq.zero import ZeroConfig

CONFIG = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=16,
              fp8_format="hybrid", fp8_recipe="tensorwise", recompute_granularity="full",
              recompute_method="uniform", recompute_num_layers=1, compile_blocks=True)


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _loss_and_norm(model, ids, engine=None):
    """Per-token losses and the global grad norm of one forward and backward."""
    loss = model(ids[:, :-1], labels=ids[:, 1:])
    loss.mean().backward()
    if engine is None:
        return loss.detach(), torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
    engine.finish_grad_sync()
    return loss.detach(), engine.grad_norm()


@pytest.mark.slow  # compiles the blocks
def test_parallelize_applies_the_config_to_a_plain_model_in_order(monkeypatch):
    compiled = []
    real_compile = torch.compile

    def compile_on_cpu(fn, **kw):  # aot_eager: the same graphs, no code generation
        compiled.append(fn)
        return real_compile(fn, **dict(kw, backend="aot_eager"))

    monkeypatch.setattr(torch, "compile", compile_on_cpu)
    cfg = GPTConfig.llama(**CONFIG)
    ids = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(1))

    # the constructor builds the model and nothing else, whatever the configuration asks
    plain = GPTModel(cfg)
    assert not fp8_gemm_layers(plain) and plain.run_layers is gpt.run_layers
    assert all(b.self_attention.core_attention is core_attention for b in plain.layers)
    assert not compiled and not any(m._forward_pre_hooks for m in plain.modules())
    plain_loss, plain_norm = _loss_and_norm(plain, ids)

    topo = build_topology(Layout(world_size=1), 0)
    (chunk,), engine = parallelize(cfg, topo, ZeroConfig(stage=3, block_size=16))
    # FP8 GEMMs in the blocks' four linear layers each, not in the output layer
    layers = fp8_gemm_layers(chunk)
    assert len(layers) == 4 * cfg.num_layers and chunk.output_layer.gemm is None
    assert all(isinstance(m.gemm, FP8GEMM) and m.gemm.recipe == cfg.fp8 for m in layers)
    assert isinstance(chunk.run_layers, RecomputedLayers)                  # full recompute
    assert len(compiled) == cfg.num_layers and all(b._megaq_compiled for b in chunk.layers)
    # the engine came last: its hooks sit on the modules, outside the compiled forwards
    assert all(b._forward_pre_hooks for b in chunk.layers)
    loss, norm = _loss_and_norm(chunk, ids, engine)

    # the same model by hand, eager, FP8 only: the other steps change no value
    ref = GPTModel(cfg)
    apply_fp8(ref.layers, cfg.fp8)
    ref_loss, ref_norm = _loss_and_norm(ref, ids)
    assert _rel(loss, ref_loss) < 1e-5 and _rel(norm, ref_norm) < 1e-5
    assert _rel(plain_loss, ref_loss) > 1e-4  # the plain model really runs without FP8
