"""What the fused model kernels' Triton ops (kernels/fused_*_triton.py) share.

Each fused op has a plain-torch reference with the same signature, and its Op
(kernels/dispatch.py: the one rule choosing between the two); its launch settings
come in a kernels.tuning.Tuning.
"""

from __future__ import annotations

import torch


def rows_view(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, last dim] with a unit stride on the last dim (a view when possible)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()
