"""GPTModel under tensor parallelism equals one process with the same weights.

For TP in {1, 2, 4}, sequence parallelism off and on, GPT-2 and Llama families (and
with --qk-layernorm):
gathered logits, per-token losses, every weight and every gradient of the TP model
match a single-process (TP=1) model built from the same config.

Errors are norm-wise relative errors ||a - b|| / ||b|| over a whole tensor, bounded
by 1e-5: fp32 with TP only changes the summation order of the row-parallel and
vocab-parallel reductions, which moves results by ~1e-7 relative, while any wrong
slice, missing reduction or mis-scaled gradient is an O(1) error.

Gradients of parameters marked ``sequence_parallel`` are partial under SP (each rank
saw only its sequence chunk) and for the q/k norms (each rank saw its own heads): the DP engines all-reduce them over TP before the DP
reduction, and so does this test before comparing.
"""

import dataclasses

import pytest
import torch
# torch imports torch._dynamo lazily on the first autograd.Function / checkpoint call
# (~3 s); importing it once here lets every forked rank inherit it instead.
import torch._dynamo  # noqa: F401

from megaq.model import GPTConfig, GPTModel, ModelConfigError
from megaq.parallel import comm
from megaq.parallel.comm import Group
from megaq.testing.ranks import run_on_ranks
from megaq.parallel.tensor_parallel import (gather_from_tp_region, model_parallel_manual_seed,
                                            shard_of, single_rank_group)
from megaq.parallel.topology import Layout, LayoutError, build_topology
from megaq.parallelize import compile_blocks, parallelize

TOL = 1e-5
VOCAB, BATCH, SEQ = 100, 2, 16


def _config(family: str, sp: bool, **kw) -> GPTConfig:
    # divisible_by=8 pads 100 to 104 / 112 / 128 at TP 1 / 2 / 4: the loss must not
    # depend on the padding.
    common = dict(num_layers=2, hidden_size=32, vocab_size=VOCAB, seq_length=SEQ,
                  make_vocab_size_divisible_by=8, sequence_parallel=sp,
                  attention_dropout=0.0, hidden_dropout=0.0, seed=7)
    if family == "gpt2":
        return GPTConfig.gpt2(**{"num_attention_heads": 4, **common, **kw})
    return GPTConfig.llama(**{"num_attention_heads": 8, "num_query_groups": 4, "ffn_hidden_size": 48,
                              **common, **kw})


def _batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    weights = torch.rand(BATCH, SEQ, generator=g)  # uneven per-token weights in the loss
    return ids, labels, weights


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([t, t.new_zeros((rows - t.shape[0],) + tuple(t.shape[1:]))]) if rows > t.shape[0] else t


def _run(model, ids, labels, weights):
    logits = model(ids)  # [b, s, V_padded/tp]
    loss = model(ids, labels=labels)  # [b, s]
    (loss * weights).sum().backward()
    return logits, loss


def _compare_tp_to_single(topo, cases):
    """On each TP rank: build the TP model and a TP=1 reference; return max errors."""
    tp = topo.tp
    out = {}
    for family, sp, extra in cases:
        cfg = _config(family, sp, **extra)
        ids, labels, weights = _batch()
        ref = GPTModel(_config(family, False, **extra), single_rank_group())
        model = GPTModel(cfg, tp)
        ref_logits, ref_loss = _run(ref, ids, labels, weights)
        logits, loss = _run(model, ids, labels, weights)

        padded = model.padded_vocab_size
        full_logits = gather_from_tp_region(logits.detach().contiguous(), tp)
        errs = {"logits": _rel(full_logits[..., :VOCAB], ref_logits.detach()[..., :VOCAB]),
                "loss": _rel(loss.detach(), ref_loss.detach())}
        ref_params = dict(ref.named_parameters())
        for name, p in model.named_parameters():
            r = ref_params[name]
            grad = p.grad.clone()
            if p.sequence_parallel:  # partial under SP: the engines all-reduce it over TP
                comm.all_reduce(grad, tp, "tp")
            r_w, r_g = r.detach(), r.grad
            if p.tensor_model_parallel:
                if "word_embeddings" in name or "output_layer" in name:
                    r_w, r_g = _pad_rows(r_w, padded), _pad_rows(r_g, padded)
                r_w = shard_of(r_w, p.partition_dim, tp.rank, tp.size, p.partition_stride)
                r_g = shard_of(r_g, p.partition_dim, tp.rank, tp.size, p.partition_stride)
            assert p.shape == r_w.shape, (name, p.shape, r_w.shape)
            errs[f"weight {name}"] = _rel(p.detach(), r_w)
            if name.endswith("k_layernorm.bias"):
                # adds the same vector to every key: softmax cancels it, so its true grad
                # is 0 and both sides are rounding noise; compare absolutely
                errs[f"grad {name}"] = (grad - r_g).abs().max().item()
            else:
                errs[f"grad {name}"] = _rel(grad, r_g)
        out[(family, sp, tuple(sorted(extra)))] = errs
    return out


CASES = [(fam, sp, {}) for fam in ("gpt2", "llama") for sp in (False, True)]


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tp_model_matches_single_process(tp):
    cases = CASES + ([("gpt2", True, {"untie_embeddings_and_output_weights": True})] if tp == 2 else [])
    # --qk-layernorm: per-head norms replicated over TP, each rank's grads from its own
    # heads only (partial, all-reduced over TP like SP's norms); RMSNorm and LayerNorm
    cases += [("llama", False, {"qk_layernorm": True}), ("gpt2", True, {"qk_layernorm": True})]
    results = run_on_ranks(_compare_tp_to_single, tp, tp=tp, args=(cases,))
    for rank, per_case in enumerate(results):
        for case, errs in per_case.items():
            assert len(errs) > 10  # logits, loss and a weight + grad per parameter
            bad = {k: v for k, v in errs.items() if not v < TOL}
            assert not bad, f"TP={tp} rank {rank} {case}: {bad}"


def test_gqa_split_keeps_whole_query_groups():
    # 8 heads in 2 groups at TP=2: each rank holds one group (4 q heads + k + v).
    cases = [("llama", sp, {"num_query_groups": 2}) for sp in (False, True)]
    results = run_on_ranks(_compare_tp_to_single, 2, tp=2, args=(cases,))
    for per_case in results:
        for case, errs in per_case.items():
            assert max(errs.values()) < TOL, (case, errs)


def _bf16_loss_errors(topo, family):
    """Per-token losses and logits of bf16 models at this TP size (SP off and on) and at
    TP 1, each measured against fp32 on the same (bf16-rounded) weights."""
    spread = dict(init_method_std=0.2)  # logits far from uniform: the loss feels their rounding
    g = torch.Generator().manual_seed(1)
    ids, labels = (torch.randint(0, VOCAB, (16, SEQ), generator=g) for _ in range(2))

    def run(cfg, group):
        model = GPTModel(cfg, group)
        if cfg.params_dtype == torch.float32:
            with torch.no_grad():
                for p in model.parameters():
                    p.copy_(p.to(torch.bfloat16).float())
        with torch.no_grad():
            logits = gather_from_tp_region(model(ids).contiguous(), group)[..., :VOCAB]
            return logits.float(), model(ids, labels=labels)

    exact_logits, exact_loss = run(_config(family, False, **spread), single_rank_group())
    errs = {}
    for name, sp, group in (("tp1", False, single_rank_group()), ("tp", False, topo.tp),
                            ("tp_sp", True, topo.tp)):
        cfg = dataclasses.replace(_config(family, sp, **spread), params_dtype=torch.bfloat16)
        logits, loss = run(cfg, group)
        assert loss.dtype == torch.float32  # the loss is fp32 whatever the activations
        errs[name] = (_rel(logits, exact_logits), _rel(loss, exact_loss))
    return errs


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_bf16_tp_losses_within_bf16_noise_of_single_process(family):
    # In bf16, TP changes more than the summation order: each rank's partial products
    # (row-parallel GEMMs, the vocab-parallel embedding) are rounded to bf16 before the
    # all-reduce, as in Megatron. That is rounding noise of the size of bf16's own, so
    # TP 2's logits and per-token losses (SP off and on) must be about as close to fp32
    # on the same weights as TP 1's bf16 ones are. Observed (CPU, 256 tokens): 1.04-1.07x
    # TP 1's error on logits, 1.06-1.11x on losses; a vocab-parallel cross-entropy whose
    # max / exp / sum ran in bf16 instead of fp32 measured 1.64-1.77x on losses. Bound:
    # 1.4x.
    for rank_errs in run_on_ranks(_bf16_loss_errors, 2, tp=2, args=(family,)):
        floor_logits, floor_loss = rank_errs["tp1"]
        assert 1e-4 < floor_loss < 1e-2, rank_errs  # bf16 rounding is really there
        for name in ("tp", "tp_sp"):
            logits_err, loss_err = rank_errs[name]
            assert logits_err < 1.4 * floor_logits and loss_err < 1.4 * floor_loss, (name, rank_errs)


def _fake_group(size: int) -> Group:
    # Construction slices weights but sends nothing, so a group without a process
    # group is enough to test refusals.
    return Group(ranks=list(range(size)), nodes=[0] * size, pg=None, rank_index=0)


def test_refuses_heads_not_divisible_by_tp():
    with pytest.raises(LayoutError, match="--num-attention-heads 6 is not divisible"):
        GPTModel(GPTConfig.gpt2(hidden_size=48, num_attention_heads=6), _fake_group(4))


def test_refuses_query_groups_not_divisible_by_tp():
    cfg = GPTConfig.llama(hidden_size=64, num_attention_heads=8, num_query_groups=2)
    with pytest.raises(LayoutError, match="--num-query-groups 2 is not divisible"):
        GPTModel(cfg, _fake_group(4))


def test_refuses_sequence_not_divisible_under_sp():
    cfg = GPTConfig.gpt2(seq_length=30, sequence_parallel=True)
    with pytest.raises(ValueError, match="--seq-length 30 is not divisible"):
        GPTModel(cfg, _fake_group(4))


def test_vocab_padding_and_layout_independent_init():
    cfg = GPTConfig.gpt2(vocab_size=50257, hidden_size=16, num_attention_heads=2, num_layers=1,
                         make_vocab_size_divisible_by=128)
    assert cfg.padded_vocab_size(1) == 50304 and cfg.padded_vocab_size(2) == 50432
    small = GPTConfig.gpt2(vocab_size=100, make_vocab_size_divisible_by=8, num_layers=3)
    full = GPTModel(small)
    rank1 = GPTModel(small, pre_process=False, layer_start=1)
    # Same global layer, same weights, whichever stage builds it.
    assert torch.equal(full.layers[1].mlp.linear_fc1.weight, rank1.layers[0].mlp.linear_fc1.weight)
    assert rank1.global_param_name("layers.0.mlp.linear_fc1.weight") == "layers.1.mlp.linear_fc1.weight"
    w = full.embedding.word_embeddings.weight
    assert w.shape[0] == 104 and torch.all(w[100:] == 0) and w[:100].std() > 0.01


def test_tied_head_on_last_stage_is_an_identical_marked_copy():
    cfg = GPTConfig.gpt2(vocab_size=100, make_vocab_size_divisible_by=8, num_layers=2)
    first = GPTModel(cfg, post_process=False, layer_end=1)
    last = GPTModel(cfg, pre_process=False, layer_start=1)
    both = GPTModel(cfg)
    assert first.output_layer is None and last.embedding is None
    assert torch.equal(first.embedding.word_embeddings.weight, last.output_layer.weight)
    assert first.embedding.word_embeddings.weight.shared_embedding
    assert last.output_layer.weight.shared_embedding
    assert both.output_layer.weight is None  # reuses the embedding: nothing to sync
    assert not both.embedding.word_embeddings.weight.shared_embedding
    # The split model computes what the whole one does.
    ids = torch.randint(0, 100, (2, cfg.seq_length), generator=torch.Generator().manual_seed(1))
    both.eval(), first.eval(), last.eval()
    torch.testing.assert_close(last(hidden_states=first(ids), labels=ids), both(ids, labels=ids))


RECOMPUTE_MODES = {  # name -> GPTConfig settings (Megatron's flags)
    "none": {},
    "selective": {"recompute_granularity": "selective"},
    "--recompute-activations": {"recompute_activations": True},
    "full uniform 1": {"recompute_granularity": "full", "recompute_method": "uniform",
                       "recompute_num_layers": 1},
    "full uniform 2": {"recompute_granularity": "full", "recompute_method": "uniform",
                       "recompute_num_layers": 2},
    "none of 3": {"num_layers": 3},
    "full uniform 2 of 3": {"num_layers": 3, "recompute_granularity": "full",
                            "recompute_method": "uniform", "recompute_num_layers": 2},
    "full block 1": {"recompute_granularity": "full", "recompute_method": "block",
                     "recompute_num_layers": 1},
}


def _recompute_grads(topo):
    out = {}
    for sp in (False, True):
        for mode, kw in RECOMPUTE_MODES.items():
            cfg = _config("gpt2", sp, attention_dropout=0.2, hidden_dropout=0.2, **kw)
            (model,), _ = parallelize(cfg, topo)  # recompute is applied there
            model_parallel_manual_seed(123, topo.tp_rank)
            torch.manual_seed(5)
            ids, labels, weights = _batch()
            (model(ids, labels=labels) * weights).sum().backward()
            out[sp, mode] = {n: p.grad.clone() for n, p in model.named_parameters()}
    return out


def test_recompute_gives_identical_grads_with_dropout():
    """Every --recompute-granularity / --recompute-method gives the gradients of no
    recomputation, bit for bit, at TP 2 with and without sequence parallelism."""
    for grads in run_on_ranks(_recompute_grads, 2, tp=2):
        for sp in (False, True):
            for mode in RECOMPUTE_MODES:
                plain = grads[sp, "none of 3" if mode.endswith("of 3") else "none"]
                recomputed = grads[sp, mode]
                for name, g in plain.items():
                    # Same ops on the same values in the same order: bit-identical, and the
                    # dropout masks must be redrawn identically (default and TP streams).
                    assert torch.equal(g, recomputed[name]), (sp, mode, name)


def test_recompute_layer_groups_follow_megatron():
    from megaq.model.recompute import layer_groups
    assert layer_groups(4, None, None, None) == [(0, 4, False)]
    assert layer_groups(4, "selective", None, None) == [(0, 4, False)]
    assert layer_groups(4, "full", "uniform", 2) == [(0, 2, True), (2, 4, True)]
    assert layer_groups(3, "full", "uniform", 2) == [(0, 2, True), (2, 3, True)]
    assert layer_groups(4, "full", "block", 1) == [(0, 1, True), (1, 4, False)]
    assert layer_groups(2, "full", "block", 2) == [(0, 1, True), (1, 2, True)]


def test_recompute_flags_are_megatrons():
    c = GPTConfig(recompute_activations=True)
    assert (c.recompute_granularity, c.recompute_activations) == ("selective", True)
    c = GPTConfig(recompute_granularity="selective")
    assert c.recompute_activations  # the two spellings agree
    assert not GPTConfig(recompute_granularity="full", recompute_method="block",
                         recompute_num_layers=1).recompute_activations
    for kw, msg in [
            ({"recompute_granularity": "full"}, "needs --recompute-method uniform|block and "
             "--recompute-num-layers N"),
            ({"recompute_activations": True, "recompute_granularity": "full",
              "recompute_method": "uniform", "recompute_num_layers": 1}, "contradicts"),
            ({"recompute_granularity": "selective", "recompute_method": "uniform"},
             "apply to --recompute-granularity full only"),
            ({"recompute_granularity": "full", "recompute_method": "uniform",
              "recompute_num_layers": 3}, "--recompute-num-layers 3 must be between 1")]:
        with pytest.raises(ModelConfigError, match=msg):
            GPTConfig(**kw)


def test_num_flops_matches_megatron_closed_forms():
    from megaq.model.flops import num_flops
    # GPT-2 (MHA, ffn = 4h): Narayanan et al.'s 72 B s L h^2 (1 + s/6h + V/12Lh), no recompute.
    c = GPTConfig.gpt2(num_layers=24, hidden_size=1024, num_attention_heads=16, vocab_size=50257,
                       seq_length=1024)
    B, s, L, h, V = 8, 1024, 24, 1024, c.padded_vocab_size(1)
    expected = 72 * B * s * L * h * h * (1 + s / (6 * h) + V / (12 * L * h))
    assert abs(num_flops(c, B * s) / expected - 1) < 1e-12
    # Llama (GQA, SwiGLU): Megatron's num_floating_point_operations, as written there.
    c = GPTConfig.llama(num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
                        ffn_hidden_size=14336, vocab_size=128256, seq_length=8192)
    B, s, L, h, V = 4, 8192, 32, 4096, c.padded_vocab_size(8)
    expected = 12 * B * s * L * h * h * (
        (1 + 8 / 32 + s / h) * 1.0 + (14336 / h) * 1.5 + V / (2 * L * h))
    assert abs(num_flops(c, B * s, tp_size=8) / expected - 1) < 1e-12


def _two_stages_vs_whole(topo):
    """A pipeline split (same process, TP ranks) computes what the whole model does."""
    out = {}
    for family in ("gpt2", "llama"):
        cfg = _config(family, True)  # sequence parallel: stages exchange [s/tp, b, h]
        ids, labels, weights = _batch()
        whole = GPTModel(cfg, topo.tp)
        first = GPTModel(cfg, topo.tp, post_process=False, layer_end=1)
        last = GPTModel(cfg, topo.tp, pre_process=False, layer_start=1)
        (whole(ids, labels=labels) * weights).sum().backward()
        hidden = first(ids)
        received = hidden.detach().requires_grad_()  # what a pipeline engine hands over
        loss = last(hidden_states=received, labels=labels)
        (loss * weights).sum().backward()
        hidden.backward(received.grad)
        errs = {"loss": _rel(loss.detach(), whole(ids, labels=labels).detach())}
        whole_grads = {n: p.grad for n, p in whole.named_parameters()}
        for stage in (first, last):
            for name, p in stage.named_parameters():
                if getattr(p, "shared_embedding", False):
                    continue  # each copy holds part of the tied gradient: summed below
                errs[name] = _rel(p.grad, whole_grads[stage.global_param_name(name)])
        if cfg.tie_embeddings:  # the embedding-group all-reduce of the two copies
            emb = first.embedding.word_embeddings.weight
            errs["tied sum"] = _rel(emb.grad + last.output_layer.weight.grad,
                                    whole_grads["embedding.word_embeddings.weight"])
        out[family] = errs
    return out


def test_pipeline_stage_split_matches_whole_model_under_tp_sp():
    for per_family in run_on_ranks(_two_stages_vs_whole, 2, tp=2):
        for family, errs in per_family.items():
            assert max(errs.values()) < TOL, (family, errs)


def test_explicit_position_ids_equal_default_positions():
    ids, labels, _ = _batch()
    pos = torch.arange(SEQ).expand(BATCH, SEQ)
    for family in ("gpt2", "llama"):
        model = GPTModel(_config(family, False))
        torch.testing.assert_close(model(ids, labels=labels, position_ids=pos), model(ids, labels=labels))


def _loss_and_grads(cfg, ids, labels, **compile_kwargs):
    model = GPTModel(cfg)
    if compile_kwargs:
        compile_blocks(model, **compile_kwargs)
    loss = model(ids, labels=labels)
    loss.mean().backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_gqa_by_repeating_kv_equals_enable_gqa():
    """attention_repeat_kv only changes how SDPA is fed, not the function (fp32: 1e-6)."""
    kw = dict(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2,
              vocab_size=64, seq_length=8)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(3))
    labels = torch.roll(ids, -1, 1)
    base = _loss_and_grads(GPTConfig.llama(**kw), ids, labels)
    rep = _loss_and_grads(GPTConfig.llama(attention_repeat_kv=True, **kw), ids, labels)
    assert _rel(rep[0], base[0]) < 1e-6
    for name, g in base[1].items():
        assert _rel(rep[1][name], g) < 1e-6, name


def test_compiled_blocks_match_eager():
    """compile_blocks (torch.compile of each block's forward) captures the blocks with
    the fused ops tracing their references and computes the same loss and gradients.
    The aot_eager backend keeps this test fast (no inductor code generation; the
    inductor path is exercised on the GPU by tools/bench/bench_train.py). fp32: 1e-5."""
    kw = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=8)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(4))
    labels = torch.roll(ids, -1, 1)
    eager = _loss_and_grads(GPTConfig.llama(**kw), ids, labels)
    compiled = _loss_and_grads(GPTConfig.llama(**kw), ids, labels, backend="aot_eager")
    assert _rel(compiled[0], eager[0]) < 1e-5
    for name, g in eager[1].items():
        assert _rel(compiled[1][name], g) < 1e-5, name


def _saved_activation_bytes(cfg: GPTConfig) -> int:
    """Bytes of the tensors autograd keeps for backward after one forward (what
    recomputation trades for compute): tensors saved inside a checkpointed region are
    dropped by torch.utils.checkpoint and not counted, parameters are not counted."""
    (model,), _ = parallelize(cfg, build_topology(Layout(world_size=1), 0))
    params = {p.data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        if t.data_ptr() not in params:
            seen[(t.data_ptr(), t.dtype, tuple(t.shape))] = t.numel() * t.element_size()
        return t
    ids, labels, _ = _batch()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids, labels=labels).sum()
    return sum(seen.values())


def test_recompute_keeps_less_activation_memory():
    """none > selective (no s x s attention probabilities) > full uniform 1 (each
    layer's input only) > full uniform 2 (each pair's input only); block 1 of 2 lies
    between uniform 1 and no recomputation."""
    size = {mode: _saved_activation_bytes(_config("gpt2", False, attention_dropout=0.2,
                                                  hidden_dropout=0.2, num_layers=2, **kw))
            for mode, kw in RECOMPUTE_MODES.items() if "of 3" not in mode}
    assert (size["none"] > size["selective"] > size["full uniform 1"]
            > size["full uniform 2"]), size
    assert size["selective"] == size["--recompute-activations"]
    assert size["none"] > size["full block 1"] > size["full uniform 1"], size
