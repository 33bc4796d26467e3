"""What DCP sees of a rank's ZeRO shard: pieces of global tensors.

One global tensor per parameter and state ("model.{name}", "optimizer.exp_avg.{name}",
...; names are global: pipeline stages and virtual chunks numbered by global layer
index, megaq.checkpoint.reshard.local_to_global_name), with the full (TP-unsharded)
shape. A rank's share of it is its ZeRO shard: a *flat range* of the parameter's
TP-local 1-D view, cut wherever the block-aligned flat buffer puts the DP boundary
(the engine's ShardedState gives the ranges, megaq.zero.state). DCP describes chunks
as boxes (offsets + sizes), so a flat range becomes at most 2 * ndim - 1 boxes (a
partial row, whole rows, a partial row; recursively), each mapped to its place in the
full tensor through the parameter's TP partition (dimension and stride). This is what
Megatron's dist_checkpointing does with its ``flattened_range`` for the distributed
optimizer; here it is expressed in DCP's own chunk metadata, so DCP's default planners
resolve any resharding (a rank reading boxes of a new layout gets every overlap with
the saved boxes).

Who writes what (each element once): sharded partitions, every DP rank its range;
replicated partitions, DP rank 0; TP-replicated parameters, TP rank 0; the tied
output-layer copy of the last stage, nobody (it is the first stage's embedding).
Every rank reads everything it holds, whatever layout wrote it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex,
                                                   TensorProperties)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from megaq.checkpoint.reshard import TIED_SOURCE, local_to_global_name
from megaq.checkpoint.staging import StagingBuffer
from megaq.parallel.pipeline.split import stage_layer_ranges
from megaq.zero.state import ParamShard, ShardedState


def dcp_name(key: str, name: str) -> str:
    """The DCP name of state `key` ("param", "exp_avg", ...) of global parameter `name`."""
    return f"model.{name}" if key == "param" else f"optimizer.{key}.{name}"


# ------------------------------------------------------ flat ranges -> global boxes
def flat_range_boxes(shape, start: int, end: int, _base: int = 0) -> list[tuple]:
    """[(offsets, sizes, flat_start)]: boxes covering elements [start, end) of a
    row-major tensor of `shape`, in order; each box is itself a contiguous flat range
    (flat_start = its first element). At most 2 * ndim - 1 boxes."""
    shape = tuple(shape)
    if start >= end:
        return []
    if len(shape) <= 1:
        return [((start,) if shape else (), (end - start,) if shape else (), _base + start)]
    inner = 1
    for n in shape[1:]:
        inner *= n
    first, last = start // inner, (end - 1) // inner

    def row(r, a, b):  # part of row r: [a, b) of its inner elements
        return [((r, *o), (1, *s), f) for o, s, f in
                flat_range_boxes(shape[1:], a, b, _base + r * inner)]
    if first == last:
        return row(first, start - first * inner, end - first * inner)
    out = []
    full_from, full_to = first, last + 1
    if start % inner:
        out += row(first, start % inner, inner)
        full_from = first + 1
    if end % inner:
        full_to = last
    if full_to > full_from:
        out.append(((full_from, *[0] * (len(shape) - 1)),
                    (full_to - full_from, *shape[1:]), _base + full_from * inner))
    if end % inner:
        out += row(last, 0, end - last * inner)
    return out


def tp_split(shard: ParamShard, offsets, sizes, tp_rank: int, tp: int) -> list[tuple]:
    """[(local_offsets, sizes, global_offsets)] of a box of this rank's TP shard:
    along the partition dimension (read as `stride` blocks, megaq.parallel.
    tensor_parallel.shard_of) a box is cut at block edges and each piece placed at its
    rank's slot of its block."""
    if shard.tp_dim is None or tp == 1:
        return [(offsets, sizes, offsets)]
    d, stride = shard.tp_dim, shard.tp_stride
    block = shard.shape[d] // stride  # local rows per block
    out = []
    lo, hi = offsets[d], offsets[d] + sizes[d]
    while lo < hi:
        b = lo // block
        cut = min(hi, (b + 1) * block)
        g = b * block * tp + tp_rank * block + (lo - b * block)
        loc = list(offsets)
        loc[d] = lo
        siz = list(sizes)
        siz[d] = cut - lo
        glo = list(offsets)
        glo[d] = g
        out.append((tuple(loc), tuple(siz), tuple(glo)))
        lo = cut
    return out


def global_shape(shard: ParamShard, tp: int) -> tuple:
    """The full (TP-unsharded) shape of the parameter."""
    shape = list(shard.shape)
    if shard.tp_dim is not None:
        shape[shard.tp_dim] *= tp
    return tuple(shape)


@dataclass
class Piece:
    offsets: tuple         # in the global tensor
    tensor: torch.Tensor   # a view of this rank's buffer (or a staged copy)


class ChunkedTensor:
    """The pieces of one global tensor this rank writes or reads, as DCP chunks
    (the ``__create_write_items__`` / ``__create_chunk_list__`` protocol DCP uses
    for DTensor; megaq.checkpoint.dcp_format's planners look pieces up by offset)."""

    def __init__(self, shape: tuple, dtype: torch.dtype, pieces: list[Piece]):
        self.shape, self.dtype, self.pieces = torch.Size(shape), dtype, pieces
        self._by_offset = {tuple(p.offsets): p.tensor for p in pieces}

    def size(self) -> torch.Size:
        return self.shape

    def __create_write_items__(self, fqn: str, obj) -> list[WriteItem]:
        props = TensorProperties(dtype=self.dtype)
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(p.offsets)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(offsets=torch.Size(p.offsets),
                                                         sizes=p.tensor.shape),
                              properties=props, size=self.shape))
                for p in self.pieces]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=torch.Size(p.offsets), sizes=p.tensor.shape)
                for p in self.pieces]

    def piece_at(self, offsets) -> torch.Tensor:
        return self._by_offset[tuple(offsets)]

    def staged(self, buffer: StagingBuffer) -> "ChunkedTensor":
        """A copy of every piece in host memory (`buffer`), for a background write."""
        return ChunkedTensor(self.shape, self.dtype, [Piece(p.offsets, buffer.copy(p.tensor))
                                                      for p in self.pieces])


# ------------------------------------------------------------ this rank's state
def local_state(sd: ShardedState, num_layers: int, topo, *, for_save: bool) -> dict[str, ChunkedTensor]:
    """{fqn: ChunkedTensor} of the engine's sharded state `sd` (its views: a save reads
    them, a load fills them) on this rank of `topo`, in a model of `num_layers` layers.

    for_save: only the pieces this rank writes (each element once over all ranks);
    otherwise every piece this rank holds (what a load must fill)."""
    ranges = stage_layer_ranges(num_layers, topo.layout.pp, sd.num_chunks, topo.pp_rank)
    tp, tp_rank, dp_rank = topo.layout.tp, topo.tp_rank, topo.dp_rank
    pieces: dict[str, list[Piece]] = {}
    shapes: dict[str, tuple] = {}
    for shard in sd.params:
        name = local_to_global_name(shard.name, ranges)
        tied_copy = shard.shared_embedding and name in TIED_SOURCE
        if tied_copy:
            name = TIED_SOURCE[name]
        if for_save and (tied_copy or (shard.replicated and dp_rank != 0)
                         or (shard.tp_dim is None and tp_rank != 0)):
            continue
        boxes = flat_range_boxes(shard.shape, shard.start, shard.end)
        for key, buf in shard.tensors.items():
            name_of_state = dcp_name(key, name)
            shapes[name_of_state] = global_shape(shard, tp)
            for offsets, sizes, flat_start in boxes:
                start = flat_start - shard.start  # in the shard's own view
                view = buf[start:start + math.prod(sizes)].view(sizes)
                for loc, siz, glo in tp_split(shard, offsets, sizes, tp_rank, tp):
                    v = view
                    for d in range(len(siz)):
                        if siz[d] != sizes[d]:
                            v = v.narrow(d, loc[d] - offsets[d], siz[d])
                    pieces.setdefault(name_of_state, []).append(Piece(glo, v))
    return {name: ChunkedTensor(shapes[name], ps[0].tensor.dtype, ps) for name, ps in pieces.items()}
