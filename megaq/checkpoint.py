"""Checkpoints in Megatron's layout: atomic saves, exact resume, DP resharding.

Layout under --save DIR::

    latest_checkpointed_iteration.txt        the iteration of the newest complete save
    iter_0000100/
      mp_rank_{tp:02d}_{pp:03d}/model_optim.pt   one per TP x PP rank, written by DP rank 0:
                                             args, iteration, consumed samples, LR schedule,
                                             layout, and engine.full_state() (full fp32
                                             master weights + AdamW moments by name, so any
                                             DP size / ZeRO++ setting can load it)
      rng/rank_{rank:05d}.pt                 every rank's RNG streams: python, numpy, torch
                                             CPU, CUDA, the TP RNG tracker

Every file holds only tensors and plain containers, and is read with
``torch.load(weights_only=True)``.

Atomicity: all ranks write into ``.iter_0000100.tmp`` (files fsynced), a barrier
waits for everyone, rank 0 renames the directory into place, then rewrites
``latest_checkpointed_iteration.txt`` through a temporary file + rename, fsyncing
the directory after each rename. A run killed at any point leaves ``latest`` naming
a complete previous checkpoint; a stale ``.tmp`` directory is removed by the next save.
"""

from __future__ import annotations

import os
import random
import shutil

import numpy as np
import torch

from megaq.arguments import ARCHITECTURE_ARGS, args_to_dict
from megaq.parallel import comm
from megaq.parallel.topology import Layout

TRACKER_FILE = "latest_checkpointed_iteration.txt"
CHECKPOINT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used as asked; the message names the reason and the fix."""


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def mp_rank_name(tp_rank: int, pp_rank: int) -> str:
    return f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


def model_file(ckpt_dir: str, tp_rank: int, pp_rank: int) -> str:
    return os.path.join(ckpt_dir, mp_rank_name(tp_rank, pp_rank), "model_optim.pt")


def rng_file(ckpt_dir: str, rank: int) -> str:
    return os.path.join(ckpt_dir, "rng", f"rank_{rank:05d}.pt")


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


def _save_file(obj, path: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _write_tracker(root: str, iteration: int) -> None:
    path = os.path.join(root, TRACKER_FILE)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(f"{iteration}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(root)


def read_tracker(root: str) -> int | None:
    """The iteration named by latest_checkpointed_iteration.txt, or None if there is none."""
    path = os.path.join(root, TRACKER_FILE)
    if not os.path.isfile(path):
        return None
    text = open(path).read().strip()
    try:
        return int(text)
    except ValueError:
        raise CheckpointError(f"{path} holds {text!r}, not an iteration number; fix it to name an "
                              f"existing iter_* directory (e.g. 100) or remove it") from None


def _barrier(topo) -> None:
    if topo is not None:
        comm.barrier(topo.world)


# ------------------------------------------------------------------------------ save
def save_checkpoint(root: str, iteration: int, *, args, topo, engine, lr_schedule,
                    consumed_samples: int, extra: dict | None = None, fault=None) -> str:
    """Collective over every rank. Returns the final directory.

    `fault(stage)` (tests only) is called at "files_written" / "before_rename" /
    "before_tracker"; it may raise or kill the process to simulate a crash there.
    """
    full = engine.full_state()  # collective over DP: full fp32 weights + moments
    rank = topo.rank if topo is not None else 0
    final = iteration_dir(root, iteration)
    tmp = os.path.join(root, f".{os.path.basename(final)}.tmp")
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left by a save that was killed
        os.makedirs(tmp)
    _barrier(topo)

    tp_rank, pp_rank, dp_rank = (topo.tp_rank, topo.pp_rank, topo.dp_rank) if topo else (0, 0, 0)
    layout = topo.layout if topo is not None else Layout(1)
    if dp_rank == 0:
        _save_file({
            "checkpoint_version": CHECKPOINT_VERSION,
            "iteration": iteration,
            "consumed_samples": consumed_samples,
            "args": args_to_dict(args),
            "layout": {"world_size": layout.world_size, "tp": layout.tp, "pp": layout.pp,
                       "dp": layout.dp},
            "lr_scheduler": lr_schedule.state_dict(),
            "extra": extra or {},
            "model_optim": full,
        }, model_file(tmp, tp_rank, pp_rank))
    _save_file(rng_state(), rng_file(tmp, rank))
    if fault is not None:
        fault("files_written")
    _barrier(topo)  # every rank's files are on disk

    if rank == 0:
        for dirpath, _, _ in os.walk(tmp):
            _fsync_dir(dirpath)
        if fault is not None:
            fault("before_rename")
        if os.path.exists(final):  # re-saving an iteration (e.g. after a resume): replace it
            old = os.path.join(root, f".{os.path.basename(final)}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
        _fsync_dir(root)
        if fault is not None:
            fault("before_tracker")
        _write_tracker(root, iteration)
    _barrier(topo)
    return final


# ------------------------------------------------------------------------------ load
def _check_architecture(saved: dict, args, path: str) -> None:
    diffs = []
    for name in ARCHITECTURE_ARGS:
        if name in saved and hasattr(args, name) and saved[name] != getattr(args, name):
            diffs.append(f"--{name.replace('_', '-')} {getattr(args, name)} (checkpoint: {saved[name]})")
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
    """(tp, pp) of a checkpoint directory, from its mp_rank_* subdirectories."""
    names = [n for n in os.listdir(ckpt_dir) if n.startswith("mp_rank_")]
    if not names:
        raise CheckpointError(f"{ckpt_dir} holds no mp_rank_* directories; it is not a megaq "
                              f"checkpoint (or it is incomplete)")
    tps = {int(n.split("_")[2]) for n in names}
    pps = {int(n.split("_")[3]) for n in names}
    return max(tps) + 1, max(pps) + 1


def load_checkpoint(root: str, *, args, topo, engine, lr_schedule,
                    load_rng: bool = True, load_optim: bool = True) -> dict | None:
    """Load the newest checkpoint under `root` into engine / schedule / RNG.

    Returns {"iteration", "consumed_samples", "extra"} or None when `root` holds no
    checkpoint yet (a fresh run; lets job scripts always pass --load).
    """
    iteration = read_tracker(root)
    if iteration is None:
        return None
    ckpt = iteration_dir(root, iteration)
    if not os.path.isdir(ckpt):
        raise CheckpointError(f"{os.path.join(root, TRACKER_FILE)} names iteration {iteration} but "
                              f"{ckpt} does not exist; point it at an existing iter_* directory")
    path = model_file(ckpt, topo.tp_rank, topo.pp_rank)
    if not os.path.isfile(path):
        tp, pp = checkpoint_layout(ckpt)
        _check_layout({"tp": tp, "pp": pp}, topo, ckpt)
        raise CheckpointError(f"{path} is missing; the checkpoint is incomplete")
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - corrupted file / foreign pickle
        raise CheckpointError(f"{path} cannot be read safely ({type(e).__name__}: "
                              f"{str(e).splitlines()[0]}); it is damaged or not a megaq checkpoint")
    _check_architecture(sd["args"], args, path)
    _check_layout(sd["layout"], topo, ckpt)

    state = sd["model_optim"]
    if not load_optim:
        state = engine_weights_only(state)
    engine.load_full_state(state)
    lr_schedule.load_state_dict(sd["lr_scheduler"])

    if load_rng:
        saved_layout = sd["layout"]
        same = (saved_layout["world_size"] == topo.layout.world_size
                and saved_layout["dp"] == topo.layout.dp)
        if same:
            src_rank = topo.rank
        else:
            # DP changed: take the streams of the rank with my TP/PP coordinates and my DP
            # rank folded onto the old DP size (dropout streams cannot be split exactly).
            old = saved_layout
            src_rank = topo.tp_rank + old["tp"] * ((topo.dp_rank % old["dp"]) + old["dp"] * topo.pp_rank)
        rpath = rng_file(ckpt, src_rank)
        if os.path.isfile(rpath):
            set_rng_state(torch.load(rpath, map_location="cpu", weights_only=True))
        else:
            raise CheckpointError(f"{rpath} is missing; the checkpoint is incomplete "
                                  f"(or pass --no-load-rng)")
    return {"iteration": int(sd["iteration"]), "consumed_samples": int(sd["consumed_samples"]),
            "extra": sd.get("extra", {}), "path": ckpt}


def engine_weights_only(state: dict) -> dict:
    """--no-load-optim: keep the weights of a full state, reset AdamW (zero moments, step 0)."""
    params = {name: {k: (v if k == "param" else torch.zeros_like(v)) for k, v in entry.items()}
              for name, entry in state["params"].items()}
    return {"step": 0, "params": params}
