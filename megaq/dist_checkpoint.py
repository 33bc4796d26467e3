"""--ckpt-format torch_dist: every rank writes only what it owns, through
torch.distributed.checkpoint (DCP), and loads reshard to any layout.

Layout under --save DIR (Megatron's; the torch format is in megaq.checkpoint)::

    latest_checkpointed_iteration.txt
    iter_0000100/
      .metadata                  DCP's index: every global tensor, its chunks, where each is
      __{rank}_0.distcp          each rank's own chunks (DCP writes one file per rank)
      common.pt                  rank 0: configuration, iteration, consumed samples, LR
                                 schedule, layout, optimizer step (megaq.checkpoint's
                                 model_file_record with a small "model_optim")
      rng/rank_{rank:05d}.pt     every rank's RNG streams (as the torch format)
      qgz/rank_{rank:05d}.pt     qgZ error-feedback residuals (as the torch format)
      MANIFEST.sha256.json       SHA-256 of every file; each rank hashes the files it wrote
                                 and rank 0 writes the manifest from theirs

What DCP sees: one global tensor per parameter and state ("model.{name}",
"optimizer.exp_avg.{name}", ...; names are global: pipeline stages and virtual chunks
numbered by global layer index, as megaq.checkpoint.local_to_global_name), with the
full (TP-unsharded) shape. A rank's share of it is its ZeRO shard: a *flat range* of
the parameter's TP-local 1-D view, cut wherever the block-aligned flat buffer puts the
DP boundary. DCP describes chunks as boxes (offsets + sizes), so a flat range becomes
at most 2 * ndim - 1 boxes (a partial row, whole rows, a partial row; recursively),
each mapped to its place in the full tensor through the parameter's TP partition
(dimension and stride). This is what Megatron's dist_checkpointing does with its
``flattened_range`` for the distributed optimizer; here it is expressed in DCP's own
chunk metadata, so DCP's default planners resolve any resharding (a rank reading
boxes of a new layout gets every overlap with the saved boxes).

Who writes what (each element once): sharded partitions, every DP rank its range;
replicated partitions, DP rank 0; TP-replicated parameters, TP rank 0; the tied
output-layer copy of the last stage, nobody (it is the first stage's embedding).
Every rank reads everything it holds, whatever layout wrote it.

Saves are atomic as in the torch format: all files go into ``.iter_*.tmp``, rank 0
writes the manifest, renames, then rewrites the tracker. With --async-save the
shards are first copied to (pinned) CPU memory (megaq.host_staging), and a background thread does the
writing, the hashing and the commit on a separate gloo process group while training
goes on; the next save and the end of the run wait for it (``wait_for_async_save``).
"""

from __future__ import annotations

import math
import os
import shutil
import threading
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata,
                                                   Metadata, MetadataIndex, StorageMeta,
                                                   TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from megaq import checkpoint as ckpt
from megaq import checkpoint_guard, failure, host_staging, integrity, safe_unpickle
from megaq.data import tokenizer_files
from megaq.parallel import comm
from megaq.parallel.pipeline.split import stage_layer_ranges
from megaq.zero import state as state_io

COMMON_FILE = "common.pt"
METADATA_FILE = ".metadata"
FORMAT = "torch_dist"


def is_dist_checkpoint(ckpt_dir: str) -> bool:
    return os.path.isfile(os.path.join(ckpt_dir, COMMON_FILE))


# ------------------------------------------------------------------ host bytes
class HostBytes:
    """Bytes of the tensors the checkpoint code itself allocates (staging copies,
    read buffers), live and peak: what a rank materialises beyond its own state."""

    def __init__(self):
        self.live = self.peak = 0

    def reset(self) -> None:
        self.live = self.peak = 0

    def add(self, nbytes: int) -> None:
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def sub(self, nbytes: int) -> None:
        self.live -= nbytes


HOST_BYTES = HostBytes()
# {"save": bytes of the pieces this rank wrote last, "load": bytes it filled last}: its
# shard, what HOST_BYTES is measured against
LAST_SHARD_BYTES: dict[str, int] = {}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


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


def _tp_split(param, offsets, sizes, tp_rank: int, tp: int) -> list[tuple]:
    """[(local_offsets, sizes, global_offsets)] of a box of this rank's TP shard:
    along the partition dimension (read as `stride` blocks, megaq.parallel.
    tensor_parallel.shard_of) a box is cut at block edges and each piece placed at its
    rank's slot of its block."""
    if not getattr(param, "tensor_model_parallel", False) or tp == 1:
        return [(offsets, sizes, offsets)]
    d, stride = param.partition_dim, param.partition_stride
    block = param.shape[d] // stride  # local rows per block
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


def global_shape(param, tp: int) -> tuple:
    shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False):
        shape[param.partition_dim] *= tp
    return tuple(shape)


@dataclass
class Piece:
    offsets: tuple         # in the global tensor
    tensor: torch.Tensor   # a view of this rank's buffer (or a staged copy)


class ChunkedTensor:
    """The pieces of one global tensor this rank writes or reads, as DCP chunks
    (the ``__create_write_items__`` / ``__create_chunk_list__`` protocol DCP uses
    for DTensor; the planners below look pieces up by offset)."""

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

    def staged(self, buffer: host_staging.StagingBuffer) -> "ChunkedTensor":
        """A copy of every piece in host memory (`buffer`), for a background write."""
        return ChunkedTensor(self.shape, self.dtype, [Piece(p.offsets, buffer.copy(p.tensor))
                                                      for p in self.pieces])


class _SavePlanner(DefaultSavePlanner):
    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.copied = 0

    def resolve_data(self, write_item):
        data = super().resolve_data(write_item)
        if isinstance(data, torch.Tensor) and data.untyped_storage().nbytes() != _nbytes(data):
            # a view into a flat shard buffer: DCP's file writer copies it (torch.save
            # would write the whole storage) and keeps the copies until the rank's file
            # is closed, so a synchronous save holds up to one copy of the shard
            self.copied += _nbytes(data)
            HOST_BYTES.add(_nbytes(data))
        return data

    def lookup_object(self, index: MetadataIndex):
        obj = self.state_dict[index.fqn]
        if isinstance(obj, ChunkedTensor):
            return obj.piece_at(index.offset)
        return super().lookup_object(index)


class _LoadPlanner(DefaultLoadPlanner):
    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        # DefaultLoadPlanner's own set-up walks the values to materialise meta tensors and
        # replaces any type it does not know (ours) with None; nothing here is on meta.
        self.original_state_dict = self.state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict[index.fqn]
        if isinstance(obj, ChunkedTensor):
            return obj.piece_at(index.offset)
        return super().lookup_tensor(index)

    def load_bytes(self, read_item, value) -> None:
        # DCP's default would unpickle the entry with torch.load(weights_only=False); what
        # megaq loads is tensors only (_fit_to_saved refuses any other entry), so this is
        # never reached, and must never unpickle
        raise ckpt.CheckpointError(f"the checkpoint holds {read_item.storage_index.fqn} as "
                                   f"pickled bytes, which megaq never reads")


class VerifiedReader(dcp.FileSystemReader):
    """DCP's file reader, refusing files that do not match the manifest, and reading
    its index (.metadata) through megaq.safe_unpickle: DCP's own reader unpickles it with
    plain pickle, which runs whatever the file names. Each file is checked once, before
    its first read; the caller checks the whole plan up front (_verify_reads) so that a
    damaged file is one clear line, not an error inside DCP."""

    def __init__(self, path: str):
        super().__init__(path)
        self.ckpt_dir = str(path)
        self._metadata = None

    def read_metadata(self, *args, **kwargs):
        """DCP's index, verified, read and checked once per reader: a tool reading
        tensor after tensor reuses it, and DCP's own calls get it from here."""
        if self._metadata is not None:
            return self._metadata
        path = os.path.join(self.ckpt_dir, METADATA_FILE)
        _verify_once(self.ckpt_dir, path)
        try:
            metadata = safe_unpickle.load(path, safe_unpickle.DCP_INDEX)
        except safe_unpickle.UnpicklingRefused as e:
            raise ckpt.CheckpointError(str(e)) from None
        except Exception as e:  # noqa: BLE001 - a damaged index (unverified load)
            raise ckpt.CheckpointError(f"{path} cannot be read ({type(e).__name__}: {e}); it is "
                                       f"damaged or not a DCP index") from None
        _check_index(metadata, path)
        if getattr(metadata, "storage_meta", None) is None:  # as DCP's reader completes it
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = getattr(self, "load_id", None)
        self._metadata = metadata
        return metadata

    @staticmethod
    def stored_chunk_bytes(metadata, item) -> int:
        """Bytes of the saved chunk a read item comes from."""
        md = metadata.state_dict_metadata[item.storage_index.fqn]
        for chunk in md.chunks:
            if tuple(chunk.offsets) == tuple(item.storage_index.offset):
                return math.prod(chunk.sizes) * md.properties.dtype.itemsize
        return 0

    def files_of(self, plan) -> list[str]:
        return sorted({self.storage_data[item.storage_index].relative_path for item in plan.items})


def _check_index(metadata, path: str) -> None:
    """Refuse a DCP index whose contents are not what DCP writes (the allowed classes in
    the wrong places), in one line: DCP would fail deep inside, or (a storage entry
    naming ../x) read a file outside the checkpoint directory."""
    def refuse(why):
        raise ckpt.CheckpointError(f"{path} is not a DCP index ({why}); the file is damaged or "
                                   f"was altered: restore it or load an earlier iteration")
    if not isinstance(metadata, Metadata):
        refuse(f"it holds a {type(metadata).__name__}")
    entries, storage = metadata.state_dict_metadata, metadata.storage_data
    if not isinstance(entries, dict) or not isinstance(storage, dict):
        refuse("its tensor list or file map is not a dict")
    for fqn, md in entries.items():
        if isinstance(md, BytesStorageMetadata):
            continue
        if not (isinstance(fqn, str) and isinstance(md, TensorStorageMetadata)
                and isinstance(md.properties, TensorProperties)
                and isinstance(md.properties.dtype, torch.dtype)
                and isinstance(md.size, torch.Size) and isinstance(md.chunks, list)
                and all(isinstance(c, ChunkStorageMetadata) and isinstance(c.offsets, torch.Size)
                        and isinstance(c.sizes, torch.Size) and len(c.offsets) == len(md.size)
                        == len(c.sizes) for c in md.chunks)):
            refuse(f"entry {fqn!r} is not a tensor's description")
    for index, info in storage.items():
        rel = getattr(info, "relative_path", None)
        if not (isinstance(index, MetadataIndex) and isinstance(info, _StorageInfo)
                and isinstance(rel, str) and rel not in ("", ".", "..")
                and os.path.basename(rel) == rel
                and isinstance(info.offset, int) and isinstance(info.length, int)
                and info.offset >= 0 and info.length >= 0):
            refuse(f"a storage entry names {rel!r}, not a file of its directory")


# --------------------------------------------------------------- this rank's state
def _global_names(engine, config, topo) -> dict[str, str]:
    """{engine slot name: global parameter name}."""
    ranges = stage_layer_ranges(config.model.num_layers, topo.layout.pp, len(engine.chunks),
                                topo.pp_rank)
    return {key: g for g, (key, _) in ckpt.global_to_local_names(engine.chunks, ranges).items()}


TIED_SOURCE = {"output_layer.weight": "embedding.word_embeddings.weight"}


def _fqn(key: str, name: str) -> str:
    return f"model.{name}" if key == "param" else f"optimizer.{key}.{name}"


def local_state(engine, config, topo, *, optim: bool, for_save: bool) -> dict[str, ChunkedTensor]:
    """{fqn: ChunkedTensor} of views into this rank's fp32 shard buffers.

    for_save: only the pieces this rank writes (each element once over all ranks);
    otherwise every piece this rank holds (what a load must fill)."""
    names = _global_names(engine, config, topo)
    tp, tp_rank, dp_rank = topo.layout.tp, topo.tp_rank, topo.dp_rank
    pieces: dict[str, list[Piece]] = {}
    shapes: dict[str, tuple] = {}
    for st in engine.optimizer.states:
        part = st.part
        buffers = state_io.state_buffers(st, optim)
        for slot in part.slots:
            p, name = slot.param, names[slot.name]
            tied_copy = getattr(p, "shared_embedding", False) and name in TIED_SOURCE
            if tied_copy:
                name = TIED_SOURCE[name]
            if for_save and (tied_copy or (not part.sharded and dp_rank != 0)
                             or (not getattr(p, "tensor_model_parallel", False) and tp_rank != 0)):
                continue
            a, b = max(slot.offset, part.lo), min(slot.offset + slot.numel, part.hi)
            if b <= a:
                continue  # the parameter lies wholly in other DP ranks' shards
            boxes = flat_range_boxes(slot.shape, a - slot.offset, b - slot.offset)
            for key, buf in buffers.items():
                fqn = _fqn(key, name)
                shapes[fqn] = global_shape(p, tp)
                for offsets, sizes, flat_start in boxes:
                    start = slot.offset + flat_start - part.lo  # in shard coordinates
                    view = buf[start:start + math.prod(sizes)].view(sizes)
                    for loc, siz, glo in _tp_split(p, offsets, sizes, tp_rank, tp):
                        v = view
                        for d in range(len(siz)):
                            if siz[d] != sizes[d]:
                                v = v.narrow(d, loc[d] - offsets[d], siz[d])
                        pieces.setdefault(fqn, []).append(Piece(glo, v))
    return {fqn: ChunkedTensor(shapes[fqn], ps[0].tensor.dtype, ps) for fqn, ps in pieces.items()}


# -------------------------------------------------------------- process group
_GROUP: dict[tuple, comm.Group] = {}


def checkpoint_group(topo) -> comm.Group:
    """A gloo group over the world for DCP's planning exchanges and the commit; its own
    group, so a background save never interleaves with training's collectives.
    Created on first use (collective: every rank saves or loads together)."""
    world = topo.world
    key = (tuple(world.ranks), id(dist.group.WORLD) if dist.is_initialized() else None)
    if key not in _GROUP:
        pg = None
        if world.size > 1:
            from megaq.parallel.launch import process_group_timeout
            pg = dist.new_group(list(world.ranks), backend="gloo", timeout=process_group_timeout())
        _GROUP[key] = comm.Group(ranks=list(world.ranks), nodes=list(world.nodes), pg=pg,
                                 rank_index=world.rank_index)
    return _GROUP[key]


def _run_dcp(fn, state: dict, group: comm.Group | None, **kw) -> None:
    """dcp.save / dcp.load over `group`, or on this process alone (one rank, tools);
    DCP warns on every single-process call that it assumes one process: we mean it."""
    try:
        if group is not None and group.size > 1:
            fn(state, process_group=group.pg, **kw)
            return
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            fn(state, no_dist=True, **kw)
    except CheckpointException as e:
        raise _first_failure(e, group) from None


def _first_failure(e: CheckpointException, group) -> BaseException:
    """DCP gathers every rank's exception into one CheckpointException (a
    BaseException, printed as a page of tracebacks): this rank's own one, else the
    lowest failing rank's, so that a full disk is an OSError and a damaged file our
    CheckpointError, reported in one line like the torch format's."""
    me = group.rank if group is not None and group.size > 1 else 0
    failures = e.failures
    rank = me if me in failures else min(failures, default=None)
    if rank is None:
        return RuntimeError(str(e).splitlines()[0])
    exc = failures[rank][0]
    if isinstance(exc, Exception):
        return exc
    return RuntimeError(f"{type(exc).__name__}: {exc}")


# ------------------------------------------------------------------------- save
class _PendingSave:
    def __init__(self, thread: threading.Thread, iteration: int):
        self.thread, self.iteration, self.error = thread, iteration, None


_PENDING: list[_PendingSave] = []


def wait_for_async_save() -> int | None:
    """Wait for the background save in flight (if any) to be written and committed;
    re-raise its failure here. Returns its iteration (None when there was none)."""
    if not _PENDING:
        return None
    pending = _PENDING.pop()
    pending.thread.join()
    if pending.error is not None:
        raise pending.error
    return pending.iteration


def async_save_in_flight() -> bool:
    return bool(_PENDING)


def save_checkpoint(root: str, iteration: int, *, config, topo, engine, lr_schedule,
                    consumed_samples: int, extra: dict | None = None,
                    save_optim: bool = True) -> str:
    """Collective over every rank. Returns the final directory (with --async-save it
    appears when the background write commits)."""
    wait_for_async_save()  # one save in flight at a time; the previous one is latest now
    group = checkpoint_group(topo)
    rank = topo.rank
    final = ckpt.iteration_dir(root, iteration)
    tmp = os.path.join(root, f".{os.path.basename(final)}.tmp")
    remove_tmp = lambda: rank == 0 and shutil.rmtree(tmp, ignore_errors=True)  # noqa: E731
    with checkpoint_guard.write_errors(root, tmp, None, group, remove_tmp):
        if rank == 0:
            os.makedirs(root, exist_ok=True)
            checkpoint_guard.remove_stale_temporaries(root)
            os.makedirs(tmp)

    state = local_state(engine, config, topo, optim=save_optim, for_save=True)
    LAST_SHARD_BYTES["save"] = _state_bytes(state)
    model_optim = {"format": FORMAT, "step": engine.optimizer.step_count,
                   "optimizer": save_optim}
    common = ckpt.model_file_record(iteration, consumed_samples, config, topo.layout,
                                    lr_schedule.state_dict(), model_optim, extra)
    rng = ckpt.rng_state()
    residuals = engine.error_feedback_state()
    engine.checkpoint_taken()
    job = dict(root=root, iteration=iteration, tmp=tmp, final=final, state=state, common=common,
               rng=rng, residuals=residuals, rank=rank, group=group, remove_tmp=remove_tmp)
    if not config.checkpointing.async_save:
        _write_and_commit(**job)
        return final
    staging = host_staging.buffer_for(host_staging.bytes_needed(
        p.tensor for t in state.values() for p in t.pieces), pin=torch.cuda.is_available())
    staged = LAST_SHARD_BYTES["save"]  # the data (the buffer adds under 64 bytes a piece)
    HOST_BYTES.add(staged)
    job["state"] = {fqn: t.staged(staging) for fqn, t in state.items()}
    job["residuals"] = {k: v.detach().to("cpu", copy=True) for k, v in residuals.items()}
    pending = _PendingSave(None, iteration)
    # daemon: a run that dies mid-write must not hang on it (the save is then simply
    # not committed, and the previous checkpoint stays latest)
    pending.thread = threading.Thread(target=_background, args=(pending, job, staged),
                                      name=f"megaq-async-save-{iteration}", daemon=True)
    _PENDING.append(pending)
    pending.thread.start()
    return final


def _background(pending: _PendingSave, job: dict, staged_bytes: int) -> None:
    try:
        _write_and_commit(**job)
    except BaseException as e:  # noqa: BLE001 - handed to the main thread's next wait
        pending.error = e
    finally:
        HOST_BYTES.sub(staged_bytes)  # the staged copies are dropped now (a pinned buffer
        job.clear()                   # stays for the next save: host_staging)


def _state_bytes(state: dict) -> int:
    return sum(_nbytes(p.tensor) for t in state.values() for p in t.pieces)


def _write_and_commit(*, root, iteration, tmp, final, state, common, rng, residuals, rank,
                      group, remove_tmp) -> None:
    """Write this rank's files into `tmp`, hash them, and (rank 0) write the manifest
    and commit. Collective over `group`; every phase agreed (a failure anywhere
    removes `tmp` and raises everywhere)."""
    mine: dict[str, dict] = {}
    with checkpoint_guard.write_errors(root, tmp, state, group, remove_tmp):
        writer = dcp.FileSystemWriter(tmp, single_file_per_rank=True, sync_files=True)
        planner = _SavePlanner()
        try:
            _run_dcp(dcp.save, state, group, storage_writer=writer, planner=planner)
        finally:
            HOST_BYTES.sub(planner.copied)
        written = [n for n in os.listdir(tmp) if n.startswith(f"__{rank}_")]
        if rank == 0:
            ckpt.save_file(common, os.path.join(tmp, COMMON_FILE))
            written += [COMMON_FILE, METADATA_FILE]
            tokenizer_files.copy_into(tmp, common["config"]["data"])  # hashed by the manifest
        ckpt.save_file(rng, ckpt.rng_file(tmp, rank))
        written.append(os.path.relpath(ckpt.rng_file(tmp, rank), tmp))
        if residuals:
            ckpt.save_file({"residuals": residuals}, ckpt.error_feedback_file(tmp, rank))
            written.append(os.path.relpath(ckpt.error_feedback_file(tmp, rank), tmp))
        for rel in written:  # each rank hashes its own files: rank 0 does not re-read them all
            digest, size = integrity.sha256_of(os.path.join(tmp, rel))
            mine[rel.replace(os.sep, "/")] = {"sha256": digest, "bytes": size}
    hashes = failure._gather(group, mine)
    with checkpoint_guard.write_errors(root, tmp, state, group, remove_tmp):
        if rank == 0:
            known = {}
            for h in hashes:
                known.update(h)
            ckpt.commit_directory(root, tmp, final, iteration, known)


# ------------------------------------------------------------------------- load
def read_common(ckpt_dir: str) -> dict:
    path = os.path.join(ckpt_dir, COMMON_FILE)
    if not os.path.isfile(path):
        raise ckpt.CheckpointError(f"{path} is missing; the checkpoint is incomplete")
    return ckpt._verified(integrity.load_verified, ckpt_dir, path)


def _fit_to_saved(state: dict, metadata, ckpt_dir: str) -> dict:
    """Clip the pieces to the saved global shapes where only the vocabulary padding
    differs (it depends on the TP size): rows past the saved ones start at zero.
    Any other shape difference is refused."""
    out = {}
    for fqn, t in state.items():
        md = metadata.state_dict_metadata.get(fqn)
        if not isinstance(md, TensorStorageMetadata):
            raise ckpt.CheckpointError(f"{ckpt_dir} has no tensor {fqn}; it is not a checkpoint "
                                       f"of this model (or was saved without optimizer state: "
                                       f"pass --no-load-optim)")
        saved = tuple(md.size)
        if saved == tuple(t.shape):
            out[fqn] = t
            continue
        diff = [d for d in range(len(saved)) if saved[d] != t.shape[d]]
        if len(saved) != len(t.shape) or len(diff) != 1:
            raise ckpt.CheckpointError(f"cannot load {fqn}: the checkpoint holds shape {saved}, "
                                       f"this model {tuple(t.shape)}")
        d = diff[0]
        pieces = []
        for p in t.pieces:
            keep = min(p.tensor.shape[d], saved[d] - p.offsets[d])
            if keep < p.tensor.shape[d]:
                p.tensor.narrow(d, max(keep, 0), p.tensor.shape[d] - max(keep, 0)).zero_()
            if keep > 0:
                pieces.append(Piece(p.offsets, p.tensor.narrow(d, 0, keep)))
        out[fqn] = ChunkedTensor(saved, t.dtype, pieces)
    return out


def _verify_reads(reader: VerifiedReader, metadata, state: dict):
    """Plan the reads of `state` and check every file they touch against the manifest
    before DCP opens any (a damaged or missing file is then one CheckpointError naming
    it, not an error inside DCP's reader). Returns the plan."""
    planner = _LoadPlanner()
    planner.set_up_planner(state, metadata, True)
    reader.set_up_storage_reader(metadata, True)
    plan = planner.create_local_plan()
    for rel in reader.files_of(plan):
        _verify_once(reader.ckpt_dir, os.path.join(reader.ckpt_dir, rel))
    return plan


_VERIFIED: set[tuple] = set()


def _verify_once(ckpt_dir: str, path: str) -> None:
    """integrity.verify, skipped for a file this process verified already, unchanged
    since (a tool reading one tensor at a time must not hash a rank's file per tensor)."""
    try:
        st = os.stat(path)
        key = (os.path.abspath(path), st.st_size, st.st_mtime_ns)
    except OSError:
        key = None
    if key is not None and key in _VERIFIED and integrity.verification_enabled():
        return
    ckpt._verified(integrity.verify, ckpt_dir, path)
    if key is not None:
        _VERIFIED.add(key)


def load_checkpoint(ckpt_dir: str, sd: dict, saved: dict, *, config, topo, engine,
                    load_optim: bool, check_flags=lambda: None) -> None:
    """Fill this rank's shard buffers from a torch_dist checkpoint of any layout.
    `sd` is its common file, `saved` its configuration. Collective over every rank.
    `check_flags()` compares the checkpoint's settings with the run's (raising a
    CheckpointError); it runs once every file this rank reads is verified, or first
    when the saved tensors do not fit this model (then the setting that differs is
    the error to show, not a tensor's shape)."""
    group = checkpoint_group(topo)
    state = local_state(engine, config, topo, optim=load_optim, for_save=False)
    reader = VerifiedReader(ckpt_dir)
    with failure.agreed(group, catch=(ckpt.CheckpointError,)):
        metadata = reader.read_metadata()
        try:
            state = _fit_to_saved(state, metadata, ckpt_dir)
        except ckpt.CheckpointError:
            check_flags()
            raise
        plan = _verify_reads(reader, metadata, state)
        check_flags()
    # What DCP's reader materialises beyond our buffers: each saved chunk it reads is
    # loaded whole, one at a time, then copied into our views.
    LAST_SHARD_BYTES["load"] = _state_bytes(state)
    largest = max((reader.stored_chunk_bytes(metadata, item) for item in plan.items), default=0)
    HOST_BYTES.add(largest)
    HOST_BYTES.sub(largest)
    if not load_optim:
        for st in engine.optimizer.states:  # fresh optimizer state
            for name, buf in state_io.state_buffers(st).items():
                if name != "param":
                    buf.zero_()
    _run_dcp(dcp.load, state, group, storage_reader=reader, planner=_LoadPlanner())
    state_io.finish_load(engine, int(sd["model_optim"]["step"]) if load_optim else 0)
    engine.state_loaded()


def read_full_tensors(ckpt_dir: str, names: list[str],
                      reader: VerifiedReader | None = None) -> dict[str, torch.Tensor]:
    """{global parameter name: its full fp32 weight} read on one process without any
    process group (tools: generate, HF export, format conversion). A tied output
    layer that the checkpoint holds as the embedding reads the embedding. A caller
    reading tensor after tensor passes one `reader` (VerifiedReader(ckpt_dir)): the
    index is then read once, not once per call."""
    reader = reader or VerifiedReader(ckpt_dir)
    metadata = reader.read_metadata()
    out = {}
    for name in names:
        fqn = _fqn("param", name)
        if fqn not in metadata.state_dict_metadata and name in TIED_SOURCE:
            fqn = _fqn("param", TIED_SOURCE[name])
        if not isinstance(metadata.state_dict_metadata.get(fqn), TensorStorageMetadata):
            raise ckpt.CheckpointError(f"{ckpt_dir} has no parameter {name}; it is not a "
                                       f"checkpoint of this model")
        out[name] = _read_one(reader, fqn)
    return out


def _read_one(reader: VerifiedReader, fqn: str) -> torch.Tensor:
    """One whole tensor of the checkpoint, assembled from its saved chunks."""
    md = reader.read_metadata().state_dict_metadata[fqn]
    full = torch.zeros(tuple(md.size), dtype=md.properties.dtype)
    state = {fqn: ChunkedTensor(tuple(md.size), full.dtype, [Piece((0,) * full.dim(), full)])}
    _verify_reads(reader, reader.read_metadata(), state)
    _run_dcp(dcp.load, state, None, storage_reader=reader, planner=_LoadPlanner())
    return full


def save_full_tensors(tensors: dict[str, torch.Tensor], ckpt_dir: str) -> None:
    """Write {fqn: full tensor} as DCP files in `ckpt_dir` from one process (the format
    converter): each tensor one chunk, loadable by any layout like a training save."""
    writer = dcp.FileSystemWriter(ckpt_dir, single_file_per_rank=True, sync_files=True)
    _run_dcp(dcp.save, tensors, None, storage_writer=writer, planner=_SavePlanner())


def read_saved_state(ckpt_dir: str, keys=("param",),
                     progress=lambda items, total: items) -> dict[str, dict[str, torch.Tensor]]:
    """{global parameter name: {state key: full tensor}} of every parameter (the
    format converter: one process, the whole model in memory). `progress` wraps the
    tensors as they are read (the converter's progress bar)."""
    reader = VerifiedReader(ckpt_dir)
    wanted = []
    for fqn, md in reader.read_metadata().state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            continue
        key, name = ("param", fqn[len("model."):]) if fqn.startswith("model.") else \
            fqn[len("optimizer."):].split(".", 1)
        if key in keys:
            wanted.append((fqn, key, name))
    out: dict[str, dict[str, torch.Tensor]] = {}
    for fqn, key, name in progress(wanted, len(wanted)):
        out.setdefault(name, {})[key] = _read_one(reader, fqn)
    return out
