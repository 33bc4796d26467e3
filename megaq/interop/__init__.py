"""Conversions between megaq checkpoints and other formats.

- `megaq.interop.common`: what every conversion shares: the model's parameter layout
  (names, TP splits) under a TP x PP x VP layout, a streaming checkpoint reader, the
  writer of an iteration-0 checkpoint and the flags that describe it, outputs written
  under a temporary name and renamed at the end.
- `megaq.interop.hf`: Hugging Face transformers (Llama family and GPT-2), both ways.
- `megaq.interop.megatron`: Megatron-LM torch-format checkpoints -> megaq (weights).

The command-line front end is tools/convert_checkpoint.py; docs/INTEROP.md has the
name mapping and what is refused.
"""
