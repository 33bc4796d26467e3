"""What every checkpoint records besides tensors, and the comparison with this run.

The record (``mp_rank_*/model_optim.pt`` of --ckpt-format torch around the model's
state, torch_dist's ``common.pt`` around the step) holds the run's configuration
(RunConfig.to_dict()), iteration, consumed samples, LR schedule, layout and
``model_optim``. :func:`saved_config` reads the configuration of any version back
(files before RunConfig held a flat "args" dict of flag values); the ``check_*``
functions refuse a checkpoint this run cannot continue, in one line each.
"""

from __future__ import annotations

from types import SimpleNamespace

from megaq.checkpoint.errors import CheckpointError
from megaq.config.flags import dest, flag_fields, to_dict
from megaq.config.run import FLAG_CLASSES, RunConfig
from megaq.model import GPTConfig
from megaq.zero import ZeroConfig

CHECKPOINT_VERSION = 1


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


def check_architecture(saved: dict, config: RunConfig, path: str, same_tp: bool) -> None:
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


def check_layout(saved: dict, topo, path: str) -> None:
    tp, pp = topo.layout.tp, topo.layout.pp
    if saved["tp"] != tp or saved["pp"] != pp:
        raise CheckpointError(
            f"{path} was saved with --tensor-model-parallel-size {saved['tp']} and "
            f"--pipeline-model-parallel-size {saved['pp']}, this run has {tp} and {pp}; "
            f"resume with the checkpoint's TP and PP (the DP size and ZeRO++ switches may change)")


def has_optimizer_state(model_optim: dict) -> bool:
    """False for a model_optim saved by --no-save-optim: the torch format's
    (weights_only_state) and torch_dist's common file mark it "optimizer": False."""
    return model_optim.get("optimizer", True) is not False


def check_optimizer(saved: dict, config: RunConfig, path: str) -> None:
    """Refuse another optimizer's state in one line (files before --optimizer: AdamW)."""
    saved_opt = (saved.get("optimizer") or {}).get("optimizer") or "adam"
    if saved_opt != config.optimizer.optimizer:
        raise CheckpointError(f"{path} holds --optimizer {saved_opt} state, this run uses "
                              f"--optimizer {config.optimizer.optimizer}; pass --no-load-optim "
                              f"to load the weights only (fresh optimizer state)")
