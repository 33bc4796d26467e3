"""Flat, padded, block-aligned buffers for one unit's parameters.

A :class:`FlatPartition` lays a list of parameters end to end in one flat buffer
(ordered decay-first / no-decay-last, and inside each TP-split before TP-replicated,
so a shard splits into at most two contiguous optimizer leaves and the grad-norm
ranges stay few). Two kinds:

* sharded (ZeRO-3): the flat length is padded up to a multiple of
  ``dp_size * block_size``, so every DP shard holds a whole number of quantization
  blocks; this rank keeps only ``shard`` (its ``1/dp`` slice, in the gather dtype).
  ``full`` is the gathered buffer: the parameters' ``.data`` are views into it, and
  releasing it resizes its storage to 0 bytes (the views keep their shapes, so
  autograd's saved tensors stay valid and see the data again once re-gathered).
* replicated (stage 0, and small persistent params under stage 3): ``full`` is
  always allocated and ``shard`` is the whole of it.

Padding elements are zero in weights and gradients, so they never move the norm or
the optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def padded(n: int, block: int) -> int:
    """Smallest multiple of `block` that holds n elements (at least one block)."""
    return round_up(max(n, 1), block)


def wants_weight_decay(name: str, param: torch.Tensor) -> bool:
    """Megatron's rule: no weight decay on biases and on 1-D tensors (norm weights)."""
    return not (name.endswith("bias") or param.dim() <= 1)


@dataclass
class ParamSlot:
    name: str
    param: torch.nn.Parameter
    offset: int
    numel: int
    shape: torch.Size
    decay: bool
    counted: bool  # does this rank count it in the global grad norm (see engine docs)


class FlatPartition:
    """One unit's parameters as a flat buffer, sharded over `world` ranks or replicated."""

    def __init__(self, name: str, named_params: list[tuple[str, torch.nn.Parameter]],
                 dtype: torch.dtype, world: int, rank: int, block_size: int, sharded: bool,
                 counted_fn, shared_embedding: bool = False):
        self.name, self.dtype, self.sharded = name, dtype, sharded
        self.world, self.rank = (world, rank) if sharded else (1, 0)
        self.shared_embedding = shared_embedding
        self.block_size = block_size
        self.device = named_params[0][1].device
        # decay first, then no-decay; inside each, TP-split before TP-replicated
        order = sorted(named_params, key=lambda np_: (not wants_weight_decay(*np_),
                                                      not getattr(np_[1], "tensor_model_parallel", False)))
        self.slots: list[ParamSlot] = []
        offset = 0
        for pname, p in order:
            self.slots.append(ParamSlot(pname, p, offset, p.numel(), p.shape,
                                        wants_weight_decay(pname, p), counted_fn(p)))
            offset += p.numel()
        self.numel = offset
        self.decay_end = sum(s.numel for s in self.slots if s.decay)
        self.padded_numel = round_up(max(offset, 1), world * block_size) if sharded else offset
        self.shard_numel = self.padded_numel // self.world
        self.lo = self.rank * self.shard_numel
        self.hi = self.lo + self.shard_numel

        # Build the flat copy of the current weights (fp32 kept for the master).
        flat32 = torch.zeros(self.padded_numel, dtype=torch.float32, device=self.device)
        for s in self.slots:
            flat32[s.offset:s.offset + s.numel].copy_(s.param.detach().reshape(-1))
        self.initial_master = flat32[self.lo:self.hi].clone()  # taken by the optimizer
        self.full = flat32.to(dtype) if dtype != torch.float32 else flat32
        if sharded:
            self.shard = self.full[self.lo:self.hi].clone()
        else:
            self.shard = self.full
        for s in self.slots:
            s.param.data = self.full[s.offset:s.offset + s.numel].view(s.shape)
        if sharded:
            self.release()

    # ------------------------------------------------------------------ buffers
    @property
    def full_bytes(self) -> int:
        return self.padded_numel * self.full.element_size()

    @property
    def is_materialized(self) -> bool:
        return self.full.untyped_storage().nbytes() > 0

    def materialize(self) -> torch.Tensor:
        """Allocate `full` (contents undefined) so a gather can fill it."""
        if not self.is_materialized:
            self.full.untyped_storage().resize_(self.full_bytes)
        return self.full

    def release(self) -> None:
        if self.sharded and self.is_materialized:
            self.full.untyped_storage().resize_(0)

    def full_storage_bytes(self) -> int:
        return self.full.untyped_storage().nbytes() if self.sharded else 0

    # ------------------------------------------------------------------ ranges
    def local_groups(self) -> list[tuple[int, int, bool]]:
        """[(start, end, decay)] in shard coordinates: at most two contiguous pieces."""
        out = []
        a, b = self.lo, min(self.hi, self.decay_end)
        if b > a:
            out.append((a - self.lo, b - self.lo, True))
        a = max(self.lo, self.decay_end)
        if self.hi > a:
            out.append((a - self.lo, self.hi - self.lo, False))
        return out

    def counted_ranges(self) -> list[tuple[int, int]]:
        """Shard-coordinate ranges this rank adds to the global grad norm (merged)."""
        out: list[tuple[int, int]] = []
        for s in self.slots:
            if not s.counted:
                continue
            a, b = max(s.offset, self.lo), min(s.offset + s.numel, self.hi)
            if b <= a:
                continue
            a, b = a - self.lo, b - self.lo
            if out and out[-1][1] == a:
                out[-1] = (out[-1][0], b)
            else:
                out.append((a, b))
        return out

    def full_flat_from(self, tensors_by_name: dict[str, torch.Tensor]) -> torch.Tensor:
        """A padded fp32 flat buffer built from full per-parameter tensors."""
        flat = torch.zeros(self.padded_numel, dtype=torch.float32, device=self.device)
        for s in self.slots:
            t = tensors_by_name[s.name]
            if tuple(t.shape) != tuple(s.shape):
                raise ValueError(f"state for {s.name} has shape {tuple(t.shape)}, the model has "
                                 f"{tuple(s.shape)}; load a checkpoint of the same model and TP/PP layout")
            flat[s.offset:s.offset + s.numel].copy_(t.reshape(-1))
        return flat

    def __repr__(self) -> str:
        kind = "sharded" if self.sharded else "replicated"
        return (f"FlatPartition({self.name}, {kind}, {len(self.slots)} params, numel={self.numel}, "
                f"padded={self.padded_numel}, shard={self.shard_numel})")
