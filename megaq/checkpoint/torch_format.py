"""--ckpt-format torch: Megatron's per-TP x PP-rank files, each holding its rank's full
(DP-gathered) state, so that any DP size or ZeRO++ setting loads it directly.

Under ``iter_XXXXXXX/``::

    mp_rank_{tp:02d}_{pp:03d}/model_optim.pt   one per TP x PP rank, written by DP rank 0:
                                             the run's record (megaq.checkpoint.record)
                                             around engine.full_state() (full fp32
                                             master weights + optimizer state by name;
                                             without the optimizer state under
                                             --no-save-optim)

plus the files both formats write (rng/, qgz/, the manifest: megaq.checkpoint).

A load with this run's TP and PP reads its own rank's file; another TP x PP layout is
resharded (megaq.checkpoint.reshard): every rank reads every shard file, the memory of
one full model.
"""

from __future__ import annotations

import os

from megaq.checkpoint.atomic import AtomicSave
from megaq.checkpoint.errors import CheckpointError
from megaq.checkpoint.integrity import Verifier
from megaq.checkpoint.paths import error_feedback_file, model_file, rng_file, save_file
from megaq.checkpoint.record import model_file_record, saved_config, saved_virtual_pipeline_size
from megaq.checkpoint.reshard import WHOLE_MODEL, Place, local_to_global_name, reshard_full_state
from megaq.checkpoint.rng import rng_state
from megaq.data import tokenizer_files
from megaq.config.flags import to_dict
from megaq.parallel.pipeline.split import stage_layer_ranges
from megaq.zero.state import OptimizerStateMismatch

NAME = "torch"
RESHARDS_ANY_LAYOUT = False  # a TP / PP change needs the model chunks (load's model_chunks)


# ------------------------------------------------------------------------------ save
def save(root: str, iteration: int, *, config, topo, engine, lr_schedule, consumed_samples: int,
         extra: dict | None, save_optim: bool) -> str:
    """Collective over every rank (the full state is gathered over DP). Returns the
    final directory."""
    full = engine.full_state()  # collective over DP: full fp32 weights + optimizer state
    engine.checkpoint_taken()
    if not save_optim:
        full = weights_only_state(full)
    atomic = AtomicSave(root, iteration, topo.rank, topo.world)
    atomic.begin(full)
    with atomic.phase(full):  # every rank's files
        if topo.dp_rank == 0:
            save_file(model_file_record(iteration, consumed_samples, config, topo.layout,
                                        lr_schedule.state_dict(), full, extra),
                      model_file(atomic.tmp, topo.tp_rank, topo.pp_rank))
        if topo.rank == 0:  # the tokenizer's files travel with the weights (data.tokenizer_files)
            tokenizer_files.copy_into(atomic.tmp, to_dict(config.data))
        save_file(rng_state(), rng_file(atomic.tmp, topo.rank))
        residuals = engine.error_feedback_state() if save_optim else None
        if residuals:
            save_file({"residuals": residuals}, error_feedback_file(atomic.tmp, topo.rank))
    atomic.commit(full)
    return atomic.final


def weights_only_state(state: dict) -> dict:
    """--no-save-optim: a full state without the optimizer state (marked "optimizer":
    False, so a load that wants it refuses it, and engine_weights_only fills zeros)."""
    return {"step": 0, "optimizer": False,
            "params": {name: {"param": entry["param"]} for name, entry in state["params"].items()}}


# ------------------------------------------------------------------------------ load
def layout(ckpt_dir: str, files: Verifier) -> tuple[int, int]:
    """(tp, pp) of the checkpoint: its mp_rank_* subdirectories."""
    names = [n for n in os.listdir(ckpt_dir) if n.startswith("mp_rank_")]
    if not names:
        raise CheckpointError(f"{ckpt_dir} holds no mp_rank_* directories; it is not a megaq "
                              f"checkpoint (or it is incomplete)")
    tps = {int(n.split("_")[2]) for n in names}
    pps = {int(n.split("_")[3]) for n in names}
    return max(tps) + 1, max(pps) + 1


def read_settings(ckpt_dir: str, files: Verifier, place: Place) -> tuple[dict, str, int, int]:
    """(the record, verified; its file; the saved TP and PP sizes) for a rank at
    `place`: every model file carries the record, so its own, or on a new TP / PP
    layout the first one."""
    tp, pp = layout(ckpt_dir, files)
    same_mp = (tp, pp) == (place.tp, place.pp)
    sd, path = read_record(ckpt_dir, files, *((place.tp_rank, place.pp_rank) if same_mp else (0, 0)))
    return sd, path, tp, pp


def read_record(ckpt_dir: str, files: Verifier, tp_rank: int, pp_rank: int,
                mmap: bool = False) -> tuple[dict, str]:
    """(the record, verified, and its file): the model file of TP rank `tp_rank` and
    stage `pp_rank` (every model file carries the record, around that rank's state)."""
    path = model_file(ckpt_dir, tp_rank, pp_rank)
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} is missing; the checkpoint is incomplete")
    return files.load(path, mmap), path


def read_all_stages(ckpt_dir: str, tp: int, pp: int, *, files: Verifier | None = None,
                    mmap: bool = False, progress=lambda items, total: items) -> tuple[dict, dict]:
    """(saved configuration, {"step", "params": {global name: [per old TP rank
    {param, <optimizer state>...}]}}), every file verified (`files`: this load's
    Verifier; by default one that verifies).

    mmap=True memory-maps the files instead of reading them: a tensor is read from disk
    only when used (the HF export streams one tensor at a time this way). `progress`
    wraps the shard files as they are read (the converter's progress bar)."""
    files = files or Verifier(ckpt_dir)
    entries: dict[str, list] = {}
    cfg = None
    step = 0
    for p, t in progress([(p, t) for p in range(pp) for t in range(tp)], tp * pp):
        sd, _ = read_record(ckpt_dir, files, t, p, mmap)
        cfg = cfg or saved_config(sd)
        step = int(sd["model_optim"]["step"])
        ranges = stage_layer_ranges(cfg["model"]["num_layers"], pp,
                                    saved_virtual_pipeline_size(cfg), p)
        for name, entry in sd["model_optim"]["params"].items():
            g = local_to_global_name(name, ranges)
            entries.setdefault(g, [None] * tp)[t] = entry
    return cfg, {"step": step, "params": entries}


def read_ahead(ckpt_dir: str, files: Verifier, saved_tp: int, saved_pp: int, same_mp: bool,
               model_chunks) -> tuple | None:
    """What the load reads before the flags are compared (so that a damaged shard is
    reported as damaged): every shard file, when this rank reshards."""
    if same_mp or model_chunks is None:
        return None
    return read_all_stages(ckpt_dir, saved_tp, saved_pp, files=files)


def load(ckpt_dir: str, files: Verifier, record: dict, path: str, ahead, *, config, topo, engine,
         model_chunks, same_mp: bool, load_optim: bool, check_flags) -> None:
    """This rank's engine state from its own model file (`record`, read from `path`) or,
    on a new TP / PP layout, resharded from every stage's (`ahead`: read_ahead's)."""
    check_flags()
    state = record["model_optim"] if same_mp else reshard_full_state(
        ahead[1], model_chunks, Place.of(topo), ckpt_dir)
    if not load_optim:
        state = engine_weights_only(state)
    try:
        engine.load_full_state(state)
    except OptimizerStateMismatch as e:
        raise CheckpointError(f"{path}: {e}; pass --no-load-optim to load the weights only")


def engine_weights_only(state: dict) -> dict:
    """--no-load-optim: keep the weights of a full state; the optimizer starts fresh
    (engine.load_full_state zeros the state of an entry holding only "param"; step 0)."""
    params = {name: {"param": entry["param"]} for name, entry in state["params"].items()}
    return {"step": 0, "params": params}


def read_whole_weights(ckpt_dir: str, files: Verifier, model) -> dict:
    """{name: full weight} of one process's whole `model` (TP = PP = 1) from every TP
    and PP rank's file."""
    tp, pp = layout(ckpt_dir, files)
    _, stages = read_all_stages(ckpt_dir, tp, pp, files=files)
    state = reshard_full_state(stages, [model], WHOLE_MODEL, ckpt_dir)
    return {name: entry["param"] for name, entry in state["params"].items()}
