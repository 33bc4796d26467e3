"""Distributed batch iterator: each DP rank's micro-batches of each global batch.

Layout (Megatron-LM's pretraining sampler): a global batch of G samples starting at
sample `step * G` is consumed in `M = G / (mb * dp)` micro-steps; at micro-step k,
DP rank d takes the mb consecutive samples starting at

    step * G + (k * dp + d) * mb.

So a single process (dp = 1) with the same micro-batch size sees micro-batch
j = k * dp + d where DP rank d sees its k-th; concatenating, for k = 0..M-1, the
micro-batches of ranks 0..dp-1 reproduces the single process's micro-batches in
order, and the union over ranks is exactly the global batch. `global_micro_batch_order`
gives this mapping for tests.

Resume: pass the checkpoint's consumed-samples count (a multiple of G); the iterator
continues with exactly the batches an uninterrupted run would have seen. Ranks that
need no data (middle pipeline stages) pass needs_data=False: they get None entries
and never touch the dataset, but keep count so every rank agrees on the step.
"""

from __future__ import annotations

import numpy as np
import torch

from megaq.data.errors import DataError


def global_micro_batch_order(dp_size: int, num_micro: int) -> list[tuple[int, int]]:
    """Single-process micro-batch j -> (dp_rank, local micro index), j in order."""
    return [(j % dp_size, j // dp_size) for j in range(dp_size * num_micro)]


class BatchIterator:
    """Yields, per training step, a list of `num_micro` micro-batches for this DP rank:
    dict(tokens [mb, s] int64, labels [mb, s] int64, loss_mask [mb, s] float32),
    or None entries when needs_data is False."""

    def __init__(self, dataset, global_batch_size: int, micro_batch_size: int, dp_rank: int,
                 dp_size: int, consumed_samples: int = 0, needs_data: bool = True,
                 eod: int | None = None, eod_mask_loss: bool = False,
                 vocab_size: int | None = None):
        per_micro_step = micro_batch_size * dp_size
        if micro_batch_size < 1 or dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"bad batch layout: micro_batch_size={micro_batch_size}, "
                             f"dp_rank={dp_rank}, dp_size={dp_size}")
        if global_batch_size % per_micro_step:
            raise ValueError(f"--global-batch-size {global_batch_size} is not a multiple of "
                             f"micro-batch-size x data-parallel size = {per_micro_step}")
        if consumed_samples % global_batch_size:
            raise ValueError(f"consumed samples {consumed_samples} is not a multiple of the global "
                             f"batch size {global_batch_size}; resume with the same batch size")
        if dataset is None and needs_data:
            raise ValueError("no dataset for this split (it is empty); cannot iterate over it")
        if eod_mask_loss and eod is None:
            raise ValueError("eod_mask_loss needs the tokenizer's eod id")
        self.dataset = dataset
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.num_micro = global_batch_size // per_micro_step
        self.consumed_samples = consumed_samples
        self.needs_data = needs_data
        self.eod, self.eod_mask_loss = eod, eod_mask_loss
        self.vocab_size = vocab_size  # token ids must be below it (None: not checked)

    def __iter__(self):
        return self

    def __len__(self) -> int:
        """Steps left before the dataset runs out."""
        if self.dataset is None:
            return 0
        return max(0, (len(self.dataset) - self.consumed_samples) // self.global_batch_size)

    def sample_indices(self, step_start: int) -> list[np.ndarray]:
        """Dataset indices of this rank's micro-batches for the batch starting at step_start."""
        mb, dp = self.micro_batch_size, self.dp_size
        return [step_start + (k * dp + self.dp_rank) * mb + np.arange(mb)
                for k in range(self.num_micro)]

    def __next__(self) -> list:
        start = self.consumed_samples
        if self.dataset is not None and start + self.global_batch_size > len(self.dataset):
            raise StopIteration
        self.consumed_samples += self.global_batch_size
        if not self.needs_data:
            return [None] * self.num_micro
        return [self._micro_batch(idx) for idx in self.sample_indices(start)]

    def _micro_batch(self, indices: np.ndarray) -> dict:
        rows = np.stack([np.asarray(self.dataset[int(i)]["tokens"], dtype=np.int64)
                         for i in indices])
        if self.vocab_size is not None:
            self._check_ids(rows, indices)
        t = torch.from_numpy(rows)
        tokens, labels = t[:, :-1].contiguous(), t[:, 1:].contiguous()
        loss_mask = torch.ones(labels.shape, dtype=torch.float32)
        if self.eod_mask_loss:
            loss_mask[tokens == self.eod] = 0.0  # as Megatron: no loss right after an eod
        return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask}

    def _check_ids(self, rows: np.ndarray, indices: np.ndarray) -> None:
        """An id outside the vocabulary (data preprocessed with another tokenizer) would
        fail deep in the embedding ("index out of range in self"), or read padding rows;
        one min/max per micro-batch finds it first and names the dataset."""
        low, high = int(rows.min()), int(rows.max())
        if 0 <= low and high < self.vocab_size:
            return
        outside = (rows < 0) | (rows >= self.vocab_size)
        r = int(np.flatnonzero(outside.any(axis=1))[0])
        i, bad = int(indices[r]), int(rows[r][outside[r]][0])
        source = getattr(self.dataset, "source", None)
        where = source(i) if source else "the dataset"
        if bad == self.vocab_size == self.eod:  # megaq's NullTokenizer eod lies past its ids
            raise DataError(f"{where}: token id {bad} (sample {i}) is Megatron's NullTokenizer "
                            f"end-of-document id, which Megatron counts in its vocab and megaq's "
                            f"--vocab-size {bad} does not: pass --vocab-size {bad + 1} (the ids "
                            f"and the end-of-document id, as Megatron's model has)")
        raise DataError(f"{where}: token id {bad} (sample {i}) is outside the tokenizer's vocab "
                        f"of {self.vocab_size} ids: the data was made with another tokenizer; "
                        f"preprocess it with this run's tokenizer (tools/preprocess_data.py), "
                        f"or train with the tokenizer it was made with")
