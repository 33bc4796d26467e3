"""--train-data-path / --valid-data-path / --test-data-path (each split its own blend,
used whole, Megatron's semantics) and --eod-mask-loss (no loss after an end-of-document
token; the loss is the masked mean, as Megatron's)."""

import os

import numpy as np
import pytest
import torch

from megaq.config.arguments import ArgumentsError, parse_config
from megaq.data.gpt_dataset import build_train_valid_test_datasets
from megaq.data.indexed import IndexedDataset


def _second_prefix(tmp_path, prefix, name):
    """The same .bin/.idx under another prefix: a second dataset for a blend."""
    other = str(tmp_path / name)
    for ext in (".bin", ".idx"):
        os.link(prefix + ext, other + ext)
    return other


def test_per_split_blends_use_each_dataset_whole(tmp_path, tiny_dataset):
    other = _second_prefix(tmp_path, tiny_dataset, "other_text_document")
    n_docs = len(IndexedDataset(tiny_dataset))
    train, valid, test = build_train_valid_test_datasets(
        None, None, 64, 7, (400, 30, 0), str(tmp_path / "cache"),
        per_split_paths=(["0.25", tiny_dataset, "0.75", other], [other], None))
    assert test is None and len(train) == 400 and len(valid) >= 30
    share = np.bincount(np.asarray(train.dataset_index)) / 400   # the weights of the blend
    assert share == pytest.approx([0.25, 0.75], abs=0.01)
    # each split reads all documents of its datasets (no --split cut)
    for part in train.datasets:
        assert part.description["doc_range"] == [0, n_docs]
    assert sorted(set(np.asarray(valid.doc_idx).tolist())) == list(range(n_docs))
    # the same file as a --data-path with the default split gives its train split fewer docs
    cut, _, _ = build_train_valid_test_datasets([other], "969,30,1", 64, 7, (30, 0, 0),
                                                str(tmp_path / "cache"))
    assert len(set(np.asarray(cut.doc_idx).tolist())) < n_docs


BASE = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--micro-batch-size", "2", "--train-iters", "20", "--lr", "1e-3"]


@pytest.mark.parametrize("extra,message", [
    (["--data-path", "A", "--train-data-path", "B"],
     "--data-path and --train/--valid/--test-data-path are both given; pass --data-path (cut by "
     "--split) or the per-split paths, not both"),
    (["--train-data-path", "A", "--split", "90,10,0"],
     "--split 90,10,0 does not apply to --train/--valid/--test-data-path (each split's blend is "
     "used whole); drop --split"),
    (["--valid-data-path", "A"], "--valid-data-path / --test-data-path need --train-data-path "
                                 "(the training blend)"),
    (["--train-data-path", "0.5", "A", "0.5"], "--train-data-path: 3 items; weighted form needs "
                                               "pairs 'W1 PREFIX1 W2 PREFIX2 ...'"),
])
def test_refusals_are_one_line(extra, message):
    tok = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "v", "--merge-file", "m"]
    with pytest.raises(ArgumentsError) as e:
        parse_config(BASE + tok + extra, world_size=1)
    assert str(e.value) == message


def _first_step(tmp_path, tiny_dataset, tiny_tokenizer, extra, eod):
    """(trainer's loss of its first step, per-token losses [mb, s], the micro-batch) on one
    process; the step's batch is the first one with an end-of-document token in it."""
    from megaq.parallel.topology import Layout, build_topology
    from megaq.pretrain import build_trainer

    argv = BASE + ["--global-batch-size", "2", "--hidden-dropout", "0", "--attention-dropout",
                   "0", "--tokenizer-model", tiny_tokenizer, "--eval-iters", "0",
                   "--train-data-path", tiny_dataset, "--valid-data-path", tiny_dataset,
                   "--data-cache-path", str(tmp_path / "cache"), *extra]
    config = parse_config(argv, world_size=1)
    trainer = build_trainer(config, build_topology(Layout(1), 0))
    (mb,) = next(b for b in trainer.p.train_batches(0) if (b[0]["tokens"] == eod).any())
    with torch.no_grad():
        per_token = trainer.p.model_chunks[0](input_ids=mb["tokens"], labels=mb["labels"])
    loss, _, applied = trainer.train_step([mb])
    assert applied
    return loss, per_token, mb


def test_eod_mask_loss_drops_the_tokens_after_eod(tmp_path, tiny_dataset, tiny_tokenizer):
    from megaq.data.tokenizer import build_tokenizer

    eod = build_tokenizer("SentencePieceTokenizer", tiny_tokenizer).eod
    loss, per_token, mb = _first_step(tmp_path, tiny_dataset, tiny_tokenizer, ["--eod-mask-loss"],
                                   eod)
    at_eod = mb["tokens"] == eod
    assert torch.equal(mb["loss_mask"], (~at_eod).float())
    expect = per_token[~at_eod].double().mean().item()   # Megatron: sum(l * m) / sum(m)
    assert loss == pytest.approx(expect, rel=1e-6)
    plain, per_token2, mb2 = _first_step(tmp_path, tiny_dataset, tiny_tokenizer, [], eod)
    assert torch.equal(mb2["tokens"], mb["tokens"]) and bool(mb2["loss_mask"].all())
    assert plain == pytest.approx(per_token2.double().mean().item(), rel=1e-6)
    assert abs(plain - loss) > 1e-4  # the masked positions were counted before
