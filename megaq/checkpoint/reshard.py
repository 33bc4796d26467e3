"""A parameter's name and shards across layouts: what lets a checkpoint of one TP x PP
layout load into another.

* **Global names.** A pipeline stage names its layers from 0 and a rank with several
  model chunks (virtual pipeline) prefixes them ``chunk{i}.``; a checkpoint names them
  by global layer index (:func:`local_to_global_name`), so the names do not depend on
  the pipeline split. The tied output layer of a last stage that lacks the embedding is
  a copy of it: its global source is the embedding (:data:`TIED_SOURCE`).
* **TP shards.** :func:`concat_tp_shards` inverts megaq.parallel.tensor_parallel.shard_of
  (checked by re-slicing), :func:`fit_rows` adds or drops the vocabulary padding that
  differs between TP sizes.
* **A rank's place.** :class:`Place` is the TP x PP coordinates a reshard cuts for: a
  training rank's (``Place.of(topo)``), or :data:`WHOLE_MODEL`, one process holding
  every layer unsplit (tools): no process group or topology is involved in either.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megaq.checkpoint.errors import CheckpointError
from megaq.parallel.pipeline.split import stage_layer_ranges
from megaq.parallel.tensor_parallel import shard_of

# a copy of a tied embedding -> the global name the checkpoint keeps it under
TIED_SOURCE = {"output_layer.weight": "embedding.word_embeddings.weight"}


@dataclass(frozen=True)
class Place:
    """Where a rank's model chunks sit: its TP rank of `tp`, its stage of `pp`."""

    tp: int = 1
    tp_rank: int = 0
    pp: int = 1
    pp_rank: int = 0

    @classmethod
    def of(cls, topo) -> "Place":
        return cls(topo.layout.tp, topo.tp_rank, topo.layout.pp, topo.pp_rank)


WHOLE_MODEL = Place()  # one process, every layer, no TP split


# ---------------------------------------------------------------------- names
def local_to_global_name(name: str, chunk_ranges: list[tuple[int, int]]) -> str:
    """'chunk1.layers.0.x' on a rank whose chunk 1 starts at layer 6 -> 'layers.6.x'."""
    chunk = 0
    if name.startswith("chunk") and name.split(".", 1)[0][5:].isdigit():
        head, name = name.split(".", 1)
        chunk = int(head[5:])
    if name.startswith("layers."):
        _, idx, rest = name.split(".", 2)
        name = f"layers.{chunk_ranges[chunk][0] + int(idx)}.{rest}"
    return name


def global_to_local_names(model_chunks, ranges) -> dict[str, tuple[str, torch.nn.Parameter]]:
    """{global name: (name as engine.full_state() keys it, parameter)} for this rank."""
    out = {}
    for c, chunk in enumerate(model_chunks):
        for name, p in chunk.named_parameters():
            key = f"chunk{c}.{name}" if len(model_chunks) > 1 else name
            out[local_to_global_name(key, ranges)] = (key, p)
    return out


# ------------------------------------------------------------------- TP shards
def concat_tp_shards(parts: list[torch.Tensor], dim: int, stride: int = 1,
                     name: str = "a parameter") -> torch.Tensor:
    """Inverse of tensor_parallel.shard_of: the full tensor from every TP rank's shard.

    Checked by re-slicing: a shard that does not come back unchanged (a layout that is
    not invertible) is refused rather than used scrambled."""
    blocks = [list(x.chunk(stride, dim=dim)) for x in parts]  # [rank][block]
    full = torch.cat([torch.cat([blocks[r][b] for r in range(len(parts))], dim=dim)
                      for b in range(stride)], dim=dim)
    for r, part in enumerate(parts):
        if not torch.equal(shard_of(full, dim, r, len(parts), stride), part):
            raise CheckpointError(f"cannot consolidate {name} from TP={len(parts)} shards (its "
                                  f"layout does not invert); load it with the training layout")
    return full


def fit_rows(full: torch.Tensor, dim: int, size: int, name: str) -> torch.Tensor:
    """Vocab padding differs between TP sizes: drop or add (zero) padding rows."""
    have = full.shape[dim]
    if have == size:
        return full
    if have > size:
        return full.narrow(dim, 0, size)
    pad_shape = list(full.shape)
    pad_shape[dim] = size - have
    return torch.cat([full, full.new_zeros(pad_shape)], dim=dim)


# ------------------------------------------------------------------- resharding
def reshard_full_state(saved: dict, model_chunks, place: Place, ckpt_dir: str) -> dict:
    """The engine.full_state()-shaped dict of `model_chunks` at `place` from the full
    state of another TP x PP layout (`saved`: {"step", "params": {global name: [per old
    TP rank {param, <optimizer state>...}]}}, megaq.checkpoint.torch_format.read_all_stages):
    stages stitched by global layer index, TP shards concatenated along each parameter's
    partition dimension and re-split for `place` (weights and every named optimizer
    state alike). `ckpt_dir` names the checkpoint in refusals."""
    num_layers = sum(c.layer_end - c.layer_start for c in model_chunks) * place.pp
    ranges = stage_layer_ranges(num_layers, place.pp, len(model_chunks), place.pp_rank)
    params = {}
    for g, (key, p) in global_to_local_names(model_chunks, ranges).items():
        src = g
        if src not in saved["params"] and g in TIED_SOURCE:
            src = TIED_SOURCE[g]  # tied head copy of a new last stage
        if src not in saved["params"]:
            raise CheckpointError(f"{ckpt_dir} has no parameter {g}; it is not a checkpoint of "
                                  f"this model")
        parts = saved["params"][src]
        entry = {}
        for k in parts[0]:  # the weights and each named optimizer state alike
            shards = [x[k] for x in parts]
            if getattr(p, "tensor_model_parallel", False):
                dim, stride = p.partition_dim, p.partition_stride
                full = concat_tp_shards(shards, dim, stride, name=g)
                if stride == 1:
                    full = fit_rows(full, dim, p.shape[dim] * place.tp, g)
                entry[k] = shard_of(full, dim, place.tp_rank, place.tp, stride)
            else:
                entry[k] = shards[0]
            if entry[k].shape != p.shape:
                raise CheckpointError(f"cannot reshard {g}: checkpoint gives {tuple(entry[k].shape)}, "
                                      f"this rank holds {tuple(p.shape)}")
        params[key] = entry
    return {"step": saved["step"], "params": params}
