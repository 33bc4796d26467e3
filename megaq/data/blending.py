"""Weighted mixing of datasets: `--data-path 0.3 A 0.7 B`.

Sample n of the blend comes from the dataset furthest below its target share,
i.e. argmax_i(w_i * max(n, 1) - taken_i), first index on ties (Megatron-LM's rule),
so after any prefix of n samples each dataset's count is within about one sample of
w_i * n. The (dataset, sample-within-dataset) pairs are cached like the GPT indices.
"""

from __future__ import annotations

import hashlib
import json
import math
import os

import numpy as np

from megaq.data.errors import DataError
from megaq.data.fsutil import BadCache, atomic_write, cache_lock, load_cached_index, values_outside


def parse_data_path(data_path, flag: str = "--data-path") -> tuple[list[float] | None, list[str]]:
    """['A'] | ['0.3', 'A', '0.7', 'B'] | ['A', 'B'] (weighted by token count later)
    -> (normalised weights or None, prefixes). Items may also be space-separated.
    `flag` names the flag the blend came from in error messages."""
    items = [t for item in ([data_path] if isinstance(data_path, str) else data_path or [])
             for t in str(item).split()]
    if not items:
        raise DataError(f"{flag} is empty; give a prefix like out/corpus_text_document "
                        "(or use --mock-data)")
    if len(items) == 1:
        return [1.0], items

    def number(s):
        try:
            v = float(s)
        except ValueError:
            return None
        return v

    if number(items[0]) is None:  # an unweighted list of prefixes
        bad = [s for s in items if number(s) is not None]
        if bad:
            raise DataError(f"{flag}: {bad[0]!r} looks like a weight but the list does not "
                            "start with one; write it as 'W1 PREFIX1 W2 PREFIX2 ...'")
        return None, items
    if len(items) % 2:
        raise DataError(f"{flag}: {len(items)} items; weighted form needs pairs "
                        "'W1 PREFIX1 W2 PREFIX2 ...'")
    weights, prefixes = [], []
    for w, p in zip(items[0::2], items[1::2]):
        v = number(w)
        if v is None or not math.isfinite(v) or v < 0:
            raise DataError(f"{flag}: weight {w!r} (before {p!r}) is not a non-negative "
                            "number; write 'W1 PREFIX1 W2 PREFIX2 ...'")
        if number(p) is not None:
            raise DataError(f"{flag}: {p!r} is in a prefix position; write "
                            "'W1 PREFIX1 W2 PREFIX2 ...'")
        weights.append(v)
        prefixes.append(p)
    total = sum(weights)
    if total <= 0:
        raise DataError(f"{flag}: weights sum to 0; give at least one positive weight")
    return [w / total for w in weights], prefixes


def build_blending_indices(weights: list[float], size: int):
    """-> (dataset_index int16 [size], dataset_sample_index int64 [size])."""
    k = len(weights)
    w = [float(x) for x in weights]
    taken = [0] * k
    ds_index = np.empty(size, dtype=np.int16)
    ds_sample = np.empty(size, dtype=np.int64)
    for n in range(size):
        m = max(n, 1)
        best, best_err = 0, w[0] * m - taken[0]
        for i in range(1, k):
            err = w[i] * m - taken[i]
            if err > best_err:
                best, best_err = i, err
        ds_index[n] = best
        ds_sample[n] = taken[best]
        taken[best] += 1
    return ds_index, ds_sample


class BlendedDataset:
    """`ds[n]` = datasets[dataset_index[n]][dataset_sample_index[n]]."""

    def __init__(self, weights, size: int, split_name: str, cache_dir: str, seed: int,
                 prefixes, build: bool = True):
        self.weights = list(weights)
        self.size = int(size)
        self.description = {"class": "BlendedDataset", "version": 1, "weights": self.weights,
                            "size": self.size, "split": split_name, "seed": int(seed),
                            "prefixes": [os.path.abspath(p) for p in prefixes]}
        self.key = hashlib.md5(json.dumps(self.description, sort_keys=True).encode()).hexdigest()
        base = os.path.join(cache_dir, f"{self.key}-{split_name}-blend")
        self.index_path, self.sample_path = base + "-dataset_index.npy", base + "-sample_index.npy"
        self.desc_path = base + "-description.json"
        self.cache_dir = cache_dir
        self.datasets = None
        if build:
            self.build_indices()
            self.load()

    def cached(self) -> bool:
        return all(map(os.path.exists, (self.index_path, self.sample_path, self.desc_path)))

    def build_indices(self) -> None:
        if self.cached():
            return
        with cache_lock(self.cache_dir, f".{self.key}.lock"):
            if self.cached():
                return
            ds_index, ds_sample = build_blending_indices(self.weights, self.size)
            for path, arr in ((self.index_path, ds_index), (self.sample_path, ds_sample)):
                with atomic_write(path) as f:
                    np.save(f, arr, allow_pickle=False)
            with atomic_write(self.desc_path, "w") as f:
                json.dump(self.description, f, indent=1, sort_keys=True)

    def load(self) -> "BlendedDataset":
        if not self.cached():
            raise DataError(f"{self.desc_path}: blending index cache missing; the building rank "
                            "did not build it (pass build=True on one rank, then barrier)")
        self.dataset_index = self._load_checked(self.index_path, len(self.weights))
        self.dataset_sample_index = self._load_checked(self.sample_path, None)
        return self

    def _load_checked(self, path: str, high) -> np.ndarray:
        """Memory-map one cached index: `size` ids in [0, high) (a truncated or foreign
        file would otherwise fail, or pick a wrong dataset, in the middle of training)."""
        try:
            a = load_cached_index(path, f"{self.size} ids")
            reason = None if len(a) == self.size else f"{len(a)} ids, expected {self.size}"
            if reason is None and self.size:
                reason = values_outside("ids", a, 0, high if high is not None else np.iinfo(np.int64).max)
            if reason:
                raise BadCache(path, reason)
        except BadCache as e:
            raise DataError(f"{path}: corrupt blending index cache ({e.reason}); delete it, or the "
                            f"cache directory {self.cache_dir}, and rerun: it is rebuilt") from None
        return a

    def counts(self) -> np.ndarray:
        """Samples needed from each dataset."""
        return np.bincount(np.asarray(self.dataset_index), minlength=len(self.weights))

    def attach(self, datasets) -> "BlendedDataset":
        self.datasets = list(datasets)
        return self

    def __len__(self) -> int:
        return self.size

    def source(self, n: int) -> str:
        """The dataset prefix sample n comes from (for error messages)."""
        return self.datasets[int(self.dataset_index[n])].source(int(self.dataset_sample_index[n]))

    def __getitem__(self, n: int) -> dict:
        return self.datasets[int(self.dataset_index[n])][int(self.dataset_sample_index[n])]
