"""GradState: the one owner of this rank's gradients, from a parameter's hook to the
optimizer's fp32 shard.

Per partition (keyed by ``part.name``, the one key every gradient structure uses) it
holds:

* the *reduce bucket*: the unit's padded flat gradient being filled by the
  parameters' hooks (``grad_sync="per_microbatch"``), or the full fp32 gradient kept
  across micro-batches (``"last_microbatch"``, and always under ZeRO stage 1:
  ``ZeroConfig.grads_reduced_once``);
* the *fp32 accumulator*: ``shard_numel`` elements, the reduced gradient of this
  rank's shard, which the optimizer's leaves view;
* whether the accumulator is *stale*: from ``zero()`` until it is settled, its
  contents are last step's, and each slot's first write of the step overwrites
  instead of adding (no zeroing pass, no read of zeros: 8 bytes per element per
  step). Settling zeroes what no write reached (unused parameters, padding).
  The accumulators start stale (nothing held while the engine is built). A stale
  accumulator holds no memory either: ``zero()`` hands its storage back to
  the allocator, and its first write (or settling) takes it again. The forward's
  activations and the step's gradients are then never held at once in full: a step
  without recompute peaks at backward's start, when the activations are all kept
  and no gradient exists yet (4 bytes per parameter of this rank's shard less than
  with accumulators held through the forward). The optimizer's ``.grad`` views keep
  pointing at the same storage, which is whole again once settled.

Who calls what:

* the engine's gradient hook: :meth:`add` (sequence-parallel grads are summed over
  TP here first); the end-of-backward callback: :meth:`flush`; ``finish_grad_sync``:
  :meth:`finish` (every reduction done, accumulators settled, tied-embedding copies
  summed over ``topo.embedding``); ``clip_grad_norm``: :meth:`global_norm`;
  ``zero_grad``: :meth:`zero`.
* a reducer (the seam of megaq.zero.collectives, or qgZ) is handed a partition's
  settled accumulator as ``out`` when its reduction starts, adds into it, and calls
  nothing here.
* the optimizer reads through :meth:`read` (settled accumulators), which its leaves'
  ``.grad`` view.

*16-bit gradients* (``keep_16bit``, set by the engine at DP = 1 when the optimizer
reads 16-bit gradients: megaq's one-pass AdamW): while each slot of a partition has
been written once in the step, its gradient is held in the gradient's own 16-bit dtype
instead of the fp32 accumulator. The fp32 accumulator of one write is that write
upcast, exactly, so a reader that upcasts as it reads (the AdamW kernel) sees the same
values, and the step keeps 2 bytes per parameter instead of 4 and moves 4 bytes fewer
(the hook's copy writes 2, the update reads 2). A second write to a slot (gradient
accumulation), a gradient of another dtype, or a reader that wants fp32 (:meth:`read`)
moves the partition to its fp32 accumulator first (:meth:`_promote`: the same values).
The grad norm then sums fp32 squares of the 16-bit values in another order than the
fp32 path's dot products (about one fp32 ulp of the norm).

Reductions in flight are bounded by ``cfg.reduce_bucket_size`` bytes of buckets: past
it, the oldest is finished (FIFO: every rank finishes them in the order it started
them, which is the order their collectives were issued).
"""

from __future__ import annotations

from collections import deque

import torch

from megaq.parallel import comm
from megaq.zero.config import ZeroConfig
from megaq.zero.partition import FlatPartition, ParamSlot


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class GradState:
    def __init__(self, partitions: list[FlatPartition], topo, cfg: ZeroConfig, reducer, replicated):
        """`reducer` reduces sharded partitions (None under stage 0, which has none),
        `replicated` all-reduces replicated ones; both have the seam's ``start_reduce``."""
        self.topo, self.cfg = topo, cfg
        self.reducer, self.replicated = reducer, replicated
        self.parts: dict[str, FlatPartition] = {}
        for p in partitions:
            if p.name in self.parts:
                raise ValueError(f"two partitions are named {p.name!r}; gradient state is keyed by name")
            self.parts[p.name] = p
        self._accum = {}
        for name, p in self.parts.items():  # stale, holding no memory (below): one at a time
            self._accum[name] = torch.empty(p.shard_numel, dtype=torch.float32, device=p.device)
            self._accum[name].untyped_storage().resize_(0)
        # the accumulator ranges this rank adds to the global norm (fixed by the layout)
        self._counted = {name: p.counted_ranges() for name, p in self.parts.items()}
        self._stale: set[str] = set()              # names whose accumulator is stale
        self._written: dict[str, set[int]] = {}    # name -> slot offsets written while stale
        self._buckets: dict[str, list] = {}        # name -> [padded flat grad, params seen]
        self._full: dict[str, torch.Tensor] = {}   # last_microbatch: name -> full fp32 grad
        self._half: dict[str, torch.Tensor] = {}   # keep_16bit: name -> the step's 16-bit grad
        self.keep_16bit = False                    # the engine sets it (see the docstring)
        self._pending: deque[tuple[object, int]] = deque()  # (reduction in flight, its bytes)
        self.inflight_bytes = 0
        # DP = 1: nothing to reduce, grads go straight into the fp32 accumulators
        # (qgZ too: at DP=1 it has nothing to exchange and adds exactly, residuals unused)
        self.direct = topo.dp.size == 1 and not cfg.grads_reduced_once
        # stale from the start, holding no memory until backward's first write: building
        # the engine never holds them beside the weights, masters and moments (the largest
        # model with full recompute peaked there, 4 bytes a parameter above its steps)
        self.zero()

    # ------------------------------------------------------------ from the engine
    def add(self, part: FlatPartition, slot: ParamSlot, grad: torch.Tensor) -> None:
        """A parameter's gradient of one micro-batch (its post-accumulate-grad hook)."""
        if getattr(slot.param, "sequence_parallel", False) and self.topo.tp.size > 1:
            comm.all_reduce(grad, self.topo.tp, "tp")  # partial per TP rank under SP
        flat = grad.reshape(-1)
        if self.direct:
            self._add_slot(part.name, slot.offset, flat)
        elif not self.cfg.grads_reduced_once:
            bucket = self._buckets.get(part.name)
            if bucket is None:
                buf = torch.zeros(part.padded_numel, dtype=grad.dtype, device=grad.device)
                bucket = self._buckets[part.name] = [buf, 0]
            bucket[0][slot.offset:slot.offset + slot.numel].copy_(flat)
            bucket[1] += 1
            if bucket[1] == len(part.slots):
                del self._buckets[part.name]
                self._launch(part, bucket[0])
        else:
            full = self._full.get(part.name)
            if full is None:
                full = self._full[part.name] = torch.zeros(
                    part.padded_numel, dtype=torch.float32, device=grad.device)
            full[slot.offset:slot.offset + slot.numel].add_(flat)

    def flush(self) -> None:
        """Reduce partially filled buckets (parameters that got no grad this pass)."""
        for name, part in self.parts.items():  # partition order: same on every DP rank
            bucket = self._buckets.pop(name, None)
            if bucket is not None:
                self._launch(part, bucket[0])

    def finish(self) -> None:
        """Every reduction of the step done; accumulators settled; tied copies summed."""
        self.flush()
        for name, part in self.parts.items():
            full = self._full.pop(name, None)
            if full is not None:
                self._launch(part, full.to(part.dtype) if part.dtype != full.dtype else full)
        self._settle_all()  # the ones no reduction reached; the others settled at launch
        while self._pending:
            self._finish_oldest()
        if self.topo.embedding.size > 1:  # tied embedding copies on first and last stage
            for name, part in self.parts.items():
                if part.shared_embedding:
                    self._promote(name)  # summed in fp32
                    comm.all_reduce(self._accum[name], self.topo.embedding, "embedding")

    def zero(self) -> None:
        """Start a step: accumulators become stale and give their memory back (nothing
        runs), buckets are dropped."""
        self._stale = set(self.parts)
        for t in self._accum.values():
            t.untyped_storage().resize_(0)
        self._written = {name: set() for name in self.parts}
        self._buckets.clear()
        self._full.clear()
        self._half.clear()

    # ------------------------------------------------------------ reductions
    def _launch(self, part: FlatPartition, flat: torch.Tensor) -> None:
        """Start reducing `flat` (the partition's padded flat grad) into its settled
        accumulator, which the reducer adds (sum over DP of my slice) / DP size into."""
        reducer = self.reducer if part.sharded else self.replicated
        nbytes = _nbytes(flat)
        self._settle(part.name)
        self._pending.append((reducer.start_reduce(part.name, flat, self._accum[part.name]), nbytes))
        self.inflight_bytes += nbytes
        while self.inflight_bytes > self.cfg.reduce_bucket_size and len(self._pending) > 1:
            self._finish_oldest()

    def _finish_oldest(self) -> None:
        reduction, nbytes = self._pending.popleft()
        reduction.finish()
        self.inflight_bytes -= nbytes

    # ------------------------------------------------------------ fp32 accumulator
    def _add_slot(self, name: str, offset: int, src: torch.Tensor) -> None:
        """Add a parameter's flat grad into its slice (upcasting): the first write of a
        step to a stale accumulator copies instead (into the 16-bit buffer while the
        partition has one: see keep_16bit in the module docstring)."""
        written = self._written[name]
        first = name in self._stale and offset not in written
        half = self._half.get(name)
        if (half is None and self.keep_16bit and first and not written
                and src.dtype == self.parts[name].dtype and src.element_size() < 4):
            half = self._half[name] = torch.empty(self._accum[name].numel(), dtype=src.dtype,
                                                  device=src.device)
        if half is not None:
            if first and src.dtype == half.dtype:
                half[offset:offset + src.numel()].copy_(src)
                written.add(offset)
                return
            self._promote(name)  # settled: this slot's write adds (to zero if it had none)
            first = False
        dst = self._live(name)[offset:offset + src.numel()]
        if first:
            dst.copy_(src)
            written.add(offset)
        else:
            dst.add_(src)

    def _promote(self, name: str) -> None:
        """Move a partition's 16-bit gradient into its fp32 accumulator (exactly; settled)."""
        if name not in self._half:
            return
        self._settle(name)
        self._live(name).copy_(self._half.pop(name))

    def _settle(self, name: str) -> None:
        """End the stale state: zero what no write reached (unused slots, padding), in
        the 16-bit buffer while the partition has one."""
        if name not in self._stale:
            return
        grad = self._half[name] if name in self._half else self._live(name)
        written, end = self._written[name], 0
        for slot in self.parts[name].slots:  # in offset order
            if slot.offset in written:
                if end < slot.offset:
                    grad[end:slot.offset].zero_()
                end = slot.offset + slot.numel
        if end < grad.numel():
            grad[end:].zero_()
        self._stale.discard(name)
        written.clear()

    def _live(self, name: str) -> torch.Tensor:
        """The accumulator with its memory (taken back from the allocator after zero())."""
        t = self._accum[name]
        storage = t.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(t.numel() * t.element_size())
        return t

    def _settle_all(self) -> None:
        for name in self.parts:
            self._settle(name)

    # ------------------------------------------------------------ for the optimizer
    def accumulator_views(self, name: str, ranges: list[tuple[int, int]]) -> list[torch.Tensor]:
        """Views of the accumulator (the optimizer's leaves' .grad, made once, at build),
        which stay valid as its memory comes and goes; read values through :meth:`read`.
        (A view needs the memory while it is made: taken for the call, then given back.)"""
        t = self._live(name)
        views = [t[a:b] for a, b in ranges]
        if name in self._stale:
            t.untyped_storage().resize_(0)
        return views

    def read(self) -> dict[str, torch.Tensor]:
        """{name: settled fp32 accumulator}, in partition order."""
        for name in list(self._half):
            self._promote(name)
        self._settle_all()
        return self._accum

    def read_any(self) -> dict[str, torch.Tensor]:
        """{name: the settled gradient}, in partition order: the fp32 accumulator, or
        the 16-bit buffer that holds it exactly (keep_16bit), for readers that upcast."""
        self._settle_all()
        return {name: self._half.get(name, t) for name, t in self._accum.items()}

    def global_norm(self) -> torch.Tensor:
        """L2 norm of the step's gradient over every DP shard, TP and PP rank, each element
        counted once (0-d fp32 tensor: no host sync). This rank sums the squares of what
        it owns: its DP shard of sharded partitions, replicated partitions on DP rank 0
        only, and within those the ranges ``FlatPartition.counted_ranges`` names
        (TP-replicated params on TP rank 0 only, a tied embedding copy on the first stage
        only); one all-reduce over the world adds them up."""
        accum = self.read_any()
        device = next(iter(accum.values())).device if accum else torch.device("cpu")
        total = torch.zeros((), dtype=torch.float32, device=device)
        halves = []  # 16-bit ranges: their fp32 norms in one multi-tensor pass
        for name, part in self.parts.items():
            if not part.sharded and self.topo.dp.rank != 0:
                continue  # replicated over DP: counted once per DP group
            grad = accum[name]
            for a, b in self._counted[name]:
                g = grad[a:b]
                if g.dtype == torch.float32:
                    total += torch.dot(g, g)
                else:
                    halves.append(g)
        if halves:
            total += torch.stack(torch._foreach_norm(halves, 2, dtype=torch.float32)).square().sum()
        comm.all_reduce(total, self.topo.world, "dp_misc")
        return total.sqrt()

    def memory_bytes(self) -> int:
        """fp32 accumulators (as held now: none between zero() and backward's first write)
        + 16-bit gradients (keep_16bit) + buckets being filled + full grads kept across micro-batches."""
        return (sum(t.untyped_storage().nbytes() for t in self._accum.values())
                + sum(_nbytes(t) for t in self._half.values())
                + sum(_nbytes(b[0]) for b in self._buckets.values())
                + sum(_nbytes(t) for t in self._full.values()))
