"""A checkpoint of any TP x PP x DP layout, either format, as one process's whole model
(tools: generate, the HF export's checks): no process group, no topology."""

from __future__ import annotations

import dataclasses

import torch

from megaq.checkpoint import formats
from megaq.checkpoint.integrity import Verifier
from megaq.checkpoint.record import saved_config
from megaq.checkpoint.reshard import WHOLE_MODEL
from megaq.model import GPTConfig, GPTModel


def consolidated_model_config(saved: dict) -> GPTConfig:
    """The model of a saved configuration for one process (TP = PP = 1, fp32, no
    recomputation), its vocabulary padded as the checkpoint's TP size padded it."""
    model = GPTConfig.from_dict(saved["model"])
    tp = saved["parallel"]["tensor_model_parallel_size"]
    return dataclasses.replace(
        model, make_vocab_size_divisible_by=model.make_vocab_size_divisible_by * tp,
        sequence_parallel=False, params_dtype=torch.float32, **GPTConfig.NO_RECOMPUTE)


def load_consolidated_model(ckpt_dir: str, verify: bool = True) -> tuple[GPTModel, dict]:
    """The checkpoint directory `ckpt_dir` as one process's whole GPTModel (weights only;
    pipeline stages stitched by global layer index, TP shards concatenated), and the
    configuration it was saved with (saved_config's nesting). Files are verified
    against the manifest unless verify=False (--no-verify-checkpoint)."""
    files = Verifier(ckpt_dir, enabled=verify)
    fmt = formats.of_directory(ckpt_dir)
    sd, _, _, _ = fmt.read_settings(ckpt_dir, files, WHOLE_MODEL)
    saved = saved_config(sd)
    model = GPTModel(consolidated_model_config(saved))
    weights = fmt.read_whole_weights(ckpt_dir, files, model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(weights[name])
    return model, saved
