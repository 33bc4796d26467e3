"""Conversions between megaq checkpoints and other formats.

- `megaq.interop.hf`: Hugging Face transformers (Llama family and GPT-2), both ways.

The command-line front end is tools/convert_checkpoint.py; docs/INTEROP.md has the
name mapping and what is refused.
"""
