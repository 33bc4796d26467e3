"""Dispatch rule shared by the fused model kernels (kernels/fused_*.py).

Each fused op has a plain-torch reference with the same signature. The Triton
version runs for CUDA tensors, the reference elsewhere (CPU: the model's numerics
tests then run the references, so TP-equality tests are unaffected). Inside
torch.compile the reference is traced instead: inductor fuses it into its own
Triton kernel, and an opaque autograd.Function would only break the graph.

MEGAQ_KERNELS (read on every call, the same switch as megaq.kernels.ops) forces a
backend: `triton` (CPU tests under TRITON_INTERPRET=1), `torch`, or `auto` (default).
"""

from __future__ import annotations

import os

import torch

BACKENDS = ("auto", "triton", "torch")

# Launch options of the fused model kernels: multiply-adds contract to FMAs, as Triton
# up to 3.9 does by default (3.9 warns that 3.10 turns the default off). The figures in
# docs/PERFORMANCE.md were measured so, and the tests' tolerances hold either way; said
# here so a Triton upgrade changes neither. (The quantization kernels and the fused
# AdamW pass False: their results are defined bit for bit by plain fp32 roundings.)
LAUNCH = dict(enable_fp_fusion=True)


def backend() -> str:
    """MEGAQ_KERNELS, checked: "auto", "triton" or "torch"."""
    choice = os.environ.get("MEGAQ_KERNELS", "auto").lower()
    if choice not in BACKENDS:
        raise ValueError(f"MEGAQ_KERNELS={choice!r} is not one of {', '.join(BACKENDS)}")
    return choice


def use_triton(t: torch.Tensor) -> bool:
    choice = backend()
    if torch.compiler.is_compiling() or choice == "torch":
        return False
    return choice == "triton" or t.is_cuda


def rows_view(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, last dim] with a unit stride on the last dim (a view when possible)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()
