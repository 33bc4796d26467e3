"""megaq's one-pass AdamW step (megaq.kernels.fused_adamw): the Triton kernel (run by
the interpreter on the CPU, compiled on a GPU with TRITON_INTERPRET=0) gives the
reference's bits, and the ZeRO engine's step with it trains as torch's AdamW, writes
the model's bf16 weights in the same pass, and resumes exactly from a checkpoint."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from megaq.kernels import fused_adamw
from megaq.parallel.topology import Layout, build_topology
from megaq.zero import OptimizerSettings, ZeroConfig, build_engine

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # the kernel-vs-reference test's device


def _buffers(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [t.to(DEV) for t in (torch.randn(n, generator=g), torch.randn(n, generator=g) * 1e-2,
                                torch.randn(n, generator=g) * 1e-3, torch.rand(n, generator=g) * 1e-5)]


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, None])
@pytest.mark.parametrize("clip", [False, True])
def test_triton_step_matches_the_reference_bit_for_bit(monkeypatch, out_dtype, clip):
    monkeypatch.setenv("MEGAQ_KERNELS", "triton")
    n = 3 * 2048 + 77  # a partial last block
    coef = torch.tensor(0.37, device=DEV) if clip else None
    got, want = _buffers(n, 0), _buffers(n, 0)
    out_got = torch.full((n,), 7.0, dtype=out_dtype, device=DEV) if out_dtype else None
    out_want = out_got.clone() if out_dtype else None
    for step in (1, 2, 50):  # the bias corrections change with the step
        scalars = fused_adamw.step_scalars(1e-3, 0.1, (0.9, 0.95), 1e-8, step)
        fused_adamw.adamw_step(*got, out_got, coef, scalars)
        fused_adamw.adamw_step_reference(*want, out_want, coef, scalars)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    if out_dtype is not None:
        assert torch.equal(out_got, out_want)
        assert torch.equal(out_got, got[0].to(out_dtype))  # round to nearest even


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kernels", ["triton", "torch"])
def test_a_16bit_grad_gives_the_bits_of_its_fp32_copy(monkeypatch, grad_dtype, kernels):
    """The engine may hand the step a 16-bit gradient (megaq.zero.grads, keep_16bit): read
    upcast, it must update exactly as its fp32 copy does (the value an fp32 accumulator
    of it would hold), clip factor included."""
    monkeypatch.setenv("MEGAQ_KERNELS", kernels)
    n = 2 * 2048 + 5
    coef = torch.tensor(0.37, device=DEV)
    got, want = _buffers(n, 1), _buffers(n, 1)
    got[1] = got[1].to(grad_dtype)
    want[1] = got[1].float()
    out_got, out_want = (torch.zeros(n, dtype=torch.bfloat16, device=DEV) for _ in range(2))
    scalars = fused_adamw.step_scalars(1e-3, 0.1, (0.9, 0.95), 1e-8, 3)
    fused_adamw.adamw_step(*got, out_got, coef, scalars)
    fused_adamw.adamw_step(*want, out_want, coef, scalars)
    for i in (0, 2, 3):
        assert torch.equal(got[i], want[i])
    assert torch.equal(out_got, out_want)
    with pytest.raises(ValueError, match="fp32, bf16 or fp16 grad"):
        fused_adamw.adamw_step(*(t.clone() for t in want[:1]), want[1].to(torch.int32),
                               *want[2:], None, None, scalars)


@pytest.mark.parametrize("kernels", ["triton", "torch"])
def test_the_step_takes_the_new_weights_amax_per_range(monkeypatch, kernels):
    """Stage 0's E4M3 weights take their scale from the new masters' max |x| per weight
    (megaq.zero.fp8_resident): the step writes it in its own pass, the same value as
    reading the new weights again, for ranges inside one block, across block edges, with
    gaps between them, empty, in the partial last block, and with a NaN (which wins)."""
    monkeypatch.setenv("MEGAQ_KERNELS", kernels)
    n = 3 * 2048 + 77
    ranges = [(0, 5), (5, 2048), (2100, 4100), (4100, 4100), (4200, n)]
    got = _buffers(n, 2)
    got[0][4300] = float("nan")
    want = [t.clone() for t in got]
    amax = torch.full((len(ranges),), -1.0, device=DEV)  # the step overwrites every element
    segments = fused_adamw.Segments(ranges, amax)
    scalars = fused_adamw.step_scalars(1e-3, 0.1, (0.9, 0.95), 1e-8, 2)
    fused_adamw.adamw_step(*got, None, None, scalars, segments)
    fused_adamw.adamw_step(*want, None, None, scalars)
    for a, b in zip(got, want):  # the update itself is unchanged (NaN included: bits)
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    new = want[0]
    expect = [new[a:b].abs().max().item() if b > a else 0.0 for a, b in ranges]
    assert amax[:4].tolist() == expect[:4] and amax[4].isnan(), (amax, expect)
    with pytest.raises(ValueError, match="sorted, disjoint"):
        fused_adamw.Segments([(10, 20), (15, 30)], torch.zeros(2, device=DEV))
    with pytest.raises(ValueError, match="must lie in param"):
        fused_adamw.adamw_step(*want, None, None, scalars,
                               fused_adamw.Segments([(0, n + 1)], torch.zeros(1, device=DEV)))


def test_step_scalars_refuse_step_zero():
    with pytest.raises(ValueError, match="steps count from 1"):
        fused_adamw.step_scalars(1e-3, 0.0, (0.9, 0.95), 1e-8, 0)


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.embedding = nn.Embedding(11, 8)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 12), nn.GELU(), nn.Linear(12, 8))
                                    for _ in range(2))
        self.output_layer = nn.Linear(8, 11, bias=False)

    def forward(self, ids):
        x = self.embedding(ids)
        for layer in self.layers:
            x = x + layer(x)
        return self.output_layer(x)


def _train(fused_step, steps, stage=0, start=None, dtype=torch.bfloat16, *, clip=0.05,
           micro_batches=1, keep_16bit=None, seen=None):
    """`steps` clipped AdamW steps from `start` (a full_state) or from scratch; returns
    (model, engine). `keep_16bit`: override the engine's choice of 16-bit gradients;
    `seen`: a list that gets (grad norm, gradient bytes held) of each step."""
    model = _Net().to(dtype)
    engine = build_engine([model], build_topology(Layout(1), 0),
                          ZeroConfig(stage=stage, block_size=4, gather_dtype=dtype),
                          OptimizerSettings(weight_decay=0.1, lr=1e-2, adam_beta2=0.95,
                                            fused_step=fused_step))
    assert engine.optimizer.kind == ("onepass" if fused_step else "foreach")
    assert engine.grads.keep_16bit == bool(fused_step and dtype != torch.float32)
    if keep_16bit is not None:
        engine.grads.keep_16bit = keep_16bit
    done = 0
    if start is not None:
        engine.load_full_state(start)
        done = start["step"]
    for i in range(done, done + steps):
        engine.zero_grad()
        for k in range(micro_batches):
            ids = torch.randint(0, 11, (4, 6), generator=torch.Generator().manual_seed(i * 7 + k))
            out = model(ids[:, :-1])
            nn.functional.cross_entropy(out.float().reshape(-1, 11), ids[:, 1:].reshape(-1)).backward()
        engine.finish_grad_sync()
        norm = engine.clip_grad_norm(clip)  # 0.05: active, the factor must reach the kernel
        if seen is not None:
            seen.append((float(norm), engine.grads.memory_bytes()))
        engine.step(1e-2)
    return model, engine


@pytest.mark.parametrize("stage", [0, 3])
def test_16bit_gradients_train_as_fp32_accumulators_in_half_the_memory(stage):
    """At DP=1 the one-pass step's engine keeps a step's bf16 gradients as they come
    (megaq.zero.grads, keep_16bit) instead of upcasting them into fp32 accumulators:
    - one micro-batch, no clipping: the same bits as the fp32 accumulators, with 2 bytes
      per parameter held instead of 4;
    - two micro-batches (the second write moves each partition to fp32 first): the same
      bits, 4 bytes per parameter;
    - clipping: the norm is summed in another order (fp32 squares of the bf16 values), so
      it and the weights agree to 1e-6 relative (one fp32 ulp is 1.2e-7; a norm of the
      wrong values would be off by far more)."""
    numel = sum(p.numel() for p in _Net().parameters())
    for micro_batches, clip in ((1, None), (2, None), (1, 0.05)):
        runs = {}
        for keep in (True, False):
            seen = []
            _, eng = _train(True, 3, stage, clip=clip, micro_batches=micro_batches,
                            keep_16bit=keep, seen=seen)
            runs[keep] = (eng.full_state()["params"], seen)
        (got, seen16), (want, seen32) = runs[True], runs[False]
        held = 2 if micro_batches == 1 else 4
        assert {b for _, b in seen16} == {held * numel} and {b for _, b in seen32} == {4 * numel}
        for name in want:
            for key in ("param", "exp_avg", "exp_avg_sq"):
                if clip is None:
                    assert torch.equal(got[name][key], want[name][key]), (micro_batches, name, key)
                else:
                    assert torch.allclose(got[name][key], want[name][key], rtol=1e-6, atol=1e-12), (name, key)
        for (n16, _), (n32, _) in zip(seen16, seen32):
            assert n16 == pytest.approx(n32, rel=1e-6)
            if clip is None and micro_batches == 1:
                assert n16 > 0.05  # the clipping case below is active


@pytest.mark.parametrize("stage", [0, 3])
def test_engine_step_trains_as_torch_adamw_and_writes_the_model_weights(stage):
    """Against torch's foreach AdamW over 4 steps: the fp32 masters agree to 2e-6
    relative (the two round a few products in another order, about one ulp per step;
    a dropped clip factor or weight decay changes them by orders of magnitude more),
    and the bf16 weights the model computes with are the masters rounded, written by the
    same kernel (no separate write-back)."""
    model_f, eng_f = _train(True, 4, stage)
    model_t, eng_t = _train(False, 4, stage)
    state_f, state_t = eng_f.full_state()["params"], eng_t.full_state()["params"]
    for name in state_t:
        for key in ("param", "exp_avg", "exp_avg_sq"):
            assert torch.allclose(state_f[name][key], state_t[name][key], rtol=2e-6, atol=1e-9), (name, key)
    if stage == 0:  # the model's own parameters are the gather-dtype weights
        for name, p in model_f.named_parameters():
            assert p.dtype == torch.bfloat16
            assert torch.equal(p.detach(), state_f[name]["param"].to(torch.bfloat16)), name


def test_engine_resumes_exactly_with_the_one_pass_step():
    """A run saved after 2 steps and resumed for 2 more ends with the same bits as 4
    uninterrupted steps (masters, moments and step count all travel)."""
    _, whole = _train(True, 4)
    _, first = _train(True, 2)
    _, resumed = _train(True, 2, start=first.full_state())
    a, b = whole.full_state(), resumed.full_state()
    assert a["step"] == b["step"] == 4
    for name in a["params"]:
        for key in ("param", "exp_avg", "exp_avg_sq"):
            assert torch.equal(a["params"][name][key], b["params"][name][key]), (name, key)


def _pipeline_steps_both_ways(topo):
    """On each of PP=2's ranks: 2 steps at 1 and at 2 micro-batches, with the engine's
    16-bit gradients and with fp32 accumulators; {(keep_16bit, micro-batches): full_state}."""
    import zero_harness as H
    from megaq.parallel.pipeline import get_forward_backward_func, pipeline_tensor_shape
    from megaq.parallelize import parallelize

    out = {}
    for n_micro in (1, 2):
        for keep in (True, False):
            cfg = H.model_config(params_dtype=torch.bfloat16)  # tied embedding: one per stage
            torch.manual_seed(0)
            chunks, engine = parallelize(cfg, topo, ZeroConfig(stage=0, gather_dtype=torch.bfloat16),
                                         optimizer=OptimizerSettings(lr=H.LR, fused_step=True))
            assert engine.grads.keep_16bit and topo.embedding.size == 2
            engine.grads.keep_16bit = keep
            fb = get_forward_backward_func(topo.layout.pp, 1)
            shape = pipeline_tensor_shape(H.SEQ, H.MBS, cfg.hidden_size, 1, False)
            for step in range(2):
                engine.zero_grad()
                fb(chunks, H.microbatches(step, 0, 1, n_micro, cfg.vocab_size), n_micro, topo,
                   tensor_shape=shape, dtype=torch.bfloat16)
                engine.finish_grad_sync()
                engine.clip_grad_norm(None)
                engine.step(H.LR)
            out[(keep, n_micro)] = engine.full_state()["params"]
    return out


def test_16bit_gradients_under_a_pipeline_with_a_tied_embedding():
    """PP=2 at DP=1 (the engine keeps 16-bit gradients): the tied embedding's two copies
    are summed in fp32 (moved there first), and a second micro-batch's write moves each
    partition to fp32; with no clipping every weight and moment is the fp32 accumulators'
    to the bit, on both stages."""
    from megaq.testing.ranks import run_on_ranks
    for rank, out in enumerate(run_on_ranks(_pipeline_steps_both_ways, 2, pp=2)):
        for n_micro in (1, 2):
            got, want = out[(True, n_micro)], out[(False, n_micro)]
            assert got.keys() == want.keys() and got
            for name in want:
                for key in ("param", "exp_avg", "exp_avg_sq"):
                    assert torch.equal(got[name][key], want[name][key]), (rank, n_micro, name, key)
