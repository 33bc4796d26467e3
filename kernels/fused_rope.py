"""Rotary position embedding, Megatron / Llama "rotate half" layout (full head dim).

`apply_rotary(x, cos, sin)`: x [s, b, heads, d], cos/sin [s, 1 or b, 1, d] (fp32
tables). Dispatches (kernels/dispatch.py) to kernels/fused_rope_triton.apply_rotary or to
`apply_rotary_reference`, the torch definition with the same signature (tables cast to
x's dtype, as Megatron's unfused path does; the Triton version keeps fp32 inside and
rounds once).
"""

from __future__ import annotations

import torch

from .dispatch import Op


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return (x * cos.to(x.dtype)) + (_rotate_half(x) * sin.to(x.dtype))


def _check_tables(x, cos, sin):
    if x.shape[-1] % 2 or cos.shape != sin.shape or cos.shape[-1] != x.shape[-1] \
            or cos.shape[0] != x.shape[0] or cos.shape[1] not in (1, x.shape[1]):
        raise ValueError(f"rotary tables {tuple(cos.shape)} do not fit x {tuple(x.shape)}; "
                         f"expected [s, 1 or b, 1, d] with an even head dim d")


ROTARY = Op("apply_rotary", apply_rotary_reference, "fused_rope_triton.apply_rotary", under_compile="reference")


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    _check_tables(x, cos, sin)
    return ROTARY.pick(x)(x, cos, sin)
