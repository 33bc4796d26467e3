"""BatchIterator: DP slices of each global batch, pipeline stages without data, resume."""

import itertools

import numpy as np
import pytest
import torch

from megaq.data.iterator import BatchIterator, global_micro_batch_order

SEQ = 8


class IndexDataset:
    """Sample i is [i, i+1, ..., i+SEQ]: every token says which sample it came from."""

    def __init__(self, n):
        self.n, self.reads = n, 0

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.reads += 1
        return {"tokens": np.arange(i, i + SEQ + 1, dtype=np.int64)}


def ids(micro):
    return micro["tokens"][:, 0].tolist()


@pytest.mark.parametrize("dp,mb,gbs", [(1, 2, 8), (2, 2, 8), (4, 1, 8), (2, 3, 12)])
def test_dp_ranks_together_read_the_single_process_batch(dp, mb, gbs):
    ds = IndexDataset(100)
    single = next(BatchIterator(ds, gbs, mb, 0, 1))
    ranks = [next(BatchIterator(ds, gbs, mb, d, dp)) for d in range(dp)]
    num_micro = gbs // (mb * dp)
    assert all(len(r) == num_micro for r in ranks)
    # Concatenating micro-batch-wise (micro step k, then DP rank d) = the single process order.
    merged = [ranks[d][k] for d, k in global_micro_batch_order(dp, num_micro)]
    assert [ids(m) for m in merged] == [ids(m) for m in single]
    assert sorted(sum((ids(m) for m in merged), [])) == list(range(gbs))
    for m in merged:
        assert m["tokens"].shape == (mb, SEQ) and m["tokens"].dtype == torch.int64
        assert torch.equal(m["labels"], m["tokens"] + 1)  # labels are inputs shifted by one
        assert m["loss_mask"].dtype == torch.float32 and bool((m["loss_mask"] == 1).all())


def test_resume_gives_the_uninterrupted_batches():
    ds = IndexDataset(200)
    full = BatchIterator(ds, 12, 2, 1, 3)
    steps = [[ids(m) for m in batch] for batch in full]
    assert len(steps) == 200 // 12 and full.consumed_samples == 12 * len(steps)
    resumed = BatchIterator(ds, 12, 2, 1, 3, consumed_samples=5 * 12)
    assert [[ids(m) for m in b] for b in resumed] == steps[5:]
    with pytest.raises(ValueError, match="not a multiple of the global batch size"):
        BatchIterator(ds, 12, 2, 1, 3, consumed_samples=13)


def test_stages_without_data_never_read():
    ds = IndexDataset(64)
    it = BatchIterator(ds, 8, 2, 0, 2, needs_data=False)
    assert next(it) == [None, None] and ds.reads == 0 and it.consumed_samples == 8
    assert len(list(it)) == 7  # same number of steps as the data-reading ranks
    # Pipeline stages with no dataset object at all still step in lockstep.
    assert next(BatchIterator(None, 8, 2, 0, 2, needs_data=False)) == [None, None]


def test_eod_mask_and_layout_errors():
    class Eod(IndexDataset):
        def __getitem__(self, i):
            t = super().__getitem__(i)["tokens"]
            t[3] = 999
            return {"tokens": t}

    m = next(BatchIterator(Eod(8), 4, 2, 0, 2, eod=999, eod_mask_loss=True))[0]
    assert m["loss_mask"][:, 3].eq(0).all() and m["loss_mask"].sum() == 2 * (SEQ - 1)
    with pytest.raises(ValueError, match="not a multiple of micro-batch-size x data-parallel"):
        BatchIterator(IndexDataset(8), 6, 2, 0, 2)
    with pytest.raises(ValueError, match="empty"):
        BatchIterator(None, 4, 2, 0, 2)


def _rank_reads(topo, prefix, cache):
    """What the training job does: rank 0 builds the index cache, everyone loads after a
    barrier, each DP rank iterates its slice."""
    from megaq.data.gpt_dataset import build_train_valid_test_datasets
    from megaq.parallel import comm

    train = build_train_valid_test_datasets([prefix], "98,2,0", 16, 3, (64, 0, 0), cache,
                                            build=topo.rank == 0,
                                            barrier=lambda: comm.barrier(topo.world))[0]
    it = BatchIterator(train, 8, 2, topo.dp_rank, topo.layout.dp)
    return [[m["tokens"].tolist() for m in step] for step in itertools.islice(it, 8)]


def test_ranks_build_once_and_together_read_the_single_process_batches(tmp_path, tiny_dataset):
    from megaq.data.gpt_dataset import build_train_valid_test_datasets
    from megaq.testing.ranks import run_on_ranks

    cache = str(tmp_path / "cache")
    per_rank = run_on_ranks(_rank_reads, 2, args=(tiny_dataset, cache))
    train = build_train_valid_test_datasets([tiny_dataset], "98,2,0", 16, 3, (64, 0, 0),
                                            cache, build=False)[0]  # reuses rank 0's cache
    single = [[m["tokens"].tolist() for m in step]
              for step in itertools.islice(BatchIterator(train, 8, 2, 0, 1), 8)]
    assert len(single) == len(per_rank[0]) == len(per_rank[1]) == 8
    for step, want in enumerate(single):
        got = [per_rank[d][step][k] for d, k in global_micro_batch_order(2, 2)]
        assert got == want


class Source(IndexDataset):
    def source(self, i):
        return f"data/prefix{i % 2}"


def test_token_id_outside_the_vocab_is_one_data_error():
    """Sample i holds ids i..i+SEQ: with a vocab of 20 the first micro-batch is fine, the
    one holding id 20 is refused before any embedding sees it (no IndexError)."""
    from megaq.data.errors import DataError

    it = BatchIterator(Source(100), 4, 2, 0, 1, vocab_size=20)
    assert len(next(it)) == 2   # samples 0..3: ids up to 11
    next(it)                    # samples 4..7: ids up to 15
    with pytest.raises(DataError) as e:
        next(it)                # samples 8..11: sample 8 ends at id 16, sample 11 at id 19...
        next(it)                # samples 12..15: sample 12 holds 20
    assert str(e.value) == ("data/prefix0: token id 20 (sample 12) is outside the tokenizer's "
                            "vocab of 20 ids: the data was made with another tokenizer; "
                            "preprocess it with this run's tokenizer (tools/preprocess_data.py), "
                            "or train with the tokenizer it was made with")


def test_pretrain_reports_an_id_outside_the_vocab_as_one_error_line(tmp_path):
    """Through the real entry point: `error:` + exit 2, not `index out of range in self`."""
    from megaq import pretrain
    from megaq.data.indexed import IndexedDatasetWriter
    from megaq.testing.ranks import run_cli_on_ranks

    prefix = str(tmp_path / "big_ids")
    w = IndexedDatasetWriter(prefix, np.uint16)
    for d in range(40):
        w.add_document(np.arange(30 * d, 30 * d + 30) % 450)  # ids 0..449: 400 is short
    w.finish()
    w.commit()
    argv = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
            "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "8",
            "--lr", "1e-3", "--train-iters", "20", "--eval-iters", "0",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "400",
            "--data-cache-path", str(tmp_path / "cache"), "--data-path", prefix]
    r = run_cli_on_ranks(pretrain.cli, argv, 1)
    lines = [x for x in r["stderr"].splitlines() if x.strip()]
    assert r["codes"] == [2] and len(lines) == 1, r
    assert lines[0].startswith(f"error: {prefix}: token id ") and "vocab of 400 ids" in lines[0]
    # data made for Megatron's NullTokenizer (--append-eod writes its eod id, 400 here, which
    # its vocab counts): the line says which --vocab-size trains on it, and that one does
    eod_prefix = str(tmp_path / "with_eod")
    w = IndexedDatasetWriter(eod_prefix, np.uint16)
    for d in range(40):
        w.add_document(np.append(np.arange(10 * d, 10 * d + 29) % 400, 400))
    w.finish()
    w.commit()
    argv[argv.index(prefix)] = eod_prefix
    argv[argv.index("--train-iters") + 1] = "2"
    r = run_cli_on_ranks(pretrain.cli, argv, 1)
    assert r["codes"] == [2] and "is Megatron's NullTokenizer end-of-document id" in r["stderr"] \
        and "pass --vocab-size 401" in r["stderr"], r
    argv[argv.index("--vocab-size") + 1] = "401"
    assert run_cli_on_ranks(pretrain.cli, argv, 1)["codes"] == [0]
