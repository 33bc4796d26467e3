"""What every conversion into or out of megaq shares: the model's parameter layout
(names and TP splits under a TP x PP x VP layout), a streaming reader of a megaq
checkpoint, the writer of an iteration-0 megaq checkpoint, the flags that describe
one, and output directories written under a temporary name and renamed at the end.

Format-specific code (names, tensor layouts, configs) lives beside it: hf.py for
Hugging Face transformers.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import shutil
import stat
import sys
from typing import Callable

import torch

from megaq import export_files
from megaq.checkpoint import dcp_format, guard, integrity, torch_format
from megaq.checkpoint.consolidate import consolidated_model_config
from megaq.checkpoint.errors import CheckpointError
from megaq.checkpoint.formats import checkpoint_layout
from megaq.checkpoint.paths import (TRACKER_FILE, is_dist_checkpoint, iteration_dir, model_file,
                                    read_tracker, save_file, write_tracker)
from megaq.checkpoint.record import model_file_record, saved_config, saved_virtual_pipeline_size
from megaq.checkpoint.reshard import concat_tp_shards, global_to_local_names
from megaq.interop.errors import InteropError


def read_foreign(path: str, fmt, error_class=InteropError, data: bytes | None = None):
    """Another framework's pickled file (or `data`, a chunk of one) through
    megaq.checkpoint.safe_unpickle's allow-list `fmt`: a refused class or a damaged file is
    one `error_class` line (the importer's own error, which the converter prints)."""
    from megaq.checkpoint import safe_unpickle
    try:
        if data is None:
            return safe_unpickle.load(path, fmt)
        return safe_unpickle.load_bytes(data, path, fmt)
    except safe_unpickle.UnpicklingRefused as e:
        raise error_class(str(e)) from None
    except Exception as e:  # noqa: BLE001 - a damaged or foreign file
        raise error_class(f"{path} cannot be read ({type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''}); the checkpoint is "
                          "damaged or incomplete") from None


def target_layout(a, error_class=InteropError) -> tuple[int, int, int]:
    """(TP, PP, VP) a converter writes, from its layout flags (absent: 1); below 1 is one
    `error_class` line."""
    tp = getattr(a, "tensor_model_parallel_size", 1) or 1
    pp = getattr(a, "pipeline_model_parallel_size", 1) or 1
    vp = getattr(a, "virtual_pipeline_size", 1) or 1
    if min(tp, pp, vp) < 1:
        raise error_class(f"--tensor-model-parallel-size {tp}, --pipeline-model-parallel-size "
                          f"{pp} and --virtual-pipeline-size {vp} must be at least 1")
    return tp, pp, vp


def progress(items, desc: str, total: int | None = None, unit: str = "tensor"):
    """`items`, with a progress bar on stderr while they are consumed (tqdm; none when
    stderr is not a terminal, so logs and captured output stay clean)."""
    return _bar_class()(items, desc=desc, total=total, unit=unit, file=sys.stderr,
                        disable=None, leave=False, dynamic_ncols=True)


@functools.cache
def _bar_class():
    """tqdm without its monitor thread. Every tqdm bar, even a disabled one, starts that
    thread, which wakes every 10 s and takes tqdm's lock; a process forked while it holds
    the lock (a test's ranks, forked after the parent converted a checkpoint) gets the
    lock held by a thread it does not have, and its first bar waits forever. The
    monitor only shortens the refresh of a stalled bar."""
    from tqdm import tqdm

    class Bar(tqdm):
        monitor_interval = 0
    return Bar



# ------------------------------------------------- the megaq model's parameter layout
@dataclasses.dataclass
class ParamInfo:
    name: str        # global megaq name (independent of the layout)
    key: str         # the name in the stage's checkpoint (chunk prefix, local layer index)
    stage: int       # pipeline stage holding it
    dim: int         # TP partition dimension, -1 if replicated
    stride: int      # TP partition stride (2 for the SwiGLU fc1)


def _fake_tp_group(rank: int, size: int):
    from megaq.parallel.comm import Group
    # only shapes and slicing are needed: no collective runs while building a model
    return Group(ranks=list(range(size)), nodes=[0] * size, pg=None, rank_index=rank)


def megaq_layout(config, tp: int, pp: int, vp: int = 1) -> list[ParamInfo]:
    """Every parameter of the model under a TP x PP (x VP) layout, in model order.

    Read off a tiny twin of the model (same structure, sizes of a few elements), so
    the names and TP split attributes are the ones the model itself declares."""
    from megaq.model import GPTModel
    from megaq.parallel.pipeline.split import stage_layer_ranges
    twin = dataclasses.replace(  # a plain model (megaq.parallelize is not applied to it)
        config, hidden_size=2, num_attention_heads=tp, num_query_groups=tp, kv_channels=2,
        ffn_hidden_size=2 * tp, vocab_size=tp, make_vocab_size_divisible_by=1, seq_length=tp,
        max_position_embeddings=tp, sequence_parallel=False, params_dtype=torch.float32)
    out = []
    for stage in range(pp):
        ranges = stage_layer_ranges(config.num_layers, pp, vp, stage)
        chunks = [GPTModel(twin, _fake_tp_group(0, tp), pre_process=stage == 0 and v == 0,
                           post_process=stage == pp - 1 and v == vp - 1,
                           layer_start=start, layer_end=end)
                  for v, (start, end) in enumerate(ranges)]
        for name, (key, p) in global_to_local_names(chunks, ranges).items():
            parallel = getattr(p, "tensor_model_parallel", False)
            out.append(ParamInfo(name, key, stage, p.partition_dim if parallel else -1,
                                 p.partition_stride if parallel else 1))
    return out


# ------------------------------------------------------------ reading a checkpoint
def resolve_checkpoint_dir(path: str) -> str:
    """A checkpoint root (latest_checkpointed_iteration.txt) or an iter_* directory."""
    if os.path.basename(os.path.normpath(path)).startswith("iter_"):
        if not os.path.isdir(path):
            raise InteropError(f"{path} does not exist; pass a checkpoint directory")
        return path
    if not os.path.isdir(path):
        raise InteropError(f"{path} does not exist; pass a checkpoint directory written by "
                           f"pretrain_gpt.py --save")
    it = read_tracker(path)
    if it is None:
        raise InteropError(f"{path} holds no {TRACKER_FILE}; pass a checkpoint directory "
                           f"written by pretrain_gpt.py --save (or one of its iter_* directories)")
    return iteration_dir(path, it)


class MegaqCheckpointReader:
    """One process's view of a whole megaq checkpoint: memory-mapped shard files, and
    `full(info)` builds one full parameter from its TP shards (reshard.concat_tp_shards).
    `config` is the configuration it was saved with (record.saved_config's nesting)
    and `model` its model on one process (consolidate.consolidated_model_config: fp32,
    the vocabulary padded as the checkpoint's TP size padded it). Every file is
    verified against the checkpoint's manifest."""

    def __init__(self, path: str):
        self.dir = resolve_checkpoint_dir(path)
        files = integrity.Verifier(self.dir)
        self.tp, self.pp = checkpoint_layout(self.dir, files)
        self.dist = is_dist_checkpoint(self.dir)
        if self.dist:  # --ckpt-format torch_dist: full tensors are read one at a time,
            # through one reader, which reads (and checks) the DCP index once
            self.config = saved_config(dcp_format.read_common(self.dir, files))
            self.params = None
            self._index = dcp_format.VerifiedReader(files)
        else:
            self.config, saved = torch_format.read_all_stages(self.dir, self.tp, self.pp,
                                                              files=files, mmap=True)
            self.params = saved["params"]
        self.vp = saved_virtual_pipeline_size(self.config)
        self.model = consolidated_model_config(self.config)

    def full(self, info: ParamInfo) -> torch.Tensor:
        if self.dist:
            try:
                return dcp_format.read_full_tensors(self._index, [info.name])[info.name]
            except CheckpointError as e:
                raise InteropError(str(e)) from None
        if info.name not in self.params:
            raise InteropError(f"{self.dir} has no parameter {info.name}; it is incomplete or "
                               f"not a checkpoint of the model its configuration describes")
        parts = [entry["param"] for entry in self.params[info.name]]
        if info.dim < 0 or self.tp == 1:
            return parts[0]
        return concat_tp_shards(parts, info.dim, info.stride, name=info.name)



# ------------------------------------------------------------ writing a checkpoint
def megaq_layout_flags(tp: int, pp: int, vp: int, num_layers: int) -> list[str]:
    flags = ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]
    if vp > 1:
        flags += ["--num-layers-per-virtual-pipeline-stage", str(num_layers // (pp * vp))]
    return flags



def megaq_run_config(flags: list[str], tp: int, pp: int):
    """The RunConfig pretrain_gpt.py builds from `flags` (architecture, layout and
    --vocab-size; the training and data flags are placeholders) on TP x PP ranks, its
    vocabulary resolved as the data setup resolves it: what an imported checkpoint
    stores, so that a run given the same flags `--load`s it like one of its own.
    A model that does not fit the layout is an InteropError."""
    from megaq.config.arguments import ArgumentsError, parse_config
    placeholders = ["--micro-batch-size", "1", "--global-batch-size", str(pp), "--train-iters", "1",
                    "--lr", "0", "--mock-data"]
    try:
        config = parse_config(placeholders + flags, world_size=tp * pp)  # the flags win
    except ArgumentsError as e:
        raise InteropError(f"the model does not fit TP={tp} x PP={pp}: {e}") from None
    if config.data.vocab_size is None:
        raise InteropError("the flags of an imported model must give --vocab-size")
    return config.resolved(config.data, config.data.vocab_size)


@dataclasses.dataclass
class ImportedTraining:
    """A run's position and optimizer state carried into a converted checkpoint:
    `moments(info)` gives the full (exp_avg, exp_avg_sq) of a parameter (fp32, padded
    like its weight), `step` the optimizer's step count, `lr_scheduler` a
    megaq.lr_schedule.LRSchedule.state_dict()."""
    iteration: int
    consumed_samples: int
    step: int
    lr_scheduler: dict
    moments: Callable[[ParamInfo], tuple[torch.Tensor, torch.Tensor]]


def write_megaq_checkpoint(root: str, config, layout: list[ParamInfo],
                           full_tensor: Callable[[ParamInfo], torch.Tensor],
                           extra: dict | None = None,
                           training: ImportedTraining | None = None) -> None:
    """A megaq checkpoint under `root` (a temporary directory the caller renames) for
    `config` (a RunConfig, megaq_run_config's): `full_tensor(info)` gives each full
    parameter (fp32, padded vocabulary), split here for every TP rank and written stage
    by stage (memory: one stage). Each file holds what save_checkpoint writes
    (checkpoint.model_file_record). Without `training`: iteration 0, zero AdamW moments
    and step 0, so `--load` starts a fresh optimizer; with it, its iteration, moments,
    step and LR schedule, so `--load` continues the run."""
    from megaq.parallel.tensor_parallel import shard_of
    tp, pp = config.parallel.tp, config.parallel.pp
    # the position only: an imported model has no LR schedule of its own, so the run
    # that loads it keeps its flags' (megaq.lr_schedule.LRSchedule.load_state_dict)
    lr_scheduler = training.lr_scheduler if training else {"num_steps": 0, "num_samples": 0}
    iteration = training.iteration if training else 0
    zero = torch.zeros(1)
    bar = progress(layout, "writing the megaq checkpoint")
    for stage in range(pp):
        shards = [{} for _ in range(tp)]
        for info in (i for i in layout if i.stage == stage):
            full = full_tensor(info).float()
            moments = [m.float() for m in training.moments(info)] if training else None
            split = (lambda t, r: t) if info.dim < 0 else (  # noqa: E731
                lambda t, r: shard_of(t, info.dim, r, tp, info.stride))
            for r in range(tp):
                part = split(full, r)
                # clone: a view would make torch.save write the whole full tensor
                if moments:
                    m, v = (split(t, r).clone() for t in moments)
                else:  # zero moments: one element expanded to the shape (takes no disk space)
                    m = v = zero.expand_as(part)
                shards[r][info.key] = {"param": part.clone(), "exp_avg": m, "exp_avg_sq": v}
            bar.update()
        for r in range(tp):
            record = model_file_record(iteration, training.consumed_samples if training else 0,
                                       config, config.parallel.layout, lr_scheduler,
                                       {"step": training.step if training else 0,
                                        "params": shards[r]}, extra)
            save_file(record, model_file(iteration_dir(root, iteration), r, stage))
        del shards
    bar.close()
    integrity.write_manifest(iteration_dir(root, iteration))  # as a save: loads verify it
    write_tracker(root, iteration)


def write_megaq_args(root: str, out_dir: str, flags: list[str], info: dict) -> None:
    """megaq_args.txt (the flags, one line to paste) and megaq_args.json beside a checkpoint."""
    with open(os.path.join(root, "megaq_args.txt"), "w") as f:
        f.write(" ".join(flags) + "\n")
    write_json(os.path.join(root, "megaq_args.json"),
               {"flags": flags, **info,
                "load_flags": ["--load", os.path.abspath(out_dir), "--no-load-rng"]})


# ------------------------------------------------------------ output directories
def write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")


def check_output(out_dir: str, overwrite: bool, source: str, writes: str) -> None:
    """Refuse an --output that cannot take the conversion of `source` (the --input):
    `writes` is what the conversion writes there, "hf" (an export) or "megaq" (a
    checkpoint); --overwrite replaces only an earlier one of those."""
    out, src = os.path.realpath(out_dir), os.path.realpath(source)
    # the output directory is replaced as a whole (replace_dir): one that is the input,
    # holds it or lies inside it would delete the input (and anything else there)
    if os.path.commonpath([out, src]) in (out, src):
        raise InteropError(f"--output {out_dir} overlaps --input {source} (the same directory, or "
                           f"one inside the other) and the output directory is replaced as a "
                           f"whole; choose an --output outside --input")
    # a file is not replaced by a directory, even with --overwrite
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise InteropError(f"--output {out_dir} is a file, not a directory; pass a directory path")
    if not os.path.exists(out_dir) or not os.listdir(out_dir):
        return
    if not overwrite:
        raise InteropError(f"{out_dir} already exists; pass a new directory (or --overwrite "
                           f"to replace it)")
    what, earlier = {"hf": ("Hugging Face export", export_files.is_export),
                     "megaq": ("megaq checkpoint", is_written_checkpoint_root)}[writes]
    if not earlier(out_dir):
        raise InteropError(f"--output {out_dir} is not an earlier {what} written by megaq (it "
                           f"holds other files), and --overwrite replaces only that; choose a "
                           f"new --output (nothing was changed)")


# what a megaq checkpoint root holds besides its iter_* directories: the tracker, what
# the converters write beside it, the job lock, and a killed save's or tracker's leftovers
_ROOT_FILES = (TRACKER_FILE, "megaq_args.txt", "megaq_args.json",
               export_files.TOKENIZER_MODEL, guard.LOCK_NAME)
_ROOT_LEFTOVER = re.compile(r"(\.iter_\d{7}\.(tmp|old)|"
                            + re.escape(TRACKER_FILE) + r"\.tmp-\d+)")


def is_written_checkpoint_root(path: str) -> bool:
    """True when `path` is a megaq checkpoint root (a --save directory or a converter's
    output) and holds nothing else: its tracker file, iter_XXXXXXX directories, and only
    the other files megaq writes there."""
    try:
        entries = list(os.scandir(path))
    except OSError:
        return False
    for e in entries:
        mode = e.stat(follow_symlinks=False).st_mode  # a symlink is never megaq's
        if re.fullmatch(r"iter_\d{7}", e.name):
            ok = stat.S_ISDIR(mode)
        elif _ROOT_LEFTOVER.fullmatch(e.name):
            ok = stat.S_ISDIR(mode) or stat.S_ISREG(mode)
        else:
            ok = e.name in _ROOT_FILES and stat.S_ISREG(mode)
        if not ok:
            return False
    return any(e.name == TRACKER_FILE for e in entries)


def temp_dir_for(out_dir: str) -> str:
    """A new empty directory beside `out_dir`, which replace_dir renames into place."""
    parent = os.path.dirname(os.path.abspath(out_dir))
    tmp = os.path.join(parent, f".{os.path.basename(os.path.abspath(out_dir))}.tmp-{os.getpid()}")
    # a file where a parent directory should be: say which (makedirs' errno names neither)
    existing = parent
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise InteropError(f"cannot write --output {out_dir}: {existing} is a file, not a "
                           f"directory; choose an --output under a directory")
    try:
        os.makedirs(parent, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    except OSError as e:  # no permission, a read-only file system, no space
        raise InteropError(f"cannot write --output {out_dir}: {e.strerror or e} "
                           f"({e.filename or parent}); choose an --output in a directory you can "
                           f"write") from None
    return tmp


def replace_dir(tmp: str, out_dir: str) -> None:
    if os.path.exists(out_dir):
        old = f"{tmp}.old"
        os.rename(out_dir, old)
        os.rename(tmp, out_dir)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, out_dir)
