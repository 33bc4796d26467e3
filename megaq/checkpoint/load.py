"""Loading a checkpoint into a run: verify, read, compare with the flags, reshard, hand
the state to its owners (the engine, the LR schedule, the RNG streams)."""

from __future__ import annotations

import os

from megaq.runtime import failure
from megaq.checkpoint import formats
from megaq.checkpoint.errors import CheckpointError
from megaq.checkpoint.integrity import Verifier, read_manifest
from megaq.checkpoint.paths import TRACKER_FILE, error_feedback_file, iteration_dir, read_tracker, rng_file
from megaq.checkpoint.record import (check_architecture, check_layout, check_optimizer,
                                     has_optimizer_state, layout_dict, saved_config)
from megaq.checkpoint.reshard import Place
from megaq.checkpoint.rng import set_rng_state

# what the qgZ residuals depend on besides the layout: a change of these restarts them
# (with grad_hadamard the residuals live in the transformed domain)
_EF_SETTINGS = ("grad_bits_intra", "grad_bits_inter", "block_size", "grad_exact_own_rows", "grad_code",
                "grad_hadamard")
# what a checkpoint saved before a setting existed meant by it
_EF_SETTINGS_BEFORE = {"grad_code": "linear", "grad_hadamard": False}


def load_checkpoint(root: str, *, config, topo, engine, lr_schedule, model_chunks=None,
                    load_rng: bool = True, load_optim: bool = True) -> dict | None:
    """Load the newest checkpoint under `root` into engine / schedule / RNG.

    Returns {"iteration", "consumed_samples", "extra", "path", "saved_global_batch_size"}
    or None when `root` holds no checkpoint yet (a fresh run; lets job scripts always
    pass --load). load_optim=False loads fresh optimizer state and only the LR
    schedule's position; lr_schedule=None leaves the schedule alone (--finetune). A
    different DP size or ZeRO++ setting loads directly; a different TP or PP size is
    resharded (--ckpt-format torch: when `model_chunks`, this rank's, are given, else
    refused). Files are verified unless config.checkpointing.no_verify_checkpoint.
    """
    iteration = read_tracker(root)
    if iteration is None:
        return None
    ckpt = iteration_dir(root, iteration)
    if not os.path.isdir(ckpt):
        raise CheckpointError(f"{os.path.join(root, TRACKER_FILE)} names iteration {iteration} but "
                              f"{ckpt} does not exist; point it at an existing iter_* directory")
    files = Verifier(ckpt, enabled=not config.checkpointing.no_verify_checkpoint)
    files.require_manifest()  # a directory without one is never loaded
    if load_rng and not _saved_rng_state(ckpt, files):
        # a converted checkpoint (megaq.interop writes none): --no-load-rng, inferred
        load_rng = False
        if topo.rank == 0:
            print(f" note: {ckpt} holds no RNG state (a converted checkpoint); RNG streams "
                  f"start from --seed, as with --no-load-rng", flush=True)
    fmt = formats.of_directory(ckpt)
    # Integrity first: every file this load reads is verified before anything of the
    # checkpoint is compared with this run's flags, so that a damaged file is reported
    # as damaged, never as a settings mismatch. The record, this rank's RNG streams and
    # what the format reads ahead (torch, on a TP / PP reshard: every shard) are read
    # here; torch_dist verifies its index and shard files before check_flags runs
    # (its load), and the qgZ residuals are verified here and read after the weights.
    # Each rank reads its own files: the ranks agree on the outcome before any of them
    # enters a collective of the load (a rank that failed alone would leave the others
    # waiting).
    with failure.agreed(topo.world):
        sd, path, saved_tp, saved_pp = fmt.read_settings(ckpt, files, Place.of(topo))
        same_mp = (saved_tp, saved_pp) == (topo.layout.tp, topo.layout.pp)
        saved = saved_config(sd)
        rng_path, rng = (_read_rng_state(ckpt, files, sd["layout"], topo) if load_rng and same_mp
                         else (None, None))
        ef_path, ef_reason = (_error_feedback_source(ckpt, sd, saved, config, topo)
                              if load_optim else (None, None))
        if ef_path is not None:
            files.verify(ef_path)
        ahead = fmt.read_ahead(ckpt, files, saved_tp, saved_pp, same_mp, model_chunks)

    def check_flags():
        """Every comparison of the checkpoint's settings with this run's flags."""
        check_architecture(saved, config, path, same_tp=same_mp)
        if not same_mp and not fmt.RESHARDS_ANY_LAYOUT and model_chunks is None:
            check_layout({"tp": saved_tp, "pp": saved_pp}, topo, ckpt)
        if load_optim and not has_optimizer_state(sd["model_optim"]):
            raise CheckpointError(f"{ckpt} was saved with --no-save-optim (no optimizer state); "
                                  f"load it with --no-load-optim (fresh optimizer state, same "
                                  f"iteration) or --finetune (weights only, iteration 0)")
        if load_optim:
            check_optimizer(saved, config, path)

    fmt.load(ckpt, files, sd, path, ahead, config=config, topo=topo, engine=engine,
             model_chunks=model_chunks, same_mp=same_mp, load_optim=load_optim,
             check_flags=check_flags)
    if ef_path is not None:
        engine.load_error_feedback_state(files.load(ef_path)["residuals"])
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


def _saved_rng_state(ckpt: str, files: Verifier) -> bool:
    """Whether the checkpoint was saved with RNG streams: its manifest lists rng/ files
    (a run's save), or, unverified, it has an rng/ directory. A save whose manifest
    lists them but whose files are gone is damaged, not converted: its load says so."""
    if files.enabled:
        return any(rel.startswith("rng/") for rel in read_manifest(ckpt)["files"])
    return os.path.isdir(os.path.dirname(rng_file(ckpt, 0)))


def _read_rng_state(ckpt: str, files: Verifier, saved_layout: dict, topo) -> tuple[str, dict]:
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
    rng = files.load(rpath)
    if not isinstance(rng, dict):
        raise CheckpointError(f"{rpath} holds a {type(rng).__name__}, not RNG state; restore the "
                              f"file, or pass --no-load-rng")
    return rpath, rng


def _error_feedback_source(ckpt: str, sd: dict, saved: dict, config,
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
