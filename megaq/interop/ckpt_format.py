"""Convert a megaq checkpoint between --ckpt-format torch and torch_dist, on one process.

Both directions keep everything a resume needs: weights, AdamW moments and step,
iteration, consumed samples, LR schedule, configuration, the per-rank RNG and qgZ
files (copied: the layout does not change). A converted checkpoint resumes exactly
as the original would. The whole model with its moments is held in memory once
(full fp32 tensors): 12 bytes per parameter.

    python tools/convert_checkpoint.py --from megaq --to megaq --ckpt-format torch --input CKPT --output OUT
"""

from __future__ import annotations

import os
import shutil

from megaq.checkpoint import dcp_format, integrity, torch_format
from megaq.checkpoint.dcp_chunks import dcp_name
from megaq.checkpoint.errors import CheckpointError
from megaq.checkpoint.paths import (common_file, is_dist_checkpoint, iteration_dir, model_file,
                                    save_file, write_tracker)
from megaq.checkpoint.record import has_optimizer_state, saved_config, saved_virtual_pipeline_size
from megaq.checkpoint.reshard import TIED_SOURCE, concat_tp_shards
from megaq.data import tokenizer_files
from megaq.interop.common import (InteropError, check_output, megaq_layout, progress, replace_dir,
                                  resolve_checkpoint_dir, temp_dir_for)
from megaq.model import GPTConfig
from megaq.parallel.tensor_parallel import shard_of
from megaq.zero.optimizer import optimizer_state_names



def _state_keys(saved: dict) -> tuple[str, ...]:
    """"param" and the optimizer state the saving run kept (files before --optimizer: AdamW)."""
    opt = saved.get("optimizer") or {}
    return ("param",) + optimizer_state_names(opt.get("optimizer") or "adam",
                                              opt.get("sgd_momentum", 0.9))


def _layout_of(saved: dict, tp: int, pp: int):
    model = GPTConfig.from_dict(saved["model"])
    return megaq_layout(model, tp, pp, saved_virtual_pipeline_size(saved))


def _tied(saved: dict) -> bool:
    return not saved["model"].get("untie_embeddings_and_output_weights", False)


def _copy_rank_files(src: str, dst: str) -> None:
    for sub in ("rng", "qgz", tokenizer_files.TOKENIZER_DIR):
        if os.path.isdir(os.path.join(src, sub)):
            shutil.copytree(os.path.join(src, sub), os.path.join(dst, sub))


def _finish(tmp_root: str, out_root: str, iteration: int, iter_tmp: str) -> str:
    integrity.write_manifest(iter_tmp)
    write_tracker(tmp_root, iteration)
    replace_dir(tmp_root, out_root)
    return iteration_dir(out_root, iteration)


def torch_to_dist(ckpt_dir: str, out_root: str) -> str:
    files = integrity.Verifier(ckpt_dir)
    tp, pp = torch_format.layout(ckpt_dir, files)
    record, _ = torch_format.read_record(ckpt_dir, files, 0, 0)
    saved, state = torch_format.read_all_stages(
        ckpt_dir, tp, pp, files=files,
        progress=lambda items, total: progress(items, "reading", total=total, unit="shard"))
    optim_saved = has_optimizer_state(record["model_optim"])
    tensors = {}
    for info in _layout_of(saved, tp, pp):
        if info.name in TIED_SOURCE and _tied(saved):
            continue  # the tied head copy: torch_dist keeps the embedding only
        parts = state["params"][info.name]
        for key in _state_keys(saved) if optim_saved else ("param",):
            shards = [p[key] for p in parts]
            full = shards[0] if info.dim < 0 or tp == 1 else concat_tp_shards(
                shards, info.dim, info.stride, name=info.name)
            tensors[dcp_name(key, info.name)] = full.contiguous()
    common = dict(record)
    common["model_optim"] = {"format": dcp_format.NAME, "step": state["step"],
                             "optimizer": optim_saved}
    tmp_root = temp_dir_for(out_root)
    iteration = int(record["iteration"])
    it = iteration_dir(tmp_root, iteration)
    os.makedirs(it)
    dcp_format.save_full_tensors(tensors, it)
    save_file(common, common_file(it))
    _copy_rank_files(ckpt_dir, it)
    return _finish(tmp_root, out_root, iteration, it)


def dist_to_torch(ckpt_dir: str, out_root: str) -> str:
    common = dcp_format.read_common(ckpt_dir)
    saved = saved_config(common)
    tp, pp = common["layout"]["tp"], common["layout"]["pp"]
    optim_saved = has_optimizer_state(common["model_optim"])
    keys = _state_keys(saved)
    full = dcp_format.read_saved_state(
        ckpt_dir, keys if optim_saved else ("param",),
        progress=lambda items, total: progress(items, "reading", total=total))
    tmp_root = temp_dir_for(out_root)
    iteration = int(common["iteration"])
    it = iteration_dir(tmp_root, iteration)
    layout = _layout_of(saved, tp, pp)
    for stage in progress(range(pp), "writing", unit="stage"):
        shards = [{} for _ in range(tp)]
        for info in (i for i in layout if i.stage == stage):
            src = info.name
            if src not in full and src in TIED_SOURCE:
                src = TIED_SOURCE[src]
            if src not in full:
                raise InteropError(f"{ckpt_dir} has no parameter {info.name}")
            for r in range(tp):
                entry = {}
                for key in keys if optim_saved else ("param",):
                    t = full[src][key]
                    entry[key] = (t if info.dim < 0 else
                                  shard_of(t, info.dim, r, tp, info.stride)).clone()
                shards[r][info.key] = entry
        for r in range(tp):
            record = dict(common)
            record["model_optim"] = {"step": common["model_optim"]["step"] if optim_saved else 0,
                                     "params": shards[r]}
            if not optim_saved:
                record["model_optim"]["optimizer"] = False  # as torch_format.weights_only_state marks it
            save_file(record, model_file(it, r, stage))
    _copy_rank_files(ckpt_dir, it)
    return _finish(tmp_root, out_root, iteration, it)


def convert_format(src: str, out_root: str, fmt: str, overwrite: bool = False) -> dict:
    """Write `src` (a checkpoint root or iter_* directory, either format) to `out_root`
    in format `fmt`; returns {"dir", "from", "to"}."""
    ckpt_dir = resolve_checkpoint_dir(src)
    integrity.read_manifest(ckpt_dir)  # a directory without one is never read
    have = dcp_format.NAME if is_dist_checkpoint(ckpt_dir) else torch_format.NAME
    if have == fmt:
        raise InteropError(f"{ckpt_dir} is in the {fmt} format already; nothing to convert")
    check_output(out_root, overwrite, src, writes="megaq")
    try:
        out = dist_to_torch(ckpt_dir, out_root) if have == "torch_dist" else \
            torch_to_dist(ckpt_dir, out_root)
    except CheckpointError as e:  # a damaged file (IntegrityError) among them
        raise InteropError(str(e)) from None
    return {"dir": out, "from": have, "to": fmt}
