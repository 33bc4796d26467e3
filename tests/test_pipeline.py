"""Pipeline parallelism: every PP / interleaving / TP / SP layout matches one process.

Each case runs 3 optimizer steps on gloo ranks and, in the parent, the same 3 steps on
one process with the whole model, then compares per-micro-batch losses, every
parameter's gradient after step 1 and every parameter after step 3 (fp32).

Tolerance: relative error ||a - b|| / ||b|| < 1e-5 per tensor. The only differences
are fp32 summation orders (TP all-reduces, gradient accumulation over micro-batches,
all-reduce of tied / sequence-parallel grads), which are ~1e-7 relative; a wrong
micro-batch pairing, a missing scale or a dropped gradient is O(1).

AdamW uses eps=1e-4 (same for both runs): Adam normalises each element, so a
gradient element that is ~0 (e.g. the key bias, whose exact gradient is zero by
softmax shift invariance) turns fp32 rounding noise delta into a step of up to
lr * delta / eps. With eps=1e-8 that is O(lr) per noisy element; with 1e-4 it is
< 1e-9, while real gradients here (1e-4 .. 1e-1) still get Adam-scaled steps.
Because Adam hides gradient scale, the step-1 gradients are compared directly.
"""

import dataclasses
import re
from types import SimpleNamespace

import pytest
import torch

from megaq.testing.ranks import run_on_ranks
from megaq.parallel.pipeline import (PipelineConfigError, PipelineP2P,
                                     check_num_microbatches, chunk_layer_range,
                                     forward_backward_no_pipelining, get_forward_backward_func,
                                     num_microbatches_per_step, pipeline_tensor_shape,
                                     virtual_pipeline_size)
from megaq.parallel.tensor_parallel import shard_of, single_rank_group
from megaq.model.config import GPTConfig
from megaq.model.gpt import GPTModel
from megaq.parallelize import parallelize
from megaq.zero import OptimizerSettings, ZeroConfig, wants_weight_decay

RTOL = 1e-5
STEPS, MBS, SEQ = 3, 2, 8
ADAM = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-4, weight_decay=0.1)


def make_config(family: str, num_layers: int, sequence_parallel: bool = False) -> GPTConfig:
    kw = dict(num_layers=num_layers, hidden_size=32, num_attention_heads=4, vocab_size=96,
              seq_length=SEQ, make_vocab_size_divisible_by=64, attention_dropout=0.0,
              hidden_dropout=0.0, sequence_parallel=sequence_parallel, seed=7)
    if family == "llama":
        return GPTConfig.llama(num_query_groups=2, **kw)
    if family == "gpt2_untied":
        return GPTConfig.gpt2(untie_embeddings_and_output_weights=True, **kw)
    return GPTConfig.gpt2(**kw)


def make_batches(cfg: GPTConfig, m: int) -> list[list[dict]]:
    g = torch.Generator().manual_seed(123)
    steps = []
    for _ in range(STEPS):
        mbs = []
        for _ in range(m):
            tokens = torch.randint(0, cfg.vocab_size, (MBS, SEQ + 1), generator=g)
            mask = (torch.rand(MBS, SEQ, generator=g) > 0.2).float()  # uneven counts per micro-batch
            mbs.append(dict(tokens=tokens[:, :-1], labels=tokens[:, 1:], loss_mask=mask))
        steps.append(mbs)
    return steps


def global_name(name: str, layer_start: int) -> str:
    return re.sub(r"^layers\.(\d+)\.", lambda mt: f"layers.{int(mt.group(1)) + layer_start}.", name)


def named_params(chunks):
    """(global name, param, is the tied copy on the last stage) over this rank's chunks."""
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            copy = getattr(p, "shared_embedding", False) and chunk.embedding is None
            yield global_name(name, chunk.layer_start), p, copy


def reference(cfg: GPTConfig, batches) -> dict:
    model = GPTModel(cfg, single_rank_group())
    named = list(model.named_parameters())
    decay = ADAM["weight_decay"]  # Megatron's rule, as the engine: none on biases and 1-D
    opt = torch.optim.AdamW([{"params": [p for n, p in named if wants_weight_decay(n, p)]},
                             {"params": [p for n, p in named if not wants_weight_decay(n, p)],
                              "weight_decay": 0.0}], **dict(ADAM, weight_decay=decay))
    losses, grads = [], {}
    for step, mbs in enumerate(batches):
        opt.zero_grad(set_to_none=True)
        losses.append(torch.stack(forward_backward_no_pipelining([model], mbs, len(mbs))))
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
    return dict(losses=losses, grads=grads, params={n: p.detach().clone()
                                                    for n, p in model.named_parameters()})


def _stage_batches(topo, mbs):
    """Only what each stage needs: tokens first, labels + mask last, nothing in between."""
    keep = (["tokens"] if topo.is_first_stage else []) + (
        ["labels", "loss_mask"] if topo.is_last_stage else [])
    return None if not keep else [{k: mb[k] for k in keep} for mb in mbs]


def _engine_grads(engine) -> dict:
    """{id(param): its fp32 gradient} read from the engine's accumulators (stage 0, DP=1:
    the accumulator of a partition is its whole flat gradient)."""
    accum = engine.grads.read()
    return {id(slot.param): accum[part.name][slot.offset:slot.offset + slot.numel].view(slot.shape)
            for part in engine.partitions for slot in part.slots}


def _train_on_rank(topo, cfg, vp, batches):
    """The production gradient path: the stage-0 engine at DP=1 sums sequence-parallel
    grads over TP and the tied embedding copies over the first and last stage."""
    opt = OptimizerSettings(lr=ADAM["lr"], adam_beta1=ADAM["betas"][0],
                            adam_beta2=ADAM["betas"][1], adam_eps=ADAM["eps"],
                            weight_decay=ADAM["weight_decay"])
    chunks, engine = parallelize(cfg, topo, ZeroConfig(stage=0), optimizer=opt, vp_size=vp)
    schedule = get_forward_backward_func(topo.layout.pp, vp)
    shape = pipeline_tensor_shape(SEQ, MBS, cfg.hidden_size, topo.tp.size, cfg.sequence_parallel)
    losses, grads = [], {}
    for step, mbs in enumerate(batches):
        engine.zero_grad()
        out = schedule(chunks, _stage_batches(topo, mbs), len(mbs), topo, tensor_shape=shape)
        losses.append(torch.stack(out) if out else None)
        engine.finish_grad_sync()
        if step == 0:
            by_id = _engine_grads(engine)
            grads = {n: by_id[id(p)].clone() for n, p, _ in named_params(chunks)}
        engine.step(ADAM["lr"])
    meta = {n: dict(dim=getattr(p, "partition_dim", -1), stride=getattr(p, "partition_stride", 1),
                    tp=getattr(p, "tensor_model_parallel", False), copy=copy,
                    shared=getattr(p, "shared_embedding", False))
            for n, p, copy in named_params(chunks)}
    return dict(losses=losses, grads=grads, meta=meta, tp_rank=topo.tp_rank, tp=topo.tp.size,
                params={n: p.detach().clone() for n, p, _ in named_params(chunks)})


def rel_err(a, b):
    return ((a - b).norm() / b.norm().clamp(min=1e-12)).item()


def check_against_reference(cfg, results, ref):
    # The tied copy on the last stage is checked against the embedding it copies.
    first_stage_shared = {n for r in results for n, m in r["meta"].items()
                          if m["shared"] and not m["copy"]}
    seen = set()
    for r in results:
        if r["losses"][0] is not None:
            for step in range(STEPS):
                assert rel_err(r["losses"][step], ref["losses"][step]) < RTOL, step
        for name, m in r["meta"].items():
            ref_name = next(iter(first_stage_shared)) if m["copy"] else name
            seen.add(ref_name)
            for what in ("grads", "params"):
                want = ref[what][ref_name]
                if m["tp"]:
                    want = shard_of(want, m["dim"], r["tp_rank"], r["tp"], m["stride"])
                err = rel_err(r[what][name], want)
                assert err < RTOL, f"{what} of {name} (tp rank {r['tp_rank']}): rel err {err:.2e}"
    assert seen == set(ref["params"]), f"parameters never compared: {set(ref['params']) - seen}"


CASES = [  # family, layers, pp, vp, tp, sequence parallel, micro-batches
    ("gpt2", 4, 2, None, 1, False, 3),
    ("llama", 4, 4, None, 1, False, 3),   # m < pp: some stages never reach steady state
    ("gpt2", 4, 2, 2, 2, True, 4),
    ("llama", 8, 4, 2, 1, False, 4),
    ("llama", 4, 2, 2, 2, True, 2),       # m == pp: the interleaved all-warm-up path
    ("gpt2_untied", 4, 2, None, 2, False, 4),
]


@pytest.mark.parametrize("family,layers,pp,vp,tp,sp,m", CASES)
def test_pipeline_matches_single_process(family, layers, pp, vp, tp, sp, m):
    cfg = make_config(family, layers, sp)
    batches = make_batches(cfg, m)
    ref = reference(make_config(family, layers), batches)
    results = run_on_ranks(_train_on_rank, tp * pp, tp=tp, pp=pp, args=(cfg, vp, batches))
    check_against_reference(cfg, results, ref)


# ------------------------------------------------------------ memory, eval mode
def _count_live_activations(topo, cfg, vp, batches):
    """Max number of micro-batch activations a rank holds (forward done, backward not yet).

    Counted from outside the schedule: a forward hook on each chunk adds one and puts a
    hook on the chunk's output that removes it when the output's gradient arrives.
    """
    chunks, _ = parallelize(cfg, topo, vp_size=vp)  # no engine: plain autograd grads
    live, peak = [0], [0]

    def on_forward(module, args, kwargs, output):
        if torch.is_grad_enabled():
            live[0] += 1
            peak[0] = max(peak[0], live[0])
            output.register_hook(lambda g: live.__setitem__(0, live[0] - 1))

    for c in chunks:
        c.register_forward_hook(on_forward, with_kwargs=True)
    shape = pipeline_tensor_shape(SEQ, MBS, cfg.hidden_size)
    schedule = get_forward_backward_func(topo.layout.pp, vp)
    mbs = _stage_batches(topo, batches[0])
    kw = dict(tensor_shape=shape, dtype=cfg.params_dtype)
    eval_losses = schedule(chunks, mbs, len(batches[0]), topo, forward_only=True, **kw)
    grads_after_eval = [p.grad for c in chunks for p in c.parameters() if p.grad is not None]
    train_losses = schedule(chunks, mbs, len(batches[0]), topo, **kw)
    grads_ok = all(p.grad is not None and p.grad.dtype == cfg.params_dtype and p.grad.isfinite().all()
                   for c in chunks for p in c.parameters())
    return dict(peak=peak[0], live_at_end=live[0], eval=eval_losses, train=train_losses,
                grads_after_eval=len(grads_after_eval), grads_ok=grads_ok)


@pytest.mark.parametrize("vp,dtype", [(None, torch.bfloat16), (2, torch.float32)])
def test_activation_memory_and_eval_mode(vp, dtype):
    """Also runs one layout in bf16: activations and gradients cross stages in that dtype."""
    pp, m = 4, 8
    cfg = dataclasses.replace(make_config("llama", 8), params_dtype=dtype)
    out = run_on_ranks(_count_live_activations, pp, pp=pp, args=(cfg, vp, make_batches(cfg, m)))
    v = vp or 1
    for stage, r in enumerate(out):
        if vp is None:
            # 1F1B: stage p runs pp-p-1 warm-up forwards, then one more before its first
            # backward -- the first stage holds pp micro-batches, not all m = 8.
            assert r["peak"] == pp - stage, (stage, r["peak"])
        else:
            # Interleaved (Megatron's warm-up): 2(pp-p-1) + (vp-1)pp forwards, plus one.
            assert r["peak"] == min(2 * (pp - stage - 1) + (v - 1) * pp + 1, m * v), (stage, r["peak"])
        assert r["live_at_end"] == 0
        assert r["grads_after_eval"] == 0  # forward-only builds no graph
        assert r["grads_ok"]  # every parameter got a finite gradient of its own dtype
    assert out[0]["peak"] < m * v
    last = out[-1]
    assert len(last["eval"]) == m and all(not r["eval"] for r in out[:-1])
    # Eval and training forward are the same computation on the same weights.
    assert torch.equal(torch.stack(last["eval"]), torch.stack(last["train"]))


# ---------------------------------------------------------------------- refusals
def test_layer_split_and_virtual_assignment():
    # Megatron's interleaved assignment: chunk v of stage p holds (v*pp + p)-th block.
    assert chunk_layer_range(8, 2, 2, stage=1, chunk=0) == (2, 4)
    assert chunk_layer_range(8, 2, 2, stage=1, chunk=1) == (6, 8)
    assert virtual_pipeline_size(8, 2, 2) == 2 and virtual_pipeline_size(8, 2, None) == 1
    topo = SimpleNamespace(layout=SimpleNamespace(pp=2), pp_rank=1, tp=single_rank_group())
    chunks, _ = parallelize(make_config("gpt2", 8), topo, vp_size=2)
    assert [(c.layer_start, c.layer_end) for c in chunks] == [(2, 4), (6, 8)]
    assert [c.embedding is None for c in chunks] == [True, True]
    assert [c.output_layer is not None for c in chunks] == [False, True]
    # The tied copy on the last stage is marked for the embedding-group all-reduce.
    assert chunks[1].output_layer.weight.shared_embedding


@pytest.mark.parametrize("call,message", [
    (lambda: chunk_layer_range(10, 4, 1, 0, 0), "--num-layers 10 is not divisible by --pipeline-model-parallel-size 4"),
    (lambda: virtual_pipeline_size(8, 1, 2), "needs --pipeline-model-parallel-size > 1"),
    (lambda: virtual_pipeline_size(12, 2, 4), "does not divide the 6 layers per pipeline stage"),
    (lambda: get_forward_backward_func(1, 2), "virtual pipeline stages need --pipeline-model-parallel-size > 1"),
    (lambda: check_num_microbatches(6, 4, 2), "needs the number of micro-batches (6) to be a multiple of"),
    (lambda: num_microbatches_per_step(10, 2, 4), "--global-batch-size 10 is not a multiple"),
    (lambda: pipeline_tensor_shape(10, 2, 32, 4, True), "--seq-length 10 is not divisible"),
    (lambda: parallelize(make_config("gpt2", 6), SimpleNamespace(
        layout=SimpleNamespace(pp=4), pp_rank=0, tp=single_rank_group())), "--num-layers 6 is not divisible"),
    (lambda: PipelineP2P(single_rank_group(), (4, 2, 8), torch.float32, "cpu", True).communicate(
        send_next=torch.zeros(8, 2, 8)), "expects (4, 2, 8)"),
    (lambda: forward_backward_no_pipelining([GPTModel(make_config("gpt2", 1))], [], 1),
     "micro-batch source ran out after 0 micro-batches"),
])
def test_refusals_name_the_problem(call, message):
    with pytest.raises(PipelineConfigError) as err:
        call()
    assert message in str(err.value)
