"""The quantization ops on the GPU (and under TRITON_INTERPRET=1): quantize, dequantize,
reorder_quantize, dequant_reduce_quantize, dequant_reduce and hadamard, with the
signatures and bit-identical results of kernels/reference.py.

This module is the host side: it checks the arguments, works out each distinct call's
launch once (a memoised plan), allocates the output and launches the kernels of
kernels/quant_triton.py. Each op takes a keyword-only `tuning` (kernels/tuning.py: how
the kernels launch, never what they compute; the benchmarks and tests pass theirs).
"""

import functools
import math
import typing

import torch

from .format import (
    HOP_FLOOR,
    HOP_FLUSH,
    QMAX,
    HADAMARD_SIGNS,
    HADAMARD_SIZE,
    KERNEL_API,
    TINY,
    check_code,
    check_hadamard,
    check_float_dtype,
    check_float_input,
    check_format,
    check_out,
    check_packed_layout,
    check_reorder,
    check_residual,
    packed_len,
)
from . import quant_triton as kt
from .launch import Launch, TensorDescriptor
from .tuning import DEFAULT_TUNING, Tuning

__all__ = list(KERNEL_API)


# Launch defaults, from the H200 sweeps of tools/bench/bench_kernels.py and
# sweep_kernels.py (docs/PERFORMANCE.md): the quantize kernel gives ~64 elements to a
# thread and 2 blocks to a program; the int4 word kernels 32 (float output) or 64 (the
# hop, which spreads its per-block work) and one block per program. (What a caller may
# vary, the size thresholds of the evict-first loads and of the bulk copies among it, is
# a field of kernels/tuning.py's Tuning.)
QUANTIZE_PER_THREAD = 64
QUANTIZE_NB = 2
WORDS_PER_THREAD = 32
HOP_PER_THREAD = 64
WORDS_NB = 1
BULK_COPIES_PER_THREAD = 32  # the bulk-copy quantize (from Tuning.bulk_copies_from elements)
# Below Tuning.bulk_copies_from the int8 quantize (linear code, no residual or transform)
# launches in DeepSpeed's shape: 16 elements a thread, one block a program, with the
# registers capped at 32 so that 2,048 threads fill an SM. Per call on the H200 at 16M
# and 32M elements (4096-blocks, 8 warps a program; training's 2048-blocks, 4 warps, the
# same work a thread) that is ~1% ahead of the 64-a-thread shape above; the same shape
# uncapped (37 registers, 75% of the threads) is 6% behind (docs/PERFORMANCE.md,
# "Per call"). From 64M, where bulk copies are not used (before Hopper, or a row that is
# not 16-byte aligned), the 64-a-thread shape stays: 0.3-0.6% ahead of the capped one
# while the kernel divided before its loads; since then one sweep read it 0-1.3% behind
# (docs/results/quantize8_divisions_h200.json, runs 3-4), too little from one run to move
# the rule on.
QUANTIZE8_SMALL_PER_THREAD = 16
QUANTIZE8_SMALL_REGS = 32


def _launch_opts(tuning: Tuning, block: int, per_thread: int, nb_default: int, *block_counts: int,
                 regs: int | None = None) -> dict:
    """Constexprs and launch options. NB (blocks per program) is the largest of
    {nb_default, 2, 1} dividing every count; warps give about `per_thread` elements per
    thread; `regs` caps the registers of that default shape (not of one the Tuning sets:
    a cap sized for 16 elements a thread would spill at 64). H200 sweep at 256M elements
    (docs/PERFORMANCE.md): quantize is fastest with NB=2 and ~64 elements per thread,
    dequantize with NB=1 and 16-32 per thread. Called when a plan is made (below), so
    once per distinct call."""
    p2 = _next_pow2(block)
    want = tuning.nb or nb_default
    nb = next(c for c in (want, 2, 1) if c <= want and all(n % c == 0 for n in block_counts))
    warps = tuning.warps or max(1, min(16, p2 * nb // (32 * per_thread)))
    opts = dict(NB=nb, BLOCK=block, BLOCK_P2=p2, TINY=TINY, num_warps=warps, enable_fp_fusion=False)
    if tuning.regs is not None:
        regs = tuning.regs
    elif tuning.warps or tuning.nb:
        regs = None
    if regs:
        opts["maxnreg"] = regs
    return opts


def _next_pow2(n: int) -> int:
    """triton.next_power_of_2 without its constexpr-function wrapper."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


@functools.lru_cache(maxsize=None)
def _has_bulk_copies(device) -> bool:
    """Hopper (sm_90) or newer, and a Triton with host-side tensor descriptors."""
    return (TensorDescriptor is not None and device.type == "cuda"
            and torch.cuda.get_device_capability(device)[0] >= 9)


_SIGNS: dict = {}  # device -> the HADAMARD_SIGNS tensor (a constant, built once per device)


def _signs(device) -> torch.Tensor:
    t = _SIGNS.get(device)
    if t is None:
        t = _SIGNS[device] = torch.tensor(HADAMARD_SIGNS, dtype=torch.float32, device=device)
    return t


# Plans. What an op launches depends only on its arguments' shapes, dtypes and options
# and on the Tuning it was given, so it is worked out (and checked) once per distinct call,
# by the memoised functions below; a call then costs its output's allocation, the
# alignment checks that choose a kernel, and the launch. That host path must stay well
# inside the time a per-call benchmark's L2 flush leaves it (docs/PERFORMANCE.md, "Per
# call"). A bad argument raises on every call: lru_cache keeps results, not exceptions.
_memoised = functools.lru_cache(maxsize=1024)


class _Plan(typing.NamedTuple):
    out_shape: tuple
    launch: Launch | None  # None: an empty input, nothing to launch
    words: Launch | None = None  # the int4 word kernel's launch, where the shapes allow it (_reduce_into)
    hop: bool = False  # the word kernel is the hop (_INT4_HOP), not the float-output one
    bulk: Launch | None = None  # the int8 bulk-copy kernel's, where the shape allows it (_quantize_into)
    bulk_forced: bool = False  # Tuning.tma asked for bulk copies: used without the device check


def _rows_plan(out_shape, rows, k, m, S, bits, block, code, hadamard, has_res, tuning) -> _Plan:
    """The quantize kernel for `rows` output rows of k * S elements, output row j's block
    b reading input chunk (b // (S / block)) * m + j (k = m = 1: plain rows)."""
    if rows == 0:
        return _Plan(out_shape, None)
    P = packed_len(k * S, bits, block)
    row_blocks, chunk_blocks, n = k * S // block, S // block, rows * k * S
    plain8 = bits == 8 and code == "linear" and not (has_res or hadamard)  # the qwZ weight quantize
    if plain8 and not tuning.chunked and n < tuning.bulk_copies_from:
        opts = _launch_opts(tuning, block, QUANTIZE8_SMALL_PER_THREAD, 1, row_blocks, chunk_blocks,
                            regs=QUANTIZE8_SMALL_REGS)
    else:
        opts = _launch_opts(tuning, block, QUANTIZE_PER_THREAD, QUANTIZE_NB, row_blocks, chunk_blocks)
    evict = tuning.evict
    if evict is None:
        evict = "evict_first" if n < tuning.evict_first_below[bits] else ""
    launch = Launch((rows * row_blocks // opts["NB"],), (m, chunk_blocks, row_blocks // opts["NB"], P,
                                                         k * S * bits // 8),
                    dict(BITS=bits, QMAX=QMAX[bits], HAS_RES=has_res, SQUARE=code == "square", HADAMARD=hadamard,
                         CHUNKED=tuning.chunked and block % HADAMARD_SIZE == 0, EVICT=evict, PLAIN=k == 1,
                         ONE_ROW=k == 1 and rows == 1, **opts), cached=tuning.cached_launch)
    bulk = None
    if (plain8 and rows == 1 and k == 1 and block % 64 == 0 and (tuning.nb or 1) * block <= 256 * 64
            and (tuning.tma if tuning.tma is not None else S >= tuning.bulk_copies_from)):
        opts = _launch_opts(tuning, block, BULK_COPIES_PER_THREAD, 1, S // block)
        bulk = Launch((S // (opts["NB"] * block),), (S,),
                      dict(ROWS=opts["NB"] * block // 64, NB=opts["NB"], QMAX=QMAX[8], TINY=opts["TINY"],
                           **{name: opts[name] for name in ("num_warps", "enable_fp_fusion", "maxnreg") if name in opts}),
                      cached=tuning.cached_launch)
    return _Plan(out_shape, launch, bulk=bulk, bulk_forced=bool(tuning.tma))


def _quantize_into(plan: _Plan, x, residual, out):
    """Launch a _rows_plan: x and residual contiguous (residual None: no error feedback).
    Bulk copies where the plan allows them (the int8 quantize of one row, no residual,
    linear code, blocks of whole 64-element rows, at most 256 of them a program), the
    device has them (or Tuning.tma forced them) and the row is 16-byte aligned."""
    if plan.launch is None:
        return
    if plan.bulk is not None and (plan.bulk_forced or _has_bulk_copies(x.device)) and x.data_ptr() % 16 == 0:
        _quantize8_tma(x, out, plan.bulk)
    else:
        kt.QUANTIZE.launch(plan.launch, x, residual if residual is not None else x, out)


def _quantize8_tma(x, out, bulk: Launch):
    """One row's int8 quantize with bulk tensor copies (_quantize8_tma_kernel): x (S
    elements) and the payload (out's first S bytes) as [S / 64, 64] tiles of ROWS rows.
    The descriptors take the contiguous tensors themselves as bases (no views to make)."""
    shape, box = [bulk.scalars[0] // 64, 64], [bulk.kwargs["ROWS"], 64]
    kt.QUANTIZE8_TMA.launch(bulk, out, TensorDescriptor(x, shape, [64, 1], box),
                            TensorDescriptor(out, shape, [64, 1], box))


def _reduce_plan(tuning, out_shape, out_rows, n_sum, L_in, bits_in, in_row_bytes, in_rows_per_out,
                 in_blocks_per_out, out_row_len, bits_out, block, factor=None, accumulate=False, code="linear",
                 hadamard=False) -> _Plan:
    """Output row o sums n_sum input rows (o * in_rows_per_out + r, from block
    o * in_blocks_per_out), then requantizes to bits_out or writes floats (bits_out 0)."""
    out_row_blocks = out_row_len // block
    out_row_bytes = packed_len(out_row_len, bits_out, block) if bits_out else 0
    square = code == "square"
    words = None
    if tuning.words and bits_in == 4 and bits_out in (0, 4) and block % 8 == 0:
        per_thread = HOP_PER_THREAD if bits_out else WORDS_PER_THREAD
        opts = _launch_opts(tuning, block, per_thread, WORDS_NB, out_row_blocks, in_blocks_per_out or out_row_blocks)
        opts.update(W=block // 8, W_P2=_next_pow2(block // 8))
        grid = (out_rows * out_row_blocks // opts["NB"],)
        scalars = (in_row_bytes // 4, L_in // 8, in_rows_per_out, in_blocks_per_out, out_row_blocks // opts["NB"])
        if bits_out:
            del opts["BLOCK"], opts["BLOCK_P2"]
            words = Launch(grid, scalars + (out_row_bytes // 4, out_row_len // 8),
                           dict(N_SUM=n_sum, HOP_FLUSH=HOP_FLUSH, HOP_FLOOR=HOP_FLOOR, SQUARE=square, **opts),
                           cached=tuning.cached_launch)
        else:
            del opts["TINY"]
            words = Launch(grid, scalars + (float(factor or 1.0),),
                           dict(N_SUM=n_sum, HAS_FACTOR=factor is not None, ACCUMULATE=accumulate,
                                MANUAL_BF16=kt.INTERPRETED, MAGIC=tuning.magic, SQUARE=square, HADAMARD=hadamard,
                                **opts), cached=tuning.cached_launch)
    opts = _launch_opts(tuning, block, 32, 1, out_row_blocks, in_blocks_per_out or out_row_blocks)
    launch = Launch((out_rows * out_row_blocks // opts["NB"],),
                    (in_row_bytes, L_in * bits_in // 8, in_rows_per_out, in_blocks_per_out,
                     out_row_blocks // opts["NB"], out_row_bytes, out_row_len * bits_out // 8, float(factor or 1.0)),
                    dict(N_SUM=n_sum, BITS_IN=bits_in, BITS_OUT=bits_out, QMAX_OUT=QMAX.get(bits_out, 1),
                         HAS_FACTOR=factor is not None, ACCUMULATE=accumulate, MANUAL_BF16=kt.INTERPRETED,
                         HOP_FLUSH=HOP_FLUSH, HOP_FLOOR=HOP_FLOOR, SQUARE=square, HADAMARD=hadamard, **opts),
                    cached=tuning.cached_launch)
    return _Plan(out_shape, launch, words, hop=bool(bits_out))


def _reduce_into(plan: _Plan, recv, out):
    """Launch a _reduce_plan: the int4 word kernel where it applies and both buffers are
    4-byte aligned (whole words), else the byte kernel (any alignment)."""
    if plan.launch is None:
        return
    if plan.words is not None and recv.data_ptr() % 4 == 0 and out.data_ptr() % 4 == 0:
        if plan.hop:
            kt.INT4_HOP.launch(plan.words, recv, out)
        else:
            kt.INT4_WORDS.launch(plan.words, recv, out, _signs(recv.device))
    else:
        kt.DEQUANT_REDUCE.launch(plan.launch, recv, out, _signs(recv.device))


@_memoised
def _quantize_plan(shape, dtype, bits, block, code, hadamard, tuning) -> _Plan:
    check_float_dtype(dtype)
    L = shape[-1] if shape else 0
    check_format(L, bits, block)
    check_code(code)
    if hadamard:
        check_hadamard(block)
    rows = math.prod(shape[:-1])
    return _rows_plan(shape[:-1] + (packed_len(L, bits, block),), rows, 1, 1, L, bits, block, code, hadamard,
                      False, tuning)


def quantize(x: torch.Tensor, bits: int, block: int, code: str = "linear",
             hadamard: bool = False, *, tuning: Tuning = DEFAULT_TUNING) -> torch.Tensor:
    plan = _quantize_plan(x.shape, x.dtype, bits, block, code, hadamard, tuning)
    x = x.contiguous()
    out = torch.empty(plan.out_shape, dtype=torch.uint8, device=x.device)
    _quantize_into(plan, x, None, out)
    return out


@_memoised
def _dequantize_plan(shape, packed_dtype, L, bits, block, code, tuning) -> _Plan:
    check_packed_layout(shape, packed_dtype, L, bits, block)
    check_code(code)
    rows = math.prod(shape[:-1])
    out_shape = shape[:-1] + (L,)
    if rows == 0:
        return _Plan(out_shape, None)
    return _reduce_plan(tuning, out_shape, rows, 1, L, bits, shape[-1], 1, 0, L, 0, block, code=code)


def dequantize(
    packed: torch.Tensor, L: int, bits: int, block: int, dtype: torch.dtype = torch.float32,
    code: str = "linear", *, tuning: Tuning = DEFAULT_TUNING,
) -> torch.Tensor:
    plan = _dequantize_plan(packed.shape, packed.dtype, L, bits, block, code, tuning)
    packed = packed.contiguous()
    out = torch.empty(plan.out_shape, dtype=dtype, device=packed.device)
    _reduce_into(plan, packed, out)
    return out


@_memoised
def _reorder_plan(numel, dtype, k, m, bits, block, code, hadamard, has_res, tuning) -> _Plan:
    check_float_dtype(dtype)
    S = check_reorder(numel, k, m, block)
    check_format(S, bits, block)
    check_code(code)
    if hadamard:
        check_hadamard(block)
    return _rows_plan((m, packed_len(k * S, bits, block)), m, k, m, S, bits, block, code, hadamard, has_res, tuning)


def reorder_quantize(
    grad: torch.Tensor, k: int, m: int, bits: int, block: int,
    residual: torch.Tensor | None = None, code: str = "linear", hadamard: bool = False, *,
    tuning: Tuning = DEFAULT_TUNING,
) -> torch.Tensor:
    plan = _reorder_plan(grad.numel(), grad.dtype, k, m, bits, block, code, hadamard, residual is not None, tuning)
    if residual is not None:
        check_residual(residual, grad)
    grad = grad.contiguous()
    out = torch.empty(plan.out_shape, dtype=torch.uint8, device=grad.device)
    _quantize_into(plan, grad, residual, out)
    return out


@_memoised
def _hop_plan(shape, packed_dtype, k, S, bits_in, bits_out, block, code, tuning) -> _Plan:
    check_format(S, bits_out, block)
    check_packed_layout(shape, packed_dtype, k * S, bits_in, block)
    check_code(code)
    n_sum = math.prod(shape[:-1])
    return _reduce_plan(tuning, (k, packed_len(S, bits_out, block)), k, n_sum, k * S, bits_in, shape[-1], 0,
                        S // block, S, bits_out, block, code=code)


def dequant_reduce_quantize(
    recv: torch.Tensor, k: int, S: int, bits_in: int, bits_out: int, block: int,
    code: str = "linear", *, tuning: Tuning = DEFAULT_TUNING,
) -> torch.Tensor:
    plan = _hop_plan(recv.shape, recv.dtype, k, S, bits_in, bits_out, block, code, tuning)
    recv = recv.contiguous()
    out = torch.empty(plan.out_shape, dtype=torch.uint8, device=recv.device)
    _reduce_into(plan, recv, out)
    return out


@_memoised
def _final_reduce_plan(shape, packed_dtype, S, bits, block, scale, accumulate, code, hadamard, tuning) -> _Plan:
    check_packed_layout(shape, packed_dtype, S, bits, block)
    check_code(code)
    if hadamard:
        check_hadamard(block)
    n_sum = math.prod(shape[:-1])
    return _reduce_plan(tuning, (S,), 1, n_sum, S, bits, shape[-1], 0, 0, S, 0, block, float(scale), accumulate,
                        code, hadamard)


def dequant_reduce(
    recv: torch.Tensor, S: int, bits: int, block: int, scale: float = 1.0,
    out: torch.Tensor | None = None, code: str = "linear", hadamard: bool = False, *,
    tuning: Tuning = DEFAULT_TUNING,
) -> torch.Tensor:
    accumulate = out is not None
    plan = _final_reduce_plan(recv.shape, recv.dtype, S, bits, block, scale, accumulate, code, hadamard, tuning)
    if accumulate:
        check_out(out, S)
    else:
        out = torch.empty(plan.out_shape, dtype=torch.float32, device=recv.device)
    _reduce_into(plan, recv.contiguous(), out)
    return out


def hadamard(x: torch.Tensor, inverse: bool = False, *, tuning: Tuning = DEFAULT_TUNING) -> torch.Tensor:
    check_float_input(x)
    L = x.shape[-1] if x.dim() else 0
    check_hadamard(L)
    flat = x.contiguous().reshape(-1)
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    groups = flat.numel() // HADAMARD_SIZE
    if groups == 0:
        return out
    nb = next(c for c in (16, 8, 4, 2, 1) if groups % c == 0)
    grid, options = (groups // nb,), dict(NB=nb, INVERSE=inverse, num_warps=max(1, nb // 4), enable_fp_fusion=False)
    if tuning.cached_launch:
        kt.HADAMARD(grid, flat, out, _signs(x.device), **options)
    else:
        kt.HADAMARD.kernel[grid](flat, out, _signs(x.device), **options)
    return out
