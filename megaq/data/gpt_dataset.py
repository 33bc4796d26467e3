"""GPT pretraining samples over Megatron indexed datasets, with cached indices.

A sample is `seq_length + 1` consecutive tokens (inputs = [:-1], labels = [1:]) read
across document boundaries; consecutive samples share one token, as in Megatron-LM.
Three index arrays define the order, built once and cached as `.npy`:

- document index: the split's documents, reshuffled every epoch, for as many epochs
  as `num_samples` needs;
- sample index [N+1, 2]: (position in the document index, token offset) where sample
  i starts; sample i ends where sample i+1 starts (inclusive);
- shuffle index [N]: sample order; the last, partial epoch is shuffled separately so
  that every full epoch is seen before any document is repeated.

Cache files are named by an md5 of the dataset description (path, size of the data,
split range, seq_length, seed, num_samples): a changed description gets new files,
an unchanged one reuses them. Building: the ranks with `build=True` build what is
missing (serialised by a file lock, written to temp names and renamed), then the
caller's `barrier()` runs, then every rank memory-maps the files.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

import numpy as np

from megaq.data.errors import DataError
from megaq.data.fsutil import BadCache, atomic_write, cache_lock, load_cached_index, values_outside
from megaq.data.indexed import IndexedDataset

INDEX_VERSION = 1
SPLIT_NAMES = ("train", "valid", "test")


def parse_split(split: str) -> list[float]:
    """'949,50,1' (or '949/50/1', fewer parts padded with 0) -> normalised fractions."""
    parts = [p for p in str(split).replace("/", ",").split(",") if p.strip() != ""]
    try:
        vals = [float(p) for p in parts]
    except ValueError:
        raise DataError(f"--split {split!r}: not numbers; give up to three weights like "
                        "949,50,1") from None
    if not vals or len(vals) > 3 or any(v < 0 or not np.isfinite(v) for v in vals) or sum(vals) <= 0:
        raise DataError(f"--split {split!r}: need 1-3 non-negative weights with a positive sum, "
                        "like 949,50,1")
    vals += [0.0] * (3 - len(vals))
    total = sum(vals)
    return [v / total for v in vals]


def split_boundaries(fractions: list[float], size: int) -> list[int]:
    """Megatron's rounding of split fractions to document boundaries [0, a, b, size]."""
    idx = [0]
    for f in fractions:
        idx.append(idx[-1] + int(round(f * float(size))))
    diff = idx[-1] - size
    return [idx[0]] + [i - diff for i in idx[1:]]


def _hash(desc: dict) -> str:
    return hashlib.md5(json.dumps(desc, sort_keys=True).encode()).hexdigest()


def _save_npy(path: str, arr: np.ndarray) -> None:
    with atomic_write(path) as f:
        np.save(f, arr, allow_pickle=False)


class GPTDataset:
    """`ds[i] -> {"tokens": int64 [seq_length + 1]}` for i in range(len(ds))."""

    def __init__(self, indexed: IndexedDataset, split_name: str, doc_range: tuple[int, int],
                 num_samples: int, seq_length: int, seed: int, cache_dir: str,
                 build: bool = True):
        self.indexed = indexed
        self.seq_length = seq_length
        self.num_samples = num_samples
        self.description = {
            "class": "GPTDataset", "version": INDEX_VERSION,
            "path_prefix": os.path.abspath(indexed.prefix),
            "num_sequences": len(indexed), "num_tokens": indexed.num_tokens,
            "split": split_name, "doc_range": [int(doc_range[0]), int(doc_range[1])],
            "num_samples": int(num_samples), "seq_length": int(seq_length), "seed": int(seed)}
        self.key = _hash(self.description)
        base = os.path.join(cache_dir, f"{self.key}-{split_name}")
        self.paths = {n: f"{base}-{n}.npy" for n in ("doc_idx", "sample_idx", "shuffle_idx")}
        self.desc_path = f"{base}-description.json"
        self.cache_dir = cache_dir
        self._doc_range = doc_range
        self._seed = seed
        # Checked on every rank (not only the builder) so all ranks fail alike, before
        # any barrier, instead of the others waiting for a builder that raised.
        check_enough_tokens(indexed.sequence_lengths, doc_range, seq_length)
        if build:
            self.build_indices()

    # -- index building (one rank) -------------------------------------------------
    def cached(self) -> bool:
        # The description is written last: its presence marks a complete set.
        return os.path.exists(self.desc_path) and all(map(os.path.exists, self.paths.values()))

    def build_indices(self) -> bool:
        """Build and cache the indices unless present and sound; True if this call built
        them. A corrupt cached set (truncated, out-of-range values) is rebuilt: the
        builder runs before the others' barrier, so no rank is reading it meanwhile."""
        if self._cache_usable():
            return False
        with cache_lock(self.cache_dir, f".{self.key}.lock"):
            if self._cache_usable():
                return False
            doc_idx, sample_idx, shuffle_idx = build_sample_indices(
                self.indexed.sequence_lengths, self._doc_range, self.num_samples,
                self.seq_length, self._seed)
            _save_npy(self.paths["doc_idx"], doc_idx)
            _save_npy(self.paths["sample_idx"], sample_idx)
            _save_npy(self.paths["shuffle_idx"], shuffle_idx)
            with atomic_write(self.desc_path, "w") as f:
                json.dump(self.description, f, indent=1, sort_keys=True)
        return True

    def _cache_usable(self) -> bool:
        """Whether a complete, sound set is cached; a corrupt one gets a note (rebuilt)."""
        if not self.cached():
            return False
        try:
            self._open_cache()
        except BadCache as e:
            print(f" note: {e.path}: {e.reason}; rebuilding the data index cache",
                  file=sys.stderr, flush=True)
            return False
        return True

    def _open_cache(self) -> tuple:
        """Memory-map the three cached arrays and check them against this dataset:
        shapes, and each index within what it indexes (min/max, one pass each; the
        per-token offsets are not checked). -> (doc_idx, sample_idx, shuffle_idx)."""
        doc_idx, sample_idx, shuffle_idx = (
            load_cached_index(path, f"a {name}", (2,) if name == "sample_idx" else ())
            for name, path in self.paths.items())
        lo, hi = self._doc_range
        problems = [
            (0, values_outside("document ids", doc_idx, lo, hi)),
            (1, values_outside("document positions", sample_idx[:, 0], 0, len(doc_idx))),
            (1, values_outside("token offsets", sample_idx[:, 1], 0, np.iinfo(np.int64).max)),
            (2, values_outside("sample ids", shuffle_idx, 0, len(sample_idx) - 1)),
            (2, None if len(shuffle_idx) == len(sample_idx) - 1 >= self.num_samples else
             f"{len(shuffle_idx)} samples for {len(sample_idx) - 1} sample starts "
             f"({self.num_samples} needed)")]
        for i, reason in problems:
            if reason:
                raise BadCache(list(self.paths.values())[i], reason)
        return doc_idx, sample_idx, shuffle_idx

    def load(self) -> "GPTDataset":
        """Memory-map the cached indices (after the building rank's barrier)."""
        if not self.cached():
            raise DataError(f"{self.desc_path}: index cache missing; the building rank did not "
                            "build it (pass build=True on one rank per cache dir, then barrier)")
        try:
            self.doc_idx, self.sample_idx, self.shuffle_idx = self._open_cache()
        except BadCache as e:  # the builder rebuilds a corrupt set: another writer's mess
            raise DataError(f"{e.path}: corrupt data index cache ({e.reason}); delete it, or the "
                            f"cache directory {self.cache_dir}, and rerun: the indices are "
                            "rebuilt") from None
        return self

    # -- reading -----------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.shuffle_idx)

    def source(self, i: int) -> str:
        """The dataset prefix sample i comes from (for error messages)."""
        return self.indexed.prefix

    def __getitem__(self, i: int) -> dict:
        j = int(self.shuffle_idx[i])
        d0, o0 = (int(x) for x in self.sample_idx[j])
        d1, o1 = (int(x) for x in self.sample_idx[j + 1])
        get = self.indexed.get
        if d0 == d1:
            tokens = get(int(self.doc_idx[d0]), o0, o1 - o0 + 1)
        else:
            parts = [get(int(self.doc_idx[d0]), o0)]
            parts += [get(int(self.doc_idx[d])) for d in range(d0 + 1, d1)]
            parts.append(get(int(self.doc_idx[d1]), 0, o1 + 1))
            tokens = np.concatenate(parts)
        return {"tokens": tokens.astype(np.int64)}


def check_not_empty(indexed, prefixes, flag: str = "--data-path") -> None:
    """Refuse a dataset of 0 documents (alone or in a blend): it can give no samples."""
    for ix, prefix in zip(indexed, prefixes):
        if len(ix) == 0 or ix.num_tokens == 0:
            raise DataError(f"{prefix}: the dataset is empty ({len(ix)} documents, {ix.num_tokens} "
                            f"tokens); preprocess non-empty input or remove it from {flag}")


def check_split_has_documents(name: str, n: int, split: str, ranges, indexed, prefixes) -> None:
    """A split asked for `n` samples must get at least one document of every dataset."""
    for (a, b), ix, prefix in zip(ranges, indexed, prefixes):
        if b > a:
            continue
        skip = {"valid": "; or pass --eval-iters 0 to skip validation",
                "test": ""}.get(name, "")
        raise DataError(f"--split {split!r} leaves the {name} split no documents of {prefix} "
                        f"({len(ix)} documents), but {n} {name} samples are needed; give the "
                        f"{name} split a larger weight (e.g. --split 949,50,1) or use more "
                        f"data{skip}")


def check_enough_tokens(sequence_lengths, doc_range, seq_length: int) -> int:
    lo, hi = doc_range
    tokens = int(np.asarray(sequence_lengths[lo:hi], dtype=np.int64).sum())
    if tokens <= seq_length:
        raise DataError(f"split documents {lo}..{hi} hold {tokens} tokens, fewer than one "
                        f"sample of {seq_length + 1}; use more data or a smaller --seq-length")
    return tokens


def _holds_a_sample(sequence_lengths, doc_range, seq_length: int) -> bool:
    lo, hi = doc_range
    return hi > lo and int(np.asarray(sequence_lengths[lo:hi], dtype=np.int64).sum()) > seq_length


def build_sample_indices(sequence_lengths: np.ndarray, doc_range: tuple[int, int],
                         num_samples: int, seq_length: int, seed: int):
    """-> (doc_idx int32 [E*D], sample_idx int64 [N+1, 2], shuffle_idx int64 [N])."""
    lo, hi = doc_range
    docs = np.arange(lo, hi, dtype=np.int32)
    tokens_per_epoch = check_enough_tokens(sequence_lengths, doc_range, seq_length)
    # Fewest epochs whose tokens give num_samples samples of seq_length (+1 shared token).
    num_epochs = max(1, -(-(num_samples * seq_length + 1) // tokens_per_epoch))
    rng = np.random.RandomState(seed)
    doc_idx = np.concatenate([rng.permutation(docs) for _ in range(num_epochs)])
    total_tokens = num_epochs * tokens_per_epoch
    n = (total_tokens - 1) // seq_length
    doc_lengths = np.asarray(sequence_lengths, dtype=np.int64)[doc_idx]
    doc_ends = np.cumsum(doc_lengths)                    # exclusive end of each doc
    starts = np.arange(n + 1, dtype=np.int64) * seq_length
    pos = np.searchsorted(doc_ends, starts, side="right")
    offsets = starts - (doc_ends[pos] - doc_lengths[pos])
    sample_idx = np.stack([pos, offsets], axis=1).astype(np.int64)
    # Full epochs first, then the partial last epoch, each shuffled on its own.
    n_full = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length if num_epochs > 1 else 0
    n_full = max(0, min(n_full, n))
    shuffle_idx = np.concatenate([rng.permutation(np.arange(0, n_full, dtype=np.int64)),
                                  rng.permutation(np.arange(n_full, n, dtype=np.int64))])
    return doc_idx, sample_idx, shuffle_idx


class MockGPTDataset:
    """`--mock-data`: deterministic synthetic samples, no files. Each sample is an
    arithmetic progression mod vocab_size (random start and step per sample), so a
    model can learn it and loss falls, which makes smoke runs meaningful."""

    def __init__(self, num_samples: int, seq_length: int, seed: int, vocab_size: int,
                 split_name: str = "train"):
        if not vocab_size or vocab_size < 2:
            raise DataError("--mock-data needs a vocab size of at least 2 (pass vocab_size)")
        self.num_samples, self.seq_length, self.vocab_size = num_samples, seq_length, vocab_size
        self._seed = [seed, SPLIT_NAMES.index(split_name)]

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> dict:
        if not 0 <= i < self.num_samples:
            raise IndexError(i)
        rng = np.random.default_rng(self._seed + [int(i)])
        start, step = rng.integers(0, self.vocab_size), rng.integers(1, min(self.vocab_size, 8))
        t = np.arange(self.seq_length + 1, dtype=np.int64)
        return {"tokens": (start + step * t) % self.vocab_size}


def build_train_valid_test_datasets(data_path, split: str | None, seq_length: int, seed: int,
                                    num_samples, cache_dir: str, mock: bool = False,
                                    vocab_size: int | None = None, build: bool = True,
                                    barrier=None, per_split_paths=None,
                                    optional_splits: frozenset = frozenset()):
    """-> (train, valid, test); each indexable (`ds[i]["tokens"]`, int64 [seq_length+1])
    or None when no samples are asked of it. A split asked for samples that gets no
    documents, and an empty dataset in --data-path, are DataErrors (one line each).

    data_path: Megatron style, ['prefix'] or ['0.3', 'A', '0.7', 'B'] (blended), cut
    into train/valid/test by `split`. per_split_paths: instead of data_path and split,
    (train, valid, test) blends of the same form, each used whole for its split
    (Megatron's --train-data-path / --valid-data-path / --test-data-path); a split
    whose blend is None gets no dataset.
    build: whether this rank builds missing index caches (set it on one rank per
    cache dir, e.g. global rank 0 on a shared filesystem, local rank 0 otherwise; if
    several ranks build, a file lock makes them take turns and the work is done once).
    barrier: called once after building and before loading, e.g. a torch.distributed
    barrier supplied by the caller; None when all ranks build or there is one rank.
    optional_splits: names of splits (e.g. {"test"}) that are None, not an error, when
    the split leaves them no documents or less than one sample of a dataset.
    """
    from megaq.data.blending import BlendedDataset

    if len(num_samples) != 3:
        raise DataError(f"num_samples must give (train, valid, test), got {num_samples!r}")
    if mock:
        out = tuple(MockGPTDataset(n, seq_length, seed, vocab_size, name) if n > 0 else None
                    for n, name in zip(num_samples, SPLIT_NAMES))
        return out
    sources = _split_sources(data_path, split, per_split_paths, num_samples)
    plans = []  # per split: None or (blend or None, [GPTDataset-to-be per prefix])
    for name, n, source in zip(SPLIT_NAMES, num_samples, sources):
        if n <= 0 or source is None:
            plans.append(None)
            continue
        weights, prefixes, indexed, ranges = source
        if name in optional_splits and not all(
                _holds_a_sample(ix.sequence_lengths, r, seq_length) for ix, r in zip(indexed, ranges)):
            plans.append(None)
            continue
        check_split_has_documents(name, n, split, ranges, indexed, prefixes)
        if len(indexed) == 1:
            ds = GPTDataset(indexed[0], name, ranges[0], n, seq_length, seed, cache_dir, build)
            plans.append((None, [ds]))
            continue
        for ix, r in zip(indexed, ranges):  # fail on every rank, before the barrier
            check_enough_tokens(ix.sequence_lengths, r, seq_length)
        blend = BlendedDataset(weights, n, name, cache_dir, seed, prefixes, build)
        counts = blend.counts() if build else None
        parts = ([GPTDataset(ix, name, r, int(c), seq_length, seed, cache_dir, build)
                  for ix, r, c in zip(indexed, ranges, counts)] if build else (indexed, ranges))
        plans.append((blend, parts))
    if barrier is not None:
        barrier()
    out = []
    for s, plan in enumerate(plans):
        if plan is None:
            out.append(None)
            continue
        blend, parts = plan
        if blend is None:
            out.append(parts[0].load())
            continue
        blend.load()
        if not build:  # sizes come from the blending index the builder wrote
            ixs, ranges = parts
            parts = [GPTDataset(ix, SPLIT_NAMES[s], r, int(c), seq_length, seed, cache_dir, False)
                     for ix, r, c in zip(ixs, ranges, blend.counts())]
        out.append(blend.attach([p.load() for p in parts]))
    return tuple(out)


def _open_blend(data_path, flag: str, opened: dict):
    """(weights, prefixes, indexed datasets) of one blend; an unweighted list is mixed
    in proportion to each dataset's tokens. `opened` shares IndexedDatasets by prefix."""
    from megaq.data.blending import parse_data_path

    weights, prefixes = parse_data_path(data_path, flag)
    for p in prefixes:
        if p not in opened:
            opened[p] = IndexedDataset(p)
    indexed = [opened[p] for p in prefixes]
    check_not_empty(indexed, prefixes, flag)
    if weights is None:
        tokens = [ix.num_tokens for ix in indexed]
        weights = [t / sum(tokens) for t in tokens]
    return weights, prefixes, indexed


def _split_sources(data_path, split, per_split_paths, num_samples) -> list:
    """Per split: None, or (weights, prefixes, indexed datasets, document range of each)."""
    opened: dict = {}
    if per_split_paths is not None:
        out = []
        for name, n, path in zip(SPLIT_NAMES, num_samples, per_split_paths):
            if not path or n <= 0:
                out.append(None)
                continue
            weights, prefixes, indexed = _open_blend(path, f"--{name}-data-path", opened)
            out.append((weights, prefixes, indexed, [(0, len(ix)) for ix in indexed]))
        return out
    fractions = parse_split(split)
    weights, prefixes, indexed = _open_blend(data_path, "--data-path", opened)
    return [(weights, prefixes, indexed,
             [tuple(split_boundaries(fractions, len(ix))[s:s + 2]) for ix in indexed])
            for s in range(3)]
