"""FP8 GEMMs for the tensor-parallel linear layers, with a CPU emulation.

The entry point is :func:`linear`: with a recipe it computes ``y = x W^T`` and, in
backward, ``dX = dY W`` and ``dW = dY^T X`` as FP8 GEMMs; without one it is F.linear.
A layer gets it from outside: :class:`FP8GEMM` (a recipe, the layer's TP group and
split, the state the GEMM keeps) is the module megaq.parallelize puts in a
ColumnParallelLinear's or RowParallelLinear's ``gemm`` slot, in place of F.linear.

Recipe (dynamic "current" scaling, as torchao's float8 training, or delayed):

* ``--fp8-format e4m3``: every operand in E4M3. ``hybrid``: activations and weights in
  E4M3, the output gradient dY in E5M2 (more range, less precision).
* ``--fp8-recipe tensorwise``: one scale per tensor, ``scale = fp8_max / amax``.
  ``rowwise``: one scale per row of each operand along the GEMM's reduction dim
  (per token for X, per output feature for W in forward, ...), rounded down to a
  power of two so that dequantising is exact. Scales are computed from the tensor
  being cast, every step: no amax history, nothing to checkpoint.
  ``delayed``: tensorwise, but x and dY take their scales from an amax history
  (megaq.parallel.fp8_delayed), so their cast is one pointwise op that inductor
  fuses into the producing kernel together with the amax for the history.
* The GEMM runs ``torch._scaled_mm`` on CUDA GPUs with FP8 tensor cores (compute
  capability >= 8.9): it multiplies the FP8 operands, accumulates in fp32 and
  multiplies by the inverse scales. Forward uses fast accumulation, the two
  backward GEMMs do not (torchao's defaults). Elsewhere (CPU, older GPUs) the same
  FP8 operands with the same scales are upcast to fp32 and multiplied there: FP8 x FP8 products are exact in fp32, so the two paths
  differ only in accumulation order and in the final rounding to the output dtype.

TP consistency. A scale whose amax spans a TP-sharded dimension is reduced with a
MAX all-reduce over the TP group (``comm``, phase ``"tp"``), so every TP split casts
every element exactly as TP=1 does: a column-parallel layer's weight (tensorwise),
its dY and, rowwise, the weight's columns for dX; a row-parallel layer's X and
weight along the input features. Row-parallel partial products and column-parallel
partial dX are then summed by the layers' usual collectives.

Why torch._scaled_mm rather than torchao's Float8Linear: torchao's module swap and
its Float8TrainingTensor subclass wrap ``nn.Linear`` and reduce amaxes over a
DTensor device mesh; megaq's layers are not nn.Linear, shard with their own
``comm`` groups and must put the amax reduction exactly where a shard boundary
cuts a scaling group. The cast itself is a few lines; the reduction placement is
the part that matters here, so megaq owns it and keeps torchao optional (used only
as the benchmark's reference).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megaq.kernels.fused_rope import (QKV_ROPE_BACKWARD_FP8, qkv_rope_backward_fp8,
                                     qkv_rope_backward, qkv_rope_split)
from megaq.kernels.fused_swiglu import SWIGLU, SWIGLU_BACKWARD_FP8, swiglu_backward, swiglu_backward_fp8
from megaq.kernels.dispatch import use_triton
from megaq.kernels.transpose import transpose
from megaq.parallel import comm
from megaq.parallel.comm import Group

PHASE = "tp"
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
EPS = 1e-12  # amax floor: an all-zero tensor gets a finite scale
FORMATS = ("e4m3", "hybrid")
RECIPES = ("tensorwise", "rowwise", "delayed")
AMAX_ALGOS = ("max", "most_recent")


@dataclass(frozen=True)
class FP8Recipe:
    """What GPTConfig(fp8_format=..., fp8_recipe=...) turns on (frozen: hashable, so a
    compiled block can key its graph on it)."""

    format: str = "hybrid"
    scaling: str = "tensorwise"
    # delayed scaling only: steps of amax history, and how a scale is taken from it
    amax_history_len: int = 16
    amax_compute_algo: str = "max"

    def __post_init__(self):
        if self.format not in FORMATS:
            raise ValueError(f"--fp8-format {self.format!r} is not supported; use one of {FORMATS}")
        if self.scaling not in RECIPES:
            raise ValueError(f"--fp8-recipe {self.scaling!r} is not supported; use one of {RECIPES}")
        if self.amax_history_len < 1:
            raise ValueError(f"--fp8-amax-history-len {self.amax_history_len} must be >= 1")
        if self.amax_compute_algo not in AMAX_ALGOS:
            raise ValueError(f"--fp8-amax-compute-algo {self.amax_compute_algo!r} is not "
                             f"supported; use one of {AMAX_ALGOS}")

    @property
    def rowwise(self) -> bool:
        return self.scaling == "rowwise"

    @property
    def delayed(self) -> bool:
        """Per-tensor scales of x and dY from an amax history (megaq.parallel.fp8_delayed);
        the weight keeps its current per-tensor scale."""
        return self.scaling == "delayed"

    @property
    def forward_dtype(self) -> torch.dtype:
        return E4M3

    @property
    def grad_dtype(self) -> torch.dtype:
        return E5M2 if self.format == "hybrid" else E4M3


def fp8_gemm_available(device: torch.device) -> bool:
    """FP8 tensor cores: CUDA, compute capability 8.9 (Ada) or 9.0+ (Hopper)."""
    if device.type != "cuda" or torch.version.hip is not None:
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


# ----------------------------------------------------------------------- casting
def scale_from_amax(amax: torch.Tensor, dtype: torch.dtype, pow2: bool) -> torch.Tensor:
    """The cast's scale (fp8_max / amax) from an fp32 amax; `pow2` rounds it down to a
    power of two. The one home of this arithmetic: the GEMMs' casts and ZeRO's FP8
    weight gathers (megaq.zero.zeropp.fp8_weights) must produce the same bits."""
    fmax = torch.finfo(dtype).max
    # float64 division: eager and compiled graphs give bit-identical scales
    scale = (fmax / amax.double().clamp(min=EPS)).float()
    if pow2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return scale


def cast(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x * scale rounded to `dtype`, saturating at the format's max (as torchao)."""
    fmax = torch.finfo(dtype).max
    return (x.float() * scale).clamp(-fmax, fmax).to(dtype)


def quantize(x: torch.Tensor, dtype: torch.dtype, dim: int | None, pow2: bool,
             group: Group | None = None, role: str = "", with_scale: bool = False) -> tuple:
    """Cast x to FP8 with dynamic scaling; returns (x_fp8, inverse scale), and the scale
    itself third with `with_scale` (to cast again, bit for bit: :func:`recast`).

    dim None: one scale (a 0-d tensor); else one per slice along `dim` (keepdim
    shape). `group`: the amax is MAX-reduced over it first (x is one TP shard of a
    tensor whose scaling group the shard boundary cuts). `pow2`: round the scale
    down to a power of two. Saturating cast, as torchao: values past the format's
    max (impossible with current scaling, but cheap to guard) clamp to it. `role`
    names the operand at the call site (tests/test_fp8.py records casts by it).
    """
    amax = (x.abs().amax() if dim is None else x.abs().amax(dim=dim, keepdim=True)).float()
    if group is not None and group.size > 1:
        amax = amax.contiguous()
        comm.all_reduce(amax, group, PHASE, op=dist.ReduceOp.MAX)
    scale = scale_from_amax(amax, dtype, pow2)
    if with_scale:
        return cast(x, scale, dtype), scale.reciprocal(), scale
    return cast(x, scale, dtype), scale.reciprocal()


def round_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """fp32 `x` rounded to the nearest bf16 value (ties to even), still fp32: the same
    values as ``x.to(torch.bfloat16).float()`` for finite `x`, in integer operations on
    the bits, which inductor keeps inside a fused kernel (it elides a bf16 downcast
    followed by an upcast, so ``x.to(bf16)`` there does not round)."""
    bits = x.view(torch.int32)
    bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & -0x10000
    return bits.view(torch.float32)


def _round_and_cast(out: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
                    via: torch.dtype | None) -> None:
    out.copy_(cast(w if via is None else round_to_bf16(w), scale, E4M3))


class _RefreshCast:
    """The compiled cast of :func:`cast_weight`, built on first use. Its fused rounding
    (``via``) is checked once per process against the two-pass form (round to bf16 in its
    own pass, then the compiled cast of the bf16 tensor, the GEMM's own path): should a
    torch version's inductor compile the rounding differently, the weights keep the GEMM's
    bits through the two-pass form, with one warning, rather than drift from them."""

    def __init__(self, compiled=None):
        self.compiled = compiled
        self.fused_ok = None  # None: not checked yet

    def __call__(self, out, w, scale, via) -> None:
        if self.compiled is None:
            self.compiled = torch.compile(_round_and_cast, dynamic=True)
        if via is None or self.fused_ok:
            return self.compiled(out, w, scale, via)
        if self.fused_ok is None:
            self.compiled(out, w, scale, via)
            two_pass = torch.empty_like(out)
            self.compiled(two_pass, w.to(via), scale, None)
            self.fused_ok = torch.equal(out.view(torch.uint8), two_pass.view(torch.uint8))
            if not self.fused_ok:
                warnings.warn("megaq: this torch's compiled E4M3 weight cast does not round "
                              "to bf16 as the GEMMs do; casting in two passes instead")
            out.copy_(two_pass)
            return
        self.compiled(out, w.to(via), scale, None)


_REFRESH_CAST = _RefreshCast()


def cast_weight(out: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
                via: torch.dtype | None = None) -> None:
    """:func:`cast` to E4M3 of a stored weight into `out`, once per optimizer step (ZeRO-3's
    FP8 weight gathers, stage 0's E4M3-only weights). `via`: round `w` to this 16-bit dtype
    first (stage 0 casts from the fp32 master the value a 16-bit copy would hold). On CUDA
    compiled: one fused pass per weight, reading `w` and writing `out`, the same
    operations, so the same bits, as the GEMM's own cast, which inductor fuses the same way
    inside a compiled block; dynamic shapes, so one graph serves every weight size
    (tests/test_fp8_resident.py: the compiled graph on the CPU backend, the check of
    :class:`_RefreshCast`, and the CUDA case of the one-process test, bit for bit)."""
    if via is not None and (via, w.dtype) != (torch.bfloat16, torch.float32):
        w, via = w.to(via), None  # a separate pass: only bf16 has the in-kernel rounding
    if not w.is_cuda:
        return _round_and_cast(out, w, scale, via)
    _REFRESH_CAST(out, w, scale, via)


def weight_scales(amax: torch.Tensor, groups) -> torch.Tensor:
    """The E4M3 scales of weights cast once per step (ZeRO-3's FP8 weight gathers, stage
    0's E4M3-only weights) from their local fp32 amaxes (1-D): one MAX all-reduce per
    ``(group, phase)`` in `groups` (the groups the weight is split over), so every rank
    casts with the scale the GEMM's own cast of the whole weight would use."""
    for group, phase in groups:  # in place
        comm.all_reduce(amax, group, phase, op=dist.ReduceOp.MAX)
    return scale_from_amax(amax, E4M3, pow2=False)


def recast(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """:func:`cast` again, for backward: the same bits (a product of two floats does not
    depend on their order), with the operands in the other order so that a compiled graph
    does not merge it with the forward's cast (common-subexpression elimination). Merged,
    the forward's FP8 copy would feed megaq's transpose op in backward, an op the
    partitioner cannot recompute into, so it would keep that copy from forward next to the
    bf16 tensors it keeps anyway; apart, backward casts again from what it keeps."""
    fmax = torch.finfo(dtype).max
    return (scale * x.float()).clamp(-fmax, fmax).to(dtype)


def recast_col_major(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """:func:`recast` laid out as _scaled_mm's second operand (column-major: the transpose
    contiguous), written so in the pass that casts. For backward's operands that a compiled
    block casts from a bf16 tensor in memory (the weight, and the input of a row-parallel
    layer: attention's or SwiGLU's output, pointwise work in backward): inductor reads the
    bf16 tensor in tiles and stores the FP8 copy transposed, 3 bytes an element, where a cast
    then megaq's transpose (:func:`_col_major`) move 5. Not where inductor would fuse the
    transposed store into a reduction (the norm's output, recomputed in backward: the
    transpose module's docstring); not eager, where the copy would be torch's generic one."""
    return recast(x.t(), scale, dtype).contiguous().t()


def cast_transposed_in_backward(device: torch.device) -> bool:
    """Whether backward casts the weight and a row-parallel input with
    :func:`recast_col_major`: inside a compiled block, where the GEMM is torch._scaled_mm
    (the emulation reads any layout). One place, so that the benchmark's A/B variant can
    turn it off (tools/bench/bench_train.py, the -otr variants)."""
    return torch.compiler.is_compiling() and fp8_gemm_available(device)


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """|x|'s max as fp32, reduced per row first: the iteration shape of the kernels that
    produce x (norms, SwiGLU, their backward), so inductor computes it in the same pass
    that writes x's FP8 copy (max is exact: the same value as x.abs().amax())."""
    return x.abs().amax(dim=-1).amax().float()


def quantize_delayed(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor,
                     role: str = "") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cast x with a scale known before x (delayed scaling): one pointwise cast and, on
    the same input, the amax that feeds the history (not this cast). Returns (x_fp8,
    inverse scale, local amax)."""
    return cast(x, scale, dtype), scale.reciprocal(), tensor_amax(x)


def _row_major(a: torch.Tensor) -> torch.Tensor:
    """`a` as _scaled_mm's first operand (row-major). A transposed view (dY^T in the
    weight-gradient GEMM) is copied by megaq.kernels.transpose: an op that inductor does
    not fuse into the reduction kernel producing dY, where its transposed store is slow
    (that module's docstring)."""
    if a.is_contiguous():
        return a
    return transpose(a.t()) if a.t().is_contiguous() else a.contiguous()


def _col_major(b: torch.Tensor) -> torch.Tensor:
    """`b` as _scaled_mm's second operand (column-major): X in the weight-gradient GEMM,
    W in the input-gradient GEMM are row-major and copied as in :func:`_row_major`."""
    if b.t().is_contiguous():
        return b
    return transpose(b).t() if b.is_contiguous() else b.t().contiguous().t()


def scaled_mm(a: torch.Tensor, b: torch.Tensor, a_inv: torch.Tensor, b_inv: torch.Tensor,
              out_dtype: torch.dtype, fast_accum: bool) -> torch.Tensor:
    """(a @ b) * a_inv * b_inv for FP8 a [M, K], b [K, N]; a_inv scalar or [M, 1],
    b_inv scalar or [1, N]. torch._scaled_mm where FP8 tensor cores exist, else the
    fp32 emulation of the same product."""
    rowwise = a_inv.dim() > 0
    if not fp8_gemm_available(a.device) or a.shape[1] % 16 or b.shape[1] % 16:
        return ((a.float() @ b.float()) * a_inv * b_inv).to(out_dtype)
    a, b = _row_major(a), _col_major(b)
    # cuBLASLt wants 16-byte aligned operands: ZeRO's FP8 gathers lay their weights out
    # aligned (megaq.zero.partition); no check here, it would break a compiled graph
    mm_dtype = torch.bfloat16 if rowwise else out_dtype  # rowwise kernels write bf16 only
    if rowwise and not fast_accum:
        # the rowwise kernel is slow without fast accumulation: run the per-tensor
        # kernel with unit scales and apply the row/column scales after (torchao's way);
        # the scales are powers of two, so scaling the bf16 product rounds nothing more
        one = a_inv.new_ones(())
        y = torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=mm_dtype)
        return (y * a_inv * b_inv).to(out_dtype)
    y = torch._scaled_mm(a, b, scale_a=a_inv, scale_b=b_inv, out_dtype=mm_dtype,
                         use_fast_accum=fast_accum)
    return y.to(out_dtype)


# ------------------------------------------------------------------ the FP8 linear
def _maybe(group: Group, cond: bool) -> Group | None:
    return group if cond and group.size > 1 else None


class _FP8Linear(torch.autograd.Function):
    """y = x W^T with FP8 GEMMs forward and backward.

    `parallel` says which dimension TP splits: "column" (W's output rows; x is whole,
    dY is split) or "row" (W's input columns; x is split, dY is whole). That decides
    which amaxes cross a shard boundary and are reduced (module docstring).

    `swiglu` (fc1 of a SwiGLU MLP, column-parallel; megaq.parallelize.apply_fp8): the
    function returns silu(gate) * up of its [gate | up] output, and its backward takes
    that product's gradient. SwiGLU's backward then produces dY for this layer's own
    GEMMs, and with a delayed scale one kernel writes dY's FP8 copy, its transpose and
    its amax (kernels/fused_swiglu.swiglu_backward_fp8): compiled, the backward, the cast
    with its amax and the transpose are three passes over dY (the bf16 dY written and read
    again), where the bytes need one.

    `cos`, `sin` (attention's fused QKV layer with RoPE, column-parallel; `per_group`
    query heads a group): the function returns RoPE'd q and k and v, split from its
    output as kernels/fused_rope.qkv_rope_split lays it out, and its backward takes their
    three gradients. With a delayed scale one kernel then writes dY's FP8 copy, its
    transpose and its amax from dq, dk and dv (kernels/fused_rope.qkv_rope_backward_fp8),
    where compiled, assembling dY with RoPE's backward, the cast and its amax are one
    pass and the transposed copy another.

    `weight_fp8`, `weight_inv` (tensorwise only): the weight already cast, as ZeRO-3's
    FP8 weight gather delivers it (``--zero-quantized-weights fp8``): E4M3 with the
    inverse of the per-tensor scale this function would have computed from `weight`
    (the same amax over the whole TP-split tensor, the same arithmetic). The weight's
    own cast is then skipped and `weight` itself is never read: it only receives dW.
    """

    @staticmethod
    def forward(ctx, x, weight, recipe: FP8Recipe, group: Group, parallel: str,
                weight_fp8=None, weight_inv=None, amax_scale=None, amax_now=None,
                grad_sink=None, ready: bool = False, record: bool = False, swiglu: bool = False,
                cos=None, sin=None, per_group: int = 0):
        col = parallel == "column"
        rw, fwd = recipe.rowwise, recipe.forward_dtype
        x2 = x.reshape(-1, x.shape[-1])
        delayed = amax_scale is not None
        if delayed and ready:  # the history's scale; this x's amax on the side, same pass
            x_scale = amax_scale[0]
            xq, xs, x_amax = quantize_delayed(x2, fwd, x_scale, "input")
        else:
            # rowwise: scales along the input features, split only in a row-parallel layer;
            # tensorwise: the weight is split in both kinds of layer, x only in row-parallel
            xq, xs, x_scale = quantize(x2, fwd, -1 if rw else None, rw, _maybe(group, not col),
                                       "input", with_scale=True)
            x_amax = tensor_amax(x2) if delayed else None
        if delayed and record:  # this step's running max (the history: fp8_delayed)
            amax_now[0].copy_(torch.maximum(amax_now[0], x_amax))
        w_scale = None  # the weight's cast scale when this function casts it
        if weight_fp8 is not None:  # gathered in FP8 by the ZeRO engine: cast already
            wq, ws = weight_fp8, weight_inv
        else:
            wq, ws, w_scale = quantize(weight, fwd, 1 if rw else None, rw,
                                       _maybe(group, not (rw and col)), "weight", with_scale=True)
        y = scaled_mm(xq, wq.t(), xs, ws.t() if rw else ws, x.dtype, fast_accum=True)
        ctx.recipe, ctx.group, ctx.col, ctx.swiglu = recipe, group, col, swiglu
        ctx.rope = cos is not None
        # SwiGLU's input, for its backward (as swiglu keeps it); RoPE's tables
        kept = (y,) if swiglu else (cos, sin) if ctx.rope else ()
        # delayed: dY's scale, and whether to report dY's amax (as the grad of amax.grad_sink)
        ctx.dy_scale = amax_scale[1] if delayed and ready else None
        ctx.amax_to_sink = delayed and record
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, weight.dtype
        if rw:  # backward casts along other dims: keep the originals
            ctx.save_for_backward(x2, weight, *kept)
        else:
            # one scale per tensor: backward's casts are the forward's, bit for bit. The
            # weight, in memory anyway, is cast again there (an FP8 copy kept from forward
            # would be one more byte per parameter); ZeRO's gathered FP8 weight is kept as
            # it is (the engine's buffer, not a copy). x: eager keeps its FP8 copy (half
            # the bytes of x, which nothing else keeps); a compiled block keeps x and
            # casts it again in backward, where inductor's partitioner recomputes x from
            # what the norm, SwiGLU and attention backward keep anyway (the FP8 copy
            # would be one more byte per element of every GEMM input). Not the input of
            # a column-parallel layer at TP > 1: under sequence parallelism it comes out
            # of an all-gather, which the partitioner never recomputes, so it would keep
            # the gathered bf16 x, twice the FP8 copy's bytes
            recompute_x = torch.compiler.is_compiling() and (not col or group.size == 1)
            x_keep, x_scale_keep = (x2, x_scale) if recompute_x else (xq, None)
            w_keep = weight if w_scale is not None else wq
            ctx.save_for_backward(x_keep, x_scale_keep, xs, w_keep, w_scale, ws, *kept)
        if swiglu:
            y = SWIGLU.pick(y)(y)
        y = y.reshape(*x.shape[:-1], y.shape[-1])
        if ctx.rope:  # (q, k, v): three tensors of their own, each with its gradient
            return qkv_rope_split(y, cos, sin, per_group)
        return y

    @staticmethod
    def backward(ctx, *grads):
        recipe, group, col = ctx.recipe, ctx.group, ctx.col
        gdt, rw = recipe.grad_dtype, recipe.rowwise
        saved = ctx.saved_tensors
        dy = grads[0]
        dyq_t = None  # dY's FP8 copy transposed, when SwiGLU's or RoPE's backward wrote it
        if ctx.rope:  # dq, dk, dv: this layer's dY comes from them through RoPE's backward
            (cos, sin), saved = saved[-2:], saved[:-2]
            if ctx.dy_scale is not None and use_triton(dy, QKV_ROPE_BACKWARD_FP8.under_compile):
                dyq, dyq_t, dy_amax = qkv_rope_backward_fp8(*grads, cos, sin, ctx.dy_scale, gdt)
            else:
                dy = qkv_rope_backward(*grads, cos, sin)
        dy2 = dy.reshape(-1, dy.shape[-1]) if dyq_t is None else None
        if ctx.swiglu:  # dy is d(silu(gate) * up): this layer's dY comes from it
            y, saved = saved[-1], saved[:-1]  # [tokens, 2F], as the GEMM wrote it
            if ctx.dy_scale is not None and use_triton(y, SWIGLU_BACKWARD_FP8.under_compile):
                dyq, dyq_t, dy_amax = swiglu_backward_fp8(dy2, y, ctx.dy_scale, gdt)
            else:
                dy2 = swiglu_backward(dy2, y)
        dx = dw = None
        if rw:
            x2, weight = saved
            if ctx.needs_input_grad[0]:  # dX = dY W: reduction over output features
                dyq, dys = quantize(dy2, gdt, -1, True, _maybe(group, col), "grad_output")
                wq, ws = quantize(weight, recipe.forward_dtype, 0, True, _maybe(group, col),
                                  "weight_for_grad_input")
                dx = scaled_mm(dyq, wq, dys, ws, ctx.x_dtype, fast_accum=False)
            if ctx.needs_input_grad[1]:  # dW = dY^T X: reduction over tokens (never split)
                dyq, dys = quantize(dy2, gdt, 0, True, None, "grad_output_for_grad_weight")
                xq, xs = quantize(x2, recipe.forward_dtype, 0, True, None, "input_for_grad_weight")
                dw = scaled_mm(dyq.t(), xq, dys.t(), xs, ctx.w_dtype, fast_accum=False)
        else:
            x_keep, x_scale, xs, w, w_scale, ws = saved
            fwd = recipe.forward_dtype
            # the weight is read only by dX's GEMM and x only by dW's, both as the second
            # operand: cast them in that layout where the cast is a pass of its own
            fused_t = cast_transposed_in_backward(dy.device)
            x_cast = recast_col_major if fused_t and not col else recast
            w_cast = recast_col_major if fused_t else recast
            xq = x_keep if x_scale is None else x_cast(x_keep, x_scale, fwd)
            wq = w if w_scale is None else w_cast(w, w_scale, fwd)
            if dyq_t is not None:
                dys = ctx.dy_scale.reciprocal()
            elif ctx.dy_scale is not None:
                dyq, dys, dy_amax = quantize_delayed(dy2, gdt, ctx.dy_scale, "grad_output")
            else:
                dyq, dys = quantize(dy2, gdt, None, False, _maybe(group, col), "grad_output")
                dy_amax = tensor_amax(dy2) if ctx.amax_to_sink else None
            if ctx.needs_input_grad[0]:
                dx = scaled_mm(dyq, wq, dys, ws, ctx.x_dtype, fast_accum=False)
            if ctx.needs_input_grad[1]:
                dw = scaled_mm(dyq.t() if dyq_t is None else dyq_t, xq, dys, xs, ctx.w_dtype,
                               fast_accum=False)
        if dx is not None:
            dx = dx.reshape(ctx.x_shape)
        sink = dy_amax.reshape(1) if ctx.amax_to_sink else None
        return dx, dw, None, None, None, None, None, None, None, sink, None, None, None, None, None, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           recipe: FP8Recipe | None, group: Group, parallel: str,
           weight_fp8: torch.Tensor | None = None,
           weight_inv: torch.Tensor | None = None, amax_state=None,
           swiglu: bool = False, rotary=None, per_group: int = 0):
    """The TP layers' GEMM: F.linear without a recipe, else the FP8 GEMMs above
    (`weight_fp8` / `weight_inv`: the weight as ZeRO's FP8 gather delivered it;
    `amax_state`: the layer's fp8_delayed.AmaxState, for the delayed recipe; `swiglu`:
    return silu(gate) * up of the [gate | up] output, a column-parallel layer without
    bias; `rotary` (RoPE's (cos, sin) tables) with `per_group` query heads a group:
    return (q, k, v) of the fused QKV output, q and k rotated, a column-parallel layer
    without bias)."""
    if (swiglu or rotary is not None) and (parallel != "column" or bias is not None or recipe is None):
        raise ValueError("the SwiGLU and RoPE epilogues are for an FP8 column-parallel layer "
                         "without bias")
    rope = (None, None, 0) if rotary is None else (*rotary, per_group)
    if recipe is None:
        return F.linear(x, weight, bias)
    if parallel not in ("column", "row"):
        raise ValueError(f"parallel must be 'column' or 'row', not {parallel!r}")
    if weight_fp8 is not None and recipe.rowwise:
        raise ValueError("an FP8-gathered weight carries one per-tensor scale; the rowwise "
                         "recipe casts per row: use --fp8-recipe tensorwise")
    if recipe.delayed != (amax_state is not None):
        raise ValueError("the delayed FP8 recipe needs the layer's amax state (and only it)")
    if amax_state is None:
        y = _FP8Linear.apply(x, weight, recipe, group, parallel, weight_fp8, weight_inv,
                             None, None, None, False, False, swiglu, *rope)
    else:  # the grad sink's gradient carries dY's amax out of backward (fp8_delayed)
        s = amax_state
        y = _FP8Linear.apply(x, weight, recipe, group, parallel, weight_fp8, weight_inv,
                             s.scale, s.now, s.grad_sink, s.ready, torch.is_grad_enabled(),
                             swiglu, *rope)
    return y if bias is None else y + bias


class FP8GEMM(nn.Module):
    """The GEMM of one TP linear layer in FP8: ``gemm(x, weight, bias)`` is
    :func:`linear` with this recipe, the layer's TP group and its split ("column" or
    "row"). megaq.parallelize puts one in the ``gemm`` slot of each linear layer of the
    transformer blocks (megaq.parallel.tensor_parallel). It holds the GEMM's state:

    * ``weight_fp8`` / ``weight_fp8_inv``: the layer's weight as ZeRO-3's FP8 weight
      gather delivers it (E4M3 and its inverse per-tensor scale; megaq.zero.zeropp
      sets them with :func:`use_fp8_weight`); None: the GEMM casts the weight itself.
      Buffers (not persistent, so never in a state dict) so that a compiled block
      treats them as graph inputs, as it treats the parameters;
    * ``amax``: the delayed recipe's megaq.parallel.fp8_delayed.AmaxState, else None;
    * ``swiglu``: the GEMM returns silu(gate) * up of its output (fc1 of a SwiGLU MLP,
      whose own activation is then off: megaq.parallelize.apply_fp8);
    * ``rope_per_group``: attention's fused QKV layer with this many query heads a
      group, whose GEMM, given RoPE's tables (``gemm(x, weight, None, rotary=...)``),
      returns q and k rotated and v (megaq.model.attention); 0: not that layer.
    """

    def __init__(self, recipe: FP8Recipe, group: Group, parallel: str, amax: nn.Module | None = None,
                 swiglu: bool = False, rope_per_group: int = 0):
        super().__init__()
        if parallel not in ("column", "row"):
            raise ValueError(f"parallel must be 'column' or 'row', not {parallel!r}")
        self.recipe, self.group, self.parallel, self.swiglu = recipe, group, parallel, swiglu
        self.rope_per_group = rope_per_group
        self.register_buffer("weight_fp8", None, persistent=False)
        self.register_buffer("weight_fp8_inv", None, persistent=False)
        self.amax = amax

    def forward(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                rotary=None):
        if rotary is not None and not self.rope_per_group:
            raise ValueError("RoPE's tables go to the fused QKV layer's FP8 GEMM only")
        return linear(x, weight, bias, self.recipe, self.group, self.parallel,
                      self.weight_fp8, self.weight_fp8_inv, self.amax, self.swiglu,
                      rotary, self.rope_per_group)

    def extra_repr(self) -> str:
        return (f"{self.parallel}, {self.recipe}" + (", swiglu" if self.swiglu else "")
                + (f", rope ({self.rope_per_group} query heads a group)" if self.rope_per_group else ""))


def fp8_gemm_layers(module: nn.Module) -> list[nn.Module]:
    """The linear layers under `module` whose GEMMs run in FP8 (an :class:`FP8GEMM` in
    their ``gemm`` slot), in module order."""
    return [m for m in module.modules() if isinstance(getattr(m, "gemm", None), FP8GEMM)]


def use_fp8_weight(layer: nn.Module, weight_fp8: torch.Tensor, weight_inv: torch.Tensor) -> None:
    """From now on `layer`'s FP8 GEMM reads these instead of casting its weight."""
    if tuple(weight_fp8.shape) != tuple(layer.weight.shape) or weight_inv.dim() != 0:
        raise ValueError(f"FP8 weight of shape {tuple(weight_fp8.shape)} / scale of shape "
                         f"{tuple(weight_inv.shape)} for a weight of shape {tuple(layer.weight.shape)}")
    layer.gemm.weight_fp8, layer.gemm.weight_fp8_inv = weight_fp8, weight_inv


__all__ = ["FP8Recipe", "FP8GEMM", "linear", "quantize", "quantize_delayed", "tensor_amax",
           "AMAX_ALGOS", "scale_from_amax", "cast", "scaled_mm", "fp8_gemm_available",
           "fp8_gemm_layers", "use_fp8_weight", "cast_weight", "recast_col_major", "FORMATS", "RECIPES"]
