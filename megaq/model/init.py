"""Deterministic parameter initialisation, independent of the TP / PP layout.

Every weight is drawn from its own CPU generator, seeded from (seed, global layer
index, parameter name), on the *full* (un-split) shape; the TP layers then keep
their slice. So TP=4 x PP=2 starts from exactly the weights of one process, and
adding a layer or a rank never shifts another parameter's values.
"""

from __future__ import annotations

import hashlib
import math

import torch


def param_generator(seed: int, layer: int | str, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}/{layer}/{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


class ParamInit:
    """Init functions (full shape -> fp32 tensor) for one layer (or 'embedding', 'output')."""

    def __init__(self, seed: int, std: float, num_layers: int, layer: int | str):
        self.seed, self.std, self.num_layers, self.layer = seed, std, num_layers, layer

    def normal(self, name: str, scaled: bool = False, valid_rows: int | None = None):
        """N(0, std); scaled=True divides std by sqrt(2 * num_layers) (Megatron's init for
        the projections that feed the residual stream). With valid_rows only the first
        rows are drawn and the rest (vocab padding) are zero, so the drawn values do not
        depend on how much padding the TP size implies."""
        std = self.std / math.sqrt(2.0 * self.num_layers) if scaled else self.std

        def init(shape: tuple[int, ...]) -> torch.Tensor:
            gen = param_generator(self.seed, self.layer, name)
            rows = shape[0] if valid_rows is None else min(valid_rows, shape[0])
            full = torch.zeros(shape, dtype=torch.float32)
            full[:rows].normal_(0.0, std, generator=gen)
            return full

        return init
