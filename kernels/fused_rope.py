"""Rotary position embedding, Megatron / Llama "rotate half" layout (full head dim).

`apply_rotary(x, cos, sin)`: x [s, b, heads, d], cos/sin [s, 1 or b, 1, d] (fp32
tables). Dispatches (kernels/dispatch.py) to kernels/fused_rope_triton.apply_rotary or to
`apply_rotary_reference`, the torch definition with the same signature (tables cast to
x's dtype, as Megatron's unfused path does; the Triton version keeps fp32 inside and
rounds once).

`qkv_rope_backward_fp8(dq, dk, dv, cos, sin, scale, dtype)`: the gradient of the fused QKV
GEMM's output from attention's dq, dk, dv, through RoPE's backward, as that GEMM's FP8
backward takes it (megaq.parallel.fp8, ``FP8GEMM.rope_per_group``: the delayed recipe,
whose dY scale is known before dY): dY cast to FP8, its transpose and its amax, in one pass. Left to
inductor, assembling dY from the three gradients with RoPE's backward, the cast and the
amax are one kernel, and the transposed copy another (kernels/transpose.py), each well
short of its bytes' time (docs/PERFORMANCE.md); this kernel reads dq, dk, dv once and
writes both FP8 layouts.
"""

from __future__ import annotations

import torch

from .dispatch import CompiledOp, Op


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


def apply_rotary_backward_reference(g: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The transpose of apply_rotary_reference (its gradient for the output gradient `g`),
    with autograd's ops and roundings: g cos + rotate_half^T(g sin)."""
    c, sn = cos.to(g.dtype), sin.to(g.dtype)
    z1, z2 = (g * sn).chunk(2, dim=-1)
    return g * c + torch.cat([z2, -z1], dim=-1)


ROTARY = Op("apply_rotary", apply_rotary_reference, "fused_rope_triton.apply_rotary", under_compile="reference")
ROTARY_BACKWARD = Op("apply_rotary_backward", apply_rotary_backward_reference,
                     "fused_rope_triton.apply_rotary_backward", under_compile="reference")


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    _check_tables(x, cos, sin)
    return ROTARY.pick(x)(x, cos, sin)


def split_qkv(qkv: torch.Tensor, per_group: int, head_dim: int):
    """q [s, b, heads, d], k and v [s, b, groups, d] of the fused QKV output [s, b, groups *
    (per_group + 2) * d], laid out by query group as the QKV weight is ([group][q heads...,
    k, v][d], as in Megatron): views (q a copy where a group holds several query heads)."""
    s, b = qkv.shape[:2]
    qkv = qkv.view(s, b, -1, per_group + 2, head_dim)
    q = qkv[:, :, :, :per_group].reshape(s, b, -1, head_dim)
    return q, qkv[:, :, :, -2], qkv[:, :, :, -1]


def qkv_rope_split(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, per_group: int):
    """(q, k, v) of :func:`split_qkv`, q and k rotated, each a tensor of its own: v is
    copied, since a view would keep the whole QKV output alive for attention's backward
    (3x v's bytes with MHA)."""
    q, k, v = split_qkv(qkv, per_group, cos.shape[-1])
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v.contiguous()


def qkv_rope_backward(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
                      cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """d(fused QKV output) [s * b, groups * (heads_per_group + 2) * d] from dq [s, b,
    heads, d], dk and dv [s, b, groups, d] (the gradients of RoPE'd q and k, and of v),
    laid out by query group as the QKV weight is ([group][q heads..., k, v][d]): RoPE's
    backward for q and k as apply_rotary's (the Triton kernel's or autograd's of the
    reference, by the same rule), then the split's."""
    s, b, heads, d = dq.shape
    groups = dk.shape[2]
    if heads % groups or dk.shape != dv.shape or dk.shape[:2] != (s, b) or dk.shape[3] != d:
        raise ValueError(f"dq {tuple(dq.shape)}, dk {tuple(dk.shape)}, dv {tuple(dv.shape)} are "
                         f"not the gradients of one QKV split")

    def rope_t(g):
        return ROTARY_BACKWARD.pick(g)(g, cos, sin)

    per_group = heads // groups
    out = torch.cat([rope_t(dq).reshape(s, b, groups, per_group, d),
                     rope_t(dk).unsqueeze(3), dv.unsqueeze(3)], dim=3)
    return out.reshape(s * b, groups * (per_group + 2) * d)


def qkv_rope_backward_fp8_reference(dq, dk, dv, cos, sin, scale: torch.Tensor,
                                    dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv_rope_backward's dY cast with `scale` to the FP8 `dtype`, that cast
    transposed (the weight-gradient GEMM's operand) and |dY|'s max (fp32, 0-d): as
    kernels/fused_swiglu.swiglu_backward_fp8_reference, with megaq.parallel.fp8's cast and
    tensor_amax written out (tests/test_fused_kernels.py holds them to the same bytes)."""
    dy = qkv_rope_backward(dq, dk, dv, cos, sin)
    fmax = torch.finfo(dtype).max
    q = (dy.float() * scale).clamp(-fmax, fmax).to(dtype)
    return q, q.t().contiguous(), dy.abs().amax(dim=-1).amax().float()


# the Triton kernel also while inductor traces it (a triton_op: launched, not fused)
QKV_ROPE_BACKWARD_FP8 = Op("qkv_rope_backward_fp8", qkv_rope_backward_fp8_reference,
                           "fused_rope_triton.qkv_rope_backward_fp8", under_compile="triton")


def _qkv_rope_backward_fp8_body(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
                                cos: torch.Tensor, sin: torch.Tensor, scale: torch.Tensor,
                                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return QKV_ROPE_BACKWARD_FP8.pick(dq)(dq, dk, dv, cos, sin, scale, dtype)


_qkv_rope_backward_fp8_op = CompiledOp("qkv_rope_backward_fp8", _qkv_rope_backward_fp8_body,
                                       qkv_rope_backward_fp8_reference)


def qkv_rope_backward_fp8(dq, dk, dv, cos, sin, scale: torch.Tensor, dtype: torch.dtype
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv_rope_backward_fp8_reference's result: one kernel where it runs, else the
    reference. dq, dk, dv with any strides but a unit last one (attention's backward
    hands them in its own layout)."""
    dq, dk, dv = (t if t.stride(-1) == 1 else t.contiguous() for t in (dq, dk, dv))
    return _qkv_rope_backward_fp8_op(dq, dk, dv, cos, sin, scale, dtype)
