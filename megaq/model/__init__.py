"""The GPT model (GPT-2 and Llama families) built from tensor-parallel layers."""

from megaq.model.config import GPTConfig
from megaq.model.gpt import GPTModel

__all__ = ["GPTConfig", "GPTModel"]
