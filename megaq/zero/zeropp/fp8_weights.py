"""FP8 weight gathers (``--zero-quantized-weights fp8``): ZeRO-3 moves the FP8 GEMM
layers' weights as E4M3 with the GEMM's own per-tensor scale, and the GEMMs read them
as they arrive.

Once per optimizer step (at the first gather after ``invalidate()``), for every
partition with FP8 weights (megaq.zero.partition: those weights lie first, in
``[0, fp8_numel)``):

1. each rank takes the amax of every FP8 weight's piece in its DP shard; one MAX
   all-reduce over ``topo.dp`` (tag ``weight_gather_fwd``) and one over ``topo.tp``
   (tag ``tp``) give every rank the amax of each whole weight, across its DP owners
   and its TP shards: the amax megaq.parallel.fp8 takes of the same weight per call
   (it MAX-reduces a weight's amax over TP too). Scales come from
   ``fp8.scale_from_amax`` and the cast is ``fp8.cast``, so every element is cast to
   the same E4M3 bits as the GEMM would cast it from the bf16 weight. All ranks hold
   all scales after the all-reduces: scales never travel in the gather.
2. each rank casts its shard's FP8-weight elements once (``S`` bytes) and keeps the
   rest of its shard (norm weights, biases: elements ``[fp8_numel, numel)``) in the
   gather dtype, zero-padded to the longest such piece over the DP ranks (``R``).

A gather is two all-gathers: the E4M3 shards straight into ``part.full_fp8`` (which the
layers' ``weight_fp8`` buffers view: no copy, no bf16 weight), and the ``R``-element
rest pieces, copied into ``part.full`` afterwards. Bytes per gather of a unit: ``n S``
(1 per element) plus ``n R`` gather-dtype elements, against ``2 n S`` for a bf16 gather
(volume.fp8_weight_gather has the formula; the amax all-reduce adds 4 bytes per FP8
weight tensor per step).

Scale per step, not per call: within a step the weights do not change, so the scale the
GEMM would compute at each call equals the per-step one: the results are bit-identical
to FP8 GEMMs over bf16 gathers (tests/test_fp8_gather.py checks it).

hpZ: after the forward gather each rank keeps its ``1/h`` slice of both gathered
buffers (the E4M3 bytes and the rest rows: the FP8 form, 1 byte per element); later
gathers of the step all-gather those over ``topo.hpz``. Units without FP8 weights (the
embedding, the head) go through :class:`ZeroPPWeightGatherer` as before (bf16, hpZ).
"""

from __future__ import annotations

import torch

from megaq.parallel import comm, fp8
from megaq.parallel.comm import Handle
from megaq.zero.config import ZeroConfig

from .weights import ZeroPPWeightGatherer

FWD = "weight_gather_fwd"


def rest_layout(part) -> tuple[list[tuple[int, int]], int]:
    """Per DP rank r, (start in ``part.full``, length) of the non-FP8 elements of its
    shard (padding excluded), and R, the longest of them."""
    F, S = part.fp8_numel, part.shard_numel
    pieces = []
    for r in range(part.world):
        a, b = max(r * S, F), min((r + 1) * S, part.numel)
        pieces.append((a - F, max(b - a, 0)))
    return pieces, max(n for _, n in pieces)


class FP8WeightGatherer:
    """Engine seam (megaq.zero.collectives): ``start_gather``, ``on_forward_gathered``,
    ``invalidate``, ``memory_bytes``; `partitions`: every partition of the engine."""

    def __init__(self, topo, cfg: ZeroConfig, partitions):
        self.cfg = cfg
        self.dp, self.tp, self.hpz = topo.dp, topo.tp, topo.hpz
        self._plain = ZeroPPWeightGatherer(topo, cfg)  # units without FP8 weights
        self._parts = [p for p in partitions if p.sharded and p.fp8_numel]
        self._layout = {p.name: rest_layout(p) for p in self._parts}
        self._fp8_shard: dict[str, torch.Tensor] = {}  # name -> my shard cast to E4M3 (S bytes)
        self._rest_send: dict[str, torch.Tensor] = {}  # name -> my rest piece, padded to R (bytes)
        self._rest_rows: dict[str, torch.Tensor] = {}  # name -> last gathered rest rows [n, R] (bytes)
        self._secondary: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # hpZ slices
        self._stamp: tuple | None = None  # the shards' (storage, version) when cast

    # ------------------------------------------------------------------ engine seam
    def start_gather(self, part, phase: str) -> Handle:
        if not part.fp8_numel:
            return self._plain.start_gather(part, phase)
        self._cast_if_stale()
        pieces, R = self._layout[part.name]
        n, elem = self.dp.size, part.full.element_size()
        fp8_out = part.full_fp8.view(torch.uint8)
        rows = torch.empty(n, R * elem, dtype=torch.uint8, device=fp8_out.device)
        sec = self._secondary.get(part.name)
        if sec is not None:  # hpZ: in-node, from the slices kept after forward
            group, fp8_in, rest_in = self.hpz, sec[0], sec[1]
        else:
            group, fp8_in, rest_in = self.dp, self._fp8_shard[part.name], self._rest_send[part.name]
        works = [comm.all_gather(fp8_out, fp8_in, group, phase, async_op=True)]
        if R:
            works.append(comm.all_gather(rows.view(-1), rest_in, group, phase, async_op=True))

        def unpack():
            rest = rows.view(part.full.dtype).view(n, R) if R else None
            for r, (start, length) in enumerate(pieces):
                if length:
                    part.full[start:start + length].copy_(rest[r, :length])
            if self.cfg.hpz and sec is None:
                self._rest_rows[part.name] = rows

        return Handle(works, unpack)

    def on_forward_gathered(self, part) -> None:
        if not part.fp8_numel:
            self._plain.on_forward_gathered(part)
            return
        if not self.cfg.hpz or part.name in self._secondary:
            return
        h, i = self.hpz.size, self.hpz.rank
        rows = self._rest_rows.pop(part.name)
        self._secondary[part.name] = (part.full_fp8.view(torch.uint8).reshape(h, -1)[i].clone(),
                                      rows.reshape(h, -1)[i].clone())

    def invalidate(self) -> None:
        """The shards changed (optimizer step, load): cast again at the next gather."""
        self._plain.invalidate()
        self._stamp = None
        self._secondary.clear()
        self._rest_rows.clear()

    def memory_bytes(self) -> dict[str, int]:
        nb = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
        out = self._plain.memory_bytes()
        out["hpz_secondary"] += nb(t for pair in self._secondary.values() for t in pair)
        out["fp8_shards"] = nb(self._fp8_shard.values()) + nb(self._rest_send.values())
        return out

    # ------------------------------------------------------------------ the cast
    def _shard_stamp(self) -> tuple:
        return tuple((p.shard.data_ptr(), p.shard._version) for p in self._parts)

    def _cast_if_stale(self) -> None:
        """Cast every FP8 partition's shard once per step. Every rank of a DP and a TP
        group reaches its first gather of the step in the same order, so the two small
        all-reduces here line up. A shard written without an ``invalidate()`` (its
        version counter moved) is caught too."""
        stamp = self._shard_stamp()
        if stamp == self._stamp:
            return
        self._secondary.clear()
        self._rest_rows.clear()
        amax = []
        for part in self._parts:
            for s in part.fp8_slots:
                a, b = max(s.offset, part.lo), min(s.offset + s.numel, part.hi)
                if b > a:  # max |x| in one pass (exact, as the GEMM's x.abs().amax())
                    piece = part.shard[a - part.lo:b - part.lo]
                    amax.append(torch.linalg.vector_norm(piece, float("inf")).float())
                else:
                    amax.append(part.shard.new_zeros((), dtype=torch.float32))
        scale = fp8.weight_scales(torch.stack(amax), [(self.dp, FWD), (self.tp, fp8.PHASE)])
        k = 0
        for part in self._parts:
            m = len(part.fp8_slots)
            part.fp8_inv_scales.copy_(scale[k:k + m].reciprocal())
            q = torch.zeros(part.shard_numel, dtype=fp8.E4M3, device=part.shard.device)
            for j, s in enumerate(part.fp8_slots):
                a, b = max(s.offset, part.lo), min(s.offset + s.numel, part.hi)
                if b > a:
                    piece = part.shard[a - part.lo:b - part.lo]
                    fp8.cast_weight(q[a - part.lo:b - part.lo], piece, scale[k + j])
            k += m
            self._fp8_shard[part.name] = q.view(torch.uint8)
            self._rest_send[part.name] = self._rest_piece(part)
        self._stamp = stamp

    def _rest_piece(self, part) -> torch.Tensor:
        pieces, R = self._layout[part.name]
        out = torch.zeros(R, dtype=part.shard.dtype, device=part.shard.device)
        start, length = pieces[part.rank]
        if length:
            a = start + part.fp8_numel - part.lo  # shard coordinates
            out[:length] = part.shard[a:a + length]
        return out.view(torch.uint8)
