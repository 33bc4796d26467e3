"""Stage 0 with FP8 GEMMs holds their weights in E4M3 only (megaq.zero.fp8_resident),
on gloo ranks with the CPU emulation of the FP8 GEMMs (megaq.parallel.fp8).

* Numerics: the bound is zero. The engine casts each weight from its fp32 master once
  per step, rounded to bf16 first, with the amax MAX-reduced over TP: the bits the GEMM
  gets by casting the bf16 weight itself. At TP=2 x DP=2 with two micro-batches, stage 0
  trains to the same losses, bit for bit, as stage 2, whose whole bf16 weights are
  gathered after every step and cast by the GEMMs (at DP=2 the two stages' gradient sums
  are the same single addition per micro-batch; no clipping, as stage 0 sums the grad
  norm's squares in another order, so its norm differs in the last bits:
  tests/test_zero_stages.py), for the tensorwise and the delayed recipes, and across a
  reload of the weights and optimizer state (tensorwise: the E4M3 weights are cast
  again; the delayed recipe's amax histories are the trainer's to save).
* Memory: the layers' 16-bit weights are never allocated; the engine reports the
  E4M3 bytes, one per element, and the rest in bf16. Rowwise FP8 (a scale per row,
  different forward and backward) keeps 16-bit weights.
"""

from __future__ import annotations

import pytest
import torch

from megaq.parallel import comm
from megaq.parallel.fp8 import fp8_gemm_layers
from megaq.parallel.pipeline import get_forward_backward_func, pipeline_tensor_shape
from megaq.parallelize import parallelize
from megaq.testing.ranks import run_on_ranks
from megaq.zero import OptimizerSettings, ZeroConfig

from zero_harness import MBS, SEQ, learnable_batch, model_config, split_microbatches

MODEL = dict(params_dtype=torch.bfloat16, hidden_size=32, num_attention_heads=4,
             untie_embeddings_and_output_weights=True, fp8_format="hybrid")
OPT = OptimizerSettings(lr=1e-2, weight_decay=0.1)


def _train(topo, stage, recipe, steps=4, n_micro=2, reload_at=None):
    cfg = model_config(**MODEL, fp8_recipe=recipe, fp8_amax_history_len=4)
    torch.manual_seed(0)
    chunks, engine = parallelize(cfg, topo, ZeroConfig(stage=stage, block_size=64,
                                                       gather_dtype=torch.bfloat16), optimizer=OPT)
    fb = get_forward_backward_func(1, 1)
    shape = pipeline_tensor_shape(SEQ, MBS, cfg.hidden_size, topo.tp.size, cfg.sequence_parallel)
    dp = topo.dp.size

    def one_step(step):
        engine.zero_grad()
        data = learnable_batch(1000 + step % 2, dp * MBS * n_micro, cfg.vocab_size)
        mbs = split_microbatches(data, topo.dp_rank, n_micro)
        out = fb(chunks, mbs, n_micro, topo, tensor_shape=shape, dtype=cfg.params_dtype)
        engine.finish_grad_sync()
        norm = float(engine.clip_grad_norm(None))
        engine.step(OPT.lr)
        t = torch.tensor([sum(float(x) for x in out) / n_micro])
        comm.all_reduce(t, topo.dp, "dp_misc")
        return float(t[0]) / dp, norm

    losses, norms = [], []
    for step in range(steps):
        loss, norm = one_step(step)
        losses.append(loss)
        norms.append(norm)
        if step + 1 == reload_at:
            snap = engine.full_state()
            one_step(step + 1)           # move the weights (and their E4M3 copies) on ...
            engine.load_full_state(snap)  # ... and rewind: the copies must be cast again
    layers = [m for c in chunks for m in fp8_gemm_layers(c)]
    e4m3_only = all(m.weight.untyped_storage().nbytes() == 0 and m.gemm.weight_fp8 is not None
                    for m in layers)
    fp8_numel = sum(m.weight.numel() for m in layers)
    numel = sum(p.numel for p in engine.partitions)
    return {"losses": losses, "norms": norms, "e4m3_only": e4m3_only,
            "params_bytes": engine.memory_report()["params"],
            "want_e4m3_bytes": 2 * (numel - fp8_numel) + fp8_numel + 16 * len(layers),
            "bf16_bytes": 2 * numel}


def _scenarios(topo):
    return {name: _train(topo, *args) for name, args in {
        "s0_tw": (0, "tensorwise"), "s2_tw": (2, "tensorwise"),
        "s0_dl": (0, "delayed"), "s2_dl": (2, "delayed"),
        "s0_tw_reloaded": (0, "tensorwise", 4, 2, 2),
        "s0_rw": (0, "rowwise", 1)}.items()}


def test_stage0_fp8_weights_are_e4m3_only_and_train_bit_identically():
    res = run_on_ranks(_scenarios, 4, tp=2)
    for r in res:
        for recipe in ("tw", "dl"):
            s0, s2 = r[f"s0_{recipe}"], r[f"s2_{recipe}"]
            assert s0["e4m3_only"] and not s2["e4m3_only"], recipe
            assert s0["losses"] == s2["losses"], (recipe, s0, s2)
            assert s0["norms"] == pytest.approx(s2["norms"], rel=1e-6), (recipe, s0, s2)
            assert s0["losses"][-1] < 0.95 * s0["losses"][0], s0  # it learns
            assert s0["params_bytes"] == s0["want_e4m3_bytes"] < s0["bf16_bytes"], s0
        assert r["s0_tw_reloaded"]["losses"] == r["s0_tw"]["losses"], r
        rw = r["s0_rw"]
        assert not rw["e4m3_only"] and rw["params_bytes"] == rw["bf16_bytes"], rw


@pytest.mark.parametrize("recipe", ["delayed", "rowwise"])
def test_planner_memory_model_counts_the_e4m3_weights(recipe):
    """megaq.planner.memory's stage-0 terms equal the engine's allocations, E4M3 or not."""
    from megaq.parallel.topology import Layout, build_topology
    from megaq.planner import memory
    from megaq.planner.shapes import stage_units
    from megaq.planner.step import PlanInput

    cfg = model_config(**MODEL, fp8_recipe=recipe)
    zero = ZeroConfig(stage=0, gather_dtype=torch.bfloat16)
    _, engine = parallelize(cfg, build_topology(Layout(world_size=1), 0), zero)
    pi = PlanInput(model=cfg, zero=zero, micro_batch_size=MBS, global_batch_size=MBS, bf16=True)
    assert pi.e4m3_weights == (recipe == "delayed")
    units = stage_units(pi.model, 1, 1, 1, 0, pi.e4m3_weights)
    model = memory.engine_bytes(units, 1, zero, pi.elem)
    rep = engine.memory_report()
    assert (rep["params"], rep["optimizer"]) == (model.params, model.optimizer), rep
    # the gradients hold nothing until backward's first write (megaq.zero.grads); the CPU's
    # torch AdamW then takes fp32 accumulators (PlanInput.grad_elem: the GPU's one-pass
    # step keeps bf16 ones instead)
    assert rep["grads"] == 0
    assert model.grads == sum(t.numel() * 4 for t in engine.grads._accum.values())


def _one_process_losses(stage: int, recipe: str, device: str, steps: int = 3,
                        opt: OptimizerSettings = OPT) -> tuple:
    from megaq.parallel.topology import Layout, build_topology

    cfg = model_config(**MODEL, fp8_recipe=recipe, fp8_amax_history_len=4)
    torch.manual_seed(0)
    (model,), engine = parallelize(cfg, build_topology(Layout(world_size=1), 0),
                                   ZeroConfig(stage=stage, block_size=64,
                                              gather_dtype=torch.bfloat16),
                                   optimizer=opt, device=device)
    losses = []
    for step in range(steps):
        engine.zero_grad()
        for mb in split_microbatches(learnable_batch(1000 + step % 2, 2 * MBS, cfg.vocab_size), 0, 2):
            loss = model(mb["tokens"].to(device), labels=mb["labels"].to(device)).float().mean()
            (loss / 2).backward()
            losses.append(float(loss.detach()))
        engine.finish_grad_sync()
        engine.step(OPT.lr)
    return losses, all(m.gemm.weight_fp8 is not None for m in fp8_gemm_layers(model))


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_one_process_e4m3_weights_equal_the_gemms_own_cast(device, recipe):
    """One process, two micro-batches a step: stage 0's E4M3 weights against ZeRO-3 at
    DP=1 (bf16 weights gathered, cast by each GEMM): the same losses, bit for bit; on a
    GPU with FP8 tensor cores through torch._scaled_mm (tests run there with
    TRITON_INTERPRET=0)."""
    s0, e4m3 = _one_process_losses(0, recipe, device)
    s3, bf16_cast = _one_process_losses(3, recipe, device)
    assert e4m3 and not bf16_cast  # stage 3 without FP8 weight gathers: the GEMMs cast
    assert s0 == s3, (s0, s3)


# the interpreter evaluates both sides of tl.where: the cross-entropy kernel's masked lanes
# (exp(-inf - -inf)) warn there, as in tests/test_fused_kernels.py
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_amaxes_from_the_one_pass_step_give_the_same_weights(monkeypatch, kernels):
    """megaq's one-pass AdamW (the GPU's default) takes each E4M3 weight's amax in its own
    pass, so the refresh does not read the masters for it: the same losses, bit for bit,
    as ZeRO-3 with the same optimizer, where each GEMM casts its gathered bf16 weight (the
    kernel in Triton's interpreter, and its torch reference); and every step's refresh
    got its amaxes from the step."""
    from megaq.zero.fp8_resident import ResidentFP8Weights
    monkeypatch.setenv("MEGAQ_KERNELS", kernels)
    handed = []
    refresh = ResidentFP8Weights.refresh
    monkeypatch.setattr(ResidentFP8Weights, "refresh",
                        lambda self, amax=None: (handed.append(amax is not None), refresh(self, amax)))
    onepass = OptimizerSettings(lr=OPT.lr, weight_decay=OPT.weight_decay, fused_step=True)
    s0, e4m3 = _one_process_losses(0, "delayed", "cpu", opt=onepass)
    assert e4m3 and handed == [False, True, True, True], handed  # build, then 3 steps
    s3, _ = _one_process_losses(3, "delayed", "cpu", opt=onepass)
    assert s0 == s3, (s0, s3)


def test_round_to_bf16_is_the_dtype_conversion():
    """fp8.round_to_bf16 (integer operations on the bits) gives exactly
    ``x.to(bfloat16).float()``: ties to even, both signs, subnormals, the top of the
    range (rounding up to inf) and exact half-ulp ties."""
    from megaq.parallel import fp8
    torch.manual_seed(0)
    x = torch.randn(1 << 18) * torch.logspace(-40, 38, 1 << 18)
    ties = (x.to(torch.bfloat16).float().view(torch.int32) + 0x8000).view(torch.float32)
    edge = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 1.17e-38, 3.3895e38, -3.3895e38, 3.4e38,
                         float("inf"), float("-inf")])
    xs = torch.cat([x, ties, edge])
    got = fp8.round_to_bf16(xs).view(torch.int32)
    assert torch.equal(got, xs.to(torch.bfloat16).float().view(torch.int32))


def test_compiled_refresh_cast_keeps_the_bf16_rounding():
    """The refresh's fused cast (fp8.cast_weight's compiled graph, here on the CPU
    backend) gives the bits of rounding to bf16 and then casting. (A plain ``w.to(bf16)``
    in that graph does not: inductor elides the downcast-upcast pair and casts the fp32
    value, as on the H100, where the refresh's first draft failed the CUDA case above.)
    The data holds values at and just past bf16 ties, where the two differ."""
    import math
    from megaq.parallel import fp8
    torch.manual_seed(0)
    m = torch.randn(1 << 16) * 0.02
    b = m.to(torch.bfloat16).float()
    m[: 1 << 14] = (b[: 1 << 14].view(torch.int32) + 0x8000).view(torch.float32)  # ties
    m[1 << 14: 1 << 15] = (b[1 << 14: 1 << 15].view(torch.int32) + 0x8001).view(torch.float32)
    scale = fp8.scale_from_amax(torch.linalg.vector_norm(m, math.inf).to(torch.bfloat16).float(),
                                fp8.E4M3, pow2=False)
    want = fp8.cast(m.to(torch.bfloat16), scale, fp8.E4M3).view(torch.uint8)
    out = torch.empty(1 << 16, dtype=fp8.E4M3)
    torch.compile(fp8._round_and_cast, dynamic=True)(out, m, scale, torch.bfloat16)
    assert torch.equal(out.view(torch.uint8), want)
    # the data tells the two apart: casting the fp32 values unrounded gives other bits
    assert not torch.equal(fp8.cast(m, scale, fp8.E4M3).view(torch.uint8), want)


def test_refresh_cast_falls_back_to_two_passes_where_compiling_loses_the_rounding():
    """fp8._RefreshCast checks its fused graph once against the two-pass form (round,
    then cast the bf16 tensor). A graph that drops the rounding, as inductor does with a
    plain ``w.to(bf16)``, is caught on the first call, warned about once, and every
    weight, that one included, gets the two-pass bits; a faithful graph is kept."""
    import math
    import warnings
    from megaq.parallel import fp8
    torch.manual_seed(0)
    m = torch.randn(4096) * 0.02
    b = m.to(torch.bfloat16).float()
    m[:1024] = (b[:1024].view(torch.int32) + 0x8000).view(torch.float32)  # bf16 ties
    scale = fp8.scale_from_amax(torch.linalg.vector_norm(m, math.inf).to(torch.bfloat16).float(),
                                fp8.E4M3, pow2=False)
    want = fp8.cast(m.to(torch.bfloat16), scale, fp8.E4M3).view(torch.uint8)

    def lossy(out, w, s, via):  # what the compiled graph of w.to(bf16) computes
        out.copy_(fp8.cast(w.float(), s, fp8.E4M3))

    def faithful(out, w, s, via):
        out.copy_(fp8.cast(w if via is None else w.to(via), s, fp8.E4M3))

    for graph, ok in ((lossy, False), (faithful, True)):
        rc = fp8._RefreshCast(compiled=graph)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                out = torch.empty(m.numel(), dtype=fp8.E4M3)
                rc(out, m, scale, torch.bfloat16)
                assert torch.equal(out.view(torch.uint8), want), graph.__name__
        assert rc.fused_ok is ok
        assert len(caught) == (0 if ok else 1), [str(w.message) for w in caught]
