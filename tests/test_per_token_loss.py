"""--calculate-per-token-loss (Megatron's): the loss and its gradient are the mean over
every loss token of the global batch, not the mean over micro-batches of each one's token
mean. Loss masks that keep a different number of tokens per sample make the two differ;
the training loop's losses then equal a one-process reference computed by hand (the
same initial weights, plain SGD steps on the global batch's token mean), so does the
validation loss (the token mean over all of an evaluation's batches), and DP 2 and
PP 2 (1F1B) equal DP 1."""

import dataclasses
import os

import pytest
import torch

from megaq import pretrain
from megaq.model import GPTModel
from megaq.training import Trainer
from megaq.testing.ranks import run_on_ranks

MB, GBS, SEQ, LR = 2, 8, 16, 0.5


def _argv(tmp, extra=()):
    # plain SGD without momentum, weight decay, clipping or an LR schedule, so one step is
    # w - lr * grad exactly; no dropout
    return ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", str(SEQ), "--micro-batch-size", str(MB),
            "--global-batch-size", str(GBS), "--train-iters", "2", "--lr", str(LR),
            "--optimizer", "sgd", "--sgd-momentum", "0", "--weight-decay", "0",
            "--clip-grad", "0", "--lr-decay-style", "constant", "--mock-data",
            "--vocab-size", "64", "--log-interval", "1", "--eval-iters", "2",
            "--eval-interval", "2",
            "--hidden-dropout", "0", "--attention-dropout", "0",
            "--data-cache-path", os.path.join(tmp, "cache"), *extra]


def _uneven_masks(micro_batches):
    """Each sample keeps its first 2..17 loss tokens, a count read from its own first
    token (so it does not depend on which DP rank or micro-batch holds the sample)."""
    out = []
    for mb in micro_batches:
        if mb is None:
            out.append(mb)
            continue
        keep = 2 + mb["tokens"][:, :1] % 15
        mask = (torch.arange(SEQ)[None, :] < keep).to(mb["loss_mask"].dtype)
        out.append({**mb, "loss_mask": mask})
    return out


def _train(topo, argv):
    from megaq.config.arguments import parse_config
    config = parse_config(argv, world_size=topo.layout.world_size,
                          ranks_per_node=topo.layout.ranks_per_node)
    trainer = pretrain.build_trainer(config, topo)
    seen = {"train": [], "valid": []}

    def masked(split, batches):
        def make(consumed):
            for micro_batches in batches(consumed):
                micro_batches = _uneven_masks(micro_batches)
                seen[split].append(micro_batches)
                yield micro_batches
        return make
    parts = dataclasses.replace(trainer.p, train_batches=masked("train", trainer.p.train_batches),
                                valid_batches=masked("valid", trainer.p.valid_batches))
    s = Trainer(parts, trainer.state).train()
    return {"losses": s.losses, "val": s.val_losses, "batches": seen["train"],
            "valid": seen["valid"], "model": trainer.config.model}


def _token_mean(model, batches):
    tokens = torch.cat([mb["tokens"] for mb in batches])
    labels = torch.cat([mb["labels"] for mb in batches])
    mask = torch.cat([mb["loss_mask"] for mb in batches])
    per_token = model(tokens, labels=labels)
    return (per_token * mask).sum() / mask.sum(), per_token, mask


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("ptl"))
    per_token = _argv(tmp, ["--calculate-per-token-loss"])
    pp2 = ["--pipeline-model-parallel-size", "2"]
    return {"dp1": run_on_ranks(_train, 1, args=(per_token,))[0],
            "dp2": run_on_ranks(_train, 2, args=(per_token,)),
            # 1F1B: only the last stage counts the tokens and scales the loss
            "pp2": run_on_ranks(_train, 2, pp=2, args=(per_token + pp2,))}


def test_per_token_loss_equals_the_reference_by_hand(runs):
    r = runs["dp1"]
    step1, step2 = r["batches"][0], r["batches"][1]
    model = GPTModel(r["model"])  # the run's initial weights (layout-independent init)
    loss1, per_token, mask = _token_mean(model, step1)
    # what the default (per micro-batch mean, then averaged) would have reported
    mb_means = [(per_token[i:i + MB] * mask[i:i + MB]).sum() / mask[i:i + MB].sum()
                for i in range(0, GBS, MB)]
    assert len({int(mask[i:i + MB].sum()) for i in range(0, GBS, MB)}) > 1  # unequal counts
    loss1.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad
            p.grad = None
    loss2 = _token_mean(model, step2)[0]
    loss2.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad
        # the evaluation after step 2: the token mean over both of its global batches
        val = _token_mean(model, [mb for step in r["valid"] for mb in step])[0]
    # fp32 on one process: summation order only (~1e-7); the default's convention is
    # off by > 1e-3 here
    assert r["losses"][1] == pytest.approx(loss1.item(), rel=1e-5)
    assert r["losses"][2] == pytest.approx(loss2.item(), rel=1e-5)
    assert len(r["valid"]) == 2 and r["val"][2] == pytest.approx(val.item(), rel=1e-5)
    assert abs(torch.stack(mb_means).mean().item() - loss1.item()) > 1e-3 * loss1.item()


def test_dp2_and_pp2_equal_dp1(runs):
    for rank in runs["dp2"] + runs["pp2"]:
        for it in (1, 2):
            assert rank["losses"][it] == pytest.approx(runs["dp1"]["losses"][it], rel=1e-6)
        assert rank["val"][2] == pytest.approx(runs["dp1"]["val"][2], rel=1e-6)

