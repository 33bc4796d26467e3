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
      qgz/rank_{rank:05d}.pt                 with --zero-gradient-error-feedback: the rank's
                                             qgZ residuals (restored when layout and qgZ
                                             settings match, else they restart from zero)

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


def error_feedback_file(ckpt_dir: str, rank: int) -> str:
    return os.path.join(ckpt_dir, "qgz", f"rank_{rank:05d}.pt")


# what the qgZ residuals depend on besides the layout: a change of these restarts them
_EF_ARGS = ("zero_quantized_gradients_bits", "zero_quantized_gradients_intra_bits",
            "zero_quantization_block_size")


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
            "layout": _layout_dict(layout),
            "lr_scheduler": lr_schedule.state_dict(),
            "extra": extra or {},
            "model_optim": full,
        }, model_file(tmp, tp_rank, pp_rank))
    _save_file(rng_state(), rng_file(tmp, rank))
    residuals = engine.error_feedback_state()
    if residuals:
        _save_file({"residuals": residuals}, error_feedback_file(tmp, rank))
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


def _layout_dict(layout) -> dict:
    return {"world_size": layout.world_size, "tp": layout.tp, "pp": layout.pp, "dp": layout.dp,
            "ranks_per_node": layout.ranks_per_node, "order": layout.order}


# ------------------------------------------------------------------------------ load
def _check_architecture(saved: dict, args, path: str, ignore=()) -> None:
    diffs = []
    for name in ARCHITECTURE_ARGS:
        if name in ignore:
            continue
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


def load_checkpoint(root: str, *, args, topo, engine, lr_schedule, model_chunks=None,
                    load_rng: bool = True, load_optim: bool = True) -> dict | None:
    """Load the newest checkpoint under `root` into engine / schedule / RNG.

    Returns {"iteration", "consumed_samples", "extra"} or None when `root` holds no
    checkpoint yet (a fresh run; lets job scripts always pass --load). A different DP
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
    saved_tp, saved_pp = checkpoint_layout(ckpt)
    same_mp = (saved_tp, saved_pp) == (topo.layout.tp, topo.layout.pp)
    # Common args/metadata live in every mp_rank file; read this rank's, or (new
    # TP/PP layout) the first one.
    path = model_file(ckpt, topo.tp_rank, topo.pp_rank) if same_mp else model_file(ckpt, 0, 0)
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} is missing; the checkpoint is incomplete")
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - corrupted file / foreign pickle
        raise CheckpointError(f"{path} cannot be read safely ({type(e).__name__}: "
                              f"{str(e).splitlines()[0]}); it is damaged or not a megaq checkpoint")
    _check_architecture(sd["args"], args, path, ignore=() if same_mp else ("padded_vocab_size",))
    if same_mp:
        state = sd["model_optim"]
    elif model_chunks is None:
        _check_layout({"tp": saved_tp, "pp": saved_pp}, topo, ckpt)
    else:
        state = reshard_full_state(ckpt, sd["layout"], topo, model_chunks, args)
    if not load_optim:
        state = engine_weights_only(state)
    engine.load_full_state(state)
    if load_optim:
        _load_error_feedback(ckpt, sd, args, topo, engine)
    lr_schedule.load_state_dict(sd["lr_scheduler"])

    if load_rng and not same_mp:
        # The TP/PP coordinates changed: no rank's streams map onto ours (the TP tracker's
        # streams are per TP rank); keep the fresh seeding of this run.
        load_rng = False
        if topo.rank == 0:
            print(f" note: {ckpt} was saved with TP={saved_tp}, PP={saved_pp}; weights and "
                  f"optimizer state resharded to TP={topo.layout.tp}, PP={topo.layout.pp}; "
                  f"RNG streams start fresh", flush=True)
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
            "extra": sd.get("extra", {}), "path": ckpt,
            "args_global_batch_size": sd["args"].get("global_batch_size")}


def _load_error_feedback(ckpt: str, sd: dict, args, topo, engine) -> None:
    """Restore this rank's qgZ error-feedback residuals when this run uses them and
    they still mean the same thing: same layout (each residual is one rank's own
    quantization error) and the same qgZ bits and block. Otherwise they restart from
    zero, as after any weight load, and rank 0 says why."""
    if not (getattr(args, "zero_quantized_gradients", False)
            and getattr(args, "zero_gradient_error_feedback", False)):
        return
    path = error_feedback_file(ckpt, topo.rank)
    if sd["layout"] != _layout_dict(topo.layout):
        reason = f"the layout changed ({sd['layout']} -> {_layout_dict(topo.layout)})"
    elif any(sd["args"].get(k) != getattr(args, k, None) for k in _EF_ARGS):
        reason = "the qgZ bits or block size changed"
    elif not os.path.isfile(path):
        reason = "the checkpoint holds none (saved without error feedback, or at DP=1)"
    else:
        engine.load_error_feedback_state(torch.load(path, map_location="cpu",
                                                    weights_only=True)["residuals"])
        return
    if topo.rank == 0:
        print(f" note: qgZ error-feedback residuals start from zero: {reason}", flush=True)


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


def concat_tp_shards(parts: list[torch.Tensor], dim: int, stride: int = 1) -> torch.Tensor:
    """Inverse of tensor_parallel.shard_of: the full tensor from every TP rank's shard."""
    blocks = [list(x.chunk(stride, dim=dim)) for x in parts]  # [rank][block]
    return torch.cat([torch.cat([blocks[r][b] for r in range(len(parts))], dim=dim)
                      for b in range(stride)], dim=dim)


def read_all_stages(ckpt_dir: str, tp: int, pp: int) -> tuple[dict, dict]:
    """(saved args, {global name: [per old TP rank {param, exp_avg, exp_avg_sq}]})."""
    from megaq.parallel.pipeline.split import stage_layer_ranges
    entries: dict[str, list] = {}
    args = None
    step = 0
    for p in range(pp):
        for t in range(tp):
            path = model_file(ckpt_dir, t, p)
            if not os.path.isfile(path):
                raise CheckpointError(f"{path} is missing; the checkpoint is incomplete")
            sd = torch.load(path, map_location="cpu", weights_only=True)
            args = args or sd["args"]
            step = int(sd["model_optim"]["step"])
            vp = args.get("virtual_pipeline_model_parallel_size") or 1
            ranges = stage_layer_ranges(args["num_layers"], pp, vp, p)
            for name, entry in sd["model_optim"]["params"].items():
                g = local_to_global_name(name, ranges)
                entries.setdefault(g, [None] * tp)[t] = entry
    return args, {"step": step, "params": entries}


def _fit_rows(full: torch.Tensor, dim: int, size: int, name: str) -> torch.Tensor:
    """Vocab padding differs between TP sizes: drop or add (zero) padding rows."""
    have = full.shape[dim]
    if have == size:
        return full
    if have > size:
        return full.narrow(dim, 0, size)
    pad_shape = list(full.shape)
    pad_shape[dim] = size - have
    return torch.cat([full, full.new_zeros(pad_shape)], dim=dim)


def reshard_full_state(ckpt_dir: str, saved_layout: dict, topo, model_chunks, args) -> dict:
    """This rank's engine.full_state()-shaped dict from a checkpoint of another TP x PP
    layout: stages stitched by global layer index, TP shards concatenated along each
    parameter's partition dimension and re-split for this rank (weights and both AdamW
    moments alike). Every rank reads every shard file: memory of one full model."""
    from megaq.parallel.pipeline.split import stage_layer_ranges
    from megaq.parallel.tensor_parallel import shard_of
    _, saved = read_all_stages(ckpt_dir, saved_layout["tp"], saved_layout["pp"])
    vp = len(model_chunks)
    ranges = stage_layer_ranges(args.num_layers, topo.layout.pp, vp, topo.pp_rank)
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
        for k in ("param", "exp_avg", "exp_avg_sq"):
            shards = [x[k] for x in parts]
            if getattr(p, "tensor_model_parallel", False):
                dim, stride = p.partition_dim, p.partition_stride
                full = concat_tp_shards(shards, dim, stride)
                if stride == 1:
                    full = _fit_rows(full, dim, p.shape[dim] * tp, g)
                entry[k] = shard_of(full, dim, tp_rank, tp, stride)
            else:
                entry[k] = shards[0]
            if entry[k].shape != p.shape:
                raise CheckpointError(f"cannot reshard {g}: checkpoint gives {tuple(entry[k].shape)}, "
                                      f"this rank holds {tuple(p.shape)}")
        params[key] = entry
    return {"step": saved["step"], "params": params}


def engine_weights_only(state: dict) -> dict:
    """--no-load-optim: keep the weights of a full state, reset AdamW (zero moments, step 0)."""
    params = {name: {k: (v if k == "param" else torch.zeros_like(v)) for k, v in entry.items()}
              for name, entry in state["params"].items()}
    return {"step": 0, "params": params}
