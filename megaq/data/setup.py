"""A run's data: tokenizer, train/valid/test datasets and this rank's batch iterators."""

from __future__ import annotations

import os
from dataclasses import dataclass

from megaq.data.config import MOCK_VOCAB_SIZE, DataConfig


@dataclass(frozen=True)
class Data:
    """train(consumed) / valid(consumed) / test(consumed) -> BatchIterator (one list of
    micro-batches per step; valid and test may be None: none asked for, or the split
    gives the test set no documents); `vocab_size` is the tokenizer's; `config` the
    DataConfig as resolved (--demo-corpus names its files), which is what a checkpoint
    records."""

    train: object
    valid: object
    vocab_size: int
    config: DataConfig
    test: object = None


def build_data(data: DataConfig, topo, *, seq_length: int, seed: int, global_batch_size: int,
               micro_batch_size: int, num_samples: tuple[int, int, int]) -> Data:
    """Index caches are built by global rank 0 while the others wait at a barrier, then
    every rank memory-maps them. `num_samples`: (train, valid, test) samples to draw."""
    from megaq.data.builtin import default_cache_dir, ensure_builtin_corpus
    from megaq.data.gpt_dataset import build_train_valid_test_datasets
    from megaq.data.iterator import BatchIterator
    from megaq.data.tokenizer import build_tokenizer
    from megaq.parallel import comm

    eod = None
    if data.demo_corpus is not None:
        prefix, model = ensure_builtin_corpus(data.demo_corpus or None)
        data = data.with_built_corpus(prefix, model)
    if data.mock_data or data.tokenizer_type == "NullTokenizer":
        vocab_size = data.vocab_size or MOCK_VOCAB_SIZE
        # Megatron's NullTokenizer: eod is the id after the vocabulary, so it never occurs
        # among the ids and --eod-mask-loss masks nothing (a mock-data launch script with
        # the flag runs as in Megatron)
        eod = vocab_size
        if data.eod_mask_loss and topo.rank == 0:
            print(f" note: --eod-mask-loss masks nothing here: the ids of --mock-data / the "
                  f"NullTokenizer have no end-of-document token (Megatron's eod id is "
                  f"{vocab_size}, past them)", flush=True)
    else:
        tok = build_tokenizer(data.tokenizer_type, data.tokenizer_model, data.vocab_file,
                              data.merge_file)
        vocab_size, eod = tok.vocab_size, tok.eod
    cache = data.data_cache_path or os.path.join(default_cache_dir(), "indices")
    # The test set is evaluated once at the end when the split gives it documents (as
    # Megatron: a split without test documents builds no test set); the train and
    # validation splits must have theirs.
    train_ds, valid_ds, test_ds = build_train_valid_test_datasets(
        list(data.data_path or []), data.split, seq_length, seed, num_samples, cache,
        mock=data.mock_data, vocab_size=vocab_size, build=topo.rank == 0,
        barrier=lambda: comm.barrier(topo.world), per_split_paths=data.per_split_paths,
        optional_splits=frozenset({"test"}))
    needs_data = topo.is_first_stage or topo.is_last_stage

    def iterator(ds):
        if ds is None:
            return None
        return lambda consumed: BatchIterator(ds, global_batch_size, micro_batch_size,
                                              topo.dp_rank, topo.layout.dp,
                                              consumed_samples=consumed, needs_data=needs_data,
                                              eod=eod, eod_mask_loss=data.eod_mask_loss,
                                              vocab_size=vocab_size)
    return Data(iterator(train_ds), iterator(valid_ds), vocab_size, data, test=iterator(test_ds))
