"""Tensor-parallel layers: communication regions, vocab-parallel cross-entropy, RNG.

Values are compared with a norm-wise relative error ||a - b|| / ||b|| (fp32 sums in a
different order: ~1e-7); the communication regions move values exactly, so they are
compared bit for bit.
"""

import torch
# torch imports torch._dynamo lazily on the first autograd.Function / checkpoint call
# (~3 s); importing it once here lets every forked rank inherit it instead.
import torch._dynamo  # noqa: F401
import torch.nn.functional as F

from megaq.model import GPTConfig, GPTModel
from megaq.model.attention import core_attention
from megaq.testing.ranks import run_on_ranks
from megaq.parallel.tensor_parallel import (TPDropout, copy_to_tp_region, gather_from_sequence_parallel_region,
                                            gather_from_tp_region, get_rng_tracker, model_parallel_manual_seed,
                                            reduce_from_tp_region, reduce_scatter_to_sequence_parallel_region,
                                            scatter_to_sequence_parallel_region, vocab_parallel_cross_entropy)

TOL = 1e-5


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# ------------------------------------------------------------ communication regions
def _per_rank(r: int, shape) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(100 + r))


def _regions(topo):
    """Forward and backward of every region against values rebuilt from all ranks."""
    g, n, r = topo.tp, topo.tp.size, topo.tp_rank
    s, b, h = 4 * n, 2, 3
    xs = [_per_rank(i, (s, b, h)) for i in range(n)]    # each rank's input
    gs = [_per_rank(50 + i, (s, b, h)) for i in range(n)]  # each rank's output grad
    chunk = lambda t, i, dim=0: t.chunk(n, dim)[i]  # noqa: E731
    ok = {}

    def run(fn, x, grad_out):
        x = x.clone().requires_grad_()
        y = fn(x)
        y.backward(grad_out)
        return y.detach(), x.grad

    # scatter to SP: keep my chunk; backward gathers the chunks' grads.
    y, gx = run(lambda x: scatter_to_sequence_parallel_region(x, g), xs[0], chunk(gs[r], r))
    ok["scatter fwd"] = torch.equal(y, chunk(xs[0], r))
    ok["scatter bwd"] = torch.equal(gx, torch.cat([chunk(gs[i], i) for i in range(n)]))
    # gather from SP feeding a TP layer: backward reduce-scatters the partial grads.
    y, gx = run(lambda x: gather_from_sequence_parallel_region(x, g), chunk(xs[r], r), gs[r])
    ok["gather fwd"] = torch.equal(y, torch.cat([chunk(xs[i], i) for i in range(n)]))
    ok["gather bwd"] = torch.allclose(gx, chunk(sum(gs), r), rtol=0, atol=1e-6)
    y, gx = run(lambda x: gather_from_sequence_parallel_region(x, g, False), chunk(xs[r], r), gs[0])
    ok["gather bwd (replicated consumer)"] = torch.equal(gx, chunk(gs[0], r))
    # reduce-scatter to SP: sum partial outputs, keep my chunk; backward gathers.
    y, gx = run(lambda x: reduce_scatter_to_sequence_parallel_region(x, g), xs[r], chunk(gs[r], r))
    ok["reduce-scatter fwd"] = torch.allclose(y, chunk(sum(xs), r), rtol=0, atol=1e-6)
    ok["reduce-scatter bwd"] = torch.equal(gx, torch.cat([chunk(gs[i], i) for i in range(n)]))
    # copy to TP: identity; backward sums the grads of the n consumers.
    y, gx = run(lambda x: copy_to_tp_region(x, g), xs[0], gs[r])
    ok["copy fwd"] = torch.equal(y, xs[0])
    ok["copy bwd"] = torch.allclose(gx, sum(gs), rtol=0, atol=1e-6)
    # reduce from TP: sum; backward identity.
    y, gx = run(lambda x: reduce_from_tp_region(x, g), xs[r], gs[0])
    ok["reduce fwd"] = torch.allclose(y, sum(xs), rtol=0, atol=1e-6)
    ok["reduce bwd"] = torch.equal(gx, gs[0])
    # gather along the last dim (logits): backward keeps my slice.
    y, gx = run(lambda x: gather_from_tp_region(x, g), xs[r], torch.cat([gs[0]] * n, -1))
    ok["gather-last fwd"] = torch.equal(y, torch.cat(xs, -1))
    ok["gather-last bwd"] = torch.equal(gx, gs[0])
    return ok


def test_communication_regions_forward_and_backward():
    for tp in (2, 4):
        for rank, ok in enumerate(run_on_ranks(_regions, tp, tp=tp)):
            assert all(ok.values()), (tp, rank, {k: v for k, v in ok.items() if not v})


# ------------------------------------------------------------ vocab-parallel loss
def _cross_entropy(topo, vocab, padded, dtype):
    g, n, r = topo.tp, topo.tp.size, topo.tp_rank
    gen = torch.Generator().manual_seed(3)
    full = (torch.randn(5, 3, padded, generator=gen) * 4).to(dtype)
    full[..., vocab:] = 30.0  # padded columns with large logits: must be ignored
    labels = torch.randint(0, vocab, (5, 3), generator=gen)
    weights = torch.rand(5, 3, generator=gen)
    shard = full.chunk(n, -1)[r].clone().requires_grad_()
    before = shard.detach().clone()
    loss = vocab_parallel_cross_entropy(shard, labels, g, vocab_size=vocab)
    (loss * weights).sum().backward()

    ref_in = full.float()[..., :vocab].clone().requires_grad_()
    ref = F.cross_entropy(ref_in.reshape(-1, vocab), labels.reshape(-1), reduction="none").view(5, 3)
    (ref * weights).sum().backward()
    ref_grad = torch.cat([ref_in.grad, torch.zeros(5, 3, padded - vocab)], -1).chunk(n, -1)[r]
    return {"loss dtype": loss.dtype == torch.float32,
            "grad dtype": shard.grad.dtype == dtype,
            "input untouched": torch.equal(shard.detach(), before),
            "loss": _rel(loss.detach(), ref.detach()),
            "grad": _rel(shard.grad.float(), ref_grad) if ref_grad.norm() > 0 else shard.grad.norm().item()}


def test_vocab_parallel_cross_entropy_matches_full_softmax():
    # vocab 50 padded to 64: on TP=4 rank 3 holds only padding (its grad must be 0).
    for tp in (1, 2, 4):
        for res in run_on_ranks(_cross_entropy, tp, tp=tp, args=(50, 64, torch.float32)):
            assert res["loss dtype"] and res["grad dtype"] and res["input untouched"], res
            assert res["loss"] < TOL and res["grad"] < TOL, (tp, res)


def test_vocab_parallel_cross_entropy_bf16_logits_fp32_loss():
    # bf16 logits: the loss is computed in fp32 from the bf16 values, so it matches a
    # fp32 reference on the same (rounded) values; the grad is rounded once to bf16.
    for res in run_on_ranks(_cross_entropy, 2, tp=2, args=(50, 64, torch.bfloat16)):
        assert res["loss dtype"] and res["grad dtype"], res
        assert res["loss"] < TOL and res["grad"] < 1e-2, res


# ---------------------------------------------------------------------- RNG/dropout
def _dropout_masks(topo):
    model_parallel_manual_seed(11, topo.tp_rank)
    ones = torch.ones(64, 64)
    replicated = TPDropout(0.5, split=False).train()(ones) != 0
    split = TPDropout(0.5, split=True).train()(ones) != 0
    # Forking the TP stream leaves the default stream where it was.
    after_forks = torch.rand(8)
    model_parallel_manual_seed(11, topo.tp_rank)
    TPDropout(0.5, split=False).train()(ones)
    untouched = torch.equal(torch.rand(8), after_forks)
    # Tracker states round-trip (checkpoints, recompute): same split mask again.
    saved = get_rng_tracker().get_states()
    again_a = TPDropout(0.5, split=True).train()(ones)
    get_rng_tracker().set_states(saved)
    again_b = TPDropout(0.5, split=True).train()(ones)
    # Attention dropout: heads are split, masks come from the TP stream.
    q = torch.randn(1, 2, 8, 4, generator=torch.Generator().manual_seed(0))
    attn_drop = core_attention(q, q, q, dropout_p=0.5)
    attn_plain = core_attention(q, q, q, dropout_p=0.0)
    return dict(replicated=replicated, split=split, untouched=untouched,
                replay=torch.equal(again_a, again_b), attn_drop=attn_drop, attn_plain=attn_plain)


def test_dropout_masks_follow_the_tp_layout():
    a, b = run_on_ranks(_dropout_masks, 2, tp=2)
    assert torch.equal(a["replicated"], b["replicated"])      # replicated: same mask
    assert not torch.equal(a["split"], b["split"])            # split: independent masks
    assert 0.4 < a["split"].float().mean() < 0.6
    assert a["untouched"] and b["untouched"] and a["replay"] and b["replay"]
    assert torch.equal(a["attn_plain"], b["attn_plain"])
    assert not torch.equal(a["attn_drop"], b["attn_drop"])


def _model_dropout(topo, sp):
    cfg = GPTConfig.gpt2(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64,
                         seq_length=8, make_vocab_size_divisible_by=8, hidden_dropout=0.5,
                         attention_dropout=0.5, sequence_parallel=sp)
    model = GPTModel(cfg, topo.tp, post_process=False).train()
    model_parallel_manual_seed(5, topo.tp_rank)
    masks = []
    for layer in model.layers:
        layer.hidden_dropout.register_forward_hook(lambda m, i, o: masks.append((o != 0) | (i[0] == 0)))
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    hidden = model(ids)
    return masks, hidden.detach()


def test_model_dropout_replicated_without_sp_split_with_sp():
    # Without SP the residual stream is replicated: every TP rank must drop the same
    # elements, and the hidden states stay identical across ranks.
    (m0, h0), (m1, h1) = run_on_ranks(_model_dropout, 2, tp=2, args=(False,))
    assert len(m0) == 4 and all(torch.equal(a, b) for a, b in zip(m0, m1))
    assert torch.equal(h0, h1)
    # With SP each rank holds a different sequence chunk: masks are independent.
    (m0, _), (m1, _) = run_on_ranks(_model_dropout, 2, tp=2, args=(True,))
    assert len(m0) == 4 and m0[0].shape[0] == 4
    assert all(not torch.equal(a, b) for a, b in zip(m0, m1))
