"""Triton kernels for the packed blockwise format (kernels/format.py).

Same signatures and bit-identical results as kernels/reference.py. Two kernels do all
the work, one Triton program per NB consecutive quantization blocks:

- _quantize_kernel: quantize one block of a (possibly reordered) fp32/bf16/fp16 input,
  optionally with error feedback (residual read, added, and rewritten).
- _dequant_reduce_kernel: dequantize one block from each of `n_sum` rows, add them in
  fp32 in row order, then either requantize (the hop between the two all-to-alls) or
  scale / accumulate / cast into a float output (plain dequantize, final reduce).

Every launch passes enable_fp_fusion=False: a fused multiply-add rounds differently
from the separate multiply and add that torch performs, and bit-identity with the
reference is the contract. Divisions use tl.math.div_rn (IEEE), never `/`, whose fp32
lowering on NVIDIA GPUs is approximate.
"""

import torch
import triton
import triton.language as tl

try:
    from triton.runtime.interpreter import InterpretedFunction
except ImportError:  # pragma: no cover - very old Triton
    InterpretedFunction = ()

from .format import (
    DEFAULT_BLOCK,
    QMAX,
    TINY,
    check_float_input,
    check_format,
    check_packed,
    check_reorder,
    packed_len,
)
from .reference import _check_out, _check_residual

__all__ = [
    "packed_len",
    "quantize",
    "dequantize",
    "reorder_quantize",
    "dequant_reduce_quantize",
    "dequant_reduce",
]


# Every tile below is [NB, BLOCK_P2]: NB consecutive quantization blocks handled by one
# program (more bytes in flight per thread), each padded to the power of two BLOCK_P2
# (lanes >= BLOCK are masked off; with a power-of-two BLOCK there is no mask at all).


@triton.jit
def _quantize_tile(x, QMAX: tl.constexpr, TINY: tl.constexpr):
    """fp32 [NB, P2] -> (q int32 [NB, P2], scale fp32 [NB]): the rule in reference.py."""
    absmax = tl.max(tl.abs(x), axis=1)
    is_zero = absmax < TINY
    qmax = tl.full(absmax.shape, QMAX, tl.float32)
    safe = tl.where(is_zero, 1.0, absmax)
    scale = tl.where(is_zero, 0.0, tl.math.div_rn(safe, qmax))
    inv = tl.where(is_zero, 0.0, tl.math.div_rn(qmax, safe))
    y = x * inv[:, None]
    q = (y + tl.where(y < 0, -0.5, 0.5)).to(tl.int32)  # float -> int truncates toward zero
    return q, scale


@triton.jit
def _tile_offsets(NB: tl.constexpr, W: tl.constexpr, STRIDE: tl.constexpr):
    return tl.arange(0, NB)[:, None] * STRIDE + tl.arange(0, W)[None, :]


@triton.jit
def _load_tile(ptr, NB: tl.constexpr, W: tl.constexpr, STRIDE: tl.constexpr):
    """[NB, W] tile of rows STRIDE apart; lanes >= STRIDE (padding) read as 0."""
    if W == STRIDE:
        return tl.load(ptr + _tile_offsets(NB, W, STRIDE))
    else:
        mask = (tl.arange(0, W) < STRIDE)[None, :] & (tl.arange(0, NB) < NB)[:, None]
        return tl.load(ptr + _tile_offsets(NB, W, STRIDE), mask=mask, other=0)


@triton.jit
def _store_tile(ptr, val, NB: tl.constexpr, W: tl.constexpr, STRIDE: tl.constexpr):
    if W == STRIDE:
        tl.store(ptr + _tile_offsets(NB, W, STRIDE), val)
    else:
        mask = (tl.arange(0, W) < STRIDE)[None, :] & (tl.arange(0, NB) < NB)[:, None]
        tl.store(ptr + _tile_offsets(NB, W, STRIDE), val, mask=mask)


@triton.jit
def _store_blocks(ptr, scale_ptr, q, scale, NB: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr,
                  BLOCK_P2: tl.constexpr):
    """Write NB consecutive blocks' payloads at ptr and their fp32 scales (4 bytes each,
    little-endian) at scale_ptr."""
    if BITS == 8:
        _store_tile(ptr, q.to(tl.int8).to(tl.uint8, bitcast=True), NB, BLOCK_P2, BLOCK)
    else:
        lo, hi = tl.split(tl.reshape(q, [NB, BLOCK_P2 // 2, 2]))
        byte = (lo & 0xF) | (hi << 4)
        _store_tile(ptr, byte.to(tl.int8).to(tl.uint8, bitcast=True), NB, BLOCK_P2 // 2, BLOCK // 2)
    bits = scale.to(tl.uint32, bitcast=True)
    shifts = (tl.arange(0, 4) * 8).to(tl.uint32)
    _store_tile(scale_ptr, ((bits[:, None] >> shifts[None, :]) & 0xFF).to(tl.uint8), NB, 4, 4)


@triton.jit
def _load_blocks(ptr, scale_ptr, NB: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr,
                 BLOCK_P2: tl.constexpr):
    """Read NB consecutive blocks back as fp32 [NB, BLOCK_P2] (q * scale)."""
    if BITS == 8:
        raw = _load_tile(ptr, NB, BLOCK_P2, BLOCK)
        q = raw.to(tl.int8, bitcast=True).to(tl.float32)
    else:
        raw = _load_tile(ptr, NB, BLOCK_P2 // 2, BLOCK // 2)
        raw = raw.to(tl.int8, bitcast=True).to(tl.int32)  # sign-extended byte
        lo = (raw << 28) >> 28
        hi = raw >> 4
        q = tl.reshape(tl.join(lo, hi), [NB, BLOCK_P2]).to(tl.float32)
    sp = scale_ptr + tl.arange(0, NB) * 4
    b0 = tl.load(sp).to(tl.uint32)
    b1 = tl.load(sp + 1).to(tl.uint32)
    b2 = tl.load(sp + 2).to(tl.uint32)
    b3 = tl.load(sp + 3).to(tl.uint32)
    scale = (b0 | (b1 << 8) | (b2 << 16) | (b3 << 24)).to(tl.float32, bitcast=True)
    return q * scale[:, None]


@triton.jit
def _load_pairs(ptr, scale_ptr, NB: tl.constexpr, BLOCK: tl.constexpr, BLOCK_P2: tl.constexpr):
    """Read NB int4 blocks as (even, odd) fp32 halves [NB, BLOCK_P2 // 2]: the nibbles
    of each byte, with no interleaving (no layout shuffle through shared memory)."""
    raw = _load_tile(ptr, NB, BLOCK_P2 // 2, BLOCK // 2)
    raw = raw.to(tl.int8, bitcast=True).to(tl.int32)
    sp = scale_ptr + tl.arange(0, NB) * 4
    b0 = tl.load(sp).to(tl.uint32)
    b1 = tl.load(sp + 1).to(tl.uint32)
    b2 = tl.load(sp + 2).to(tl.uint32)
    b3 = tl.load(sp + 3).to(tl.uint32)
    scale = (b0 | (b1 << 8) | (b2 << 16) | (b3 << 24)).to(tl.float32, bitcast=True)[:, None]
    return ((raw << 28) >> 28).to(tl.float32) * scale, (raw >> 4).to(tl.float32) * scale


@triton.jit
def _store_pairs_int4(ptr, scale_ptr, even, odd, NB: tl.constexpr, BLOCK: tl.constexpr, BLOCK_P2: tl.constexpr,
                      TINY: tl.constexpr):
    """Quantize (even, odd) fp32 halves of NB blocks to int4 and write them: the same
    rule as _quantize_tile, with the block absmax taken over both halves."""
    absmax = tl.maximum(tl.max(tl.abs(even), axis=1), tl.max(tl.abs(odd), axis=1))
    is_zero = absmax < TINY
    qmax = tl.full(absmax.shape, 7, tl.float32)
    safe = tl.where(is_zero, 1.0, absmax)
    scale = tl.where(is_zero, 0.0, tl.math.div_rn(safe, qmax))
    inv = tl.where(is_zero, 0.0, tl.math.div_rn(qmax, safe))[:, None]
    ye = even * inv
    yo = odd * inv
    qe = (ye + tl.where(ye < 0, -0.5, 0.5)).to(tl.int32)
    qo = (yo + tl.where(yo < 0, -0.5, 0.5)).to(tl.int32)
    byte = (qe & 0xF) | (qo << 4)
    _store_tile(ptr, byte.to(tl.int8).to(tl.uint8, bitcast=True), NB, BLOCK_P2 // 2, BLOCK // 2)
    bits = scale.to(tl.uint32, bitcast=True)
    shifts = (tl.arange(0, 4) * 8).to(tl.uint32)
    _store_tile(scale_ptr, ((bits[:, None] >> shifts[None, :]) & 0xFF).to(tl.uint8), NB, 4, 4)


@triton.jit
def _cast_out(x, DTYPE: tl.constexpr, MANUAL_BF16: tl.constexpr):
    """fp32 -> DTYPE, round to nearest even. Under the Triton interpreter bf16 is rounded
    by hand: the interpreter truncates fp32 -> bf16, the GPU and torch round to even."""
    if MANUAL_BF16 and DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = bits + 0x7FFF + ((bits >> 16) & 1)
        return (rounded >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(DTYPE)


@triton.jit
def _quantize_kernel(
    x_ptr, res_ptr, out_ptr,
    m, chunk_blocks, row_groups, row_bytes, payload_bytes,
    NB: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_P2: tl.constexpr,
    QMAX: tl.constexpr, TINY: tl.constexpr, HAS_RES: tl.constexpr,
):
    # Program g handles output blocks b .. b + NB - 1 of row `row`; output block b reads
    # source block ((b // cb) * m + row) * cb + b % cb (NB divides cb, so the NB source
    # blocks are consecutive). With k = 1 (cb = blocks per row) this is plain row-major.
    pid = tl.program_id(0).to(tl.int64)
    row = pid // row_groups
    b = (pid % row_groups) * NB
    src = ((b // chunk_blocks) * m + row) * chunk_blocks + b % chunk_blocks
    x_blk = x_ptr + src * BLOCK
    x = _load_tile(x_blk, NB, BLOCK_P2, BLOCK).to(tl.float32)
    if HAS_RES:
        r_blk = res_ptr + src * BLOCK
        x = x + _load_tile(r_blk, NB, BLOCK_P2, BLOCK)
    q, scale = _quantize_tile(x, QMAX, TINY)
    row_ptr = out_ptr + row * row_bytes
    _store_blocks(row_ptr + b * (BLOCK * BITS // 8), row_ptr + payload_bytes + b * 4, q, scale,
                  NB, BITS, BLOCK, BLOCK_P2)
    if HAS_RES:
        _store_tile(r_blk, x - q.to(tl.float32) * scale[:, None], NB, BLOCK_P2, BLOCK)


@triton.jit
def _dequant_reduce_kernel(
    in_ptr, out_ptr,
    in_row_bytes, in_payload_bytes, in_rows_per_out, in_blocks_per_out,
    out_row_groups, out_row_bytes, out_payload_bytes, factor,
    NB: tl.constexpr, N_SUM: tl.constexpr, BITS_IN: tl.constexpr, BITS_OUT: tl.constexpr, BLOCK: tl.constexpr,
    BLOCK_P2: tl.constexpr, QMAX_OUT: tl.constexpr, TINY: tl.constexpr, HAS_FACTOR: tl.constexpr,
    ACCUMULATE: tl.constexpr, MANUAL_BF16: tl.constexpr,
):
    # Output blocks (orow, ob .. ob + NB - 1) sum input rows orow * in_rows_per_out + r,
    # r < N_SUM, at blocks orow * in_blocks_per_out + ob .. of each row. The row loop is
    # unrolled so all N_SUM loads are in flight at once. Summing from row 0 instead of
    # from +0.0 is bit-identical to the reference: q * scale is never -0.0.
    pid = tl.program_id(0).to(tl.int64)
    orow = pid // out_row_groups
    ob = (pid % out_row_groups) * NB
    in_blk = orow * in_blocks_per_out + ob
    row_ptr = in_ptr + orow * in_rows_per_out * in_row_bytes
    if BITS_IN == 4 and BITS_OUT == 4:
        # int4 -> int4 (the qgZ hop) stays in the (even, odd) nibble domain throughout
        even, odd = _load_pairs(row_ptr + in_blk * (BLOCK // 2), row_ptr + in_payload_bytes + in_blk * 4,
                                NB, BLOCK, BLOCK_P2)
        for r in tl.static_range(1, N_SUM):
            row_ptr = in_ptr + (orow * in_rows_per_out + r) * in_row_bytes
            e, o = _load_pairs(row_ptr + in_blk * (BLOCK // 2), row_ptr + in_payload_bytes + in_blk * 4,
                               NB, BLOCK, BLOCK_P2)
            even = even + e
            odd = odd + o
        row_ptr = out_ptr + orow * out_row_bytes
        _store_pairs_int4(row_ptr + ob * (BLOCK // 2), row_ptr + out_payload_bytes + ob * 4, even, odd,
                          NB, BLOCK, BLOCK_P2, TINY)
        return
    acc = _load_blocks(row_ptr + in_blk * (BLOCK * BITS_IN // 8), row_ptr + in_payload_bytes + in_blk * 4,
                       NB, BITS_IN, BLOCK, BLOCK_P2)
    for r in tl.static_range(1, N_SUM):
        row_ptr = in_ptr + (orow * in_rows_per_out + r) * in_row_bytes
        acc = acc + _load_blocks(row_ptr + in_blk * (BLOCK * BITS_IN // 8), row_ptr + in_payload_bytes + in_blk * 4,
                                 NB, BITS_IN, BLOCK, BLOCK_P2)
    if BITS_OUT != 0:
        if BLOCK != BLOCK_P2:  # padding lanes must not touch the absmax
            acc = tl.where((tl.arange(0, BLOCK_P2) < BLOCK)[None, :], acc, 0.0)
        q, scale = _quantize_tile(acc, QMAX_OUT, TINY)
        row_ptr = out_ptr + orow * out_row_bytes
        _store_blocks(row_ptr + ob * (BLOCK * BITS_OUT // 8), row_ptr + out_payload_bytes + ob * 4,
                      q, scale, NB, BITS_OUT, BLOCK, BLOCK_P2)
    else:
        if HAS_FACTOR:
            acc = acc * factor
        o = out_ptr + (orow * out_row_groups * NB + ob) * BLOCK
        if ACCUMULATE:
            acc = _load_tile(o, NB, BLOCK_P2, BLOCK) + acc
        _store_tile(o, _cast_out(acc, out_ptr.dtype.element_ty, MANUAL_BF16), NB, BLOCK_P2, BLOCK)


# Launch shape: warps per program and blocks per program (NB). The defaults come from
# the sweep in tools/bench_kernels.py on an H200; the overrides exist for that sweep.
WARPS_OVERRIDE = None
NB_OVERRIDE = None


def _launch_opts(block: int, per_thread: int, nb_default: int, *block_counts: int) -> dict:
    """Constexprs and launch options. NB (blocks per program) is the largest of
    {nb_default, 2, 1} dividing every count; warps give about `per_thread` elements per
    thread. H200 sweep at 256M elements (docs/PERFORMANCE.md): quantize is fastest with
    NB=2 and ~64 elements per thread, dequantize with NB=1 and 16-32 per thread."""
    p2 = triton.next_power_of_2(block)
    want = NB_OVERRIDE or nb_default
    nb = next(c for c in (want, 2, 1) if c <= want and all(n % c == 0 for n in block_counts))
    warps = WARPS_OVERRIDE or max(1, min(16, p2 * nb // (32 * per_thread)))
    return dict(NB=nb, BLOCK=block, BLOCK_P2=p2, TINY=TINY, num_warps=warps, enable_fp_fusion=False)


def _interpreting() -> bool:
    return isinstance(_quantize_kernel, InterpretedFunction)


def _quantize_rows(x, residual, rows, k, m, S, bits, block):
    """Quantize rows x [rows, k*S] where output row j block b reads chunk (b//cb)*m + j."""
    P = packed_len(k * S, bits, block)
    out = torch.empty((rows, P), dtype=torch.uint8, device=x.device)
    if rows == 0:  # empty leading dimensions: nothing to launch
        return out
    row_blocks, chunk_blocks = k * S // block, S // block
    opts = _launch_opts(block, 64, 2, row_blocks, chunk_blocks)
    res = residual if residual is not None else x
    _quantize_kernel[(rows * row_blocks // opts["NB"],)](
        x, res, out, m, chunk_blocks, row_blocks // opts["NB"], P, k * S * bits // 8,
        BITS=bits, QMAX=QMAX[bits], HAS_RES=residual is not None, **opts,
    )
    return out


def _dequant_reduce_launch(recv, out, out_rows, n_sum, L_in, bits_in, in_rows_per_out, in_blocks_per_out,
                           out_row_len, bits_out, block, factor=None, accumulate=False):
    out_row_blocks = out_row_len // block
    out_row_bytes = packed_len(out_row_len, bits_out, block) if bits_out else 0
    opts = _launch_opts(block, 32, 1, out_row_blocks, in_blocks_per_out or out_row_blocks)
    _dequant_reduce_kernel[(out_rows * out_row_blocks // opts["NB"],)](
        recv, out, recv.shape[-1], L_in * bits_in // 8, in_rows_per_out, in_blocks_per_out,
        out_row_blocks // opts["NB"], out_row_bytes, out_row_len * bits_out // 8, float(factor or 1.0),
        N_SUM=n_sum, BITS_IN=bits_in, BITS_OUT=bits_out, QMAX_OUT=QMAX.get(bits_out, 1),
        HAS_FACTOR=factor is not None, ACCUMULATE=accumulate, MANUAL_BF16=_interpreting(), **opts,
    )
    return out


def quantize(x: torch.Tensor, bits: int = 8, block: int = DEFAULT_BLOCK) -> torch.Tensor:
    check_float_input(x)
    L = x.shape[-1] if x.dim() else 0
    check_format(L, bits, block)
    lead = x.shape[:-1]
    flat = x.contiguous().reshape(-1, L)
    out = _quantize_rows(flat, None, flat.shape[0], 1, 1, L, bits, block)
    return out.reshape(*lead, out.shape[-1])


def dequantize(
    packed: torch.Tensor, L: int, bits: int = 8, block: int = DEFAULT_BLOCK, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    check_packed(packed, L, bits, block)
    lead = packed.shape[:-1]
    flat = packed.contiguous().reshape(-1, packed.shape[-1])
    out = torch.empty((flat.shape[0], L), dtype=dtype, device=packed.device)
    if flat.shape[0] == 0:
        return out.reshape(*lead, L)
    _dequant_reduce_launch(flat, out, flat.shape[0], 1, L, bits, 1, 0, L, 0, block)
    return out.reshape(*lead, L)


def reorder_quantize(
    grad: torch.Tensor, k: int, m: int, bits: int = 4, block: int = DEFAULT_BLOCK,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    check_float_input(grad)
    S = check_reorder(grad.numel(), k, m, block)
    check_format(S, bits, block)
    if residual is not None:
        _check_residual(residual, grad)
    return _quantize_rows(grad.contiguous().reshape(-1), residual, m, k, m, S, bits, block)


def dequant_reduce_quantize(
    recv: torch.Tensor, k: int, S: int, bits_in: int = 4, bits_out: int = 4, block: int = DEFAULT_BLOCK
) -> torch.Tensor:
    check_format(S, bits_out, block)
    check_packed(recv, k * S, bits_in, block)
    flat = recv.contiguous().reshape(-1, recv.shape[-1])
    out = torch.empty((k, packed_len(S, bits_out, block)), dtype=torch.uint8, device=recv.device)
    return _dequant_reduce_launch(flat, out, k, flat.shape[0], k * S, bits_in, 0, S // block, S, bits_out, block)


def dequant_reduce(
    recv: torch.Tensor, S: int, bits: int = 4, block: int = DEFAULT_BLOCK, scale: float = 1.0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    check_packed(recv, S, bits, block)
    flat = recv.contiguous().reshape(-1, recv.shape[-1])
    accumulate = out is not None
    if accumulate:
        _check_out(out, S)
    else:
        out = torch.empty(S, dtype=torch.float32, device=recv.device)
    return _dequant_reduce_launch(flat, out, 1, flat.shape[0], S, bits, 0, 0, S, 0, block, float(scale), accumulate)
