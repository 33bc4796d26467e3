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
* sharded and resident (ZeRO stages 1 and 2): laid out and sharded as above, but
  ``full`` stays allocated: the model's weights are whole on every rank, and the
  engine refills ``full`` from the shards once after each optimizer step.
* replicated (stage 0, and small persistent params under stages 1-3): ``full`` is
  always allocated and ``shard`` is the whole of it.

Padding elements are zero in weights and gradients, so they never move the norm or
the optimizer.

FP8 weights (``fp8_params``): the weights of FP8 GEMM layers are laid out first, in
``[0, fp8_numel)``, and held in E4M3 only: ``full_fp8`` (``padded_numel`` bytes), where
each such weight's layer reads its E4M3 view (``slot.fp8_weight``) and inverse scale
(``slot.fp8_inv``). ``full`` then holds only the rest, ``[fp8_numel, numel)``, in the
gather dtype; the FP8 weights' parameters view a gather-dtype buffer that is never
allocated (they only carry shapes and receive grads). Two users:

* sharded (``--zero-quantized-weights fp8``, ZeRO-3's FP8 weight gathers): ``shard``
  keeps every element in the gather dtype; ``full_fp8`` is every rank's FP8 shard as
  gathered (megaq.zero.zeropp.fp8_weights);
* replicated (stage 0 with FP8 GEMMs, megaq.zero.fp8_resident): ``shard`` is ``full``,
  the rest only (``shard_from`` = ``fp8_numel``), and ``full_fp8`` is cast from the
  fp32 master after every optimizer step: no 16-bit copy of those weights exists.
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
    fp8_weight: torch.Tensor | None = None  # E4M3 view into full_fp8 (FP8 weight gathers)
    fp8_inv: torch.Tensor | None = None     # its inverse per-tensor scale (0-d)


def _alias(view: torch.Tensor) -> torch.Tensor:
    """A tensor on `view`'s memory with a version counter of its own, as a parameter's
    ``.data``: writes into the gathered buffer (a gather, an hpZ refill) must not look
    like in-place changes to what autograd saved from it."""
    t = torch.empty(0, dtype=view.dtype, device=view.device)
    t.data = view
    return t


class FlatPartition:
    """One unit's parameters as a flat buffer, sharded over `world` ranks or replicated."""

    def __init__(self, name: str, named_params: list[tuple[str, torch.nn.Parameter]],
                 dtype: torch.dtype, world: int, rank: int, block_size: int, sharded: bool,
                 counted_fn, shared_embedding: bool = False, fp8_params: frozenset = frozenset(),
                 resident: bool = False):
        self.name, self.dtype, self.sharded = name, dtype, sharded
        self.resident = sharded and resident  # full never released (stages 1 and 2)
        self.world, self.rank = (world, rank) if sharded else (1, 0)
        self.shared_embedding = shared_embedding
        self.block_size = block_size
        self.device = named_params[0][1].device
        fp8_ids = fp8_params
        for pname, p in named_params:
            if id(p) in fp8_ids and not wants_weight_decay(pname, p):
                raise ValueError(f"{pname}: an FP8 weight must be a 2-D weight matrix")
        if fp8_ids and not sharded and dtype == torch.float32:
            raise ValueError("FP8 weights of a replicated partition are cast from the fp32 "
                             "master, which an fp32 partition does not keep apart: use 16-bit "
                             "weights")
        # decay first, then no-decay; inside decay, FP8-gathered weights first; then
        # TP-split before TP-replicated
        order = sorted(named_params, key=lambda np_: (not wants_weight_decay(*np_),
                                                      id(np_[1]) not in fp8_ids,
                                                      not getattr(np_[1], "tensor_model_parallel", False)))
        self.slots: list[ParamSlot] = []
        offset = 0
        for pname, p in order:
            self.slots.append(ParamSlot(pname, p, offset, p.numel(), p.shape,
                                        wants_weight_decay(pname, p), counted_fn(p)))
            offset += p.numel()
        self.numel = offset
        self.fp8_slots = [s for s in self.slots if id(s.param) in fp8_ids]  # a prefix of slots
        if self.device.type == "cuda":
            for s in self.fp8_slots:  # the GEMM reads them in place: cuBLASLt needs alignment
                if s.offset % 16:
                    raise ValueError(f"{s.name}: FP8 weight gathers need every FP8 weight's "
                                     f"size to be a multiple of 16 elements (cuBLASLt reads "
                                     f"them 16-byte aligned); use --zero-quantized-weights "
                                     f"int8 or none with this model's shapes")
        self.fp8_numel = sum(s.numel for s in self.fp8_slots)
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
        flat = flat32.to(dtype) if dtype != torch.float32 else flat32
        F = self.fp8_numel
        # where ``shard`` starts, in shard coordinates (the master's): replicated FP8
        # weights have no gather-dtype copy, so its first F elements are not in it
        self.shard_from = 0 if sharded else F
        if F:
            # sharded: every rank's whole shard lands here (FP8 weights and the rest's
            # place); replicated: the FP8 weights only
            self.full_fp8 = torch.zeros(self.padded_numel if sharded else F,
                                        dtype=torch.float8_e4m3fn, device=self.device)
            # one inverse scale per FP8 weight, each in its own 16-byte slot (column 0): the
            # GEMM hands cuBLASLt a pointer to it, and cuBLASLt wants 16-byte alignment
            self.fp8_inv_scales = torch.ones(len(self.fp8_slots), 4, dtype=torch.float32,
                                             device=self.device)[:, 0]
            self.full = flat[F:self.numel].clone()
            never_allocated = torch.empty(F, dtype=dtype, device=self.device)
            for i, s in enumerate(self.fp8_slots):
                s.param.data = never_allocated[s.offset:s.offset + s.numel].view(s.shape)
                s.fp8_weight = _alias(self.full_fp8[s.offset:s.offset + s.numel].view(s.shape))
                s.fp8_inv = _alias(self.fp8_inv_scales[i])
            never_allocated.untyped_storage().resize_(0)
        else:
            self.full = flat
        self.shard = flat[self.lo:self.hi].clone() if sharded else self.full
        self._gathered = [self.full_fp8, self.full] if F else [self.full]
        self._gathered_bytes = [t.numel() * t.element_size() for t in self._gathered]
        for s in self.slots[len(self.fp8_slots):]:
            s.param.data = self.full[s.offset - F:s.offset - F + s.numel].view(s.shape)
        if sharded and not self.resident:
            self.release()

    # ------------------------------------------------------------------ buffers
    @property
    def full_bytes(self) -> int:
        """Bytes a gather materializes (with FP8 gathers: the E4M3 buffer and the rest)."""
        return sum(self._gathered_bytes)

    @property
    def own_weight_bytes(self) -> int:
        """Bytes of this rank's own copy of the weights: the shard, and a replicated
        partition's E4M3 weights with their scales (a sharded one's are gathered)."""
        nb = self.shard.numel() * self.shard.element_size()
        if self.fp8_numel and not self.sharded:
            nb += self.full_fp8.numel() + self.fp8_inv_scales.untyped_storage().nbytes()
        return nb

    @property
    def model_bytes(self) -> int:
        """The unit's weights in the gather dtype, padded (the 'M' of the byte figures)."""
        return self.padded_numel * self.shard.element_size()

    def gathered_buffers(self) -> list[torch.Tensor]:
        """What a gather fills: [full], or [full_fp8, full] with FP8 weight gathers."""
        return self._gathered

    @property
    def is_materialized(self) -> bool:
        return self._gathered[0].untyped_storage().nbytes() > 0

    def materialize(self) -> torch.Tensor:
        """Allocate the gathered buffers (contents undefined) so a gather can fill them."""
        if not self.is_materialized:
            for t, nbytes in zip(self._gathered, self._gathered_bytes):
                t.untyped_storage().resize_(nbytes)
        return self.full

    def release(self) -> None:
        if self.sharded and not self.resident and self.is_materialized:
            for t in self._gathered:
                t.untyped_storage().resize_(0)

    def full_storage_bytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in self._gathered) if self.sharded else 0

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
