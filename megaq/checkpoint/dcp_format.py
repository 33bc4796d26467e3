"""--ckpt-format torch_dist: every rank writes only what it owns, through
torch.distributed.checkpoint (DCP), and loads reshard to any layout.

Under ``iter_XXXXXXX/`` (Megatron's layout)::

    .metadata                  DCP's index: every global tensor, its chunks, where each is
    __{rank}_0.distcp          each rank's own chunks (DCP writes one file per rank)
    common.pt                  rank 0: the run's record (megaq.checkpoint.record) with a
                               small "model_optim": the optimizer step

plus the files both formats write (rng/, qgz/, the manifest: megaq.checkpoint); each
rank hashes the files it wrote and rank 0 writes the manifest from theirs. What the
global tensors are and which rank writes which piece: megaq.checkpoint.dcp_chunks.

With --async-save the shards are first copied to (pinned) CPU memory
(megaq.checkpoint.staging), and a background thread does the writing, the hashing and
the commit on a separate gloo process group while training goes on; the next save and
the end of the run wait for it.

Reading: DCP's index is read through megaq.checkpoint.safe_unpickle (never DCP's own
plain unpickling) and checked for what DCP writes; every file a read plan touches is
verified against the manifest before DCP opens it.
"""

from __future__ import annotations

import math
import os
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata,
                                                   Metadata, MetadataIndex, StorageMeta,
                                                   TensorProperties, TensorStorageMetadata)

from megaq.runtime import failure
from megaq.checkpoint import integrity, safe_unpickle, staging
from megaq.checkpoint.atomic import AtomicSave
from megaq.checkpoint.dcp_chunks import ChunkedTensor, Piece, dcp_name, local_state
from megaq.checkpoint.errors import CheckpointError
from megaq.checkpoint.integrity import Verifier
from megaq.checkpoint.paths import COMMON_FILE, common_file, error_feedback_file, rng_file, save_file
from megaq.checkpoint.record import model_file_record
from megaq.checkpoint.reshard import TIED_SOURCE
from megaq.checkpoint.rng import rng_state
from megaq.data import tokenizer_files
from megaq.parallel import comm

NAME = "torch_dist"
RESHARDS_ANY_LAYOUT = True  # each rank reads the pieces it holds, whatever layout wrote them
METADATA_FILE = ".metadata"
# {"save": bytes of the pieces this rank wrote last, "load": bytes it filled last}: its
# shard, what staging.HOST_BYTES is measured against
LAST_SHARD_BYTES: dict[str, int] = {}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


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
            staging.HOST_BYTES.add(_nbytes(data))
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
        raise CheckpointError(f"the checkpoint holds {read_item.storage_index.fqn} as "
                              f"pickled bytes, which megaq never reads")


class VerifiedReader(dcp.FileSystemReader):
    """DCP's file reader over `files` (the checkpoint directory's Verifier), refusing
    files that do not match the manifest, and reading its index (.metadata) through
    megaq.checkpoint.safe_unpickle: DCP's own reader unpickles it with plain pickle,
    which runs whatever the file names. Each file is checked once, before its first
    read; the caller checks the whole plan up front (_verify_reads) so that a damaged
    file is one clear line, not an error inside DCP."""

    def __init__(self, files: Verifier):
        super().__init__(files.root)
        self.ckpt_dir, self.files = files.root, files
        self._metadata = None

    def read_metadata(self, *args, **kwargs):
        """DCP's index, verified, read and checked once per reader: a tool reading
        tensor after tensor reuses it, and DCP's own calls get it from here."""
        if self._metadata is not None:
            return self._metadata
        path = os.path.join(self.ckpt_dir, METADATA_FILE)
        self.files.verify(path)
        try:
            metadata = safe_unpickle.load(path, safe_unpickle.DCP_INDEX)
        except safe_unpickle.UnpicklingRefused as e:
            raise CheckpointError(str(e)) from None
        except Exception as e:  # noqa: BLE001 - a damaged index (unverified load)
            raise CheckpointError(f"{path} cannot be read ({type(e).__name__}: {e}); it is "
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
        raise CheckpointError(f"{path} is not a DCP index ({why}); the file is damaged or "
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
            pg = dist.new_group(list(world.ranks), backend="gloo", timeout=topo.timeout)
        _GROUP[key] = comm.Group(ranks=list(world.ranks), nodes=list(world.nodes), pg=pg,
                                 rank_index=world.rank_index, timing=world.timing)
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
def save(root: str, iteration: int, *, config, topo, engine, lr_schedule, consumed_samples: int,
         extra: dict | None, save_optim: bool) -> str:
    """Collective over every rank. Returns the final directory (with --async-save it
    appears when the background write commits)."""
    group = checkpoint_group(topo)
    atomic = AtomicSave(root, iteration, topo.rank, group)
    atomic.begin()
    sd = engine.sharded_state(optim=save_optim)
    state = local_state(sd, config.model.num_layers, topo, for_save=True)
    LAST_SHARD_BYTES["save"] = _state_bytes(state)
    model_optim = {"format": NAME, "step": sd.step, "optimizer": save_optim}
    common = model_file_record(iteration, consumed_samples, config, topo.layout,
                               lr_schedule.state_dict(), model_optim, extra)
    rng = rng_state()
    residuals = engine.error_feedback_state()
    engine.checkpoint_taken()
    job = dict(atomic=atomic, state=state, common=common, rng=rng, residuals=residuals)
    if not config.checkpointing.async_save:
        _write_and_commit(**job)
        return atomic.final
    buffer = staging.buffer_for(staging.bytes_needed(
        p.tensor for t in state.values() for p in t.pieces), pin=torch.cuda.is_available())
    staged = LAST_SHARD_BYTES["save"]  # the data (the buffer adds under 64 bytes a piece)
    staging.HOST_BYTES.add(staged)
    job["state"] = {name: t.staged(buffer) for name, t in state.items()}
    job["residuals"] = {k: v.detach().to("cpu", copy=True) for k, v in residuals.items()}
    staging.start_background(iteration, _write_and_commit, job, staged)
    return atomic.final


def _state_bytes(state: dict) -> int:
    return sum(_nbytes(p.tensor) for t in state.values() for p in t.pieces)


def _write_and_commit(*, atomic: AtomicSave, state, common, rng, residuals) -> None:
    """Write this rank's files into the save's temporary directory, hash them, and (rank
    0) write the manifest and commit. Collective over the save's group; every phase
    agreed (a failure anywhere removes the directory and raises everywhere)."""
    tmp, rank = atomic.tmp, atomic.rank
    mine: dict[str, dict] = {}
    with atomic.phase(state):
        writer = dcp.FileSystemWriter(tmp, single_file_per_rank=True, sync_files=True)
        planner = _SavePlanner()
        try:
            _run_dcp(dcp.save, state, atomic.group, storage_writer=writer, planner=planner)
        finally:
            staging.HOST_BYTES.sub(planner.copied)
        written = [n for n in os.listdir(tmp) if n.startswith(f"__{rank}_")]
        if rank == 0:
            save_file(common, common_file(tmp))
            written += [COMMON_FILE, METADATA_FILE]
            tokenizer_files.copy_into(tmp, common["config"]["data"])  # hashed by the manifest
        save_file(rng, rng_file(tmp, rank))
        written.append(os.path.relpath(rng_file(tmp, rank), tmp))
        if residuals:
            save_file({"residuals": residuals}, error_feedback_file(tmp, rank))
            written.append(os.path.relpath(error_feedback_file(tmp, rank), tmp))
        for rel in written:  # each rank hashes its own files: rank 0 does not re-read them all
            digest, size = integrity.sha256_of(os.path.join(tmp, rel))
            mine[rel.replace(os.sep, "/")] = {"sha256": digest, "bytes": size}
    hashes = failure._gather(atomic.group, mine)
    known = {}
    for h in hashes:
        known.update(h)
    atomic.commit(state, known)


# ------------------------------------------------------------------------- load
def read_common(ckpt_dir: str, files: Verifier | None = None) -> dict:
    """The record (common.pt), verified (`files`: this load's Verifier; by default one
    that verifies)."""
    path = common_file(ckpt_dir)
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} is missing; the checkpoint is incomplete")
    return (files or Verifier(ckpt_dir)).load(path)


def layout(ckpt_dir: str, files: Verifier) -> tuple[int, int]:
    """(tp, pp) of the checkpoint, as its record says."""
    saved = read_common(ckpt_dir, files)["layout"]
    return saved["tp"], saved["pp"]


def read_settings(ckpt_dir: str, files: Verifier, place) -> tuple[dict, str, int, int]:
    """(the record, verified; its file; the saved TP and PP sizes): the common file,
    whatever the rank's `place`."""
    sd = read_common(ckpt_dir, files)
    return sd, common_file(ckpt_dir), sd["layout"]["tp"], sd["layout"]["pp"]


def read_ahead(ckpt_dir: str, files: Verifier, saved_tp: int, saved_pp: int, same_mp: bool,
               model_chunks) -> None:
    """Nothing: this format verifies the files a rank reads once it planned the reads
    (load)."""
    return None


def _fit_to_saved(state: dict, metadata, ckpt_dir: str) -> dict:
    """Clip the pieces to the saved global shapes where only the vocabulary padding
    differs (it depends on the TP size): rows past the saved ones start at zero.
    Any other shape difference is refused."""
    out = {}
    for fqn, t in state.items():
        md = metadata.state_dict_metadata.get(fqn)
        if not isinstance(md, TensorStorageMetadata):
            raise CheckpointError(f"{ckpt_dir} has no tensor {fqn}; it is not a checkpoint "
                                  f"of this model (or was saved without optimizer state: "
                                  f"pass --no-load-optim)")
        saved = tuple(md.size)
        if saved == tuple(t.shape):
            out[fqn] = t
            continue
        diff = [d for d in range(len(saved)) if saved[d] != t.shape[d]]
        if len(saved) != len(t.shape) or len(diff) != 1:
            raise CheckpointError(f"cannot load {fqn}: the checkpoint holds shape {saved}, "
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
        reader.files.verify(os.path.join(reader.ckpt_dir, rel))
    return plan


def load(ckpt_dir: str, files: Verifier, record: dict, path: str, ahead, *, config, topo,
         engine, model_chunks, same_mp: bool, load_optim: bool, check_flags) -> None:
    """Fill this rank's shard of the engine from the checkpoint, whatever layout wrote it
    (`record`: its common file). Collective over every rank. `check_flags()` compares
    the checkpoint's settings with the run's (raising a CheckpointError); it runs once
    every file this rank reads is verified, or first when the saved tensors do not fit
    this model (then the setting that differs is the error to show, not a tensor's
    shape)."""
    group = checkpoint_group(topo)
    sd = engine.sharded_state(optim=load_optim)  # views: DCP reads into the shard buffers
    state = local_state(sd, config.model.num_layers, topo, for_save=False)
    reader = VerifiedReader(files)
    with failure.agreed(group, catch=(CheckpointError,)):
        metadata = reader.read_metadata()
        try:
            state = _fit_to_saved(state, metadata, ckpt_dir)
        except CheckpointError:
            check_flags()
            raise
        plan = _verify_reads(reader, metadata, state)
        check_flags()
    # What DCP's reader materialises beyond our buffers: each saved chunk it reads is
    # loaded whole, one at a time, then copied into our views.
    LAST_SHARD_BYTES["load"] = _state_bytes(state)
    largest = max((reader.stored_chunk_bytes(metadata, item) for item in plan.items), default=0)
    staging.HOST_BYTES.add(largest)
    staging.HOST_BYTES.sub(largest)
    _run_dcp(dcp.load, state, group, storage_reader=reader, planner=_LoadPlanner())
    sd.step = int(record["model_optim"]["step"]) if load_optim else 0
    engine.load_sharded_state(sd)  # without load_optim: fresh optimizer state


def read_full_tensors(reader: VerifiedReader, names: list[str]) -> dict[str, torch.Tensor]:
    """{global parameter name: its full fp32 weight} read on one process without any
    process group (tools: generate, HF export, format conversion). A tied output
    layer that the checkpoint holds as the embedding reads the embedding. A caller
    reading tensor after tensor passes the same `reader`: the index is then read and
    each file verified once, not once per call."""
    metadata = reader.read_metadata()
    out = {}
    for name in names:
        fqn = dcp_name("param", name)
        if fqn not in metadata.state_dict_metadata and name in TIED_SOURCE:
            fqn = dcp_name("param", TIED_SOURCE[name])
        if not isinstance(metadata.state_dict_metadata.get(fqn), TensorStorageMetadata):
            raise CheckpointError(f"{reader.ckpt_dir} has no parameter {name}; it is not a "
                                  f"checkpoint of this model")
        out[name] = _read_one(reader, fqn)
    return out


def read_whole_weights(ckpt_dir: str, files: Verifier, model) -> dict:
    """{name: full weight} of one process's whole `model` (TP = PP = 1): each weight
    read whole from its pieces."""
    return read_full_tensors(VerifiedReader(files), [name for name, _ in model.named_parameters()])


def _read_one(reader: VerifiedReader, fqn: str) -> torch.Tensor:
    """One whole tensor of the checkpoint, assembled from its saved chunks."""
    md = reader.read_metadata().state_dict_metadata[fqn]
    full = torch.zeros(tuple(md.size), dtype=md.properties.dtype)
    state = {fqn: ChunkedTensor(tuple(md.size), full.dtype, [Piece((0,) * full.dim(), full)])}
    _verify_reads(reader, reader.read_metadata(), state)
    _run_dcp(dcp.load, state, None, storage_reader=reader, planner=_LoadPlanner())
    return full


def save_full_tensors(tensors: dict, ckpt_dir: str) -> None:
    """Write {fqn: full tensor} as DCP files in `ckpt_dir` from one process (the format
    converters): each tensor one chunk, loadable by any layout like a training save; a
    value that is not a tensor is written as DCP's bytes item (a torch.save stream: the
    Megatron export's objects)."""
    writer = dcp.FileSystemWriter(ckpt_dir, single_file_per_rank=True, sync_files=True)
    _run_dcp(dcp.save, tensors, None, storage_writer=writer, planner=_SavePlanner())


def read_saved_state(ckpt_dir: str, keys=("param",),
                     progress=lambda items, total: items) -> dict[str, dict[str, torch.Tensor]]:
    """{global parameter name: {state key: full tensor}} of every parameter, verified (the
    format converter: one process, the whole model in memory). `progress` wraps the
    tensors as they are read (the converter's progress bar)."""
    reader = VerifiedReader(Verifier(ckpt_dir))
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
