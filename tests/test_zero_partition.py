"""Single-process tests of the ZeRO building blocks: flat padded partitions, the
ZeRO++ seam selection, config validation, and a DP=1 engine against torch AdamW."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from torch import nn

from megaq.parallel.topology import Layout, build_topology
from megaq.zero import ZeroConfig, ZeroConfigError, build_engine
from megaq.zero.collectives import GradReducer, WeightGatherer, make_gatherer, make_reducer
from megaq.zero.partition import FlatPartition


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


def test_zeropp_switches_refused_until_provided(monkeypatch):
    topo = build_topology(Layout(1), 0)
    assert isinstance(make_gatherer(topo, ZeroConfig()), WeightGatherer)
    assert isinstance(make_reducer(topo, ZeroConfig()), GradReducer)
    monkeypatch.setitem(sys.modules, "megaq.zero.zeropp", types.ModuleType("megaq.zero.zeropp"))
    with pytest.raises(ZeroConfigError, match="qwZ.*make_gatherer"):
        make_gatherer(topo, ZeroConfig(quantized_weights=True))
    with pytest.raises(ZeroConfigError, match="qgZ.*make_reducer"):
        make_reducer(topo, ZeroConfig(quantized_gradients=True))


@pytest.mark.parametrize("kw, match", [({"stage": 2}, "stage 2"), ({"grad_sync": "x"}, "grad_sync"),
                                       ({"block_size": 3}, "block_size"),
                                       ({"stage": 0, "quantized_gradients": True}, "stage 3")])
def test_config_errors_name_the_setting(kw, match):
    with pytest.raises(ZeroConfigError, match=match):
        ZeroConfig(**kw)


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


@pytest.mark.parametrize("stage", [0, 3])
def test_single_rank_engine_matches_torch_adamw(stage):
    """DP=1 (no process group): the engine is exactly AdamW + clip_grad_norm_, including
    gradient accumulation over two micro-batches and the release/re-gather of weights."""
    from megaq.zero.partition import wants_weight_decay
    topo = build_topology(Layout(1), 0)
    ref, model = _Chunk(), _Chunk()
    engine = build_engine([model], topo, ZeroConfig(stage=stage, block_size=4, weight_decay=0.1,
                                                    lr=1e-2))
    launched_in_backward = []
    if stage == 3:  # gradient reductions start during backward, as each unit is ready
        inner = engine.reducer.start_reduce
        engine.reducer.start_reduce = lambda *a: (launched_in_backward.append(engine._in_backward),
                                                  inner(*a))[1]
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
    assert engine.memory_report()["gathered"] == 0
    if stage == 3:  # 4 units x 2 micro-batches x 3 steps, none deferred to finish_grad_sync
        assert launched_in_backward == [True] * 24
