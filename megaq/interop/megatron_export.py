"""Write a megaq checkpoint as a Megatron-LM `torch_dist` checkpoint, optimizer included
(tools/convert_checkpoint.py --from megaq --to megatron), the inverse of
megaq.interop.megatron's torch_dist import.

What is written (megaq.interop.megatron_dist describes the format)::

    latest_checkpointed_iteration.txt
    iter_XXXXXXX/metadata.json     {"sharded_backend": "torch_dist", ...}
    iter_XXXXXXX/.metadata, __0_0.distcp   through megaq.checkpoint.dcp_format (DCP)
    iter_XXXXXXX/common.pt         args, iteration, opt_param_scheduler, sharding type

The model as global tensors (layers stacked), and the distributed optimizer's state in
the `dp_reshardable` layout for Megatron TP 1 x PP 1 at any DP size: one gradient
bucket (megatron-core's single bucket: --overlap-grad-reduce off, or a model under its
default bucket size of 40 M parameters), fp32 parameters, the parameters in the order
of megatron-core's local or Transformer Engine layer spec (`impl`), starts padded to 64
elements. Megatron-LM loads it with the architecture flags of the run, --ckpt-format
torch_dist, --use-distributed-optimizer and --no-load-rng.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil

import torch

from megaq.checkpoint import dcp_format, integrity, torch_format
from megaq.checkpoint.paths import is_dist_checkpoint, iteration_dir, save_file, write_tracker
from megaq.checkpoint.record import has_optimizer_state, saved_config
from megaq.checkpoint.reshard import concat_tp_shards
from megaq.interop.common import (InteropError, megaq_layout, resolve_checkpoint_dir,
                                  temp_dir_for, replace_dir)
from megaq.interop.megatron import _megaq_name
from megaq.interop.megatron_dist import COMMON, METADATA_JSON, mcore_order
from megaq.model import GPTConfig

IMPLS = ("transformer_engine", "local")
_BUCKET = "optimizer.distributed.dp_group_idx_0"
_DTYPES = (torch.float32, torch.float32)  # (param, grad) dtype of the one gradient buffer
_LINEARS = ("self_attention.linear_proj", "self_attention.linear_qkv", "mlp.linear_fc1",
            "mlp.linear_fc2")


def full_optimizer_state(ckpt_dir: str) -> tuple[dict, dict, dict]:
    """(saved config, record, {megaq name: {"param", "exp_avg", "exp_avg_sq"}}) of a
    megaq checkpoint of either format, every file verified (also what the interop tests
    compare against the other frameworks' moments); the record's "model_optim" holds
    only the optimizer's step."""
    files = integrity.Verifier(ckpt_dir)
    if is_dist_checkpoint(ckpt_dir):
        record = dcp_format.read_common(ckpt_dir, files)
        saved = saved_config(record)
        if not has_optimizer_state(record["model_optim"]):
            raise InteropError(f"{ckpt_dir} was saved without optimizer state (--no-save-optim); "
                               "--to megatron writes the optimizer too")
        return saved, record, dcp_format.read_saved_state(ckpt_dir, ("param", "exp_avg",
                                                                     "exp_avg_sq"))
    tp, pp = torch_format.layout(ckpt_dir, files)
    record, _ = torch_format.read_record(ckpt_dir, files, 0, 0)
    if not has_optimizer_state(record["model_optim"]):
        raise InteropError(f"{ckpt_dir} was saved without optimizer state (--no-save-optim); "
                           "--to megatron writes the optimizer too")
    saved, state = torch_format.read_all_stages(ckpt_dir, tp, pp, files=files)
    model = GPTConfig.from_dict(saved["model"])
    full = {}
    for info in megaq_layout(model, tp, pp):
        parts = state["params"][info.name]
        full[info.name] = {k: parts[0][k] if info.dim < 0 or tp == 1 else
                           concat_tp_shards([p[k] for p in parts], info.dim, info.stride,
                                            name=info.name)
                           for k in ("param", "exp_avg", "exp_avg_sq")}
    record["model_optim"] = {"step": state["step"]}
    return saved, record, full


def _arch(saved: dict) -> dict:
    m = saved["model"]
    return {"num_layers": m["num_layers"], "add_bias_linear": m.get("add_bias_linear", True),
            "normalization": m.get("normalization", "LayerNorm"),
            "qk_layernorm": bool(m.get("qk_layernorm")),
            "position_embedding_type": m.get("position_embedding_type", "learned_absolute"),
            "untie_embeddings_and_output_weights": m.get("untie_embeddings_and_output_weights",
                                                         False)}


def _megatron_args(saved: dict, rows: int, iteration: int, consumed: int) -> argparse.Namespace:
    m, o, t = saved["model"], saved.get("optimizer") or {}, saved.get("training") or {}
    return argparse.Namespace(
        num_layers=m["num_layers"], hidden_size=m["hidden_size"],
        num_attention_heads=m["num_attention_heads"],
        group_query_attention=m.get("num_query_groups") not in (None, m["num_attention_heads"]),
        num_query_groups=m.get("num_query_groups"), ffn_hidden_size=m.get("ffn_hidden_size"),
        kv_channels=m.get("kv_channels"), seq_length=m.get("seq_length"),
        max_position_embeddings=m.get("max_position_embeddings"),
        position_embedding_type=m.get("position_embedding_type"),
        rotary_base=m.get("rotary_base"), normalization=m.get("normalization"),
        qk_layernorm=bool(m.get("qk_layernorm")), use_rope_scaling=bool(m.get("use_rope_scaling")),
        rope_scaling_factor=m.get("rope_scaling_factor") or 8.0,
        norm_epsilon=m.get("layernorm_epsilon"), swiglu=m.get("swiglu"),
        add_bias_linear=m.get("add_bias_linear"),
        untie_embeddings_and_output_weights=m.get("untie_embeddings_and_output_weights"),
        hidden_dropout=m.get("hidden_dropout"), attention_dropout=m.get("attention_dropout"),
        vocab_size=m.get("vocab_size"), padded_vocab_size=rows,
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
        use_distributed_optimizer=True, ckpt_format="torch_dist", params_dtype=torch.float32,
        bf16=False, fp16=False, optimizer="adam", lr=o.get("lr"), min_lr=o.get("min_lr"),
        weight_decay=o.get("weight_decay"), adam_beta1=o.get("adam_beta1"),
        adam_beta2=o.get("adam_beta2"), adam_eps=o.get("adam_eps"), clip_grad=o.get("clip_grad"),
        global_batch_size=t.get("global_batch_size"), iteration=iteration,
        consumed_train_samples=consumed, consumed_valid_samples=0)


def _scheduler(lr: dict, saved: dict) -> dict:
    """megaq's LR schedule state as Megatron's OptimizerParamScheduler state (samples)."""
    per = lr.get("samples_per_step", 1) if lr.get("unit", "iterations") == "iterations" else 1
    wd = (saved.get("optimizer") or {}).get("weight_decay", 0.0)
    return {"max_lr": lr["max_lr"], "min_lr": lr["min_lr"],
            "lr_warmup_steps": lr["warmup_steps"] * per, "lr_decay_steps": lr["decay_steps"] * per,
            "lr_decay_style": lr["decay_style"], "num_steps": lr["num_samples"],
            "start_wd": wd, "end_wd": wd, "wd_incr_steps": lr["decay_steps"] * per,
            "wd_incr_style": "constant"}


def _param_groups(saved: dict, lr: dict, step: int) -> list[dict]:
    """Megatron's two default param groups (weight decay, then none on biases and norms)."""
    o = saved.get("optimizer") or {}
    base = {"is_expert_parallel": False, "default_config": True, "lr_mult": 1.0,
            "is_decoupled_lr": False, "max_lr": lr["max_lr"], "min_lr": lr["min_lr"],
            "lr": lr["max_lr"], "betas": (o.get("adam_beta1", 0.9), o.get("adam_beta2", 0.999)),
            "eps": o.get("adam_eps", 1e-8), "amsgrad": False, "maximize": False, "foreach": None,
            "capturable": False, "differentiable": False, "fused": None,
            "decoupled_weight_decay": True, "step": float(step)}
    return [dict(base, wd_mult=1.0, weight_decay=o.get("weight_decay", 0.0)),
            dict(base, wd_mult=0.0, weight_decay=0.0)]


def export_to_megatron(src: str, out_root: str, impl: str = "transformer_engine") -> dict:
    """`src` (a megaq checkpoint, either format) -> `out_root` (a Megatron-LM --save
    directory); returns {"dir", "iteration", "tensors", "params"}."""
    if impl not in IMPLS:
        raise InteropError(f"--megatron-transformer-impl {impl!r}: choose one of {', '.join(IMPLS)}")
    if os.path.exists(out_root):
        raise InteropError(f"{out_root} exists; choose a new --output")
    ckpt_dir = resolve_checkpoint_dir(src)
    integrity.read_manifest(ckpt_dir)  # a directory without one is never read
    saved, record, full = full_optimizer_state(ckpt_dir)
    if (saved.get("optimizer") or {}).get("optimizer", "adam") != "adam":
        raise InteropError(f"{ckpt_dir} holds --optimizer {saved['optimizer']['optimizer']} state; "
                           "--to megatron writes the distributed optimizer's Adam state only")
    model = saved["model"]
    arch = _arch(saved)
    iteration, consumed = int(record["iteration"]), int(record["consumed_samples"])
    step = int(record["model_optim"]["step"])
    rows = full["embedding.word_embeddings.weight"]["param"].shape[0]

    # {DCP name: tensor, or a ShardedObject's value: megatron-core stores each as a
    # one-element list, `<key>/shard_<offset>_<count>`}
    tensors, order = {}, []
    stacked: dict[str, list] = {}
    for mname in mcore_order(arch, te=impl == "transformer_engine"):
        gname = _megaq_name(mname, 0, ckpt_dir)[0]
        if gname not in full:
            raise InteropError(f"{ckpt_dir} has no parameter {gname}; it is incomplete")
        order.append((mname, full[gname]))
        parts = mname.split(".")
        if mname.startswith("decoder.layers."):
            stacked.setdefault("decoder.layers." + ".".join(parts[3:]), []).append(
                full[gname]["param"])
        else:
            tensors[mname] = full[gname]["param"].float().contiguous()
    for name, layers in stacked.items():
        tensors[name] = torch.stack(layers).float().contiguous()
    layers = model["num_layers"]
    for i in range(layers):  # the linears' (empty) Transformer Engine / local extra state
        for lin in _LINEARS:
            tensors[f"decoder.layers.{lin}._extra_state/shard_{i}_{layers}"] = [None]

    # the distributed optimizer's one bucket: parameters in reverse order, starts padded to 64
    start, places = 0, []
    for mname, state in reversed(order):
        start = math.ceil(start / 64) * 64
        places.append((start, state))
        start += state["param"].numel()
    unpadded = start
    for key in ("param", "exp_avg", "exp_avg_sq"):
        flat = torch.zeros(unpadded, dtype=torch.float32)
        for s, state in places:
            t = state[key].float().flatten()
            flat[s:s + t.numel()] = t
        tensors[f"{_BUCKET}.gbuf_idx_0.dtype_{_DTYPES}.bucket_idx_0.{key}"] = flat
    padded = math.ceil(unpadded / 128) * 128  # megatron-core's bucket end at DP 1
    tensors[f"{_BUCKET}.per_bucket_numel/shard_0_1"] = [[{_DTYPES: [padded]}]]
    tensors[f"{_BUCKET}.per_bucket_numel_unpadded/shard_0_1"] = [[{_DTYPES: [unpadded]}]]
    lr = record["lr_scheduler"]
    if "max_lr" not in lr:
        raise InteropError(f"{ckpt_dir} holds no LR schedule settings (a converter's checkpoint "
                           "that was never trained); train it one step in megaq first")
    tensors[f"{_BUCKET}.optimizer/shard_0_1"] = [{"param_groups": _param_groups(saved, lr, step)}]

    common = {"args": _megatron_args(saved, rows, iteration, consumed), "checkpoint_version": 3.0,
              "iteration": iteration, "opt_param_scheduler": _scheduler(lr, saved),
              "num_floating_point_operations_so_far": 0,
              "optimizer": {"param_state_sharding_type": "dp_reshardable"},
              "content_metadata": {"distrib_optim_sharding_type": "dp_reshardable",
                                   "singleton_local_shards": False,
                                   "chained_optim_avoid_prefix": True}}
    tmp = temp_dir_for(out_root)
    try:
        it = iteration_dir(tmp, iteration)
        os.makedirs(it)
        dcp_format.save_full_tensors(tensors, it)
        save_file(common, os.path.join(it, COMMON))
        with open(os.path.join(it, METADATA_JSON), "w") as f:
            json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                       "common_backend": "torch", "common_backend_version": 1}, f)
        write_tracker(tmp, iteration)
        replace_dir(tmp, out_root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"dir": out_root, "iteration": iteration, "tensors": len(tensors),
            "params": sum(s["param"].numel() for _, s in order)}
