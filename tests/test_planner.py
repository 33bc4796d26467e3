"""The planner (megaq.planner) against megaq itself.

* bytes: the step's bytes per ZeRO phase and link equal what megaq.parallel.comm counts
  on gloo ranks posing as 2 nodes x 4, for ZeRO-3, qwZ + hpZ + qgZ, weight deltas,
  stages 0, 1 and 2 (and 2 with qwZ + qgZ), stages 0 and 3 reducing gradients once per
  step (--zero-grad-sync last_microbatch), and TP x PP (interleaved) layouts, over a
  step of two micro-batches;
* memory: the engine's allocations (memory_report) equal the memory model's, per kind,
  and so do the gradients it holds at the end of the step's backward;
* FLOPs: the model's FLOP terms add up to megaq.model.flops.num_flops;
* bubble: the pass order equals the one megaq's schedules issue (recorded by running
  them on stand-in runners), and its idle slots are Megatron's (p-1)(F+B)/v;
* search: every plan it prints parses with pretrain_gpt.py's parser unchanged, is the
  same run, and fits; the CLI's errors are one line; --json has the promised keys;
  pretrain_gpt.py --dry-run prints the plan without starting a process group.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
import torch.distributed as dist

from megaq.config.flags import flag_fields
from megaq.model.config import GPTConfig
from megaq.model.flops import num_flops
from megaq.parallel import comm
from megaq.parallel.comm import INTER
from megaq.testing.ranks import run_on_ranks
from megaq.parallel.pipeline import (get_forward_backward_func, masked_mean_loss,
                                     pipeline_tensor_shape)
from megaq.parallel.pipeline import interleaved as interleaved_mod
from megaq.parallel.pipeline import schedules as schedules_mod
from megaq.parallelize import parallelize
from megaq.planner import bubble, compute, memory
from megaq.planner.calibration import load_calibration
from megaq.planner.hardware import Cluster, HardwareError, gpu_preset
from megaq.planner.search import search
from megaq.planner.shapes import stage_units
from megaq.planner.step import PlanInput, predict
from megaq.planner.traffic import PHASES
from megaq.zero import ZeroConfig

from zero_harness import MBS, SEQ, microbatches, model_config, world_totals

PER_NODE = 4
N_MICRO = 2
MODEL = dict(params_dtype=torch.bfloat16, hidden_size=32, num_attention_heads=4,
             untie_embeddings_and_output_weights=True)
Z3 = dict(block_size=64, gather_dtype=torch.bfloat16)
# DP 8 over 2 nodes x 4 (TP 1, PP 1)
DP_CASES = {
    "zero3": dict(Z3),
    "zeropp": dict(Z3, quantized_weights=True, hpz_partition_size=PER_NODE,
                   quantized_gradients=True, grad_chunk=128),
    "deltas": dict(Z3, hpz_partition_size=PER_NODE, weight_deltas=True,
                   quantized_gradients=True, grad_chunk=128),
    "stage0": dict(Z3, stage=0),
    # full fp32 grads kept over the micro-batches, reduced once in finish_grad_sync
    "stage0_last": dict(Z3, stage=0, grad_sync="last_microbatch"),
    "zero3_last": dict(Z3, grad_sync="last_microbatch"),
    "stage1": dict(Z3, stage=1),
    "stage2": dict(Z3, stage=2),
    "stage2_qwz_qgz": dict(Z3, stage=2, quantized_weights=True, quantized_gradients=True,
                           grad_chunk=128),
}
# TP 2 x PP 2 (2 virtual chunks) x DP 2, DP groups across the nodes (rank order tp-pp-dp)
GRID_MODEL = dict(MODEL, num_layers=4, sequence_parallel=True)
GRID_CASES = {"grid_zero3_qwz_qgz": dict(Z3, quantized_weights=True, quantized_gradients=True,
                                         grad_chunk=128),
              "grid_stage0": dict(Z3, stage=0)}
STEPS = 2  # bytes and memory from the second step (weight deltas' steady state)
CAL = load_calibration()


def _step(topo, chunks, engine, step, fb, shape, cfg):
    engine.zero_grad()
    mbs = microbatches(step, topo.dp_rank, topo.dp.size, N_MICRO, cfg.vocab_size)
    fb(chunks, mbs, N_MICRO, topo, tensor_shape=shape, dtype=cfg.params_dtype)
    engine.finish_grad_sync()
    engine.step(1e-3)


def _one_case(topo, model_kw, zero_kw, vp=1):
    """Counted bytes of the last step, and the engine's memory right after its first
    forward (hpZ's slices and qwZ's packed shards alive, nothing gathered but the
    units still in use) and right after its last backward (the gradients it holds
    until finish_grad_sync)."""
    cfg = model_config(**model_kw)
    torch.manual_seed(0)
    chunks, engine = parallelize(cfg, topo, ZeroConfig(**zero_kw), vp_size=vp)
    fb = get_forward_backward_func(topo.layout.pp, vp)
    shape = pipeline_tensor_shape(SEQ, MBS, cfg.hidden_size, topo.tp.size, cfg.sequence_parallel)
    for step in range(STEPS - 1):
        _step(topo, chunks, engine, step, fb, shape, cfg)
    comm.STATS.reset()
    mem = after_backward = None
    if topo.layout.pp == 1:  # by hand, to look at the engine between forward and backward
        engine.zero_grad()
        for mb in microbatches(STEPS - 1, topo.dp_rank, topo.dp.size, N_MICRO, cfg.vocab_size):
            loss = masked_mean_loss(chunks[0](input_ids=mb["tokens"], labels=mb["labels"]),
                                    mb["loss_mask"]) / N_MICRO
            if mem is None:
                mem = engine.memory_report()
            loss.backward()
        after_backward = engine.memory_report()
        engine.finish_grad_sync()
        engine.step(1e-3)
    else:
        _step(topo, chunks, engine, STEPS - 1, fb, shape, cfg)
    return {"bytes": comm.per_node_totals(topo.world), "mem": mem,
            "after_backward": after_backward}


def _dp_cases(topo):
    return {name: _one_case(topo, MODEL, kw) for name, kw in DP_CASES.items()}


def _grid_cases(topo):
    return {name: _one_case(topo, GRID_MODEL, kw, vp=2) for name, kw in GRID_CASES.items()}


@pytest.fixture(scope="module")
def measured():
    out = {}
    for ranks in (run_on_ranks(_dp_cases, 8, ranks_per_node=PER_NODE, hpz_size=PER_NODE),
                  run_on_ranks(_grid_cases, 8, tp=2, pp=2, ranks_per_node=PER_NODE,
                               order="tp-pp-dp")):
        for name in ranks[0]:
            out[name] = {"bytes": world_totals(ranks[0][name]["bytes"]),
                         "mem": [r[name]["mem"] for r in ranks],
                         "after_backward": [r[name]["after_backward"] for r in ranks]}
    return out


def _plan_input(name: str) -> PlanInput:
    grid = name.startswith("grid")
    kw = (GRID_CASES if grid else DP_CASES)[name]
    cfg = model_config(**(GRID_MODEL if grid else MODEL))
    tp, pp, vp = (2, 2, 2) if grid else (1, 1, 1)
    dp = 8 // (tp * pp)
    return PlanInput(model=cfg, zero=ZeroConfig(**kw), tp=tp, pp=pp, vp=vp, dp=dp,
                     micro_batch_size=MBS,
                     global_batch_size=MBS * dp * N_MICRO, bf16=True, gpus_per_node=PER_NODE,
                     rank_order="tp-pp-dp" if grid else "tp-dp-pp")


CLUSTER = Cluster(gpu_preset("H200"), num_nodes=2, gpus_per_node=PER_NODE)


@pytest.mark.parametrize("name", list(DP_CASES) + list(GRID_CASES))
def test_byte_terms_equal_the_counted_bytes(measured, name):
    pred = predict(_plan_input(name), CLUSTER, CAL)
    counted = {p: v for p, v in measured[name]["bytes"].items() if p in PHASES}
    assert counted, measured[name]["bytes"]
    assert pred.bytes_per_phase == counted, (name, pred.bytes_per_phase, counted)
    assert pred.cross_node_bytes == sum(v[INTER] for v in counted.values())


@pytest.mark.parametrize("name", list(DP_CASES))
def test_memory_terms_equal_the_engine_allocations(measured, name):
    pi = _plan_input(name)
    units = stage_units(pi.model, pi.tp, pi.pp, pi.vp, 0, pi.e4m3_weights)
    model = memory.engine_bytes(units, pi.dp, pi.zero, pi.elem)
    for rep in measured[name]["mem"]:
        assert rep["params"] - rep["gathered"] == model.params, (name, rep)
        # the step's first forward: the accumulators have handed their memory back
        assert rep["grads"] == 0, (name, rep)
        assert rep["optimizer"] == model.optimizer, (name, rep)
        engine_zeropp = {k: v for k, v in rep.items() if k not in (
            "params", "gathered", "grads", "optimizer", "zeropp", "total") and v}
        assert engine_zeropp == {k: v for k, v in model.zeropp.items() if v}, (name, rep)
    # after the last backward: the accumulators, taken back at backward's first write;
    # when the gradients are reduced once per step, the full fp32 gradients kept until
    # finish_grad_sync instead (the accumulators come back there, beside them: the
    # planner's peak counts both)
    assert (model.full_grads > 0) == pi.zero.grads_reduced_once
    for rep in measured[name]["after_backward"]:
        want = model.full_grads if pi.zero.grads_reduced_once else model.grads
        assert rep["grads"] == want, (name, rep)


@pytest.mark.parametrize("kw,tp", [(dict(), 1), (dict(swiglu=True, num_query_groups=2,
                                                     group_query_attention=True), 2)])
def test_flop_terms_add_up_to_flops_py(kw, tp):
    cfg = GPTConfig(num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=1000,
                    seq_length=128, **kw)
    split = compute.flop_split(cfg, 4096, tp)
    assert split.total == pytest.approx(num_flops(cfg, 4096, tp), rel=1e-12)
    # per GPU, over every stage, chunk and micro-batch: the whole step's count
    pp, vp, dp, mb, m = 2, 2, 2, 2, 4
    per_gpu = 0.0
    for s in range(pp):
        for c in range(vp):
            cc = compute.chunk_compute(cfg, gpu_preset("H200"), CAL, layers=1, tp=tp, sp=False,
                                       micro_batch=mb, has_head=s == pp - 1 and c == vp - 1,
                                       fp8=False, compiled=True)
            per_gpu += m * (cc.flops_fwd + cc.flops_bwd)
    total = per_gpu * tp * dp
    assert total == pytest.approx(num_flops(cfg, dp * m * mb * cfg.seq_length, tp), rel=1e-9)


def test_weight_delta_bytes_equal_the_routes_pair_by_pair():
    """volume.weight_deltas counts per (hpZ slot, node) so the scale study can afford it;
    it must equal the routes the engine takes (delta_routes), summed sender by sender, for
    every node count, node size and hpZ size that divides the group."""
    from megaq.zero.zeropp import volume
    from megaq.zero.zeropp.deltas import delta_routes
    cases = 0
    for k in (1, 2, 3, 5, 8):
        for m in (1, 2, 3, 4, 8):
            n = k * m
            for h in (h for h in range(2, n + 1) if n % h == 0):
                cfg = ZeroConfig(hpz_partition_size=h, weight_deltas=True, block_size=64)
                groups = [[g * h + j for j in range(h)] for g in range(n // h)]
                unit = volume.delta_bytes(1000, cfg)
                want = {comm.INTRA: 0, INTER: 0}
                for r in range(n):
                    for d in delta_routes(n, r, groups, r % h)[0]:
                        if d != r:
                            want[INTER if d // m != r // m else comm.INTRA] += unit
                assert volume.weight_deltas(1000, k, m, cfg) == want, (k, m, h)
                cases += 1
    assert cases > 50


def test_weight_delta_exchange_pays_one_latency_per_message_the_engine_posts():
    """The exchange's latency term is the messages a rank posts (delta_routes: one per
    destination that is not itself), at its link's latency, averaged over the group: it
    grows with the number of hpZ groups, not one latency per unit."""
    from megaq.planner import traffic
    from megaq.planner.shapes import UnitShape
    from megaq.zero.zeropp.deltas import delta_routes
    cluster = Cluster(gpu_preset("H100-SXM"), num_nodes=1, gpus_per_node=8,
                      inter_node_latency_s=1.0, intra_node_latency_s=1e-3)
    unit = UnitShape("u", 4096, 0)
    for k, m, h in ((2, 2, 2), (4, 2, 2), (3, 4, 4), (8, 8, 8), (2, 8, 4)):
        n = k * m
        cfg = ZeroConfig(hpz_partition_size=h, weight_deltas=True, block_size=64)
        groups = [[g * h + j for j in range(h)] for g in range(n // h)]
        want = sum((1.0 if d // m != r // m else 1e-3)
                   for r in range(n) for d in delta_routes(n, r, groups, r % h)[0] if d != r) / n
        g = traffic.DPGroupShape(k, m, 1)
        got = traffic.delta_time(unit, g, cfg, cluster.with_nodes(k), CAL.link_efficiency).latency
        assert got == pytest.approx(want, rel=1e-12), (k, m, h)
        assert got >= (n // h - 1) * 1e-3


def test_qgz_hops_pay_one_latency_per_message():
    """qgZ's all-to-all hops send one message to every other member of their group: m - 1
    in the node, k - 1 across nodes, per chunk (the engine's all_to_all over its intra
    and inter groups)."""
    from megaq.planner import traffic
    from megaq.planner.shapes import UnitShape
    cluster = Cluster(gpu_preset("H100-SXM"), num_nodes=4, gpus_per_node=8,
                      inter_node_gbit_per_s=1e12, intra_node_gb_per_s=1e12,
                      inter_node_latency_s=1.0, intra_node_latency_s=1e-3)
    cfg = ZeroConfig(quantized_gradients=True, hpz_partition_size=8, block_size=64)
    for k, m in ((4, 8), (2, 2), (16, 4)):
        got = traffic.reduce_time(UnitShape("u", 1 << 16, 0), traffic.DPGroupShape(k, m, 1),
                                  cfg, 2, cluster.with_nodes(k), CAL.link_efficiency).latency
        assert got == pytest.approx((k - 1) * 1.0 + (m - 1) * 1e-3, rel=1e-6), (k, m)


def test_weight_delta_exchange_hides_behind_the_first_forward():
    """The exchanges are posted together at the first gather and queue on the link; unit
    i's is waited for at unit i's gather. Nothing to hide behind: every second is waited
    for; long spans: only the first unit's; in between, what outruns the forward."""
    from megaq.planner.step import _delta_exchange_waits
    x = [2.0, 1.0, 1.0]
    assert _delta_exchange_waits(x, [0.0, 0.0, 0.0]) == pytest.approx(4.0)
    assert _delta_exchange_waits(x, [5.0, 5.0, 5.0]) == pytest.approx(2.0)
    # unit 1 lands at 3, reached at 2 + 0.5: waits 0.5; unit 2 lands at 4, reached at 3.5
    assert _delta_exchange_waits(x, [0.5, 0.5, 0.5]) == pytest.approx(2.0 + 0.5 + 0.5)


def test_emulated_replay_adds_each_configuration_s_host_time():
    """The emulated replay charges the profiled host time of the configuration, ZeRO-3's
    where the profile has none; the ZeRO-3 link fit includes it."""
    from megaq.planner import calibrate
    link = {"efficiency": 0.9, "latency_s": 1e-3, "loopback_gb_per_s": 1.0,
            "host_s_per_step": {"ZeRO-3": 0.02, "deltas": 0.05}}
    assert calibrate.emulated_calibration(CAL, link, "deltas").fixed_step_overhead_s == 0.05
    assert calibrate.emulated_calibration(CAL, link, "qwZ").fixed_step_overhead_s == 0.02
    host = calibrate.emulated_host_seconds(
        os.path.join(calibrate.RESULTS, calibrate.FIT_EMULATED_PROFILE))
    assert host["deltas"] > host["ZeRO-3"] > 0


def test_prefetch_limit_exposes_what_is_not_fetched_ahead():
    """The published check's DeepSpeed overlap: a limit at least a unit's size is
    megaq's prefetch; the smaller the limit, the more of the forward gathers is exposed,
    and with nothing fetched ahead the step is slower than megaq's."""
    from megaq.planner.calibrate import _predict
    argv = ["--num-layers", "4", "--hidden-size", "2048", "--num-attention-heads", "16",
            "--seq-length", "1024", "--max-position-embeddings", "1024", "--vocab-size", "32000",
            "--micro-batch-size", "1", "--global-batch-size", "32", "--bf16", "--lr", "1e-4",
            "--train-iters", "1", "--mock-data", "--zero-stage", "3"]
    cluster = Cluster(gpu_preset("H100-SXM"), num_nodes=4, gpus_per_node=8,
                      inter_node_gbit_per_s=100.0)
    exposed = lambda p: p.exposed_comm_s  # noqa: E731
    megaq_own = _predict(argv, CAL, cluster)
    assert _predict(argv, CAL, cluster, prefetch_limit=10**12).step_time_s == megaq_own.step_time_s
    fwd = [exposed(_predict(argv, CAL, cluster, prefetch_limit=n))["weight_gather_fwd"]
           for n in (10**12, 20_000_000, 5_000_000, 0)]
    assert fwd == sorted(fwd) and fwd[0] < fwd[-1]
    nothing_ahead = _predict(argv, CAL, cluster, prefetch_limit=0)
    assert nothing_ahead.step_time_s > megaq_own.step_time_s


@pytest.mark.parametrize("stage", ["0", "3"])
def test_gradients_reduced_once_are_exposed_once_after_backward(stage):
    """--zero-grad-sync last_microbatch: the engine reduces every unit's gradient once, in
    finish_grad_sync after the last backward (megaq.zero.grads), with nothing left to
    hide it behind: the same exposed seconds for 1 or 4 micro-batches, fewer than
    reducing each of 4 micro-batches' gradients, more than reducing 1 behind backward."""
    from megaq.planner.calibrate import _predict
    argv = ["--num-layers", "4", "--hidden-size", "2048", "--num-attention-heads", "16",
            "--seq-length", "1024", "--max-position-embeddings", "1024", "--vocab-size", "32000",
            "--micro-batch-size", "1", "--bf16", "--lr", "1e-4", "--train-iters", "1",
            "--mock-data", "--zero-stage", stage]
    cluster = Cluster(gpu_preset("H100-SXM"), num_nodes=4, gpus_per_node=8,
                      inter_node_gbit_per_s=100.0)

    def reduce_s(sync, micro_batches):
        plan = _predict(argv + ["--zero-grad-sync", sync,
                                "--global-batch-size", str(32 * micro_batches)], CAL, cluster)
        return plan.exposed_comm_s["grad_reduce"]
    once = reduce_s("last_microbatch", 1)
    assert reduce_s("last_microbatch", 4) == pytest.approx(once, rel=1e-12)
    assert reduce_s("per_microbatch", 1) < once < reduce_s("per_microbatch", 4)


# ----------------------------------------------------------------------------- bubble
class _Recorder:
    """Stands in for the schedules' runner and p2p: records each pass per chunk."""

    def __init__(self, pp_rank, pp, vp):
        self.pp_rank, self.pp, self.vp = pp_rank, pp, vp
        self.order, self.count = [], {}
        self.losses = []

    def _note(self, kind, c):
        i = self.count.get((kind, c), 0)
        self.count[(kind, c)] = i + 1
        self.order.append((kind, i, c))

    def forward(self, c, inp):
        self._note("F", c)
        return "out"

    def backward(self, c, inp, out, grad):
        self._note("B", c)
        return "grad"

    def is_first(self, c):
        return self.pp_rank == 0 and c == 0

    def is_last(self, c):
        return self.pp_rank == self.pp - 1 and c == self.vp - 1

    def __getattr__(self, name):  # p2p: every send / receive hands back a stand-in
        if name.startswith(("send", "recv", "communicate")):
            return lambda *a, **k: ("x", "x") if name == "communicate" else "x"
        raise AttributeError(name)


def _recorded_orders(pp, vp, m, monkeypatch):
    orders = []
    for rank in range(pp):
        rec = _Recorder(rank, pp, vp)
        fake = lambda *a, **k: (rec, rec, rank, pp)  # noqa: E731
        monkeypatch.setattr(schedules_mod, "_setup", fake)
        monkeypatch.setattr(interleaved_mod, "_setup", fake)
        topo = type("T", (), {"layout": type("L", (), {"pp": pp})()})()
        get_forward_backward_func(pp, vp)([None] * vp, None, m, topo, tensor_shape=None)
        orders.append(rec.order)
    return orders


@pytest.mark.parametrize("pp,vp,m", [(2, 1, 3), (4, 1, 8), (4, 1, 2), (2, 2, 4), (4, 2, 8),
                                     (4, 2, 4), (3, 3, 6)])
def test_bubble_is_the_schedules_idle_slots(pp, vp, m, monkeypatch):
    # the pass order megaq's schedules issue, rank by rank
    assert bubble.stage_orders(pp, vp, m) == _recorded_orders(pp, vp, m, monkeypatch)
    # equal passes: Megatron's bubble, (p-1)(F+B) for 1F1B, / v interleaved
    f, b = 1.0 / vp, 2.0 / vp
    t = bubble.simulate(pp, vp, m, lambda s, c: f, lambda s, c: b)
    assert t.makespan_s == pytest.approx(m * vp * (f + b) + (pp - 1) * (f + b))
    assert all(i == pytest.approx((pp - 1) * (f + b)) for i in t.idle_s)


# ----------------------------------------------------------------------------- search
def _parse(parser, flags, world, per_node):
    from megaq.config.run import RunConfig
    ns = parser.parse_args(flags + ["--lr", "1e-4", "--train-iters", "1", "--mock-data",
                                    "--vocab-size", "32000"])
    return RunConfig.from_flags(ns, world, per_node)


@pytest.mark.parametrize("layers,hidden,heads,gpu,nodes,gbs", [
    (24, 1024, 16, "H100-SXM", 1, 32),       # 350M on one node
    (24, 2048, 16, "A100-40GB", 2, 64),      # 1.3B on 16 A100s
    (32, 4096, 32, "H200", 4, 64),           # 7B on 32 H200s
])
def test_every_searched_plan_parses_unchanged_and_fits(layers, hidden, heads, gpu, nodes, gbs):
    from megaq.config.arguments import build_parser
    cfg = GPTConfig.llama(num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                          vocab_size=32000, seq_length=2048, params_dtype=torch.bfloat16)
    cluster = Cluster(gpu_preset(gpu), nodes, 8)
    plans = search(cfg, gbs, 2048, cluster, CAL)
    assert plans
    parser = build_parser()
    seen = set()
    assert all(p.prediction.fits for p in plans)  # never one that does not fit
    for plan in plans[:40]:  # what --search prints (its --top), and more
        run = _parse(parser, plan.flags, cluster.world_size, 8)
        again = PlanInput.from_config(run)
        # the same run: model, layout, batch, and every ZeRO setting the plan reads (the
        # optimizer's hyper-parameters, which come from other flags, aside)
        zero_kw = {f.name: getattr(plan.input.zero, f.name)
                   for f in flag_fields(ZeroConfig)} | {"fp8_weights": plan.input.zero.fp8_weights}
        assert again == dataclasses.replace(
            plan.input, zero=dataclasses.replace(again.zero, **zero_kw),
            model=dataclasses.replace(plan.input.model,
                                      recompute_activations=again.model.recompute_activations)), \
            plan.name
        assert plan.prediction.fits and predict(again, cluster, CAL).fits, plan.name
        seen.add((plan.input.tp, plan.input.pp, plan.input.zero.stage))
    assert len(seen) > 2  # the search ranges over layouts, not one
    rates = [p.prediction.tokens_per_s for p in plans]
    assert rates == sorted(rates, reverse=True)


# ----------------------------------------------------------------------------- CLI
LLAMA = ("--num-layers 4 --hidden-size 256 --num-attention-heads 4 --seq-length 512 --swiglu "
         "--normalization RMSNorm --position-embedding-type rope --disable-bias-linear "
         "--untie-embeddings-and-output-weights --bf16 --micro-batch-size 2").split()


def _plan_cli(argv, capsys):
    from megaq.plan_cli import plan_main
    code = plan_main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_plan_json_has_the_keys(capsys):
    code, out, err = _plan_cli(LLAMA + ["--json", "--gpu", "H100-SXM", "--num-nodes", "2",
                                        "--zero-hpz-partition-size", "8"], capsys)
    assert code == 0, err
    d = json.loads(out)
    for key in ("step_time_s", "tokens_per_s", "tflops_per_gpu", "mfu", "memory_gib", "fits"):
        assert key in d
    assert d["fits"] is True and d["step_time_s"] > 0
    assert {"compute", "exposed_comm", "bubble", "optimizer"} <= set(d["breakdown_s"])
    assert {"weight_gather_fwd", "weight_gather_bwd", "grad_reduce", "pp", "tp"} <= set(
        d["breakdown_s"]["exposed_comm"])
    assert d["cross_node_bytes_per_iteration"] > 0 and "weights" in d["memory_parts_gib"]


def test_search_json_plans_parse_unchanged(capsys):
    """The flags --search prints (here with the parser's default head count, a required
    flag that must still be written out) are a run pretrain_gpt.py accepts."""
    from megaq.config.arguments import build_parser
    code, out, err = _plan_cli(LLAMA + ["--search", "--json", "--top", "3", "--num-nodes", "2",
                                        "--global-batch-size", "32"], capsys)
    assert code == 0, err
    d = json.loads(out)
    assert d["reason"] and len(d["plans"]) == 3
    parser = build_parser()
    for plan in d["plans"]:
        run = _parse(parser, plan["flags"], 16, 8)
        assert run.model.num_attention_heads == 4 and run.training.global_batch_size == 32
        assert plan["fits"] and plan["step_time_s"] > 0


@pytest.mark.parametrize("argv,words", [
    (["--gpu", "B300"], "not a known preset"),
    (["--tensor-model-parallel-size", "3"], "not divisible by TP"),
    (["--inter-node-bandwidth", "0"], "--inter-node-bandwidth"),
    (["--fp8-format", "e4m3", "--gpu", "A100-80GB"], "FP8"),
    (["--search", "--num-layers", "80", "--hidden-size", "8192", "--num-attention-heads", "64",
      "--gpu", "V100-32GB", "--gpus-per-node", "1"], "fits on"),
])
def test_cli_errors_are_one_line(argv, words, capsys):
    code, out, err = _plan_cli(LLAMA + argv, capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], err


def test_a_plan_that_does_not_fit_exits_2(capsys):
    code, out, err = _plan_cli(LLAMA + ["--micro-batch-size", "512", "--gpu", "V100-32GB",
                                        "--gpus-per-node", "1", "--zero-stage", "0"], capsys)
    assert code == 2 and "DOES NOT FIT" in out and err.startswith("error: ")


def test_pretrain_dry_run_prints_the_plan_without_ranks(capsys):
    from megaq.pretrain import cli
    argv = LLAMA + ["--lr", "1e-4", "--train-iters", "5", "--mock-data", "--dry-run",
                    "--num-nodes", "2", "--gpus-per-node", "8", "--gpu", "H100-SXM",
                    "--zero-quantized-gradients"]
    assert cli(argv) == 0
    out = capsys.readouterr().out
    assert "step time" in out and "memory per GPU" in out and "qgZ" in out
    assert not dist.is_initialized()


def test_elementwise_kernels_run_at_the_reference_rate_or_the_gpus_hbm_rate():
    """The element-wise term: on the H200 its fitted rate (HBM over the byte scale), carried
    as a ceiling; a GPU with less usable HBM than that ceiling is HBM-bound."""
    from megaq.planner.compute import elementwise_rate
    h200, h100, v100 = (gpu_preset(g) for g in ("H200", "H100-SXM", "V100-32GB"))
    scale, eff = CAL.elementwise_bytes_scale["compiled"], CAL.hbm_efficiency
    ceiling = h200.hbm_gb_per_s * 1e9 * eff / scale
    assert elementwise_rate(h200, CAL, "compiled") == pytest.approx(ceiling)
    assert elementwise_rate(h100, CAL, "compiled") == pytest.approx(
        min(ceiling, h100.hbm_gb_per_s * 1e9 * eff))
    assert elementwise_rate(v100, CAL, "compiled") == pytest.approx(v100.hbm_gb_per_s * 1e9 * eff)
    flat = dataclasses.replace(CAL, elementwise_bytes_scale={"compiled": 0.0, "eager": 0.5})
    assert elementwise_rate(h200, flat, "compiled") == pytest.approx(h200.hbm_gb_per_s * 1e9 * eff)


def test_a_step_with_little_gpu_work_per_layer_says_it_may_be_host_bound():
    """The 500-step FP8 check's 91M model ran 1.24x (bf16) and 2.1x (FP8) its predicted step
    on an H100, waiting on the host (docs/PLANNING.md): its plans say so; the 1.3B bench
    steps, which the model predicts within 3%, do not."""
    from megaq.planner.bench_rows import bench_argv
    from megaq.planner.calibrate import _predict
    h100 = Cluster(gpu_preset("H100-SXM"), num_nodes=1, gpus_per_node=1)
    small = ["--num-layers", "12", "--hidden-size", "768", "--num-attention-heads", "12",
             "--seq-length", "1024", "--max-position-embeddings", "1024", "--vocab-size", "4096",
             "--micro-batch-size", "8", "--global-batch-size", "16", "--swiglu",
             "--normalization", "RMSNorm", "--disable-bias-linear", "--position-embedding-type",
             "rope", "--untie-embeddings-and-output-weights", "--bf16", "--compile-blocks",
             "--zero-stage", "0", "--lr", "6e-4", "--train-iters", "500", "--mock-data"]
    fp8 = ["--fp8-format", "hybrid", "--fp8-recipe", "delayed"]

    def host_notes(argv):
        return [n for n in _predict(argv, CAL, h100).notes if "bound by the host" in n]
    assert host_notes(small) and host_notes(small + fp8)
    assert "~2.7 ms" in host_notes(small + fp8)[0] and "~1.5 ms" in host_notes(small)[0]
    for variant in ("megaq-s0-comp", "megaq-fp8dl-comp"):
        assert not host_notes(bench_argv("1.3B", variant))


def test_fused_swiglu_fp8_backward_saves_its_bytes_where_megaq_runs_it():
    """fc1's fused FP8 SwiGLU backward (megaq.parallelize.apply_fp8: the delayed recipe, a
    SwiGLU MLP without biases) writes the FP8 dY and its transpose in one pass: 5 bytes per
    dY element fewer than the 16-bit dY written, read back and cast, and the cast read again
    for the transpose. The plan takes it where megaq runs it; a replayed bench row takes it
    as the row ran (its key, or the files of FUSED_SWIGLU_FP8_FILES, never -nse)."""
    from megaq.planner.bench_rows import bench_argv, fused_swiglu_fp8_of
    from megaq.planner.calibrate import _run_config

    cfg = GPTConfig.llama(num_layers=2, hidden_size=256, num_attention_heads=4, vocab_size=512,
                          seq_length=64, fp8_format="hybrid", fp8_recipe="delayed")
    f = cfg.ffn_hidden_size
    for tp in (1, 2):
        unfused = compute.elementwise_bytes_per_token_layer(cfg, tp, False, True)
        fused = compute.elementwise_bytes_per_token_layer(cfg, tp, False, True, fused_swiglu_fp8=True)
        assert unfused - fused == 5 * 2 * f / tp
    assert (compute.elementwise_bytes_per_token_layer(cfg, 1, False, False, fused_swiglu_fp8=True)
            == compute.elementwise_bytes_per_token_layer(cfg, 1, False, False))  # bf16: no FP8 dY

    def plan(variant, bias=False):
        argv = [a for a in bench_argv("1.3B", variant) if not (bias and a == "--disable-bias-linear")]
        return PlanInput.from_config(_run_config(argv))
    assert plan("megaq-fp8dl-comp").swiglu_fp8_backward_fused
    for variant, bias in (("megaq-fp8tw-comp", False), ("megaq-s0-comp", False),
                          ("megaq-fp8dl-comp", True)):
        assert not plan(variant, bias).swiglu_fp8_backward_fused, (variant, bias)
    h100 = Cluster(gpu_preset("H100-SXM"), num_nodes=1, gpus_per_node=1)
    fast, slow = (predict(dataclasses.replace(plan("megaq-fp8dl-comp"), fused_swiglu_fp8=on),
                          h100, CAL).step_time_s for on in (True, False))
    assert 0.95 < fast / slow < 1.0

    fused_file = "bench_train_h100_1.3B_fused_cvt.json"
    assert fused_swiglu_fp8_of(fused_file, {"variant": "megaq-fp8dl-comp"})
    assert not fused_swiglu_fp8_of(fused_file, {"variant": "megaq-fp8dl-nse-comp"})
    assert not fused_swiglu_fp8_of("fp8final_h200_1.3B.json", {"variant": "megaq-fp8dl-comp"})
    assert fused_swiglu_fp8_of("new.json", {"variant": "megaq-fp8dl-comp", "fused_swiglu_fp8": True})


def test_fused_rope_fp8_backward_saves_the_transposes_read_where_megaq_runs_it():
    """RoPE's fused FP8 backward (kernels/fused_rope.qkv_rope_backward_fp8) writes the QKV
    layer's dY and its transpose in one pass: 1 byte per dY element less (the transpose
    op's read), on the delayed recipe with RoPE and no bias or q/k norms only."""
    from megaq.planner.bench_rows import bench_argv
    from megaq.planner.calibrate import _run_config

    cfg = GPTConfig.llama(num_layers=2, hidden_size=256, num_attention_heads=4,
                          num_query_groups=2, vocab_size=512, seq_length=64,
                          fp8_format="hybrid", fp8_recipe="delayed")
    qkv = cfg.num_attention_heads * cfg.kv_channels + 2 * cfg.num_query_groups * cfg.kv_channels
    for tp in (1, 2):
        plain = compute.elementwise_bytes_per_token_layer(cfg, tp, False, True)
        fused = compute.elementwise_bytes_per_token_layer(cfg, tp, False, True, fused_rope_fp8=True)
        assert plain - fused == qkv / tp

    def plan(*extra):
        return PlanInput.from_config(_run_config(bench_argv("1.3B", "megaq-fp8dl-comp") + list(extra)))
    assert plan().rope_fp8_backward_fused
    assert not plan("--qk-layernorm").rope_fp8_backward_fused
    assert not PlanInput.from_config(_run_config(bench_argv("1.3B", "megaq-fp8tw-comp"))).rope_fp8_backward_fused
    h100 = Cluster(gpu_preset("H100-SXM"), num_nodes=1, gpus_per_node=1)
    fast, slow = (predict(dataclasses.replace(plan(), fused_rope_fp8=on), h100, CAL).step_time_s
                  for on in (True, False))
    assert 0.99 < fast / slow < 1.0


def test_refresh_reads_the_masters_only_where_the_step_leaves_the_amaxes():
    """Stage 0's E4M3 refresh (megaq.zero.fp8_resident) costs the optimizer step 3 bytes a
    weight element after megaq's one-pass AdamW, which takes the amaxes in its own pass,
    and 4 more where a pass over the masters finds them (SGD; replayed runs from before):
    the difference of the two predictions is those 4 bytes of every FP8 weight."""
    from megaq.planner.bench_rows import bench_argv
    from megaq.planner.calibrate import _run_config
    from megaq.zero.fp8_resident import AMAX_READ_BYTES_PER_PARAM

    pi = PlanInput.from_config(_run_config(bench_argv("1.3B", "megaq-fp8dl-comp")))
    assert not pi.refresh_reads_masters
    assert dataclasses.replace(pi, optimizer="sgd").refresh_reads_masters
    h100 = Cluster(gpu_preset("H100-SXM"), num_nodes=1, gpus_per_node=1)
    took, read = (predict(dataclasses.replace(pi, amax_from_step=on), h100, CAL).step_time_s
                  for on in (True, False))
    fp8_numel = sum(u.fp8_numel for u in stage_units(pi.model, 1, 1, 1, 0, pi.e4m3_weights))
    assert fp8_numel > 0.9e9  # the block weights of 1.3B
    assert read - took == pytest.approx(
        fp8_numel * AMAX_READ_BYTES_PER_PARAM / (h100.gpu.hbm_gb_per_s * 1e9 * CAL.hbm_efficiency), rel=1e-6)


def test_hardware_presets():
    assert gpu_preset("h100-sxm").name == "H100-SXM"
    with pytest.raises(HardwareError, match="V100-32GB, A100-40GB"):
        gpu_preset("TPU")
    for g in ("V100-32GB", "A100-40GB", "A100-80GB", "H100-SXM", "H800", "H200"):
        gpu_preset(g)


@pytest.mark.parametrize("device_name,preset", [
    ("NVIDIA H100 80GB HBM3", "H100-SXM"), ("NVIDIA H200", "H200"), ("NVIDIA H800", "H800"),
    ("NVIDIA A100-SXM4-80GB", "A100-80GB"), ("NVIDIA A100-SXM4-40GB", "A100-40GB"),
    ("Tesla V100-SXM2-32GB", "V100-32GB"), ("Tesla V100-SXM2-16GB", None),
    ("NVIDIA H100 PCIe", None), ("NVIDIA H100 NVL", None), ("NVIDIA GH200 480GB", None),
    ("NVIDIA GeForce RTX 4090", None)])
def test_a_run_plans_for_the_gpu_it_trains_on(device_name, preset):
    """pretrain_gpt.py's plan (metrics file, end-of-run line) is for its own GPU unless --gpu
    names one: an H100 run compared with the H200's prediction said nothing about either."""
    from megaq.planner.hardware import preset_of_device
    from megaq.planner.run import HardwareFlags
    assert preset_of_device(device_name) == preset
    assert HardwareFlags().on_device(device_name).preset == (preset or "H200")
    assert HardwareFlags(gpu="A100-40GB").on_device(device_name).preset == "A100-40GB"
    assert HardwareFlags().on_device(None).preset == "H200"


def _bench_parts(variant="megaq-s0-comp", extra=(), micro_batches=1):
    from megaq.planner.bench_rows import bench_argv
    from megaq.planner.calibrate import _predict
    argv = bench_argv("1.3B", variant)
    gb = argv.index("--global-batch-size") + 1
    argv[gb] = str(int(argv[gb]) * micro_batches)
    return _predict([*argv, *extra], CAL).memory_parts_gib


RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform",
             "--recompute-num-layers", "1"]


def test_memory_peak_follows_when_the_engine_holds_its_gradients():
    """The fp32 accumulators are handed back between steps (megaq.zero.grads): without
    recompute the peak is backward's start, all activations and no accumulator; with
    full recompute and accumulation it is backward's end, every accumulator and one
    layer's recompute; with accumulation the second micro-batch's forward runs with them
    held. With one micro-batch the gradients are bf16 (keep_16bit): half the bytes."""
    plain = _bench_parts()
    assert plain["grads"] == 0 and plain["activations"] > 10 and plain["logits"] > 0
    full = _bench_parts(extra=RECOMPUTE, micro_batches=2)
    assert full["grads"] == pytest.approx(plain["weights"] * 2)  # fp32 against bf16 weights
    # the second forward: every layer's input and one layer's recompute, the accumulators held
    assert full["activations"] == pytest.approx(plain["activations"] * 2.5 / 24.003, rel=1e-3)
    accum = _bench_parts(micro_batches=2)
    assert accum["grads"] == full["grads"] and accum["activations"] == plain["activations"]
    fp8 = _bench_parts("megaq-fp8dl-comp")
    assert fp8["activations"] < 0.75 * plain["activations"]
    # gradients reduced once per step (stage 1; stages 0 and 3 with last_microbatch): the
    # full fp32 gradients come at the first backward and are held through the second
    # micro-batch's forward, the accumulators only in finish_grad_sync
    for extra in (["--zero-stage", "1"], ["--zero-grad-sync", "last_microbatch"],
                  ["--zero-stage", "3", "--zero-grad-sync", "last_microbatch"]):
        once, once_accum = (_bench_parts(extra=extra, micro_batches=m) for m in (1, 2))
        assert once["grads"] == 0 and once_accum["grads"] == 0, extra
        assert once_accum["grad_buckets"] == pytest.approx(full["grads"], rel=0.01), extra


def test_gradients_are_planned_16bit_where_the_engine_keeps_them_so():
    """PlanInput.grad_elem follows the engine's keep_16bit (megaq.zero.grads; the engine's
    own bytes: tests/test_fused_adamw.py): DP = 1, one micro-batch, AdamW; anything that
    writes or reduces a gradient twice, or SGD, holds fp32 accumulators."""
    from megaq.planner.bench_rows import bench_argv
    from megaq.planner.calibrate import _run_config

    def plan(extra=(), micro_batches=1):
        argv = bench_argv("1.3B", "megaq-s0-comp")
        gb = argv.index("--global-batch-size") + 1
        argv[gb] = str(int(argv[gb]) * micro_batches)
        return PlanInput.from_config(_run_config([*argv, *extra]))

    one = plan()
    assert one.grad_elem == 2
    for extra, m in (((), 2), (("--zero-grad-sync", "last_microbatch"), 1),
                     (("--zero-stage", "1"), 1), (("--optimizer", "sgd"), 1)):
        assert plan(extra, m).grad_elem == 4, (extra, m)
    assert dataclasses.replace(one, bf16=False).grad_elem == 4  # fp32 weights: fp32 grads
    assert plan(("--zero-stage", "3")).grad_elem == 2
    units = stage_units(one.model, 1, 1, 1, 0, one.e4m3_weights)
    numel = sum(u.numel for u in units)
    assert memory.engine_bytes(units, 1, one.zero, 2, grad_elem=one.grad_elem).grads == 2 * numel
    # full recompute, one micro-batch: backward's end (every gradient, 2 bytes each) is now
    # below backward's start (the kept layer inputs and the logits), which is the peak
    full16 = _bench_parts(extra=RECOMPUTE)
    assert full16["grads"] == 0 and full16["logits"] > 0


@pytest.mark.slow  # torch.compile on the CPU
@pytest.mark.parametrize("fp8", [None, ("hybrid", "delayed")], ids=["bf16", "fp8-delayed"])
def test_activation_terms_equal_what_a_compiled_block_saves(fp8):
    """memory.activation_bytes_per_layer against the saved tensors that
    megaq.testing.saved_bytes counts for one compiled block (inductor's partitioner, as
    on the GPU), byte for byte. FP8: that backend also keeps an FP8 copy of attention's
    output, which inductor's own passes (the GPU's compile) drop and the model leaves out."""
    from megaq.testing.saved_bytes import block_saved_bytes
    seq, mb = 32, 2
    kw = dict(fp8_format=fp8[0], fp8_recipe=fp8[1]) if fp8 else {}
    cfg = GPTConfig.llama(num_layers=1, hidden_size=64, num_attention_heads=4, vocab_size=64,
                          seq_length=seq, params_dtype=torch.bfloat16, **kw)
    counted = block_saved_bytes(cfg, compiled=True, micro_batch=mb)
    model = memory.activation_bytes_per_layer(cfg, seq * mb, 1, False, fp8=bool(fp8),
                                              compiled=True)
    partitioner_only = seq * mb * cfg.hidden_size if fp8 else 0  # the FP8 attention output
    # FP8 also keeps its 0-d scales and their inverses (a few bytes a GEMM, left out)
    scalars = 16 * 4 if fp8 else 0
    assert 0 <= counted.total - (model + partitioner_only) <= scalars, counted.by_dtype
