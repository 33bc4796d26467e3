"""Conversions between megaq checkpoints and other formats.

- `megaq.interop.megatron`: Megatron-LM torch-format checkpoints -> megaq (weights).
"""
