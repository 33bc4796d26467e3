"""Single-process tests of the ZeRO building blocks: flat padded partitions, the
ZeRO++ seam selection, config validation, and a DP=1 engine against torch AdamW."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from megaq.parallel.topology import Layout, build_topology
from megaq.zero import OptimizerSettings, ZeroConfig, ZeroConfigError, build_engine
from megaq.zero.collectives import GradReducer, WeightGatherer, make_gatherer, make_reducer
from megaq.zero.partition import FlatPartition
from megaq.zero.zeropp import QuantizedGradReducer, ZeroPPWeightGatherer


def _odd_module():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(7, 5), nn.LayerNorm(5), nn.Linear(5, 3, bias=False))
    m[0].weight.tensor_model_parallel = True
    return m


def _partition(module, world, rank, block, tp_rank=0):
    named = list(module.named_parameters())
    counted = lambda p: getattr(p, "tensor_model_parallel", False) or tp_rank == 0  # noqa: E731
    return FlatPartition("u", named, torch.float32, world, rank, block, True, counted)


def test_odd_sizes_pad_to_whole_blocks_per_shard():
    base = _odd_module()
    full = torch.cat([p.detach().reshape(-1) for p in base.parameters()])
    world, block = 3, 4
    parts = [_partition(_odd_module(), world, r, block) for r in range(world)]
    p0 = parts[0]
    assert p0.numel == full.numel() == 7 * 5 + 5 + 5 + 5 + 15  # 65: divides nothing
    assert p0.padded_numel % (world * block) == 0 and p0.padded_numel >= p0.numel
    assert p0.shard_numel % block == 0
    # The shards tile the padded flat buffer; padding is zero.
    flat = torch.cat([p.shard for p in parts])
    assert flat.numel() == p0.padded_numel and not flat[p0.numel:].any()
    # decay-first layout: 2-D weights, then biases / norm weights (no decay)
    assert [s.decay for s in p0.slots] == [True, True, False, False, False]
    assert sorted(flat[:p0.numel].tolist()) == sorted(full.tolist())
    # at most two optimizer leaves per shard, and they tile it
    for p in parts:
        groups = p.local_groups()
        assert 1 <= len(groups) <= 2 and groups[0][0] == 0 and groups[-1][1] == p.shard_numel
    # released: params keep their shapes but hold no memory until gathered
    w = p0.slots[0].param
    assert not p0.is_materialized and w.shape == (5, 7)
    p0.materialize().copy_(flat)
    assert torch.equal(torch.cat([s.param.detach().reshape(-1) for s in p0.slots]), flat[:p0.numel])
    p0.release()
    assert p0.full_storage_bytes() == 0


def test_grad_norm_ranges_count_tp_replicated_params_once():
    tp0 = _partition(_odd_module(), 1, 0, 4, tp_rank=0)
    tp1 = _partition(_odd_module(), 1, 0, 4, tp_rank=1)
    assert tp0.counted_ranges() == [(0, tp0.numel)]
    # TP rank 1 counts only the TP-split weight (laid out first inside the decay group)
    assert tp1.counted_ranges() == [(0, 35)]


def test_zeropp_switches_select_the_seams():
    topo = build_topology(Layout(1), 0)
    assert isinstance(make_gatherer(topo, ZeroConfig()), WeightGatherer)
    assert isinstance(make_reducer(topo, ZeroConfig()), GradReducer)
    assert isinstance(make_gatherer(topo, ZeroConfig(quantized_weights=True)), ZeroPPWeightGatherer)
    # qgZ changes only the reducer, qwZ only the gatherer
    assert isinstance(make_reducer(topo, ZeroConfig(quantized_gradients=True)), QuantizedGradReducer)
    assert isinstance(make_gatherer(topo, ZeroConfig(quantized_gradients=True)), WeightGatherer)
    assert isinstance(make_reducer(topo, ZeroConfig(quantized_weights=True)), GradReducer)


@pytest.mark.parametrize("kw, match", [({"stage": 4}, "stage 4"), ({"grad_sync": "x"}, "grad_sync"),
                                       ({"block_size": 3}, "block_size"),
                                       ({"stage": 0, "quantized_gradients": True}, "stage 1, 2 or 3"),
                                       ({"stage": 2, "hpz_partition_size": 2}, "use --zero-stage 3"),
                                       ({"weight_bits": 2}, "weight_bits=2.*use 8 or 4"),
                                       ({"grad_bits_inter": 3}, "grad_bits_inter=3"),
                                       ({"hpz_partition_size": 0}, "hpz_partition_size 0"),
                                       ({"grad_chunk": 0}, "quantized-gradients-chunk 0"),
                                       ({"error_feedback": True}, "needs quantized_gradients")])
def test_config_errors_name_the_setting(kw, match):
    with pytest.raises(ZeroConfigError, match=match):
        ZeroConfig(**kw)


def test_config_is_frozen_with_one_default_per_setting():
    cfg = ZeroConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.block_size = 64
    # the block training uses unless --zero-quantization-block-size says otherwise
    assert cfg.block_size == 2048 and cfg.weight_bits == 8 and cfg.grad_chunk == 1 << 22
    assert not cfg.zeropp_enabled and ZeroConfig(hpz_partition_size=2).weights_need_zeropp


def test_dtype_mismatch_is_refused():
    topo = build_topology(Layout(1), 0)
    with pytest.raises(ValueError, match="gather_dtype"):
        build_engine([_odd_module()], topo, ZeroConfig(gather_dtype=torch.bfloat16))


class _Chunk(nn.Module):
    """Shaped like GPTModel: embedding / layers / final_norm / output_layer, untied."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.embedding = nn.Embedding(11, 6)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(6, 9), nn.GELU(), nn.Linear(9, 6))
                                    for _ in range(2))
        self.final_norm = nn.LayerNorm(6)
        self.output_layer = nn.Linear(6, 11, bias=False)

    def forward(self, ids):
        x = self.embedding(ids)
        for layer in self.layers:
            x = x + layer(x)
        return self.output_layer(self.final_norm(x))


@pytest.mark.parametrize("stage", [0, 2, 3])  # stage 1 reduces once, in finish
def test_single_rank_engine_matches_torch_adamw(stage):
    """DP=1 (no process group): the engine is exactly AdamW + clip_grad_norm_, including
    gradient accumulation over two micro-batches and the release/re-gather of weights."""
    from megaq.zero.partition import wants_weight_decay
    topo = build_topology(Layout(1), 0)
    ref, model = _Chunk(), _Chunk()
    engine = build_engine([model], topo, ZeroConfig(stage=stage, block_size=4),
                          OptimizerSettings(weight_decay=0.1, lr=1e-2))
    # At DP=1 there is nothing to reduce: each grad goes into the fp32 accumulator during
    # backward, as its parameter's grad is ready (never deferred to finish_grad_sync).
    accumulated_in_backward = []
    inner = engine.grads._add_slot
    engine.grads._add_slot = lambda *a: (accumulated_in_backward.append(engine._in_backward), inner(*a))[1]
    named = list(ref.named_parameters())
    opt = torch.optim.AdamW([{"params": [p for n, p in named if wants_weight_decay(n, p)],
                              "weight_decay": 0.1},
                             {"params": [p for n, p in named if not wants_weight_decay(n, p)],
                              "weight_decay": 0.0}], lr=1e-2)
    ce = nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        ids = torch.randint(0, 11, (2, 4, 5), generator=g)
        opt.zero_grad()
        ce(ref(ids[:, :, :-1].reshape(8, 4)).reshape(-1, 11), ids[:, :, 1:].reshape(-1)).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
        opt.step()
        engine.zero_grad()
        for m in range(2):  # two micro-batches, each half of the batch
            out = model(ids[m, :, :-1])
            (ce(out.reshape(-1, 11), ids[m, :, 1:].reshape(-1)) / 2).backward()
        engine.finish_grad_sync()
        norm = engine.clip_grad_norm(0.1)
        assert torch.allclose(norm, ref_norm, rtol=1e-5)
        engine.step(1e-2)
    state = engine.full_state()["params"]
    for n, p in ref.named_parameters():
        assert torch.allclose(state[n]["param"], p.detach(), rtol=1e-5, atol=1e-7), n
    # stage 3 holds no gathered weights between steps; stage 2 holds them all, resident
    assert engine.memory_report()["gathered"] == (0 if stage == 3 else engine.zero_model_bytes)
    n_params = len(list(model.parameters()))  # x 2 micro-batches x 3 steps
    assert accumulated_in_backward == [True] * (n_params * 6)


def _forward_with_unused(model, ids, step):
    """_Chunk's forward, except that layer 1 runs without its first bias in step 1 (one
    parameter of a unit gets no grad; the partition is laid out decay-first, so that
    slot lies between written ones) and is skipped in step 2 (a whole unit gets none).
    Each follows a step that wrote grads there: a stale accumulator would hold nonzeros."""
    x = model.embedding(ids)
    for i, layer in enumerate(model.layers):
        if i == 1 and step == 2:
            continue
        if i == 1 and step == 1:
            x = x + layer[2](layer[1](nn.functional.linear(x, layer[0].weight)))
        else:
            x = x + layer(x)
    return model.output_layer(model.final_norm(x))


@pytest.mark.parametrize("stage", [0, 2, 3])  # stage 1 reduces once, in finish
def test_direct_accumulation_at_dp1_matches_the_reduce_path(stage):
    """At DP=1 grads go straight into the fp32 accumulators and zero_grad only marks them
    stale (a slot's first write of a step overwrites). The same training as torch AdamW
    with zero grads for unused parameters, and bit for bit the same as the flat-buffer
    reduce path, also in steps where a whole unit or one parameter gets no grad (its
    accumulator must read zero, not the previous step's grad)."""
    from megaq.zero.partition import wants_weight_decay

    def batches():
        g = torch.Generator().manual_seed(0)
        return [torch.randint(0, 11, (2, 4, 5), generator=g) for _ in range(4)]

    def train(direct: bool):
        model = _Chunk()
        engine = build_engine([model], build_topology(Layout(1), 0),
                              ZeroConfig(stage=stage, block_size=4),
                              OptimizerSettings(weight_decay=0.1, lr=1e-2))
        assert engine.grads.direct
        engine.grads.direct = direct
        norms = []
        for step, ids in enumerate(batches()):
            engine.zero_grad()
            for m in range(2):
                out = _forward_with_unused(model, ids[m, :, :-1], step)
                (nn.functional.cross_entropy(out.reshape(-1, 11), ids[m, :, 1:].reshape(-1)) / 2).backward()
            engine.finish_grad_sync()
            norms.append(engine.clip_grad_norm(0.1))
            engine.step(1e-2)
        return torch.stack(norms), engine.full_state()["params"]

    ref = _Chunk()
    named = list(ref.named_parameters())
    opt = torch.optim.AdamW([{"params": [p for n, p in named if wants_weight_decay(n, p)],
                              "weight_decay": 0.1},
                             {"params": [p for n, p in named if not wants_weight_decay(n, p)],
                              "weight_decay": 0.0}], lr=1e-2)
    ref_norms = []
    for step, ids in enumerate(batches()):
        opt.zero_grad(set_to_none=True)
        out = _forward_with_unused(ref, ids[:, :, :-1].reshape(8, 4), step)
        nn.functional.cross_entropy(out.reshape(-1, 11), ids[:, :, 1:].reshape(-1)).backward()
        for p in ref.parameters():  # the engine treats an unused parameter's grad as zero
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        ref_norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1))
        opt.step()

    norms_d, state_d = train(direct=True)
    norms_r, state_r = train(direct=False)
    assert torch.allclose(norms_d, torch.stack(ref_norms), rtol=1e-5)
    for n, p in ref.named_parameters():
        assert torch.allclose(state_d[n]["param"], p.detach(), rtol=1e-5, atol=1e-7), n
    assert torch.equal(norms_d, norms_r)
    for name in state_r:
        assert torch.equal(state_d[name]["param"], state_r[name]["param"]), name


def test_fused_adamw_applies_the_clip_factor_in_its_own_pass():
    """torch's fused AdamW (CPU build here, CUDA in production) takes the clip factor as
    grad_scale instead of a separate multiply over the grads: the grads it leaves and
    the weights it writes equal the foreach path's (multiply, then step). Adam is
    nearly scale-invariant, so the grads are compared too: a factor silently dropped
    shows there (coef ~0.1 / norm, far from 1)."""
    def run(fused: bool):
        model = _Chunk()
        engine = build_engine([model], build_topology(Layout(1), 0),
                              ZeroConfig(stage=3, block_size=4),
                              OptimizerSettings(weight_decay=0.1, lr=1e-2, fused_adamw=fused))
        assert engine.optimizer.kind == ("fused" if fused else "foreach")
        g = torch.Generator().manual_seed(0)
        coefs = []
        for _ in range(3):
            ids = torch.randint(0, 11, (4, 5), generator=g)
            engine.zero_grad()
            out = model(ids[:, :-1])
            nn.functional.cross_entropy(out.reshape(-1, 11), ids[:, 1:].reshape(-1)).backward()
            engine.finish_grad_sync()
            coefs.append(0.1 / engine.clip_grad_norm(0.1))
            engine.step(1e-2)
        grads = torch.cat(list(engine.grads.read().values()))
        return torch.stack(coefs), grads, engine.full_state()["params"]

    coef_f, grads_f, state_f = run(fused=True)
    coef_e, grads_e, state_e = run(fused=False)
    assert (coef_e < 0.5).all()  # clipping is active in every step
    assert torch.allclose(grads_f, grads_e, rtol=1e-5, atol=1e-9)
    for name in state_e:
        assert torch.allclose(state_f[name]["param"], state_e[name]["param"], rtol=1e-5, atol=1e-7), name


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_engine_and_model_are_freed_when_dropped(stage):
    """The engine's parameter hooks live on autograd's C++ side, where the garbage
    collector cannot see a cycle: they hold the engine weakly, so dropping engine and
    model after training frees both (a benchmark building one model per variant ran out
    of GPU memory when they stayed alive)."""
    import gc
    import weakref
    model = _Chunk()
    engine = build_engine([model], build_topology(Layout(1), 0), ZeroConfig(stage=stage, block_size=4))
    ids = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(0))
    engine.zero_grad()
    model(ids).sum().backward()
    engine.finish_grad_sync()
    engine.clip_grad_norm(1.0)
    engine.step(1e-3)
    refs = weakref.ref(engine), weakref.ref(model)
    del engine, model
    gc.collect()
    assert [r() is None for r in refs] == [True, True]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_engine_step_given_the_loss_skips_non_finite_steps_without_a_trace(stage):
    """engine.step(lr, loss=...) decides the skip (the training loop's one call after
    clipping): a non-finite loss, or a finite loss with non-finite grads, leaves weights,
    moments and step count as they were and reports the grad norm as a float; the next
    finite step is then bit for bit a fresh engine's first step (nothing of the skipped
    steps' grads reaches it)."""
    import math

    ids = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(0))

    def build():
        model = _Chunk()
        return model, build_engine([model], build_topology(Layout(1), 0),
                                   ZeroConfig(stage=stage, block_size=4),
                                   OptimizerSettings(lr=1e-2))

    def backward(model, engine, scale=1.0):
        engine.zero_grad()
        (model(ids).float().pow(2).mean() * scale).backward()
        engine.finish_grad_sync()
        return float(engine.clip_grad_norm(0.1))

    model, engine = build()
    start = engine.full_state()
    norm = backward(model, engine)
    bad_loss = engine.step(1e-2, loss=float("nan"))
    assert bad_loss.skipped and bad_loss.grad_norm == norm and math.isfinite(norm)
    backward(model, engine, scale=float("inf"))
    bad_grads = engine.step(1e-2, loss=1.0)
    assert bad_grads.skipped and not math.isfinite(bad_grads.grad_norm)
    _assert_same_state(engine.full_state(), start)
    backward(model, engine)
    good = engine.step(1e-2, loss=1.0)
    assert not good.skipped and good.grad_norm == norm
    ref_model, ref = build()
    backward(ref_model, ref)
    assert ref.step(1e-2).grad_norm is None  # no loss: nothing read to the host
    _assert_same_state(engine.full_state(), ref.full_state())
    assert ref.step_count == 1


def _assert_same_state(got: dict, want: dict) -> None:
    assert got["step"] == want["step"]
    for name, st in want["params"].items():
        for key, t in st.items():
            assert torch.equal(got["params"][name][key], t), (name, key)
