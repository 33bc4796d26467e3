"""Checkpoints in Megatron's layout: atomic saves, exact resume, DP resharding.

Layout under --save DIR::

    latest_checkpointed_iteration.txt        the iteration of the newest complete save
    iter_0000100/
      mp_rank_{tp:02d}_{pp:03d}/model_optim.pt   one per TP x PP rank, written by DP rank 0:
                                             the run's configuration (RunConfig.to_dict()),
                                             iteration, consumed samples, LR schedule,
                                             layout, and engine.full_state() (full fp32
                                             master weights + AdamW moments by name, so any
                                             DP size / ZeRO++ setting can load it; without
                                             the moments under --no-save-optim)
      rng/rank_{rank:05d}.pt                 every rank's RNG streams: python, numpy, torch
                                             CPU, CUDA, the TP RNG tracker
      qgz/rank_{rank:05d}.pt                 with --zero-gradient-error-feedback: the rank's
                                             qgZ residuals (restored when layout and qgZ
                                             settings match, else they restart from zero)
      tokenizer/                             a copy of the run's tokenizer files
                                             (megaq.data.tokenizer_files), for exports
      MANIFEST.sha256.json                   SHA-256 of every file above, written last
                                             (megaq.integrity); loads verify every file
                                             they read and refuse a directory without it

Every file holds only tensors and plain containers, and is read through
megaq.safe_unpickle (torch's weights_only unpickler: nothing else is unpickled).

Atomicity: all ranks write into ``.iter_0000100.tmp`` (files fsynced), a barrier
waits for everyone, rank 0 renames the directory into place, then rewrites
``latest_checkpointed_iteration.txt`` through a temporary file + rename, fsyncing
the directory after each rename. A run killed at any point leaves ``latest`` naming
a complete previous checkpoint; stale ``.iter_*.tmp`` directories are removed by the
next save and at the start of a run (megaq.checkpoint_guard). A write error (disk
full) removes the save's own ``.tmp`` and leaves the previous checkpoint ``latest``.
"""

from __future__ import annotations

import dataclasses
import os
import random
import shutil
from types import SimpleNamespace

import numpy as np
import torch

from megaq import checkpoint_guard, failure, integrity
from megaq.config import FLAG_CLASSES, RunConfig
from megaq.data import tokenizer_files
from megaq.flags import dest, flag_fields, to_dict
from megaq.model import GPTConfig, GPTModel
from megaq.parallel.pipeline.split import stage_layer_ranges
from megaq.parallel.tensor_parallel import shard_of, single_rank_group
from megaq.parallel.topology import Layout, Topology
from megaq.zero import ZeroConfig
from megaq.zero.state import OptimizerStateMismatch

TRACKER_FILE = "latest_checkpointed_iteration.txt"
CHECKPOINT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used as asked; the message names the reason and the fix."""


class NonFiniteWeights(CheckpointError):
    """A save refused because the weights hold inf or nan. Every rank raises it together
    (it follows from an all-reduce), so rank 0 prints the one line (megaq.failure)."""

    agreed = True


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def mp_rank_name(tp_rank: int, pp_rank: int) -> str:
    return f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


def model_file(ckpt_dir: str, tp_rank: int, pp_rank: int) -> str:
    return os.path.join(ckpt_dir, mp_rank_name(tp_rank, pp_rank), "model_optim.pt")


def rng_file(ckpt_dir: str, rank: int) -> str:
    return os.path.join(ckpt_dir, "rng", f"rank_{rank:05d}.pt")


def error_feedback_file(ckpt_dir: str, rank: int) -> str:
    return os.path.join(ckpt_dir, "qgz", f"rank_{rank:05d}.pt")


# what the qgZ residuals depend on besides the layout: a change of these restarts them
# (with grad_hadamard the residuals live in the transformed domain)
_EF_SETTINGS = ("grad_bits_intra", "grad_bits_inter", "block_size", "grad_exact_own_rows", "grad_code",
                "grad_hadamard")
# what a checkpoint saved before a setting existed meant by it
_EF_SETTINGS_BEFORE = {"grad_code": "linear", "grad_hadamard": False}


# ------------------------------------------------------------------------ RNG streams
def _tp_tracker():
    try:
        from megaq.parallel.tensor_parallel import get_rng_tracker
    except ImportError:
        return None
    return get_rng_tracker()


def rng_state() -> dict:
    """Every RNG stream of this process, as tensors and plain values."""
    version, internal, gauss = random.getstate()
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state = {
        "python": {"version": version, "internal": torch.tensor(internal, dtype=torch.int64),
                   "gauss": gauss},
        "numpy": {"kind": np_kind, "keys": torch.from_numpy(np_keys.astype(np.int64)),
                  "pos": int(np_pos), "has_gauss": int(np_has_gauss),
                  "cached_gaussian": float(np_gauss)},
        "torch_cpu": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }
    tracker = _tp_tracker()
    state["tp_tracker"] = tracker.get_states() if tracker is not None else {}
    return state


def set_rng_state(state: dict) -> None:
    py = state["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["internal"].tolist()), py["gauss"]))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"],
                         n["has_gauss"], n["cached_gaussian"]))
    torch.set_rng_state(state["torch_cpu"])
    if torch.cuda.is_available() and state["cuda"]:
        torch.cuda.set_rng_state_all(state["cuda"])
    tracker = _tp_tracker()
    if tracker is not None and state["tp_tracker"]:
        tracker.set_states(state["tp_tracker"])


# ---------------------------------------------------------------------- file helpers
def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_file(obj, path: str) -> None:
    """torch.save to `path` (directories made), flushed and fsynced."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def write_tracker(root: str, iteration: int) -> None:
    """Point latest_checkpointed_iteration.txt at `iteration` (temporary file + rename).
    The temporary is created exclusively and never through a link; the rename replaces
    the name itself (a link there is replaced, what it pointed to is untouched)."""
    path = os.path.join(root, TRACKER_FILE)
    tmp = f"{path}.tmp-{os.getpid()}"
    checkpoint_guard.write_file_no_follow(tmp, f"{iteration}\n".encode(), "the tracker's temporary")
    os.replace(tmp, path)
    _fsync_dir(root)


def read_tracker(root: str) -> int | None:
    """The iteration named by latest_checkpointed_iteration.txt, or None if there is none.
    A tracker that is a symbolic link is refused (CheckpointError), never followed."""
    path = os.path.join(root, TRACKER_FILE)
    try:
        text = checkpoint_guard.read_tracker_text(root)
    except checkpoint_guard.LinkRefused as e:
        raise CheckpointError(str(e)) from None
    if text is None:
        return None
    text = text.strip()
    try:
        return int(text)
    except ValueError:
        raise CheckpointError(f"{path} holds {text[:200]!r}, not an iteration number; fix it to "
                              f"name an existing iter_* directory (e.g. 100) or remove it") from None


def not_a_checkpoint_root(path: str) -> str | None:
    """For a --load / --pretrained-checkpoint PATH without a tracker file: the one-line
    reason PATH is something other than a checkpoint root (so that a mistyped path does
    not start a run from scratch unnoticed), or None: an empty or missing directory, or
    anything else Megatron-LM would also start from scratch in."""
    if os.path.isfile(path):
        return (f"{path} is a file; name the checkpoint directory, the one holding "
                f"{TRACKER_FILE}")
    if not os.path.isdir(path) or read_tracker(path) is not None:
        return None
    parent = os.path.dirname(os.path.abspath(path))
    if read_tracker(parent) is not None:
        return (f"{path} is one iteration of the checkpoint {parent}; name the checkpoint "
                f"directory itself (it resumes from the iteration {TRACKER_FILE} names)")
    names = set(os.listdir(path))
    if "config.json" in names and any(n.endswith((".safetensors", ".bin")) for n in names):
        return (f"{path} is a Hugging Face model directory, not a megaq checkpoint; convert it with "
                f"`python tools/convert_checkpoint.py --from hf --to megaq --input {path} --output "
                f"MEGAQ_DIR` and start from it with --finetune --load MEGAQ_DIR")
    if "latest" in names and any(n.startswith("global_step") for n in names):
        return (f"{path} is a DeepSpeed checkpoint, which megaq does not read; save the model in "
                f"Hugging Face form and convert that with tools/convert_checkpoint.py --from hf")
    return None


def _verified(fn, *a):
    """fn(*a) (an integrity check or verified read) with its failure as a CheckpointError."""
    try:
        return fn(*a)
    except integrity.IntegrityError as e:
        raise CheckpointError(str(e)) from None


# ------------------------------------------------------------------------------ save
def save_checkpoint(root: str, iteration: int, *, config: RunConfig, topo, engine, lr_schedule,
                    consumed_samples: int, extra: dict | None = None,
                    save_optim: bool = True) -> str:
    """Collective over every rank. Returns the final directory. Writes the format of
    --ckpt-format: torch_dist in megaq.dist_checkpoint, torch here. save_optim=False
    (--no-save-optim) leaves out the optimizer state and qgZ residuals: weights, RNG
    streams, the LR schedule and the position only (such a checkpoint loads with
    --no-load-optim or --finetune)."""
    from megaq import dist_checkpoint  # it builds on this module's helpers
    wait_for_async_save()  # a background save in flight commits first, whatever happens here
    refuse_non_finite_weights(root, iteration, engine)  # before anything is staged or written
    if config.checkpointing.ckpt_format == "torch_dist":
        return dist_checkpoint.save_checkpoint(
            root, iteration, config=config, topo=topo, engine=engine, lr_schedule=lr_schedule,
            consumed_samples=consumed_samples, extra=extra, save_optim=save_optim)
    full = engine.full_state()  # collective over DP: full fp32 weights + optimizer state
    engine.checkpoint_taken()
    if not save_optim:
        full = weights_only_state(full)
    rank = topo.rank if topo is not None else 0
    final = iteration_dir(root, iteration)
    tmp = os.path.join(root, f".{os.path.basename(final)}.tmp")
    group = topo.world if topo is not None else None
    remove_tmp = lambda: rank == 0 and shutil.rmtree(tmp, ignore_errors=True)  # noqa: E731
    with checkpoint_guard.write_errors(root, tmp, full, group, remove_tmp):
        if rank == 0:
            os.makedirs(root, exist_ok=True)
            checkpoint_guard.remove_stale_temporaries(root)  # left by saves that were killed
            os.makedirs(tmp)

    tp_rank, pp_rank, dp_rank = (topo.tp_rank, topo.pp_rank, topo.dp_rank) if topo else (0, 0, 0)
    layout = topo.layout if topo is not None else Layout(1)
    with checkpoint_guard.write_errors(root, tmp, full, group, remove_tmp):  # every rank's files
        if dp_rank == 0:
            save_file(model_file_record(iteration, consumed_samples, config, layout,
                                        lr_schedule.state_dict(), full, extra),
                      model_file(tmp, tp_rank, pp_rank))
        if rank == 0:  # the tokenizer's files travel with the weights (data.tokenizer_files)
            tokenizer_files.copy_into(tmp, to_dict(config.data))
        save_file(rng_state(), rng_file(tmp, rank))
        residuals = engine.error_feedback_state() if save_optim else None
        if residuals:
            save_file({"residuals": residuals}, error_feedback_file(tmp, rank))

    with checkpoint_guard.write_errors(root, tmp, full, group, remove_tmp):
        if rank == 0:
            commit_directory(root, tmp, final, iteration)
    return final


def refuse_non_finite_weights(root: str, iteration: int, engine) -> None:
    """Collective: raise NonFiniteWeights on every rank when any fp32 master weight of any
    shard is inf or nan, so that `latest` never moves onto weights that cannot train on.
    One all-reduce of one number after a pass over this rank's shard (what the save
    writes, read once more: small next to writing it)."""
    if engine.params_finite():
        return
    latest = checkpoint_guard.latest_iteration(root)
    if latest is not None:
        keep = (f"the previous checkpoint (iteration {latest}) stays latest; resume from it with "
                f"a lower --lr (plus --override-opt_param-scheduler) or a smaller --weight-decay")
    else:
        keep = "no checkpoint was written; start again with a lower --lr or --weight-decay"
    raise NonFiniteWeights(f"refusing to save iteration {iteration} to {root}: the weights hold "
                           f"inf or nan (an update overflowed them); {keep}")


def commit_directory(root: str, tmp: str, final: str, iteration: int,
                     known_hashes: dict | None = None) -> None:
    """Rank 0, once every file of a save is in `tmp`: write the manifest (the last
    file: its presence marks a whole save), fsync, rename `tmp` to `final`, point the
    tracker at `iteration`. `known_hashes`: files their writers hashed already."""
    integrity.write_manifest(tmp, known_hashes)
    for dirpath, _, _ in os.walk(tmp):
        _fsync_dir(dirpath)
    if os.path.exists(final):  # re-saving an iteration (e.g. after a resume): replace it
        old = os.path.join(root, f".{os.path.basename(final)}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    _fsync_dir(root)
    write_tracker(root, iteration)


def wait_for_async_save() -> int | None:
    """Wait for a background save (--async-save) to be written and committed; its
    failure is raised here. Its iteration, or None when none was in flight."""
    from megaq import dist_checkpoint
    return dist_checkpoint.wait_for_async_save()


def async_save_in_flight() -> bool:
    from megaq import dist_checkpoint
    return dist_checkpoint.async_save_in_flight()


def model_file_record(iteration: int, consumed_samples: int, config: RunConfig, layout,
                      lr_scheduler: dict, model_optim: dict, extra: dict | None = None) -> dict:
    """What one mp_rank_*/model_optim.pt holds (also written by converters, e.g.
    megaq.interop, so that `--load` reads their checkpoints like its own)."""
    return {"checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration,
            "consumed_samples": consumed_samples, "config": config.to_dict(),
            "layout": layout_dict(layout), "lr_scheduler": lr_scheduler, "extra": extra or {},
            "model_optim": model_optim}


def layout_dict(layout) -> dict:
    """A Layout as the checkpoint records it."""
    return {"world_size": layout.world_size, "tp": layout.tp, "pp": layout.pp, "dp": layout.dp,
            "ranks_per_node": layout.ranks_per_node, "order": layout.order}


# ------------------------------------------------------------------------------ load
class _SavedFlags(SimpleNamespace):
    def __getattr__(self, name):  # a flag the saving version did not have
        return None


def saved_config(sd: dict) -> dict:
    """The configuration a model_optim.pt file was saved with, as RunConfig.to_dict()
    nests it; files written before RunConfig (a flat "args" dict of flag values) are
    read through the same flag declarations."""
    if "config" in sd:
        return sd["config"]
    args = sd["args"]
    flags = _SavedFlags(**args)
    sections = dict(zip(("model", "parallel", "zero", "training", "optimizer", "data",
                         "checkpointing", "logging"), FLAG_CLASSES))
    out = {}
    for section, cls in sections.items():
        out[section] = {f.name: (f.metadata["value"](flags) if f.metadata["value"]
                                 else getattr(flags, dest(f), None)) for f in flag_fields(cls)}
    out["model"].update(vocab_size=args.get("vocab_size"), seed=args.get("seed", 1234))
    out["model"] = to_dict(GPTConfig.from_dict(out["model"]))
    out["training"]["global_batch_size"] = args.get("global_batch_size")
    bits = args.get("zero_quantized_gradients_bits")
    out["zero"] = {"grad_bits_intra": args.get("zero_quantized_gradients_intra_bits") or bits,
                   "grad_bits_inter": bits,
                   "block_size": args.get("zero_quantization_block_size") or ZeroConfig.block_size,
                   # flat-args files quantized every row (own rows were not exact)
                   "grad_exact_own_rows": False}
    return out


def saved_virtual_pipeline_size(cfg: dict) -> int:
    per_chunk = cfg["parallel"].get("num_layers_per_virtual_pipeline_stage")
    if not per_chunk:
        return 1
    return cfg["model"]["num_layers"] // cfg["parallel"]["pipeline_model_parallel_size"] // per_chunk


def _architecture_name(field_name: str) -> str:
    """How a refusal names a setting: its flag, unless the flag says it the other way
    round (--disable-bias-linear sets add_bias_linear False)."""
    for f in flag_fields(GPTConfig):
        if f.name == field_name and f.metadata["value"] is None:
            return f.metadata["flag"]
    return field_name


def _check_architecture(saved: dict, config: RunConfig, path: str, same_tp: bool) -> None:
    """Refuse a checkpoint whose model differs in shape or meaning, in one line."""
    have = {name: getattr(config.model, name) for name in GPTConfig.ARCHITECTURE}
    want = {name: saved["model"].get(name) for name in GPTConfig.ARCHITECTURE}
    if same_tp:  # the padded vocab depends on the TP size; a TP change re-pads it
        have["padded_vocab_size"] = config.padded_vocab_size
        want["padded_vocab_size"] = GPTConfig.from_dict(saved["model"]).padded_vocab_size(
            saved["parallel"]["tensor_model_parallel_size"])
    diffs = [f"{_architecture_name(name)} {have[name]} (checkpoint: {want[name]})"
             for name in have if want[name] is not None and want[name] != have[name]]
    if diffs:
        raise CheckpointError(f"{path} was saved with a different architecture: "
                              + "; ".join(diffs)
                              + ". Use the checkpoint's values or start without --load")


def _check_layout(saved: dict, topo, path: str) -> None:
    tp, pp = topo.layout.tp, topo.layout.pp
    if saved["tp"] != tp or saved["pp"] != pp:
        raise CheckpointError(
            f"{path} was saved with --tensor-model-parallel-size {saved['tp']} and "
            f"--pipeline-model-parallel-size {saved['pp']}, this run has {tp} and {pp}; "
            f"resume with the checkpoint's TP and PP (the DP size and ZeRO++ switches may change)")


def checkpoint_layout(ckpt_dir: str) -> tuple[int, int]:
    """(tp, pp) of a checkpoint directory: a torch_dist one's common file records it,
    a torch one has its mp_rank_* subdirectories."""
    from megaq import dist_checkpoint
    if dist_checkpoint.is_dist_checkpoint(ckpt_dir):
        layout = dist_checkpoint.read_common(ckpt_dir)["layout"]
        return layout["tp"], layout["pp"]
    names = [n for n in os.listdir(ckpt_dir) if n.startswith("mp_rank_")]
    if not names:
        raise CheckpointError(f"{ckpt_dir} holds no mp_rank_* directories; it is not a megaq "
                              f"checkpoint (or it is incomplete)")
    tps = {int(n.split("_")[2]) for n in names}
    pps = {int(n.split("_")[3]) for n in names}
    return max(tps) + 1, max(pps) + 1


def load_checkpoint(root: str, *, config: RunConfig, topo, engine, lr_schedule, model_chunks=None,
                    load_rng: bool = True, load_optim: bool = True) -> dict | None:
    """Load the newest checkpoint under `root` into engine / schedule / RNG.

    Returns {"iteration", "consumed_samples", "extra"} or None when `root` holds no
    checkpoint yet (a fresh run; lets job scripts always pass --load). load_optim=False
    loads fresh AdamW moments and only the LR schedule's position; lr_schedule=None
    leaves the schedule alone (--finetune). A different DP
    size or ZeRO++ setting loads directly (full states are DP-independent); a different
    TP or PP size is resharded when `model_chunks` (this rank's) are given, else refused.
    """
    iteration = read_tracker(root)
    if iteration is None:
        return None
    ckpt = iteration_dir(root, iteration)
    if not os.path.isdir(ckpt):
        raise CheckpointError(f"{os.path.join(root, TRACKER_FILE)} names iteration {iteration} but "
                              f"{ckpt} does not exist; point it at an existing iter_* directory")
    integrity.verify_checkpoints(not config.checkpointing.no_verify_checkpoint)
    _verified(integrity.require_manifest, ckpt)  # a directory without one is never loaded
    from megaq import dist_checkpoint  # it builds on this module's helpers
    dist = dist_checkpoint.is_dist_checkpoint(ckpt)  # --ckpt-format torch_dist wrote it
    # Integrity first: every file this load reads is verified before anything of the
    # checkpoint is compared with this run's flags, so that a damaged file is reported
    # as damaged, never as a settings mismatch. The settings file (model / common file),
    # this rank's RNG streams and, on a TP / PP reshard, every shard are read here; the
    # DCP index and shard files are verified before check_flags runs (dist_checkpoint),
    # and the qgZ residuals are verified here and read after the weights. Each rank
    # reads its own files: the ranks agree on the outcome before any of them enters a
    # collective of the load (a rank that failed alone would leave the others waiting).
    with failure.agreed(topo.world):
        sd, path, saved_tp, saved_pp, same_mp = _read_settings(ckpt, dist, topo)
        saved = saved_config(sd)
        rng_path, rng = (_read_rng_state(ckpt, sd["layout"], topo) if load_rng and same_mp
                         else (None, None))
        ef_path, ef_reason = (_error_feedback_source(ckpt, sd, saved, config, topo)
                              if load_optim else (None, None))
        if ef_path is not None:
            _verified(integrity.verify, ckpt, ef_path)
        stages = None
        if not dist and not same_mp and model_chunks is not None:
            stages = read_all_stages(ckpt, saved_tp, saved_pp)

    def check_flags():
        """Every comparison of the checkpoint's settings with this run's flags."""
        _check_architecture(saved, config, path, same_tp=same_mp)
        if not dist and not same_mp and model_chunks is None:
            _check_layout({"tp": saved_tp, "pp": saved_pp}, topo, ckpt)
        if load_optim and not has_optimizer_state(sd["model_optim"]):
            raise CheckpointError(f"{ckpt} was saved with --no-save-optim (no optimizer state); "
                                  f"load it with --no-load-optim (fresh optimizer state, same "
                                  f"iteration) or --finetune (weights only, iteration 0)")
        if load_optim:
            _check_optimizer(saved, config, path)

    if dist:
        # every layout reshards: each rank reads the pieces it now holds
        dist_checkpoint.load_checkpoint(ckpt, sd, saved, config=config, topo=topo, engine=engine,
                                        load_optim=load_optim, check_flags=check_flags)
    else:
        check_flags()
        state = sd["model_optim"] if same_mp else reshard_full_state(
            ckpt, sd["layout"], topo, model_chunks, stages=stages)
        if not load_optim:
            state = engine_weights_only(state)
        try:
            engine.load_full_state(state)
        except OptimizerStateMismatch as e:
            raise CheckpointError(f"{path}: {e}; pass --no-load-optim to load the weights only")
    if ef_path is not None:
        engine.load_error_feedback_state(_verified(integrity.load_verified, ckpt,
                                                   ef_path)["residuals"])
    elif ef_reason is not None and topo.rank == 0:
        print(f" note: qgZ error-feedback residuals start from zero: {ef_reason}", flush=True)
    if lr_schedule is not None:  # None: --finetune (the flags' schedule from its start)
        if load_optim:  # settings checked against the flags (megaq.lr_schedule)
            lr_schedule.load_state_dict(sd["lr_scheduler"])
        else:
            lr_schedule.restore_position(sd["lr_scheduler"])

    if load_rng and not same_mp and topo.rank == 0:
        # The TP/PP coordinates changed: no rank's streams map onto ours (the TP tracker's
        # streams are per TP rank); keep the fresh seeding of this run.
        print(f" note: {ckpt} was saved with TP={saved_tp}, PP={saved_pp}; weights and "
              f"optimizer state resharded to TP={topo.layout.tp}, PP={topo.layout.pp}; "
              f"RNG streams start fresh", flush=True)
    if rng is not None:
        try:
            set_rng_state(rng)
        except (RuntimeError, KeyError, TypeError, ValueError, AttributeError) as e:
            raise CheckpointError(f"{rng_path} holds no valid RNG state ({type(e).__name__}: "
                                  f"{e}); restore the file, or pass --no-load-rng") from None
    return {"iteration": int(sd["iteration"]), "consumed_samples": int(sd["consumed_samples"]),
            "extra": sd.get("extra", {}), "path": ckpt,
            "saved_global_batch_size": saved["training"].get("global_batch_size")}


def _read_settings(ckpt: str, dist: bool, topo) -> tuple:
    """(the file holding the saved settings, read and verified; its path; the saved TP
    and PP sizes; whether this run has them): torch_dist's common file, or the torch
    format's model file of this rank (the first one on a new TP / PP layout)."""
    from megaq import dist_checkpoint
    if dist:
        sd = dist_checkpoint.read_common(ckpt)
        saved_tp, saved_pp = sd["layout"]["tp"], sd["layout"]["pp"]
        same_mp = (saved_tp, saved_pp) == (topo.layout.tp, topo.layout.pp)
        return sd, os.path.join(ckpt, dist_checkpoint.COMMON_FILE), saved_tp, saved_pp, same_mp
    saved_tp, saved_pp = checkpoint_layout(ckpt)
    same_mp = (saved_tp, saved_pp) == (topo.layout.tp, topo.layout.pp)
    # The configuration and metadata live in every mp_rank file; read this rank's, or
    # (new TP/PP layout) the first one.
    path = model_file(ckpt, topo.tp_rank, topo.pp_rank) if same_mp else model_file(ckpt, 0, 0)
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} is missing; the checkpoint is incomplete")
    return _verified(integrity.load_verified, ckpt, path), path, saved_tp, saved_pp, same_mp


def _read_rng_state(ckpt: str, saved_layout: dict, topo) -> tuple[str, dict]:
    """(file, RNG streams) this rank resumes with (verified): its own rank's, or when DP
    changed, those of the rank with its TP/PP coordinates and its DP rank folded onto the
    old DP size (dropout streams cannot be split exactly)."""
    if (saved_layout["world_size"] == topo.layout.world_size
            and saved_layout["dp"] == topo.layout.dp):
        src_rank = topo.rank
    else:
        old = saved_layout
        src_rank = topo.tp_rank + old["tp"] * ((topo.dp_rank % old["dp"]) + old["dp"] * topo.pp_rank)
    rpath = rng_file(ckpt, src_rank)
    if not os.path.isfile(rpath):
        raise CheckpointError(f"{rpath} is missing; the checkpoint is incomplete "
                              f"(or pass --no-load-rng)")
    rng = _verified(integrity.load_verified, ckpt, rpath)
    if not isinstance(rng, dict):
        raise CheckpointError(f"{rpath} holds a {type(rng).__name__}, not RNG state; restore the "
                              f"file, or pass --no-load-rng")
    return rpath, rng


def _check_optimizer(saved: dict, config: RunConfig, path: str) -> None:
    """Refuse another optimizer's state in one line (files before --optimizer: AdamW)."""
    saved_opt = (saved.get("optimizer") or {}).get("optimizer") or "adam"
    if saved_opt != config.optimizer.optimizer:
        raise CheckpointError(f"{path} holds --optimizer {saved_opt} state, this run uses "
                              f"--optimizer {config.optimizer.optimizer}; pass --no-load-optim "
                              f"to load the weights only (fresh optimizer state)")


def _error_feedback_source(ckpt: str, sd: dict, saved: dict, config: RunConfig,
                           topo) -> tuple[str | None, str | None]:
    """(file, None) when this rank restores its qgZ error-feedback residuals: this run
    uses them and they still mean the same thing (same layout: each residual is one
    rank's own quantization error; the same qgZ bits and block). Otherwise (None, why
    they restart from zero, as after any weight load), or (None, None) when this run
    keeps none."""
    if not (config.zero.quantized_gradients and config.zero.error_feedback):
        return None, None
    path = error_feedback_file(ckpt, topo.rank)
    if sd["layout"] != layout_dict(topo.layout):
        return None, f"the layout changed ({sd['layout']} -> {layout_dict(topo.layout)})"
    if any(saved["zero"].get(k, _EF_SETTINGS_BEFORE.get(k)) != getattr(config.zero, k)
           for k in _EF_SETTINGS):
        return None, "the qgZ bits, block size, own-rows setting, int4 code or Hadamard setting changed"
    if not os.path.isfile(path):
        return None, "the checkpoint holds none (saved without error feedback, or at DP=1)"
    return path, None


# ------------------------------------------------------------- TP / PP resharding
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


def read_all_stages(ckpt_dir: str, tp: int, pp: int, mmap: bool = False,
                    progress=lambda items, total: items) -> tuple[dict, dict]:
    """(saved configuration, {"step", "params": {global name: [per old TP rank
    {param, exp_avg, exp_avg_sq}]}}).

    mmap=True memory-maps the files instead of reading them: a tensor is read from disk
    only when used (the HF export streams one tensor at a time this way). `progress`
    wraps the shard files as they are read (the converter's progress bar)."""
    entries: dict[str, list] = {}
    cfg = None
    step = 0
    for p, t in progress([(p, t) for p in range(pp) for t in range(tp)], tp * pp):
        path = model_file(ckpt_dir, t, p)
        if not os.path.isfile(path):
            raise CheckpointError(f"{path} is missing; the checkpoint is incomplete")
        sd = _verified(integrity.load_verified, ckpt_dir, path, mmap)
        cfg = cfg or saved_config(sd)
        step = int(sd["model_optim"]["step"])
        ranges = stage_layer_ranges(cfg["model"]["num_layers"], pp,
                                    saved_virtual_pipeline_size(cfg), p)
        for name, entry in sd["model_optim"]["params"].items():
            g = local_to_global_name(name, ranges)
            entries.setdefault(g, [None] * tp)[t] = entry
    return cfg, {"step": step, "params": entries}


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


def reshard_full_state(ckpt_dir: str, saved_layout: dict, topo, model_chunks,
                       stages: tuple | None = None) -> dict:
    """This rank's engine.full_state()-shaped dict from a checkpoint of another TP x PP
    layout: stages stitched by global layer index, TP shards concatenated along each
    parameter's partition dimension and re-split for this rank (weights and every named
    optimizer state alike). Every rank reads every shard file: memory of one full model.
    `stages`: what read_all_stages returned, when the caller read them already."""
    _, saved = stages or read_all_stages(ckpt_dir, saved_layout["tp"], saved_layout["pp"])
    num_layers = sum(c.layer_end - c.layer_start for c in model_chunks) * topo.layout.pp
    ranges = stage_layer_ranges(num_layers, topo.layout.pp, len(model_chunks), topo.pp_rank)
    tp, tp_rank = topo.layout.tp, topo.tp_rank
    params = {}
    for g, (key, p) in global_to_local_names(model_chunks, ranges).items():
        src = g
        if src not in saved["params"] and g == "output_layer.weight":
            src = "embedding.word_embeddings.weight"  # tied head copy of a new last stage
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
                    full = fit_rows(full, dim, p.shape[dim] * tp, g)
                entry[k] = shard_of(full, dim, tp_rank, tp, stride)
            else:
                entry[k] = shards[0]
            if entry[k].shape != p.shape:
                raise CheckpointError(f"cannot reshard {g}: checkpoint gives {tuple(entry[k].shape)}, "
                                      f"this rank holds {tuple(p.shape)}")
        params[key] = entry
    return {"step": saved["step"], "params": params}


def engine_weights_only(state: dict) -> dict:
    """--no-load-optim: keep the weights of a full state; the optimizer starts fresh
    (engine.load_full_state zeros the state of an entry holding only "param"; step 0)."""
    params = {name: {"param": entry["param"]} for name, entry in state["params"].items()}
    return {"step": 0, "params": params}


def weights_only_state(state: dict) -> dict:
    """--no-save-optim: a full state without the AdamW moments (marked "optimizer":
    False, so a load that wants them refuses it, and engine_weights_only fills zeros)."""
    return {"step": 0, "optimizer": False,
            "params": {name: {"param": entry["param"]} for name, entry in state["params"].items()}}


def has_optimizer_state(model_optim: dict) -> bool:
    """False for a model_optim saved by --no-save-optim: the torch format's
    (weights_only_state) and torch_dist's common file mark it "optimizer": False."""
    return model_optim.get("optimizer", True) is not False


# ------------------------------------------------------- one process, whole model
def one_process_topology() -> Topology:
    """TP = PP = DP = 1 without any process group (tools that need no training ranks)."""
    g = single_rank_group()
    return Topology(layout=Layout(1), rank=0, tp=g, dp=g, pp=g, embedding=g, intra=g,
                    inter=g, hpz=g, world=g)


def consolidated_model_config(saved: dict) -> GPTConfig:
    """The model of a saved configuration for one process (TP = PP = 1, fp32, no
    recomputation), its vocabulary padded as the checkpoint's TP size padded it."""
    model = GPTConfig.from_dict(saved["model"])
    tp = saved["parallel"]["tensor_model_parallel_size"]
    return dataclasses.replace(
        model, make_vocab_size_divisible_by=model.make_vocab_size_divisible_by * tp,
        sequence_parallel=False, params_dtype=torch.float32, **GPTConfig.NO_RECOMPUTE)


def load_consolidated_model(ckpt_dir: str) -> tuple[GPTModel, dict]:
    """A checkpoint of any TP x PP x DP layout and either format as one process's whole
    GPTModel (weights only; pipeline stages stitched by global layer index, TP shards
    concatenated), and the configuration it was saved with (saved_config's nesting).
    No process group is needed."""
    from megaq import dist_checkpoint
    if dist_checkpoint.is_dist_checkpoint(ckpt_dir):  # each weight read whole from its pieces
        saved = saved_config(dist_checkpoint.read_common(ckpt_dir))
        model = GPTModel(consolidated_model_config(saved))
        names = [name for name, _ in model.named_parameters()]
        weights = dist_checkpoint.read_full_tensors(ckpt_dir, names)
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(weights[name])
        return model, saved
    tp, pp = checkpoint_layout(ckpt_dir)
    sd = _verified(integrity.load_verified, ckpt_dir, model_file(ckpt_dir, 0, 0))
    saved = saved_config(sd)
    model = GPTModel(consolidated_model_config(saved))
    state = reshard_full_state(ckpt_dir, {"tp": tp, "pp": pp}, one_process_topology(), [model])
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(state["params"][name]["param"])
    return model, saved
