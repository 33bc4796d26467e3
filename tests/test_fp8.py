"""FP8 linear layers (megaq.parallel.fp8) on CPU, through the fp32 emulation.

The emulation casts operands to FP8 exactly as the GPU path does and multiplies the
upcast values in fp32; FP8 x FP8 products are exact in fp32, so two runs that cast
the same values with the same scales differ only by fp32 accumulation order.

Tolerances:
* TP 1/2/4 (+SP), one layer or the whole model: every operand is cast from
  bit-identical values with bit-identical scales (the amax reductions make that so,
  and the scale test checks it), so outputs and grads differ only by fp32 summation
  order over shards: 1e-5 norm-relative, as tests/test_tensor_parallel.py
  (measured: <= 6e-8 for the layers, 4e-8 for the model's loss, 0 for its grads).
  Tensorwise scales taken per shard instead re-round each shard on its own grid:
  1e-2 to 7e-2 on these layers (measured), far above the tolerance. (Rowwise
  power-of-two scales hide most per-shard amax differences, which is why the scale
  test compares every scale exactly.)
* FP8 against fp32 (to show the tests exercise FP8 at all): 1e-4 to 1e-1,
  E4M3 carries 3 mantissa bits (relative step 6-12%), E5M2 2.
"""

import contextlib
import os

import pytest
import torch
import torch._dynamo  # noqa: F401  (imported once before the ranks fork)
from torch._dynamo.backends.common import aot_autograd
from functorch.compile import make_boxed_func

from megaq import pretrain
from megaq.kernels.dispatch import register_compiled_ops
from megaq.model import GPTConfig
from megaq.parallel import fp8, fp8_delayed
from megaq.parallel.fp8 import FP8Recipe, quantize
from megaq.testing.ranks import run_on_ranks
from megaq.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear, single_rank_group
from megaq.parallel.topology import Layout, build_topology
from megaq.parallelize import apply_fp8, compile_blocks, parallelize

RECIPES = [("hybrid", "tensorwise"), ("e4m3", "tensorwise"), ("hybrid", "rowwise")]


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _randn(seed, *shape):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def triton_on_cpu(monkeypatch):
    """megaq's Triton kernels on CPU tensors (MEGAQ_KERNELS=triton): Triton's interpreter,
    the CPU suite. A GPU run (TRITON_INTERPRET=0) cannot launch them on CPU tensors; its
    cases are the GPU tests below."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs megaq's Triton kernels on CPU tensors: needs TRITON_INTERPRET=1 (the CPU suite)")
    monkeypatch.setenv("MEGAQ_KERNELS", "triton")


@contextlib.contextmanager
def capture_scales():
    """Collect (role, inverse scale) of every cast the FP8 GEMMs make inside (eager only),
    by wrapping megaq.parallel.fp8's two cast functions (the GEMMs look them up by name
    at each call)."""
    log = []
    plain, delayed = fp8.quantize, fp8.quantize_delayed

    def recorded(cast):
        def run(*args, **kwargs):
            out = cast(*args, **kwargs)
            log.append((args[-1], out[1].detach().clone()))  # role (last), inverse scale
            return out
        return run

    fp8.quantize, fp8.quantize_delayed = recorded(plain), recorded(delayed)
    try:
        yield log
    finally:
        fp8.quantize, fp8.quantize_delayed = plain, delayed


def _one_process_model(cfg: GPTConfig):
    """The model of `cfg` on one process with its FP8 GEMMs (megaq.parallelize)."""
    return parallelize(cfg, build_topology(Layout(world_size=1), 0))[0][0]


# ------------------------------------------------------------------- casting
def test_quantize_scales_amax_to_the_format_max_and_rounds_to_fp8():
    x = _randn(0, 32, 64)
    x[3, 5] = 40.0  # an outlier sets the per-tensor scale
    for dtype in (fp8.E4M3, fp8.E5M2):
        fmax = torch.finfo(dtype).max
        q, inv = quantize(x, dtype, None, pow2=False)
        assert q.dtype == dtype and inv.shape == ()
        assert q.float()[3, 5].item() == fmax        # amax lands exactly on the format's max
        back = q.float() * inv
        # every value is an FP8 number times the scale: casting it again changes nothing
        assert torch.equal((back / inv).to(dtype).float(), q.float())
        assert _rel(back, x) < (0.07 if dtype == fp8.E4M3 else 0.14)  # 3 / 2 mantissa bits
    q, inv = quantize(x, fp8.E4M3, -1, pow2=True)    # rowwise: one power-of-two scale per row
    assert inv.shape == (32, 1)
    assert torch.equal(torch.exp2(torch.log2(inv).round()), inv)
    assert (q.float().abs().amax(-1) >= torch.finfo(fp8.E4M3).max / 2).all()  # at most 1 bit lost


def test_emulated_gemm_is_the_fp32_product_of_the_cast_operands():
    a, b = _randn(1, 16, 64), _randn(2, 64, 32)
    aq, ai = quantize(a, fp8.E4M3, -1, True)
    bq, bi = quantize(b.t(), fp8.E5M2, -1, True)
    y = fp8.scaled_mm(aq, bq.t(), ai, bi.t(), torch.float32, fast_accum=False)
    ref = (aq.double() * ai.double()) @ (bq.double() * bi.double()).t()
    assert _rel(y, ref) < 1e-6
    assert 1e-3 < _rel(y, a @ b) < 0.1  # FP8 is really in effect, and close


def test_gemm_operands_get_the_layouts_scaled_mm_reads(triton_on_cpu):
    """torch._scaled_mm reads A row-major and B column-major: the weight-gradient GEMM's
    dY^T and X and the input-gradient GEMM's W are row-major FP8 tensors, copied into
    those layouts by megaq's transpose kernel (the interpreter here) with every value
    kept; an operand already laid out (the forward's W^T) is passed as it is."""
    dyq, _ = quantize(_randn(3, 48, 32), fp8.E5M2, None, False)
    xq, _ = quantize(_randn(4, 48, 16), fp8.E4M3, None, False)
    b = fp8._col_major(xq)
    assert b.t().is_contiguous() and torch.equal(b.float(), xq.float())
    a = fp8._row_major(dyq.t())
    assert a.is_contiguous() and torch.equal(a.float(), dyq.t().float())
    assert fp8._row_major(dyq) is dyq
    assert fp8._col_major(xq.t()).data_ptr() == xq.data_ptr()


def _cpu_scaled_mm_takes_row_scales() -> bool:
    """torch 2.13's CPU _scaled_mm takes per-row scales; torch 2.11's asserts ("only
    supports per-tensor scaling for CPU backend", seen on the GPU machine's image)."""
    a = torch.ones(16, 16).to(fp8.E4M3)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16),
                         out_dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return True


@pytest.mark.parametrize("parallel", ["column", "row"])
@pytest.mark.parametrize("recipe,tol", [(("hybrid", "tensorwise"), 1e-6), (("e4m3", "rowwise"), 5e-3)])
def test_scaled_mm_path_with_transposed_operands_matches_the_emulation(triton_on_cpu, monkeypatch,
                                                                        parallel, recipe, tol):
    """The torch._scaled_mm path itself (forced here: torch's CPU build has the op too),
    with the backward's operands copied by megaq's transpose op, eager and compiled (fullgraph:
    the op traces without a graph break): y, dX and dW equal the emulation's.
    Tolerances: tensorwise writes fp32 here, so only the accumulation order differs
    (~1e-7); rowwise multiplies in bf16 (the GPU kernels' output), half a bf16 ulp ~2e-3."""
    rec = FP8Recipe(*recipe)
    if rec.rowwise and not _cpu_scaled_mm_takes_row_scales():
        pytest.skip("this torch's CPU _scaled_mm takes per-tensor scales only (torch < 2.13); "
                    "the GPU runs the rowwise GEMMs: tools/bench/check_fp8_gpu.py")
    x, w, dy = _randn(5, 64, 32), 0.1 * _randn(6, 48, 32), _randn(7, 64, 48)
    group = single_rank_group()

    def run(scaled_mm_path, compiled=False):
        monkeypatch.setattr(fp8, "fp8_gemm_available", lambda device: scaled_mm_path)
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        fn = lambda a, b: fp8.linear(a, b, None, rec, group, parallel)  # noqa: E731
        if compiled:  # the transpose as the op compiled blocks trace (compile_blocks registers it)
            register_compiled_ops()
            fn = torch.compile(fn, backend="aot_eager", fullgraph=True)
        y = fn(xx, ww)
        y.backward(dy)
        return y.detach(), xx.grad, ww.grad

    emulated = run(False)
    for got in (run(True), run(True, compiled=True)):
        for a, b in zip(got, emulated):
            assert _rel(a, b) < tol


@pytest.mark.parametrize("parallel", ["column", "row"])
def test_compiled_backward_casts_weight_and_row_input_straight_into_the_gemm_layout(
        triton_on_cpu, monkeypatch, parallel):
    """Inside a compiled block on the _scaled_mm path (forced here, as above), backward
    casts the weight, and a row-parallel layer's input, straight into the column-major
    layout dX's and dW's GEMMs read (fp8.recast_col_major) instead of casting and then
    copying the FP8 tensor's transpose (megaq's transpose op): one such copy per layer
    remains (dY^T) where eager makes three, and a column-parallel layer keeps its input's
    (the norm's output, whose recompute is a reduction). Same FP8 values in the same
    layout, so the same bits: compiled (aot_eager) equals eager exactly."""
    rec = FP8Recipe("hybrid", "tensorwise")
    x, w, dy = _randn(5, 64, 32), 0.1 * _randn(6, 48, 32), _randn(7, 64, 48)
    group = single_rank_group()
    monkeypatch.setattr(fp8, "fp8_gemm_available", lambda device: True)
    register_compiled_ops()
    backward_graphs = []

    def keep_backward(gm, example_inputs):
        backward_graphs.append(gm.graph)
        return make_boxed_func(gm.forward)

    def run(compiled=False):
        torch._dynamo.reset()
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        fn = lambda a, b: fp8.linear(a, b, None, rec, group, parallel)  # noqa: E731
        if compiled:  # aot_eager, keeping the backward graph to read
            fn = torch.compile(fn, fullgraph=True, backend=aot_autograd(
                fw_compiler=lambda gm, _: make_boxed_func(gm.forward), bw_compiler=keep_backward))
        y = fn(xx, ww)
        y.backward(dy)
        return y.detach(), xx.grad, ww.grad

    eager, compiled = run(), run(compiled=True)
    for a, b in zip(compiled, eager):
        assert torch.equal(a, b)
    # the transpose op as a trace records it off the GPU: clone(t(an FP8 tensor))
    t, clone = torch.ops.aten.t.default, torch.ops.aten.clone.default
    fp8_transposes = [tuple(n.args[0].meta["val"].shape) for n in backward_graphs[-1].nodes
                      if n.target == clone and n.args[0].target == t
                      and n.args[0].args[0].meta["val"].dtype in (fp8.E4M3, fp8.E5M2)]
    assert fp8_transposes == ([(48, 64), (32, 64)] if parallel == "column" else [(48, 64)])  # dY^T, X^T
    monkeypatch.setattr(fp8, "cast_transposed_in_backward", lambda device: False)  # as before
    run(compiled=True)
    assert len([n for n in backward_graphs[-1].nodes if n.target == clone]) == 3  # W, X, dY


@pytest.mark.skipif(not torch.cuda.is_available() or not fp8.fp8_gemm_available(torch.device("cuda")),
                    reason="needs a GPU with FP8 tensor cores (the CPU case is the test above)")
@pytest.mark.parametrize("parallel", ["column", "row"])
def test_inductor_casts_straight_into_the_gemm_layout_bit_for_bit_on_the_gpu(monkeypatch, parallel):
    """The GPU path of the test above: inductor's generated kernels (the cast with its
    transposed store) against the cast then megaq's transpose op, at a 1.3B layer's
    shapes in bf16: the same output and gradients, bit for bit."""
    register_compiled_ops()
    rec, group = FP8Recipe("hybrid", "tensorwise"), single_rank_group()
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4096, 2048, device="cuda", generator=g, dtype=torch.bfloat16)
    w = 0.02 * torch.randn(5504, 2048, device="cuda", generator=g, dtype=torch.bfloat16)
    dy = torch.randn(4096, 5504, device="cuda", generator=g, dtype=torch.bfloat16)

    def run(fused):
        monkeypatch.setattr(fp8, "cast_transposed_in_backward",
                            lambda device: fused and torch.compiler.is_compiling())
        torch._dynamo.reset()
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        fn = torch.compile(lambda a, b: fp8.linear(a, b, None, rec, group, parallel), fullgraph=True)
        y = fn(xx, ww)
        y.backward(dy)
        return y.detach(), xx.grad, ww.grad

    for a, b in zip(run(True), run(False)):
        assert torch.equal(a, b)


def test_bad_fp8_settings_are_refused():
    with pytest.raises(ValueError, match="--fp8-format"):
        GPTConfig(fp8_format="e5m2")
    with pytest.raises(ValueError, match="--fp8-recipe"):
        GPTConfig(fp8_format="hybrid", fp8_recipe="blockwise")
    assert GPTConfig().fp8 is None
    assert GPTConfig(fp8_format="e4m3", fp8_recipe="rowwise").fp8 == FP8Recipe("e4m3", "rowwise")


# ------------------------------------------------------------ layers under TP
T, B, K, N = 16, 2, 64, 96


def _layers(topo, recipe_args):
    """A column- and a row-parallel FP8 layer, forward and backward, at this TP size."""
    g, n, r = topo.tp, topo.tp.size, topo.tp_rank
    recipe = FP8Recipe(*recipe_args)
    col = apply_fp8(ColumnParallelLinear(K, N, g, init_weight=lambda s: _randn(10, *s), bias=False), recipe)
    row = apply_fp8(RowParallelLinear(N, K, g, init_weight=lambda s: _randn(11, *s), bias=False), recipe)
    x, dy = _randn(12, T, B, K), _randn(13, T, B, N).chunk(n, -1)[r]
    xr, dyr = _randn(14, T, B, N), _randn(15, T, B, K)
    x[2, 1, 7] = 30.0  # outliers: the tensorwise scales are set by one element
    xr[..., 0] *= 20.0
    xr = xr.chunk(n, -1)[r].clone()
    with capture_scales() as scales:
        x.requires_grad_()
        y = col(x)
        y.backward(dy)
        xr.requires_grad_()
        yr = row(xr)
        yr.backward(dyr)
    return {"col": (y.detach(), x.grad, col.weight.grad), "row": (yr.detach(), xr.grad, row.weight.grad),
            "scales": scales}


def _full(per_rank, layer, i, dim):
    """Reassemble a sharded result from the ranks (dim None: replicated, take rank 0's)."""
    parts = [res[layer][i] for res in per_rank]
    return parts[0] if dim is None else torch.cat(parts, dim)


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_layers_give_the_same_outputs_grads_and_scales_at_every_tp_size(recipe):
    ref = run_on_ranks(_layers, 1, tp=1, args=(recipe,))[0]
    # the reference really is FP8: the emulation differs from the fp32 layer
    x, w = _randn(12, T, B, K), _randn(10, N, K)
    x[2, 1, 7] = 30.0
    assert 1e-3 < _rel(ref["col"][0], x @ w.t()) < 0.1
    for tp in (2, 4):
        out = run_on_ranks(_layers, tp, tp=tp, args=(recipe,))
        # (output, input grad, weight grad): where each is split over TP
        for layer, dims in (("col", (-1, None, 0)), ("row", (None, -1, 1))):
            for i, dim in enumerate(dims):
                err = _rel(_full(out, layer, i, dim), ref[layer][i])
                assert err < 1e-5, f"tp={tp} {recipe} {layer}[{i}]: rel err {err:.2e}"
        # every cast used the TP=1 scale of the same elements (this rank's part of it)
        for r, res in enumerate(out):
            assert [role for role, _ in res["scales"]] == [role for role, _ in ref["scales"]]
            for (role, mine), (_, full) in zip(res["scales"], ref["scales"]):
                split = [d for d in range(full.dim()) if full.shape[d] != mine.shape[d]]
                expect = full.chunk(tp, split[0])[r] if split else full
                assert torch.equal(mine, expect), f"tp={tp} {recipe} rank {r}: {role} scale differs"


# ------------------------------------------------------------- whole model
def _model(topo, recipe_args, sp):
    kw = dict(fp8_format=recipe_args[0], fp8_recipe=recipe_args[1]) if recipe_args else {}
    cfg = GPTConfig.llama(num_layers=2, hidden_size=64, num_attention_heads=4,
                          vocab_size=200, seq_length=16, sequence_parallel=sp, **kw)
    (model,), _ = parallelize(cfg, topo)
    ids = torch.randint(0, 200, (2, 17), generator=torch.Generator().manual_seed(3))
    loss = model(ids[:, :-1], labels=ids[:, 1:])
    loss.mean().backward()
    fc1 = model.layers[1].mlp.linear_fc1.weight.grad          # column-parallel, stride 2
    proj = model.layers[0].self_attention.linear_proj.weight.grad  # row-parallel
    return loss.detach(), fc1, proj


def _gather_fc1(per_rank):
    gates, ups = zip(*(p[1].chunk(2, 0) for p in per_rank))  # [gate; up] per rank
    return torch.cat(gates + ups)


def test_fp8_model_under_tp_and_sp_matches_tp1():
    recipe = ("hybrid", "rowwise")
    loss1, fc1_1, proj1 = run_on_ranks(_model, 1, tp=1, args=(recipe, False))[0]
    loss_hp, fc1_hp, _ = run_on_ranks(_model, 1, tp=1, args=(None, False))[0]
    assert 1e-4 < _rel(loss1, loss_hp) < 5e-2 and 1e-2 < _rel(fc1_1, fc1_hp) < 0.5
    for tp, sp in ((2, False), (2, True), (4, True)):
        out = run_on_ranks(_model, tp, tp=tp, args=(recipe, sp))
        assert _rel(out[0][0], loss1) < 1e-5, f"tp={tp} sp={sp}"
        assert _rel(_gather_fc1(out), fc1_1) < 1e-5, f"tp={tp} sp={sp}"
        assert _rel(torch.cat([p[2] for p in out], 1), proj1) < 1e-5, f"tp={tp} sp={sp}"


# -------------------------------------------------------- checkpoint resume
def _train(topo, argv):
    return pretrain.main(argv, topo=topo).losses


def _fp8_argv(tmp_path, extra, fmt="e4m3", recipe="rowwise", iters=3):
    """pretrain_gpt.py's arguments for a tiny Llama with FP8 GEMMs."""
    return ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
            "--train-iters", str(iters), "--lr", "5e-3", "--lr-warmup-iters", "1",
            "--mock-data", "--vocab-size", "96", "--log-interval", "1", "--eval-iters", "0",
            "--attention-dropout", "0", "--hidden-dropout", "0", "--swiglu",
            "--normalization", "RMSNorm", "--position-embedding-type", "rope",
            "--disable-bias-linear", "--fp8-format", fmt, "--fp8-recipe", recipe,
            "--data-cache-path", str(tmp_path / "cache"), *extra]


def test_fp8_training_under_tp_pp_sp_recompute_matches_one_process(tmp_path):
    """pretrain_gpt.py with FP8 GEMMs: TP=2 x PP=2 with sequence parallelism and
    recomputation trains the same losses as one process (fp32 masters; 1e-5 as the
    layer tests: only summation order differs)."""
    one = run_on_ranks(_train, 1, args=(_fp8_argv(tmp_path, []),))[0]
    split = run_on_ranks(_train, 4, tp=2, pp=2, args=(_fp8_argv(tmp_path, [
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
        "--sequence-parallel", "--recompute-granularity", "full", "--recompute-method", "uniform",
        "--recompute-num-layers", "1"]),))
    losses = next(r for r in split if r)  # the last stage's ranks report the losses
    assert len(one) == 3
    for it, loss in one.items():
        assert abs(losses[it] - loss) / loss < 1e-5, (it, losses[it], loss)


def test_fp8_training_resumes_exactly_from_a_checkpoint(tmp_path):
    """FP8 current scaling keeps no state beyond the fp32 masters and the optimizer: a
    run resumed at iteration 2 repeats the uninterrupted run's losses bit for bit
    (TP=2 x DP=1 gloo ranks, fp32 masters, recompute on)."""
    def argv(iters, extra):
        return _fp8_argv(tmp_path, ["--recompute-activations", "--tensor-model-parallel-size", "2",
                                    *extra], fmt="hybrid", recipe="tensorwise", iters=iters)
    ck = str(tmp_path / "ck")
    full = run_on_ranks(_train, 2, tp=2, args=(argv(4, ["--save", ck, "--save-interval", "2"]),))[0]
    os.remove(os.path.join(ck, "latest_checkpointed_iteration.txt"))
    with open(os.path.join(ck, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("2\n")
    resumed = run_on_ranks(_train, 2, tp=2, args=(argv(4, ["--load", ck]),))[0]
    assert len(full) == 4 and [full[i] for i in (3, 4)] == [resumed[i] for i in (3, 4)], (full, resumed)


# ----------------------------------------------------------- compiled blocks
@pytest.mark.slow  # torch.compile on the CPU
@pytest.mark.parametrize("recipe", [("hybrid", "tensorwise"), ("e4m3", "rowwise")])
def test_fp8_compiled_blocks_match_eager(recipe):
    """compile_blocks traces the FP8 autograd function (casts, emulated GEMM) and gives
    the eager loss and gradients (aot_eager backend: no code generation, so the casts
    run the same kernels; the inductor path runs on the GPU in tools/bench/bench_train.py).
    Same casts of the same values: 1e-5, as the other fp32 comparisons."""
    kw = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=16,
              fp8_format=recipe[0], fp8_recipe=recipe[1])
    ids = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(4))
    results = []
    for compiled in (False, True):
        torch._dynamo.reset()
        model = _one_process_model(GPTConfig.llama(**kw))
        if compiled:
            compile_blocks(model, backend="aot_eager")
        loss = model(ids[:, :-1], labels=ids[:, 1:])
        loss.mean().backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (le, ge), (lc, gc) = results
    assert _rel(lc, le) < 1e-5
    for name, g in ge.items():
        assert _rel(gc[name], g) < 1e-5, name


# ------------------------------------------------------------ delayed scaling
def _delayed_layers(topo, steps):
    """A column- and a row-parallel layer with the delayed recipe trained `steps` steps
    on different inputs (fp8_delayed.step after each backward): per step the outputs
    and grads, and at the end every history and scale."""
    g, n, r = topo.tp, topo.tp.size, topo.tp_rank
    recipe = FP8Recipe("hybrid", "delayed", amax_history_len=3)
    col = apply_fp8(ColumnParallelLinear(K, N, g, init_weight=lambda s: _randn(10, *s), bias=False), recipe)
    row = apply_fp8(RowParallelLinear(N, K, g, init_weight=lambda s: _randn(11, *s), bias=False), recipe)
    per_step = []
    for s in range(steps):
        # the amaxes move from step to step, so the history's scales differ from current ones
        x, dy = _randn(12 + s, T, B, K) * (1 + s), _randn(20 + s, T, B, N).chunk(n, -1)[r]
        xr, dyr = _randn(30 + s, T, B, N), _randn(40 + s, T, B, K) / (1 + s)
        xr[..., s] *= 20.0  # an outlier in one rank's shard of the row-parallel input
        xr = xr.chunk(n, -1)[r].clone().requires_grad_()
        x.requires_grad_()
        y, yr = col(x), row(xr)
        y.backward(dy)
        yr.backward(dyr)
        per_step.append({"col": (y.detach(), x.grad, col.weight.grad.clone()),
                         "row": (yr.detach(), xr.grad, row.weight.grad.clone())})
        col.weight.grad = row.weight.grad = None
        fp8_delayed.step([col, row], g)
    return per_step, [(m.gemm.amax.history.clone(), m.gemm.amax.scale.clone()) for m in (col, row)]


def test_delayed_scaling_histories_and_scales_are_identical_at_every_tp_size():
    """The amaxes are MAX-reduced over TP once per step, so every TP split keeps the
    TP=1 history and scales bit for bit and casts every element as TP=1 does: outputs
    and grads agree to fp32 summation order (1e-5, as the tensorwise test)."""
    steps = 4  # more than the history (3): the oldest step rolls out
    ref_steps, ref_state = run_on_ranks(_delayed_layers, 1, tp=1, args=(steps,))[0]
    (hist, scale), _ = ref_state
    assert (hist > 0).all()
    assert torch.equal(scale, fp8.scale_from_amax(hist.amax(0), fp8.E4M3, False)
                       .where(torch.tensor([True, False]),
                              fp8.scale_from_amax(hist.amax(0), fp8.E5M2, False)))
    for tp in (2, 4):
        out = run_on_ranks(_delayed_layers, tp, tp=tp, args=(steps,))
        for r, (res_steps, state) in enumerate(out):
            for (h, s), (h1, s1) in zip(state, ref_state):
                assert torch.equal(h, h1) and torch.equal(s, s1), f"tp={tp} rank {r}"
        for step in range(steps):
            per_rank = [res[0][step] for res in out]
            for layer, dims in (("col", (-1, None, 0)), ("row", (None, -1, 1))):
                for i, dim in enumerate(dims):
                    err = _rel(_full(per_rank, layer, i, dim), ref_steps[step][layer][i])
                    assert err < 1e-5, f"tp={tp} step {step} {layer}[{i}]: rel err {err:.2e}"


def test_delayed_scaling_starts_as_tensorwise_then_casts_with_the_history():
    """Step 1 (empty history) scales as the tensorwise recipe, bit for bit; later steps
    cast x and dY with fp8_max / (the history's max, or its newest row) and record the
    current amaxes; a skipped step leaves the history alone."""
    from megaq.parallel.comm import Group

    g = Group(ranks=[0], nodes=[0], pg=None, rank_index=0)

    def layer(scaling, algo="max"):
        rec = FP8Recipe("hybrid", scaling, amax_history_len=2, amax_compute_algo=algo)
        return apply_fp8(ColumnParallelLinear(K, N, g, init_weight=lambda s: _randn(10, *s), bias=False), rec)

    def run(m, x, dy):
        x = x.clone().requires_grad_()
        with capture_scales() as scales:
            y = m(x)
            y.backward(dy)
        return (y.detach(), x.grad, m.weight.grad), dict(scales)

    xs = [_randn(50 + s, T, B, K) * (3 - s) for s in range(3)]
    dys = [_randn(60 + s, T, B, N) * 10 ** -s for s in range(3)]
    tw, dl, mr = layer("tensorwise"), layer("delayed"), layer("delayed", "most_recent")
    a, _ = run(tw, xs[0], dys[0])
    b, _ = run(dl, xs[0], dys[0])
    assert all(torch.equal(u, v) for u, v in zip(a, b))  # step 1: tensorwise exactly
    amaxes = []
    for s in range(3):
        amaxes.append(torch.stack([xs[s].abs().amax(), dys[s].abs().amax()]))
        for m in (dl, mr):
            if s:
                _, scales = run(m, xs[s], dys[s])
                hist = torch.stack(amaxes[-3:-1][::-1])  # the two previous steps, newest first
                amax = hist.amax(0) if m is dl else hist[0]
                assert torch.equal(scales["input"], 1 / fp8.scale_from_amax(amax[0], fp8.E4M3, False))
                assert torch.equal(scales["grad_output"],
                                   1 / fp8.scale_from_amax(amax[1], fp8.E5M2, False))
            else:
                run(m, xs[0], dys[0])
            assert torch.equal(m.gemm.amax.now, amaxes[-1])
            fp8_delayed.step(m, g)
            assert torch.equal(m.gemm.amax.history[0], amaxes[-1]) and not m.gemm.amax.now.any()
    before = dl.gemm.amax.history.clone()
    run(dl, xs[0] * 1e3, dys[0])
    fp8_delayed.step(dl, g, skipped=True)
    assert torch.equal(dl.gemm.amax.history, before) and not dl.gemm.amax.now.any()


@pytest.mark.slow  # torch.compile on the CPU
def test_delayed_cast_compiled_gives_the_same_fp8_bytes_and_amax_as_eager():
    """The fused (inductor) delayed cast writes the same FP8 bytes and the same amax as
    the eager ops, and the same bytes as the tensorwise cast with that scale (fp8.cast)."""
    x = _randn(70, 64, 96).to(torch.bfloat16) * 5
    for dtype, scale in ((fp8.E4M3, torch.tensor(30.0)), (fp8.E5M2, torch.tensor(4096.0))):
        eager = fp8.quantize_delayed(x, dtype, scale)
        torch._dynamo.reset()
        fused = torch.compile(fp8.quantize_delayed, backend="inductor", fullgraph=True)(x, dtype, scale)
        assert torch.equal(fused[0].view(torch.uint8), eager[0].view(torch.uint8))
        assert torch.equal(fused[0].view(torch.uint8), fp8.cast(x, scale, dtype).view(torch.uint8))
        assert torch.equal(fused[1], eager[1]) and torch.equal(fused[2], eager[2])
        assert eager[2].item() == x.float().abs().max().item()


def test_delayed_scaling_compiled_blocks_match_eager_without_graph_breaks():
    """Two steps (the tensorwise-scaled first step, then the history's scales) through
    compile_blocks with fullgraph=True (a graph break raises), equal to eager: losses,
    gradients, histories (aot_eager; same casts of the same values: 1e-5)."""
    kw = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=16,
              fp8_format="hybrid", fp8_recipe="delayed")
    gen = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, 64, (2, 17), generator=gen) for _ in range(2)]
    results = []
    for compiled in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = _one_process_model(GPTConfig.llama(**kw))
        if compiled:
            compile_blocks(model, backend="aot_eager", fullgraph=True)
        out = []
        for ids in batches:
            loss = model(ids[:, :-1], labels=ids[:, 1:])
            loss.mean().backward()
            out.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
            model.zero_grad()
            fp8_delayed.step(model, None)
        hists = [s.history.clone() for s in fp8_delayed.states(model)]
        results.append((out, hists))
    (oe, he), (oc, hc) = results
    assert len(he) == 8 and all((h[:2] > 0).all() for h in he)  # 4 GEMMs x 2 layers, 2 steps
    for (le, ge), (lc, gc) in zip(oe, oc):
        assert _rel(lc, le) < 1e-5
        for name, g in ge.items():
            assert _rel(gc[name], g) < 1e-5, name
    for a, b in zip(he, hc):
        assert _rel(b, a) < 1e-5


def _delayed_steps(model, batches):
    """Eager steps of `model` with delayed scaling on `batches`: each step's loss and
    gradients, and the amax histories after the last."""
    out = []
    for ids in batches:
        loss = model(ids[:, :-1], labels=ids[:, 1:])
        loss.float().mean().backward()
        out.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        model.zero_grad()
        fp8_delayed.step(model, None)
    return out, [s.history.clone() for s in fp8_delayed.states(model)]


def _swiglu_split(model) -> None:
    """Undo the SwiGLU epilogue of apply_fp8: fc1's GEMM plain, the MLP's activation on."""
    from megaq.kernels.fused_swiglu import swiglu

    for block in model.layers:
        block.mlp.linear_fc1.gemm.swiglu, block.mlp.activation = False, swiglu


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_swiglu_epilogue_matches_swiglu_after_the_gemm(monkeypatch, kernels):
    """apply_fp8 moves a SwiGLU MLP's activation into fc1's FP8 GEMM, whose backward then
    hands fc1 its FP8 dY from one kernel once the delayed scale is known. Against the
    model with the activation after the GEMM, two steps (tensorwise-scaled, then the
    history's scales), eager:

    * torch references (the CPU path): the same losses, gradients and histories, bit for bit;
    * the Triton kernels (interpreted here; the GPU's path): step 1 (no delayed scale yet,
      the unfused backward) bit for bit; step 2 runs the fused kernel, which rounds dY to
      bf16 once where autograd rounds twice (tests/test_fused_kernels.py: a few percent of
      dY's FP8 bytes one code apart). One E5M2 code is 2^-2 of the value at most, so a few
      percent of them moving by it changes a gradient by ~1% (relative norm); 3% allowed,
      against the ~10% by which FP8 gradients differ from bf16 ones at this size."""
    monkeypatch.setenv("MEGAQ_KERNELS", kernels)
    if kernels == "triton":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    kw = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=16,
              fp8_format="hybrid", fp8_recipe="delayed", params_dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, 64, (2, 17), generator=gen) for _ in range(2)]
    runs = []
    for fused in (True, False):
        torch.manual_seed(0)
        model = _one_process_model(GPTConfig.llama(**kw))
        assert all((b.mlp.activation is None) and b.mlp.linear_fc1.gemm.swiglu for b in model.layers)
        if not fused:
            _swiglu_split(model)
        runs.append(_delayed_steps(model, batches))
    (fused_out, fused_hist), (split_out, split_hist) = runs
    for step, ((lf, gf), (ls, gs)) in enumerate(zip(fused_out, split_out)):
        exact = kernels == "torch" or step == 0
        assert torch.equal(lf, ls) if exact else _rel(lf, ls) < 1e-2
        for name, g in gs.items():
            assert torch.equal(gf[name], g) if exact else _rel(gf[name], g) < 3e-2, (step, name)
    for a, b in zip(fused_hist, split_hist):
        assert torch.equal(a, b) if kernels == "torch" else _rel(a, b) < 1e-2


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_rope_epilogue_matches_rope_after_the_gemm(monkeypatch, kernels):
    """apply_fp8 moves RoPE and the q, k, v split of attention's fused QKV layer into its
    FP8 GEMM, whose backward then takes dq, dk, dv and, once the delayed scale is known,
    writes its FP8 dY, the transpose and the amax in one kernel. Against the model with
    RoPE after the GEMM, GQA (4 query heads in 2 groups), two steps (tensorwise-scaled,
    then the history's scales), eager, losses, gradients and histories bit for bit: with
    the torch references (the CPU path: the same ops), and with the Triton kernels
    (interpreted here; the GPU's path), where both routes compute RoPE's backward in fp32
    and round dY to bf16 once before the same cast (tests/test_fused_kernels.py holds the
    kernel to its reference)."""
    monkeypatch.setenv("MEGAQ_KERNELS", kernels)
    if kernels == "triton":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    kw = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
              vocab_size=64, seq_length=16, fp8_format="hybrid", fp8_recipe="delayed",
              params_dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(6)
    batches = [torch.randint(0, 64, (2, 17), generator=gen) for _ in range(2)]
    calls = []
    kernel = fp8.qkv_rope_backward_fp8
    monkeypatch.setattr(fp8, "qkv_rope_backward_fp8", lambda *a: (calls.append(1), kernel(*a))[1])
    runs = []
    for fused in (True, False):
        torch.manual_seed(0)
        model = _one_process_model(GPTConfig.llama(**kw))
        qkv = [b.self_attention.linear_qkv.gemm for b in model.layers]
        assert all(g.rope_per_group == 2 for g in qkv) and "rope" in repr(qkv[0])
        if not fused:
            for g in qkv:
                g.rope_per_group = 0
        runs.append(_delayed_steps(model, batches))
    # the one-pass kernel ran where it should: each layer's second step (a delayed scale)
    assert len(calls) == (2 if kernels == "triton" else 0)
    (fused_out, fused_hist), (split_out, split_hist) = runs
    for step, ((lf, gf), (ls, gs)) in enumerate(zip(fused_out, split_out)):
        assert torch.equal(lf, ls), step
        for name, g in gs.items():
            assert torch.equal(gf[name], g), (step, name)
    assert all(h[1].abs().sum() > 0 for h in fused_hist)  # dY's amaxes were recorded
    for a, b in zip(fused_hist, split_hist):
        assert torch.equal(a, b)


def test_rope_epilogue_is_refused_where_it_does_not_apply():
    """Only attention's QKV layer takes RoPE into its GEMM: an FP8 layer without the
    epilogue refuses RoPE's tables, a layer with a bias refuses both epilogues, and q/k
    norms (applied between the split and RoPE) keep RoPE after the GEMM."""
    kw = dict(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=64,
              seq_length=16, fp8_format="hybrid", fp8_recipe="delayed")
    model = _one_process_model(GPTConfig.llama(**kw))
    proj = model.layers[0].self_attention.linear_proj
    x = torch.randn(16, 1, 32)
    with pytest.raises(ValueError, match="fused QKV layer's FP8 GEMM only"):
        proj.gemm(x, proj.weight, None, rotary=(torch.ones(16, 1, 1, 8), torch.zeros(16, 1, 1, 8)))
    with pytest.raises(ValueError, match="without bias"):
        fp8.linear(x, proj.weight, torch.zeros(32), proj.gemm.recipe, proj.gemm.group, "column",
                   amax_state=proj.gemm.amax, rotary=(torch.ones(16, 1, 1, 8), torch.zeros(16, 1, 1, 8)),
                   per_group=1)
    normed = _one_process_model(GPTConfig.llama(**kw, qk_layernorm=True))
    assert not normed.layers[0].self_attention.rope_in_gemm


def test_fp8_delayed_training_resumes_exactly_from_a_checkpoint(tmp_path):
    """Delayed scaling's amax histories travel in the checkpoint (every pipeline stage's,
    gathered over PP): a run resumed at iteration 2 repeats the uninterrupted run's
    losses bit for bit (PP=2 gloo ranks, torch_dist, fp32 masters). Without the
    histories, iteration 3 would cast with current scales and its loss would differ."""
    def argv(extra):
        return _fp8_argv(tmp_path, ["--pipeline-model-parallel-size", "2",
                                    "--fp8-amax-history-len", "4", *extra],
                         "hybrid", "delayed", iters=4)
    ck = str(tmp_path / "ck")
    full = run_on_ranks(_train, 2, pp=2, args=(argv(["--save", ck, "--save-interval", "2"]),))[1]
    with open(os.path.join(ck, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("2\n")
    resumed = run_on_ranks(_train, 2, pp=2, args=(argv(["--load", ck]),))[1]
    assert len(full) == 4 and [full[i] for i in (3, 4)] == [resumed[i] for i in (3, 4)], (full, resumed)


def _dp_histories(topo):
    """Two DP ranks see different data; after fp8_delayed.step both hold the max."""
    recipe = FP8Recipe("hybrid", "delayed", amax_history_len=2)
    col = apply_fp8(ColumnParallelLinear(K, N, topo.tp, init_weight=lambda s: _randn(10, *s),
                                         bias=False), recipe)
    x = (_randn(80 + topo.dp_rank, T, B, K) * (1 + 4 * topo.dp_rank)).requires_grad_()
    dy = _randn(90 + topo.dp_rank, T, B, N) * (5 - 4 * topo.dp_rank)
    col(x).backward(dy)
    local = col.gemm.amax.now.clone()
    fp8_delayed.step(col, topo.tp, topo.dp)
    return local, col.gemm.amax.history.clone(), col.gemm.amax.scale.clone()


def test_delayed_scaling_reduces_amaxes_over_dp():
    """Every DP rank rolls the same history (the MAX over ranks), so the ranks cast with
    the same scales and any rank's checkpoint record serves them all."""
    out = run_on_ranks(_dp_histories, 2, tp=1)
    assert not torch.equal(out[0][0], out[1][0])  # the ranks' own amaxes differ
    expect = torch.maximum(out[0][0], out[1][0])
    for _, hist, scale in out:
        assert torch.equal(hist[0], expect) and torch.equal(scale, out[0][2])


def test_bad_delayed_settings_are_refused():
    with pytest.raises(ValueError, match="--fp8-amax-history-len 0 must be >= 1"):
        GPTConfig(fp8_format="hybrid", fp8_recipe="delayed", fp8_amax_history_len=0)
    with pytest.raises(ValueError, match="--fp8-amax-compute-algo"):
        GPTConfig(fp8_format="hybrid", fp8_recipe="delayed", fp8_amax_compute_algo="mean")
    w = torch.zeros(16, 16)
    with pytest.raises(ValueError, match="amax state"):  # a layer without its AmaxState
        fp8.linear(torch.zeros(2, 16), w, None, FP8Recipe("hybrid", "delayed"), None, "column")
