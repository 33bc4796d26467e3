"""Weight deltas (``--zero-weight-deltas``): hpZ's secondary partition as a persistent
reference, updated by quantized differences; every weight gather runs in-node.

With hpZ the h DP ranks of an hpZ group (inside one node) together hold the full
weights, 1/h each (``full.reshape(h, -1)[i]`` on member i: the DP shards
``[i n/h, (i+1) n/h)``). Here those slices are not dropped after a step: they are
the *reference*, the weights the forward and backward see, in the gather dtype
(bf16 in bf16 training, fp32 in fp32 training).

After an optimizer step, at the first gather of the step (all DP ranks reach it in
the same order, as every gather), the exchange of every unit is posted at once (the
requested unit first), so later units' differences travel while earlier layers compute:

1. each owner (DP rank r, primary shard ``w``) takes ``d = w - ref_r`` in fp32 against
   its own copy ``ref_r`` of the reference for its shard, packs it
   (:class:`QuantizedDeltas`: the kernels' blockwise int4/int8 format, one fp32 scale
   per block) and replaces ``ref_r`` by ``dtype(ref_r + decode(packed))``;
2. it sends the packed bytes only to the member of each hpZ group whose slice covers
   shard r (one rank per hpZ group; the ones in other nodes are the only cross-node
   traffic of the weights, phase ``weight_delta_gather``).

When a unit is gathered (or prefetched) its exchange is waited for and

3. each receiver applies the same expression to its slice's section: the same bytes
   decoded by the same op and added in the same order, so every copy of the reference
   stays bit-identical to the owner's;
4. the unit's full weights are all-gathered from the slices over the hpZ group
   (in-node, asynchronous like any prefetch; phase ``weight_ref_gather`` in forward,
   ``weight_gather_bwd`` in backward).

The quantization error of step t stays in ``w - ref`` and is part of the difference
sent at step t+1 (error feedback on the weight side): per element,
``|ref - w| <= step/2 + u |ref|`` after every update, step = the current difference's
block absmax / q (q = 7 for int4, 127 for int8), u = the reference dtype's unit
roundoff (2^-8 bf16, 2^-24 fp32), and it does not accumulate (docs/ZEROPP.md,
"Weight deltas").

The first gather of a unit, and the first one after ``invalidate()`` (a checkpoint
load or any other weight write the engine announces), re-synchronises at full
precision: a plain all-gather of the shards over DP (phase ``weight_gather_fwd``), from
which the slices and the owners' copies are taken. ``after_step()`` (the engine calls
it after each optimizer step) marks the references stale instead. A write to a shard
the engine did not announce (its version counter moved) is sent as a difference too.
References are not checkpointed: a load re-synchronises them, and so does taking a
checkpoint (``engine.checkpoint_taken()`` calls ``invalidate()``), so a resumed run and
the run that kept going continue from the same references: resume is exact.
"""

from __future__ import annotations

import torch

from megaq.kernels import ops
from megaq.kernels.format import packed_len
from megaq.parallel import comm
from megaq.parallel.comm import Handle
from megaq.zero.config import ZeroConfig

DELTA = "weight_delta_gather"  # the packed differences, owner -> covering ranks
REF = "weight_ref_gather"      # a forward gather from the references (in-node)


class QuantizedDeltas:
    """The wire form of a difference: blockwise symmetric int4/int8, the kernels' packed
    format (payload, then one fp32 scale per block) and their public ops."""

    def __init__(self, bits: int, block: int):
        self.bits, self.block = bits, block

    def nbytes(self, n: int) -> int:
        return packed_len(n, self.bits, self.block)

    # the linear code (q * absmax/q_max): the error bound below is its half step
    def encode(self, diff: torch.Tensor) -> torch.Tensor:
        return ops.quantize(diff, self.bits, self.block, code="linear")

    def decode(self, packed: torch.Tensor, n: int) -> torch.Tensor:
        return ops.dequantize(packed, n, self.bits, self.block, torch.float32, code="linear")


def apply_delta(ref: torch.Tensor, delta: torch.Tensor) -> None:
    """ref <- dtype(ref + delta), in fp32: the one expression every holder of a
    reference runs, so all copies stay bit-identical."""
    ref.copy_(torch.add(ref.float(), delta).to(ref.dtype))


def delta_routes(dp_size: int, my_dp: int, hpz_groups: list[list[int]],
                 hpz_index: int) -> tuple[list[int], list[int]]:
    """(DP members my shard's difference goes to, DP shards my slice covers).

    hpz_groups: the hpZ groups of my DP group as DP member indices. Member i of any
    hpZ group holds DP shards [i n/h, (i+1) n/h) of the full unit."""
    h = len(hpz_groups[0])
    per = dp_size // h
    dests = [g[my_dp // per] for g in hpz_groups]
    return dests, list(range(hpz_index * per, (hpz_index + 1) * per))


class WeightDeltaGatherer:
    """Engine seam (megaq.zero.collectives): ``start_gather``, ``on_forward_gathered``,
    ``after_step``, ``invalidate``, ``memory_bytes``; ``references(name)`` for tests."""

    def __init__(self, topo, cfg: ZeroConfig, partitions=()):
        self.cfg, self.dp, self.hpz = cfg, topo.dp, topo.hpz
        member = {g: i for i, g in enumerate(self.dp.ranks)}
        # topo.hpz is one of these groups: build_topology made them all from one hpZ size
        groups = [[member[g] for g in grp]
                  for grp in topo.layout.hpz_groups(list(self.dp.ranks), self.hpz.size)]
        self._dests, self._covered = delta_routes(self.dp.size, self.dp.rank, groups, self.hpz.rank)
        self.codec = QuantizedDeltas(cfg.weight_delta_bits, cfg.block_size)
        # the engine's sharded partitions, in its order (the same on every DP peer)
        self._parts = [p for p in partitions if p.sharded]
        self._slice: dict[str, torch.Tensor] = {}  # name -> my hpZ slice of the reference
        self._own: dict[str, torch.Tensor] = {}    # name -> the reference of my own shard
        self._stamp: dict[str, tuple] = {}         # name -> the shard's (storage, version)
        self._current: set[str] = set()            # names whose references match the shards
        # name -> (posted exchange, {DP shard: packed difference}) not yet applied
        self._posted: dict[str, tuple[Handle, dict[int, torch.Tensor]]] = {}

    # ------------------------------------------------------------------ engine seam
    def start_gather(self, part, phase: str) -> Handle:
        key, shard, full = part.name, part.shard, part.full
        if key not in self._slice:
            return self._resync(key, shard, full, phase)
        if key in self._current and self._stamp[key] != _stamp(shard):
            self._current.discard(key)  # an unannounced write: send it as a difference
        out_phase = REF if phase == "weight_gather_fwd" else phase
        if key not in self._current:
            if key not in self._posted:
                self._post_stale(key, shard)
            self._apply_posted(key, shard)
        return comm.all_gather(full.reshape(-1), self._slice[key], self.hpz, out_phase, async_op=True)

    def on_forward_gathered(self, part) -> None:
        """The references are kept by start_gather itself."""

    def after_step(self) -> None:
        """The shards moved: the next gather of each unit sends its difference."""
        self._current.clear()

    def invalidate(self) -> None:
        """A load or another write: the next gather of each unit re-synchronises at full
        precision."""
        for work, _ in self._posted.values():  # exchanges in flight finish, unused
            work.wait()
        self._posted.clear()
        self._slice.clear()
        self._own.clear()
        self._stamp.clear()
        self._current.clear()

    def memory_bytes(self) -> dict[str, int]:
        nb = lambda d: sum(t.numel() * t.element_size() for t in d.values())  # noqa: E731
        return {"hpz_secondary": nb(self._slice), "weight_delta_own_reference": nb(self._own)}

    def references(self, key: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(my hpZ slice of the reference, the reference of my own shard), or None."""
        if key not in self._slice:
            return None
        return self._slice[key], self._own[key]

    # ---------------------------------------------------------------------- protocol
    def _keep(self, key: str, shard: torch.Tensor, full: torch.Tensor) -> None:
        h = self.hpz.size
        if full.numel() % h:
            raise ValueError(f"hpZ: unit of {full.numel()} elements does not split over {h} "
                             f"ranks; pad the unit to a multiple of the DP size")
        self._slice[key] = full.reshape(h, -1)[self.hpz.rank].clone()
        self._own[key] = shard.reshape(-1).clone()
        self._mark_current(key, shard)

    def _mark_current(self, key: str, shard: torch.Tensor) -> None:
        self._stamp[key] = _stamp(shard)
        self._current.add(key)

    def _resync(self, key: str, shard: torch.Tensor, full: torch.Tensor, phase: str) -> Handle:
        """Full precision: a plain all-gather of the shards, then keep the references."""
        work = comm.all_gather(full.reshape(-1), shard.reshape(-1), self.dp, phase, async_op=True)
        return Handle(work, lambda: self._keep(key, shard, full))

    def _post_stale(self, first: str, shard: torch.Tensor) -> None:
        """Post the exchange of `first` and then of every other unit whose reference is
        stale (engine order): all DP peers post the same units in the same order."""
        self._post(first, shard)
        for p in self._parts:
            if p.name in self._slice and p.name not in self._current and p.name not in self._posted:
                self._post(p.name, p.shard)

    def _post(self, key: str, shard: torch.Tensor) -> None:
        """Owner side (steps 1-2): pack my difference, update my own reference, send."""
        S, me = shard.numel(), self.dp.rank
        own = self._own[key]
        packed = self.codec.encode(shard.reshape(-1).float() - own.float())
        apply_delta(own, self.codec.decode(packed, S))
        sends = [(packed, j) for j in self._dests if j != me]
        incoming = {s: (packed if s == me else torch.empty_like(packed)) for s in self._covered}
        recvs = [(buf, s) for s, buf in incoming.items() if s != me]
        self._posted[key] = (comm.batch_p2p(sends, recvs, self.dp, DELTA), incoming)
        self._stamp[key] = _stamp(shard)

    def _apply_posted(self, key: str, shard: torch.Tensor) -> None:
        """Receiver side (step 3): the differences my slice covers, added to it."""
        work, incoming = self._posted.pop(key)
        work.wait()
        S = shard.numel()
        sections = self._slice[key].view(len(self._covered), S)
        for s, buf in incoming.items():
            apply_delta(sections[s - self._covered[0]], self.codec.decode(buf, S))
        self._current.add(key)  # as of the stamp taken when the difference was packed


def _stamp(shard: torch.Tensor) -> tuple:
    return shard.data_ptr(), shard._version
