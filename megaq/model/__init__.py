"""The GPT model (GPT-2 and Llama families) built from tensor-parallel layers.

A plain model: parallelism (stage split, FP8 GEMMs, recompute, compile, the ZeRO
engine) is applied from outside by megaq.parallelize."""

from megaq.model.config import GPTConfig, ModelConfigError
from megaq.model.gpt import GPTModel

__all__ = ["GPTConfig", "GPTModel", "ModelConfigError"]
