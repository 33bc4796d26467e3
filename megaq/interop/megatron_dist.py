"""Read Megatron-LM's `torch_dist` checkpoints (megatron-core's dist_checkpointing, the
default --ckpt-format) without Megatron installed.

An iteration directory holds::

    metadata.json        {"sharded_backend": "torch_dist", ...}   (JSON)
    .metadata            torch.distributed.checkpoint's index: every global tensor, its
                         chunks and where each chunk's bytes are; megatron-core adds the
                         save plans (planner classes), all read by safe_unpickle.DCP_INDEX
    __{rank}_{n}.distcp  the chunks, each a torch.save stream at (offset, length)
    common.pt            rank 0: args (argparse.Namespace), iteration, checkpoint_version,
                         opt_param_scheduler, the optimizer's sharding type

Model tensors are global (full) tensors, the layers stacked on a leading axis:
``decoder.layers.self_attention.linear_qkv.weight`` is [num_layers, ...]. The
distributed optimizer's state in the `dp_reshardable` layout (megatron-core 0.16's
default) is one flat tensor per gradient bucket and model-parallel rank::

    optimizer.distributed.dp_group_idx_{mp}.gbuf_idx_{g}.dtype_{(param, grad)}.bucket_idx_{b}.{param,exp_avg,exp_avg_sq}
    optimizer.distributed.dp_group_idx_{mp}.per_bucket_numel[_unpadded]   (objects)
    optimizer.distributed.dp_group_idx_{mp}.optimizer                      (param groups, step)

where a bucket holds the rank's parameters in reverse model order, each starting on a
multiple of 64 elements (megatron-core's _ParamAndGradBuffer). The order of parameters
inside a layer depends on the layer spec (local or Transformer Engine), which the
checkpoint does not record: both are tried and the one whose `param` slices equal the
model's weights (the fp32 main params round to them) is taken; none matching is refused.

In the `fully_reshardable` layout (Megatron-LM's --dist-ckpt-optim-fully-reshardable)
the state is in model space instead: one global tensor per parameter and state, named
and stacked as the model's, ``optimizer.state.{param,exp_avg,exp_avg_sq}.<model key>``,
with the param groups (and their step) in common.pt; its main params must equal the
weights too.

Every byte is read through megaq.checkpoint.safe_unpickle; a chunk must lie inside a
regular `__*.distcp` file of the directory (no path, no symlink).
"""

from __future__ import annotations

import json
import math
import os
import re
import stat

import torch

from megaq.checkpoint import safe_unpickle
from megaq.interop.common import InteropError, read_foreign

METADATA_JSON = "metadata.json"
INDEX = ".metadata"
COMMON = "common.pt"
_DATA_FILE = re.compile(r"__\d+_\d+\.distcp")
# the distributed optimizer's checkpoint layouts megaq reads (param_state_sharding_type)
BUCKETS, MODEL_SPACE = "dp_reshardable", "fully_reshardable"


class MegatronImportError(InteropError):
    """A Megatron-LM checkpoint (either format) that cannot be imported as asked; one line
    naming why and the fix. An InteropError, so tools/convert_checkpoint.py prints it as
    its one `error:` line. (Here, the lower of the two Megatron modules.)"""


def unpickle(path: str, fmt, data: bytes | None = None):
    """A Megatron-LM file (or `data`, a chunk of one) through megaq.checkpoint.safe_unpickle's
    allow-list `fmt`: a refused class or a damaged file is one MegatronImportError line."""
    return read_foreign(path, fmt, MegatronImportError, data)


class DistCheckpoint:
    """One Megatron-LM torch_dist iteration directory, read lazily and safely."""

    def __init__(self, iter_dir: str):
        self.dir = iter_dir
        try:
            with open(os.path.join(iter_dir, METADATA_JSON), "rb") as f:
                meta = json.loads(f.read(1 << 16).decode("utf-8"))
        except (OSError, ValueError) as e:
            raise MegatronImportError(f"{iter_dir}/{METADATA_JSON} cannot be read ({e}); the "
                                  f"checkpoint is incomplete") from None
        if not isinstance(meta, dict) or meta.get("sharded_backend") != "torch_dist":
            raise MegatronImportError(f"{iter_dir} uses the sharded backend "
                                  f"{meta.get('sharded_backend') if isinstance(meta, dict) else meta!r}, "
                                  "not torch_dist; re-save it with --ckpt-format torch_dist")
        self.index = self._unpickle(os.path.join(iter_dir, INDEX), safe_unpickle.DCP_INDEX)
        if not hasattr(self.index, "state_dict_metadata") or not hasattr(self.index, "storage_data"):
            raise MegatronImportError(f"{iter_dir}/{INDEX} is not a DCP index; the checkpoint is damaged")
        self.common = self._unpickle(os.path.join(iter_dir, COMMON), safe_unpickle.MEGATRON)
        if not isinstance(self.common, dict):
            raise MegatronImportError(f"{iter_dir}/{COMMON} holds a {type(self.common).__name__}, not "
                                  "the dict megatron-core saves; it is not a Megatron-LM checkpoint")
        self._sizes = {}

    def _unpickle(self, path: str, fmt, data: bytes | None = None):
        return unpickle(path, fmt, data)

    # ---------------------------------------------------------------- raw items
    def names(self) -> list[str]:
        return list(self.index.state_dict_metadata)

    def _bytes(self, key) -> tuple[bytes, str]:
        info = self.index.storage_data.get(key)
        if info is None:
            raise MegatronImportError(f"{self.dir}/{INDEX} lists {key.fqn} without its storage; the "
                                  "checkpoint is damaged")
        name, off, length = info.relative_path, info.offset, info.length
        where = f"{self.dir}/{name}"
        if not (isinstance(name, str) and _DATA_FILE.fullmatch(name)):
            raise MegatronImportError(f"{self.dir}/{INDEX} points {key.fqn} at {name!r}, not a "
                                  "__N_M.distcp file of the directory; refused (the index was altered)")
        if getattr(info, "transform_descriptors", None):
            raise MegatronImportError(f"{where}: {key.fqn} is stored transformed "
                                  f"({info.transform_descriptors}); only plain torch_dist files import")
        path = os.path.join(self.dir, name)
        if name not in self._sizes:
            st = os.lstat(path) if os.path.lexists(path) else None
            if st is None or not stat.S_ISREG(st.st_mode):
                raise MegatronImportError(f"{where} is missing or not a regular file; the checkpoint "
                                      "is incomplete")
            self._sizes[name] = st.st_size
        if not (isinstance(off, int) and isinstance(length, int) and 0 <= off
                and 0 < length and off + length <= self._sizes[name]):
            raise MegatronImportError(f"{self.dir}/{INDEX} places {key.fqn} outside {where}; the "
                                  "checkpoint is damaged")
        with open(path, "rb") as f:
            f.seek(off)
            return f.read(length), where

    def tensor(self, fqn: str) -> torch.Tensor:
        """The global tensor `fqn`, assembled from its chunks (each checked to lie inside it)."""
        from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata
        md = self.index.state_dict_metadata.get(fqn)
        if not isinstance(md, TensorStorageMetadata):
            raise MegatronImportError(f"{self.dir} holds no tensor {fqn}; the checkpoint is incomplete "
                                  "or not of the model its args describe")
        full = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        covered = 0
        for chunk in md.chunks:
            data, where = self._bytes(MetadataIndex(fqn, chunk.offsets))
            part = self._unpickle(where, safe_unpickle.TENSORS, data)
            if (not isinstance(part, torch.Tensor) or tuple(part.shape) != tuple(chunk.sizes)
                    or any(o + s > n for o, s, n in zip(chunk.offsets, chunk.sizes, md.size))):
                raise MegatronImportError(f"{where}: a chunk of {fqn} does not have the shape the "
                                      "index gives; the checkpoint is damaged")
            full[tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))] = part
            covered += part.numel()
        if covered != full.numel():
            raise MegatronImportError(f"{self.dir}: the chunks of {fqn} cover {covered} of its "
                                  f"{full.numel()} elements; the checkpoint is incomplete")
        return full

    def obj(self, fqn: str):
        """A ShardedObject's value (megatron-core names it `<key>/shard_0_1`)."""
        from torch.distributed.checkpoint.metadata import MetadataIndex
        name = fqn if fqn in self.index.state_dict_metadata else f"{fqn}/shard_0_1"
        if name not in self.index.state_dict_metadata:
            raise MegatronImportError(f"{self.dir} holds no {fqn}; the checkpoint is incomplete")
        data, where = self._bytes(MetadataIndex(name))
        value = self._unpickle(where, safe_unpickle.MEGATRON, data)
        return value[0] if isinstance(value, list) and len(value) == 1 else value


# --------------------------------------------------------------- the model's weights
def model_tensors(ck: DistCheckpoint, arch: dict, name_of, prefix: str = "") -> dict:
    """{megaq global name: full tensor} of the model; `name_of(mcore name, layer)` maps a
    megatron-core per-layer name to megaq's (megatron._megaq_name's rule). With `prefix`
    ("optimizer.state.exp_avg."), the tensors stored in model space under that prefix
    (the fully_reshardable optimizer state) instead of the model's."""
    out = {}
    layers = arch["num_layers"]
    for fqn in ck.names():
        if not fqn.startswith(prefix):
            continue
        key = fqn[len(prefix):]
        if key.startswith("optimizer.") or "_extra_state" in key or key.startswith("rng_state"):
            continue
        if key.startswith("decoder.layers."):
            t = ck.tensor(fqn)
            if t.shape[0] != layers:
                raise MegatronImportError(f"{ck.dir}: {fqn} stacks {t.shape[0]} layers, args say "
                                      f"--num-layers {layers}; the checkpoint is inconsistent")
            for i in range(layers):
                mapped = name_of(key.replace("decoder.layers.", f"decoder.layers.{i}.", 1))
                if mapped is not None:
                    out[mapped[0]] = t[i].clone()
        else:
            mapped = name_of(key)
            if mapped is not None:
                out[mapped[0]] = ck.tensor(fqn)
    return out


# ------------------------------------------------- the distributed optimizer's state
def mcore_order(arch: dict, te: bool) -> list[str]:
    """megatron-core GPTModel's parameters in model.parameters() order (checkpoint names).
    te: Transformer Engine specs, whose norms live inside the next linear (after
    linear_proj); the local spec registers input_layernorm first."""
    bias = arch["add_bias_linear"]
    norm = ["weight"] + (["bias"] if arch["normalization"] == "LayerNorm" else [])
    lin = lambda m: [f"{m}.weight"] + ([f"{m}.bias"] if bias else [])  # noqa: E731
    names = ["embedding.word_embeddings.weight"]
    if arch["position_embedding_type"] == "learned_absolute":
        names.append("embedding.position_embeddings.weight")
    for i in range(arch["num_layers"]):
        p = f"decoder.layers.{i}."
        in_ln = [f"{p}self_attention.linear_qkv.layer_norm_{k}" for k in norm]
        mlp_ln = [f"{p}mlp.linear_fc1.layer_norm_{k}" for k in norm]
        attn = lin(f"{p}self_attention.linear_proj")
        qkv = lin(f"{p}self_attention.linear_qkv")
        names += (attn + in_ln + qkv) if te else (in_ln + attn + qkv)
        if arch.get("qk_layernorm"):  # SelfAttention registers them after linear_qkv
            names += [f"{p}self_attention.{qk}_layernorm.{k}" for qk in "qk" for k in norm]
        names += mlp_ln + lin(f"{p}mlp.linear_fc1") + lin(f"{p}mlp.linear_fc2")
    names += [f"decoder.final_layernorm.{k}" for k in norm]
    if arch["untie_embeddings_and_output_weights"]:
        names.append("output_layer.weight")
    return names


def _bucket_places(order: list[tuple[str, int]], numel: list[int], unpadded: list[int]):
    """{name: (bucket, start, end)} of each parameter in its bucket's checkpoint tensor,
    laid out as megatron-core's _ParamAndGradBuffer does (reverse order, starts padded
    to 64 elements), the bucket ends read from the checkpoint; None when they disagree."""
    places, b, bucket_start, start, in_bucket = {}, 0, 0, 0, 0
    for name, n in reversed(order):
        start = math.ceil(start / 64) * 64
        if in_bucket and b < len(unpadded) and start - bucket_start >= unpadded[b]:
            bucket_start += numel[b]   # the bucket closed before this parameter
            b, start, in_bucket = b + 1, bucket_start, 0
        if b >= len(numel):
            return None
        places[name] = (b, start - bucket_start, start - bucket_start + n)
        start, in_bucket = start + n, in_bucket + 1
        if start - bucket_start == unpadded[b]:
            bucket_start += numel[b]
            b, start, in_bucket = b + 1, bucket_start, 0
    return places if b == len(numel) else None


def optimizer_state(ck: DistCheckpoint, arch: dict, tp: int, pp: int, full_weights: dict,
                    name_of, tp_split) -> dict:
    """{"step", "shards": {megaq name: [{"param", "exp_avg", "exp_avg_sq"} fp32, one per
    TP rank of the checkpoint, or one full tensor]}}. `tp_split(megaq name, full, rank)`
    is the TP shard megatron-core holds on `rank`; `full_weights` the model's (to place
    and check the bucket slices, or the model-space main params)."""
    optim = ck.common.get("optimizer")
    kind = optim.get("param_state_sharding_type") if isinstance(optim, dict) else None
    if kind is None:
        raise MegatronImportError(f"{ck.dir} holds no optimizer state (saved with --no-save-optim?); "
                              "import it with --no-optimizer (weights only)")
    if kind not in (BUCKETS, MODEL_SPACE):
        raise MegatronImportError(f"{ck.dir} keeps the distributed optimizer's state in the {kind!r} "
                              f"layout; megaq imports {BUCKETS!r} (megatron-core's default) and "
                              f"{MODEL_SPACE!r} (--dist-ckpt-optim-fully-reshardable): re-save with "
                              "one of them, or import with --no-optimizer")
    if pp > 1:
        raise MegatronImportError(f"{ck.dir} was saved at pipeline size {pp}; the distributed "
                              "optimizer's state imports from pipeline size 1 only (import with "
                              "--no-optimizer for the weights)")
    if kind == MODEL_SPACE:
        groups = (optim.get("optimizer") or {}).get("param_groups") \
            if isinstance(optim.get("optimizer"), dict) else None
        return {"step": _one_step(ck, groups), "shards": _model_space_state(ck, arch, full_weights,
                                                                             name_of)}
    groups = ck.obj("optimizer.distributed.dp_group_idx_0.optimizer").get("param_groups")
    step = _one_step(ck, groups)
    shards = {}  # megaq name -> [per TP rank {"param", "exp_avg", "exp_avg_sq"}]
    for rank in range(tp):
        pre = f"optimizer.distributed.dp_group_idx_{rank}"
        numel = ck.obj(f"{pre}.per_bucket_numel")
        unpadded = ck.obj(f"{pre}.per_bucket_numel_unpadded")
        if not (isinstance(numel, list) and len(numel) == 1 and isinstance(numel[0], dict)
                and len(numel[0]) == 1):
            raise MegatronImportError(f"{ck.dir}: TP rank {rank}'s optimizer has "
                                  f"{len(numel) if isinstance(numel, list) else '?'} gradient "
                                  "buffers; megaq imports one (a dense model, one dtype)")
        (dtype_key, numel), = numel[0].items()
        unpadded = unpadded[0][dtype_key]
        prefix = f"{pre}.gbuf_idx_0.dtype_{dtype_key}"
        buckets = [{k: ck.tensor(f"{prefix}.bucket_idx_{b}.{k}").float()
                    for k in ("param", "exp_avg", "exp_avg_sq")} for b in range(len(numel))]
        local = {}  # mcore name -> (megaq name, local weight)
        for mname in mcore_order(arch, te=False):
            gname = name_of(mname)[0]
            local[mname] = (gname, tp_split(gname, full_weights[gname], rank))
        picked = None
        for te in (False, True):
            order = [(m, local[m][1].numel()) for m in mcore_order(arch, te)]
            places = _bucket_places(order, numel, unpadded)
            if places is None:
                continue
            if all(buckets[b]["param"][s:e].view_as(local[m][1]).to(local[m][1].dtype)
                   .equal(local[m][1]) for m, (b, s, e) in places.items()):
                picked = places
                break
        if picked is None:
            raise MegatronImportError(f"{ck.dir}: TP rank {rank}'s optimizer buckets do not line up "
                                  "with the model's parameters (megatron-core's local or "
                                  "Transformer Engine layer order); the checkpoint was written by "
                                  "an unsupported megatron-core version or is damaged")
        for m, (b, s, e) in picked.items():
            gname, w = local[m]
            shards.setdefault(gname, []).append(
                {k: buckets[b][k][s:e].view_as(w).clone() for k in buckets[b]})
    return {"step": step, "shards": shards}


def _one_step(ck: DistCheckpoint, groups) -> int:
    """The AdamW step of the saved param groups (one for all of them)."""
    steps = {int(g.get("step", 0)) for g in groups if isinstance(g, dict)} \
        if isinstance(groups, list) else set()
    if len(steps) != 1:
        raise MegatronImportError(f"{ck.dir}: the optimizer's param groups hold steps {sorted(steps)}, "
                              "not one; the checkpoint is damaged")
    return steps.pop()


def _model_space_state(ck: DistCheckpoint, arch: dict, full_weights: dict, name_of) -> dict:
    """The fully_reshardable state: {megaq name: [{"param", "exp_avg", "exp_avg_sq"}]}, the
    full fp32 tensors; every main param must round to its saved weight."""
    state = {k: model_tensors(ck, arch, name_of, prefix=f"optimizer.state.{k}.")
             for k in ("param", "exp_avg", "exp_avg_sq")}
    shards = {}
    for gname, w in full_weights.items():
        if not all(gname in state[k] for k in state):
            continue  # the caller names what has no state
        parts = {k: state[k][gname].float() for k in state}
        if parts["param"].shape != w.shape or not parts["param"].to(w.dtype).equal(w):
            raise MegatronImportError(f"{ck.dir}: the optimizer's main parameter for {gname} is not "
                                      "the saved weight; the checkpoint is inconsistent or damaged")
        shards[gname] = [parts]
    return shards
