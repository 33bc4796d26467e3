"""Triton kernels, each with a plain-torch reference of the same signature.

Installed as `megaq.kernels` (never as a top-level `kernels`). CPU runs use the
references; tests compare both under TRITON_INTERPRET=1.
"""
