"""Triton kernels for the packed blockwise format (kernels/format.py), launched by
kernels/quant.py (which works out the launches and holds the public ops).

Same results as kernels/reference.py, bit for bit. These kernels do all the work, one
Triton program per NB consecutive quantization blocks:

- _quantize_kernel: quantize one block of a (possibly reordered) fp32/bf16/fp16 input,
  optionally with error feedback (residual read, added, and rewritten).
- _dequant_reduce_kernel: dequantize one block from each of `n_sum` rows, add them in
  fp32, then either requantize (the hop between the two all-to-alls) or scale /
  accumulate / cast into a float output (plain dequantize, final reduce). Any block
  size and alignment.
- _int4_hop_kernel: the hop for int4 input and int4 output, reading the payload as
  32-bit words (block a multiple of 8, 4-byte aligned buffers): in the linear code one
  LOP3 and one FFMA per input element (docs/KERNELS.md, "The qgZ hop"); in the
  square-law code dequantize, sum, requantize.
- _int4_words_kernel: int4 input, float output, in 32-bit words likewise.
- _quantize8_tma_kernel: the int8 quantize of one row through Hopper's bulk tensor
  copies (_quantize_kernel's arithmetic, the same bytes).
- _hadamard_kernel: the blockwise randomized Hadamard transform alone.

Each kernel has one cached launcher below (QUANTIZE, ...; kernels/launch.py). Every
launch passes enable_fp_fusion=False (kernels/quant.py's _launch_opts), so a multiply
and an add are fused only where the code says tl.fma: there the product is exact
(20-bit scales times small integers), or the fma is the rounding step of the rule,
which the reference computes exactly in float64. Divisions use tl.math.div_rn (IEEE),
never `/`, whose fp32 lowering on NVIDIA GPUs is approximate.
"""

import triton
import triton.language as tl

from .format import HADAMARD_SIGNS, HADAMARD_SIZE, SCALE_DROP, SQUARE_QMAX, SQUARE_SCALE_DROP, SQUARE_SCALE_FLOOR
from .launch import CachedLauncher, interpreted


# Every tile below is [NB, BLOCK_P2]: NB consecutive quantization blocks handled by one
# program (more bytes in flight per thread), each padded to the power of two BLOCK_P2
# (lanes >= BLOCK are masked off; with a power-of-two BLOCK there is no mask at all).


# The low mantissa bits a scale drops (format.SCALE_BITS), and 1.5 * 2^23: fma(y, inv,
# ROUND_MAGIC) rounds the exact product to an integer q (half to even) and leaves the
# bits 0x4B400000 + q, whose low byte / nibble is q in two's complement.
_SCALE_DROP = tl.constexpr(SCALE_DROP)
_SQUARE_DROP = tl.constexpr(SQUARE_SCALE_DROP)
_SQUARE_QMAX = tl.constexpr(SQUARE_QMAX)
_SQUARE_FLOOR = tl.constexpr(SQUARE_SCALE_FLOOR)
_ROUND_MAGIC = tl.constexpr(12582912.0)
_MAGIC_BITS = tl.constexpr(0x4B400000)


@triton.jit
def _scale_rule(absmax, is_zero, QMAX: tl.constexpr, DROP: tl.constexpr):
    """(scale, inv) per block, the rule in reference.py: absmax / qmax rounded up to
    SCALE_BITS significant bits (the low bits DROP zero), and its IEEE reciprocal; 0 and
    0 for zero blocks."""
    safe = tl.where(is_zero, 1.0, absmax)
    s = tl.math.div_rn(safe, tl.full(absmax.shape, QMAX, tl.float32))
    s = ((s.to(tl.int32, bitcast=True) + DROP) & ~DROP).to(tl.float32, bitcast=True)
    inv = tl.where(is_zero, 0.0, tl.math.div_rn(tl.full(absmax.shape, 1.0, tl.float32), s))
    return tl.where(is_zero, 0.0, s), inv


@triton.jit
def _round_bits(y, inv):
    """int32 0x4B400000 + q, q = y * inv (exact product) rounded half to even: one FFMA."""
    return tl.fma(y, inv, _ROUND_MAGIC).to(tl.int32, bitcast=True)


@triton.jit
def _quantize_tile(x, QMAX: tl.constexpr, TINY: tl.constexpr):
    """fp32 [NB, P2] -> (q as _round_bits int32 [NB, P2], scale fp32 [NB])."""
    absmax = tl.max(tl.abs(x), axis=1)
    scale, inv = _scale_rule(absmax, absmax < TINY, QMAX, _SCALE_DROP)
    return _round_bits(x, inv[:, None]), scale


# The square-law int4 code (reference._square_q): c = the number of thresholds T_t =
# t^2 + t + 1/2 (t = 0..6) that the exact product y = |x| * inv reaches, i.e. the c with
# T_(c-1) <= y < T_c (T_-1 = -inf). The estimate e = round(sqrt(rn(y + 1))) is c or c + 1:
# y + 1 lies in [c^2 - c + 3/2, c^2 + c + 3/2), whose square roots lie in (c - 1/2 +
# 0.089, c + 3/2 - 0.27) for c = 0..7, and rn(y + 1) >= T_(c-1) + 1 still (rounding is
# monotonic, T + 1 is an fp32 number); the root's error (~2^-22 relative) and a tie of the
# rounding cannot cross those margins. So e >= 1 always, and one exact compare settles c:
# c = e - 1 where y < T_(e-1) = e^2 - e + 1/2 (for c = 0: e = 1 and y < 1/2).
# fma(|x|, -inv, T) is the exact T - y rounded once, whose sign is the exact sign (the
# difference is a multiple of 2^-48 or more near T, far from underflow). The result does
# not depend on the root's accuracy. Per element: one MUFU square root and ten full-rate
# operations (two FADDs round to an integer with _ROUND_MAGIC, as _round_bits does; the
# sign of x is OR-ed into c), instead of 7 compares, 7 conversions and a fix-up.


@triton.jit
def _square_q(x, inv):
    """The square code's q = sign(x) c for fp32 x, as _round_bits gives q (int32
    0x4B400000 + q: the low nibble is q's two's-complement nibble), bit for bit
    reference._square_q (the argument above)."""
    a = tl.abs(x)
    e = (tl.sqrt(tl.fma(a, inv, 1.0)) + _ROUND_MAGIC) - _ROUND_MAGIC
    below = e - 1.0
    c = tl.where(tl.fma(a, -inv, tl.fma(e, below, 0.5)) > 0.0, below, e)  # y < T_(e-1): c = e - 1
    signed = c.to(tl.int32, bitcast=True) | (x.to(tl.int32, bitcast=True) & -2147483648)  # c >= +0
    return (signed.to(tl.float32, bitcast=True) + _ROUND_MAGIC).to(tl.int32, bitcast=True)


@triton.jit
def _quantize_tile_square(x, TINY: tl.constexpr):
    """fp32 [NB, P2] -> (q int32 [NB, P2], scale fp32 [NB]) in the square code."""
    absmax = tl.max(tl.abs(x), axis=1)
    scale, inv = _scale_rule(absmax, absmax < TINY, _SQUARE_QMAX, _SQUARE_DROP)
    return _square_q(x, inv[:, None]), scale


@triton.jit
def _tile_offsets(NB: tl.constexpr, W: tl.constexpr, STRIDE: tl.constexpr):
    return tl.arange(0, NB)[:, None] * STRIDE + tl.arange(0, W)[None, :]


@triton.jit
def _load_tile(ptr, NB: tl.constexpr, W: tl.constexpr, STRIDE: tl.constexpr):
    """[NB, W] tile of rows STRIDE apart; lanes >= STRIDE (padding) read as 0."""
    return _load_tile_evict(ptr, NB, W, STRIDE, "")


@triton.jit
def _load_tile_evict(ptr, NB: tl.constexpr, W: tl.constexpr, STRIDE: tl.constexpr, EVICT: tl.constexpr):
    """_load_tile with an L2 eviction policy ("evict_first": data read once; "": the default)."""
    if W == STRIDE:
        return tl.load(ptr + _tile_offsets(NB, W, STRIDE), eviction_policy=EVICT)
    else:
        mask = (tl.arange(0, W) < STRIDE)[None, :] & (tl.arange(0, NB) < NB)[:, None]
        return tl.load(ptr + _tile_offsets(NB, W, STRIDE), mask=mask, other=0, eviction_policy=EVICT)


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
    """Write NB consecutive blocks' payloads at ptr (q: int32 whose low byte / nibble is
    the value, as _round_bits gives) and their fp32 scales (4 bytes each, little-endian)
    at scale_ptr."""
    if BITS == 8:
        _store_tile(ptr, q.to(tl.int8).to(tl.uint8, bitcast=True), NB, BLOCK_P2, BLOCK)
    else:
        lo, hi = tl.split(tl.reshape(q, [NB, BLOCK_P2 // 2, 2]))
        byte = (lo & 0xF) | (hi << 4)
        _store_tile(ptr, byte.to(tl.int8).to(tl.uint8, bitcast=True), NB, BLOCK_P2 // 2, BLOCK // 2)
    _store_scales(scale_ptr, scale, NB)


@triton.jit
def _store_scales(scale_ptr, scale, NB: tl.constexpr):
    """NB fp32 scales written bytewise, little-endian (the byte kernel needs no alignment)."""
    bits = scale.to(tl.uint32, bitcast=True)
    shifts = (tl.arange(0, 4) * 8).to(tl.uint32)
    _store_tile(scale_ptr, ((bits[:, None] >> shifts[None, :]) & 0xFF).to(tl.uint8), NB, 4, 4)


@triton.jit
def _load_scales(scale_ptr, NB: tl.constexpr):
    """NB fp32 scales read bytewise (the byte kernel needs no alignment)."""
    sp = scale_ptr + tl.arange(0, NB) * 4
    b0 = tl.load(sp).to(tl.uint32)
    b1 = tl.load(sp + 1).to(tl.uint32)
    b2 = tl.load(sp + 2).to(tl.uint32)
    b3 = tl.load(sp + 3).to(tl.uint32)
    return (b0 | (b1 << 8) | (b2 << 16) | (b3 << 24)).to(tl.float32, bitcast=True)


@triton.jit
def _load_q(ptr, NB: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_P2: tl.constexpr):
    """NB consecutive blocks' payloads as fp32 q [NB, BLOCK_P2]."""
    if BITS == 8:
        raw = _load_tile(ptr, NB, BLOCK_P2, BLOCK)
        return raw.to(tl.int8, bitcast=True).to(tl.float32)
    else:
        raw = _load_tile(ptr, NB, BLOCK_P2 // 2, BLOCK // 2)
        raw = raw.to(tl.int8, bitcast=True).to(tl.int32)  # sign-extended byte
        lo = (raw << 28) >> 28
        hi = raw >> 4
        return tl.reshape(tl.join(lo, hi), [NB, BLOCK_P2]).to(tl.float32)


@triton.jit
def _load_blocks(ptr, scale_ptr, NB: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr,
                 BLOCK_P2: tl.constexpr, SQUARE: tl.constexpr):
    """Read NB consecutive blocks back as fp32 [NB, BLOCK_P2] (q * scale; int4 in the
    square code: q |q| * scale, exact)."""
    q = _load_q(ptr, NB, BITS, BLOCK, BLOCK_P2)
    if SQUARE and BITS == 4:
        return (q * tl.abs(q)) * _square_read_scale(_load_scales(scale_ptr, NB))[:, None]
    return q * _load_scales(scale_ptr, NB)[:, None]


# The int4 -> requantized qgZ hop (reference._int4_hop, docs/KERNELS.md): sums are kept
# relative to 2^e_max, the power of two of the block's largest input scale, as
# -(sum_r 8 s_r) + sum_r u_r s_r with u = q + 8 and exact products, so each row costs one
# FFMA per element; both kernels below use these helpers.


@triton.jit
def _hop_pow2(smax):
    """(2^e_max, 2^-e_max) for the largest scale of a block (2^0 for an all-zero one)."""
    ebits = smax.to(tl.int32, bitcast=True) & 0x7F800000
    ebits = tl.where(ebits == 0, 127 << 23, ebits)
    return ebits.to(tl.float32, bitcast=True), (0x7F000000 - ebits).to(tl.float32, bitcast=True)


@triton.jit
def _hop_scale(s, norm, HOP_FLUSH: tl.constexpr):
    """s truncated to SCALE_BITS bits, / 2^e_max (exact); 0 below HOP_FLUSH."""
    sn = (s.to(tl.int32, bitcast=True) & ~_SCALE_DROP).to(tl.float32, bitcast=True) * norm
    return tl.where(sn < HOP_FLUSH, 0.0, sn)


@triton.jit
def _hop_row_scale(first, r, stride, norm, NB: tl.constexpr, HOP_FLUSH: tl.constexpr, BYTEWISE: tl.constexpr):
    """_hop_scale of row r's NB scales, which start at first + r * stride: fp32 words, or
    bytes read one by one (BYTEWISE: the byte kernel, any alignment)."""
    if BYTEWISE:
        s = _load_scales(first + r * stride, NB)
    else:
        s = tl.load(first + r * stride + tl.arange(0, NB))
    return _hop_scale(s, norm, HOP_FLUSH)


@triton.jit
def _hop_prologue(first, stride, NB: tl.constexpr, N_SUM: tl.constexpr, HOP_FLUSH: tl.constexpr,
                  BYTEWISE: tl.constexpr):
    """(2^e_max, 2^-e_max, bias B = sum_r 8 s_r / 2^e_max * 2^-22 in row order) of NB
    blocks of N_SUM rows (scales as for _hop_row_scale). The power of two is taken from
    the untruncated scales: truncating a mantissa never changes the exponent."""
    smax = tl.zeros([NB], tl.float32)
    for r in tl.static_range(N_SUM):
        if BYTEWISE:
            smax = tl.maximum(smax, _load_scales(first + r * stride, NB))
        else:
            smax = tl.maximum(smax, tl.load(first + r * stride + tl.arange(0, NB)))
    pow2, norm = _hop_pow2(smax)
    bias = tl.zeros([NB], tl.float32)
    for r in tl.static_range(N_SUM):
        bias = bias + _hop_row_scale(first, r, stride, norm, NB, HOP_FLUSH, BYTEWISE) * 1.9073486328125e-06  # 2^-19
    return pow2, norm, bias


@triton.jit
def _hop_requant_scale(absmax, pow2, QMAX: tl.constexpr, TINY: tl.constexpr, HOP_FLOOR: tl.constexpr):
    """absmax of a hop sum (in units of 2^(e_max + 22)) -> (scale in true units, inv in
    the sum's units): _scale_rule, scaled by powers of two (exact)."""
    a22 = absmax * 4194304.0  # 2^22
    scale, inv = _scale_rule(absmax, (a22 < HOP_FLOOR) | (a22 * pow2 < TINY), QMAX, _SCALE_DROP)
    return (scale * 4194304.0) * pow2, inv


# The blockwise randomized Hadamard transform (reference._hadamard_fp32): the butterfly
# runs on the whole [NB, BLOCK_P2] tile seen as flat groups of 64 (BLOCK is a multiple of
# 64, so groups never straddle blocks, and padding lanes form whole zero groups that stay
# zero). Stage h pairs lanes i and i + h inside each group of 2h: the tile is reshaped to
# [groups, 2, h], the pair axis moved last and split; the two halves are joined back as
# (a + b, a - b). Plain fp32 adds (no fma), in the reference's order: bit for bit. The
# fused uses: _quantize_kernel (before the absmax), the float outputs of
# _dequant_reduce_kernel and _int4_words_kernel (after the sum and factor, in element order).
_HAD = tl.constexpr(HADAMARD_SIZE)
_SIGN_BITS = tl.constexpr(sum(1 << i for i, sign in enumerate(HADAMARD_SIGNS) if sign < 0))


@triton.jit
def _butterfly(x, N: tl.constexpr, H: tl.constexpr):
    y = tl.permute(tl.reshape(x, [N // (2 * H), 2, H]), (0, 2, 1))
    a, b = tl.split(y)
    return tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 2, 1)), [N])


@triton.jit
def _hadamard_tile(x, sign_ptr, NB: tl.constexpr, P2: tl.constexpr, INVERSE: tl.constexpr):
    """fp32 [NB, P2] -> H x per 64 consecutive lanes (H^T x with INVERSE); signs from
    sign_ptr (HADAMARD_SIZE fp32 +-1)."""
    signs = tl.load(sign_ptr + tl.arange(0, P2) % _HAD)[None, :]
    if not INVERSE:
        x = x * signs
    y = tl.reshape(x, [NB * P2])
    y = _butterfly(y, NB * P2, 1)
    y = _butterfly(y, NB * P2, 2)
    y = _butterfly(y, NB * P2, 4)
    y = _butterfly(y, NB * P2, 8)
    y = _butterfly(y, NB * P2, 16)
    y = _butterfly(y, NB * P2, 32)
    y = tl.reshape(y, [NB, P2]) * 0.125
    if INVERSE:
        y = y * signs
    return y


# The forward transform fused into _quantize_kernel (_quantize_chunks): the tile
# reshaped as above makes the compiler move every lane through shared memory and spill
# (~130 GB/s on an H200). Instead each 64-group is held as 8 chunks of 8 consecutive
# elements, chunk o in its own tile [NB, GB_P2, 8] (o = 0..7; group g of block n): the 8
# lanes of a chunk are one 16-byte load in one thread, so stages 1, 2, 4 pair lanes inside
# a thread (reshape, split, join: no data movement) and stages 8, 16, 32 pair whole tiles
# (chunk o with o + 1, o + 2, o + 4): plain elementwise adds. The same adds of the same
# operands in the same stage order as the reference: bit for bit.


@triton.jit
def _lane_stage(x, NB: tl.constexpr, GB: tl.constexpr, H: tl.constexpr):
    """Butterfly stage H (1, 2 or 4) along the last axis (8 lanes) of x [NB, GB, 8]."""
    y = tl.permute(tl.reshape(x, [NB, GB, 4 // H, 2, H]), (0, 1, 2, 4, 3))
    a, b = tl.split(y)
    return tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 2, 4, 3)), [NB, GB, 8])


@triton.jit
def _lane_stages(x, o: tl.constexpr, NB: tl.constexpr, GB: tl.constexpr):
    """Chunk o: the signs (bit i of _SIGN_BITS: HADAMARD_SIGNS[i] is -1; a sign-bit flip
    is x * -1 exactly, and needs no load), then stages 1, 2, 4."""
    mask = tl.full([8], (_SIGN_BITS >> (o * 8)) & 0xFF, tl.int32)
    flip = (((mask >> tl.arange(0, 8)) & 1) << 31)[None, None, :]
    x = (x.to(tl.int32, bitcast=True) ^ flip).to(tl.float32, bitcast=True)
    return _lane_stage(_lane_stage(_lane_stage(x, NB, GB, 1), NB, GB, 2), NB, GB, 4)


@triton.jit
def _pair(a, b):
    return a + b, a - b


@triton.jit
def _hadamard_chunks(c0, c1, c2, c3, c4, c5, c6, c7, NB: tl.constexpr, GB: tl.constexpr):
    """The forward transform of 8 chunk tiles (fp32 [NB, GB, 8]): H x per group of 64."""
    c0 = _lane_stages(c0, 0, NB, GB)
    c1 = _lane_stages(c1, 1, NB, GB)
    c2 = _lane_stages(c2, 2, NB, GB)
    c3 = _lane_stages(c3, 3, NB, GB)
    c4 = _lane_stages(c4, 4, NB, GB)
    c5 = _lane_stages(c5, 5, NB, GB)
    c6 = _lane_stages(c6, 6, NB, GB)
    c7 = _lane_stages(c7, 7, NB, GB)
    c0, c1 = _pair(c0, c1)  # stage 8
    c2, c3 = _pair(c2, c3)
    c4, c5 = _pair(c4, c5)
    c6, c7 = _pair(c6, c7)
    c0, c2 = _pair(c0, c2)  # stage 16
    c1, c3 = _pair(c1, c3)
    c4, c6 = _pair(c4, c6)
    c5, c7 = _pair(c5, c7)
    c0, c4 = _pair(c0, c4)  # stage 32
    c1, c5 = _pair(c1, c5)
    c2, c6 = _pair(c2, c6)
    c3, c7 = _pair(c3, c7)
    return c0 * 0.125, c1 * 0.125, c2 * 0.125, c3 * 0.125, c4 * 0.125, c5 * 0.125, c6 * 0.125, c7 * 0.125


@triton.jit
def _chunk_offsets(NB: tl.constexpr, GB_P2: tl.constexpr, BLOCK: tl.constexpr, GROUP: tl.constexpr,
                   LANES: tl.constexpr):
    """[NB, GB_P2, LANES] offsets n * BLOCK + g * GROUP + lane."""
    return (tl.arange(0, NB)[:, None, None] * BLOCK + tl.arange(0, GB_P2)[None, :, None] * GROUP
            + tl.arange(0, LANES)[None, None, :])


@triton.jit
def _chunk_mask(NB: tl.constexpr, GB: tl.constexpr, GB_P2: tl.constexpr, LANES: tl.constexpr):
    """Groups g < GB (the others are padding of a block that is not a power of two)."""
    return ((tl.arange(0, GB_P2) < GB)[None, :, None] & (tl.arange(0, NB) < NB)[:, None, None]
            & (tl.arange(0, LANES) < LANES)[None, None, :])


@triton.jit
def _load_chunk(ptr, o: tl.constexpr, NB: tl.constexpr, GB: tl.constexpr, GB_P2: tl.constexpr,
                BLOCK: tl.constexpr, EVICT: tl.constexpr):
    """Chunk o of every group as fp32 [NB, GB_P2, 8]; padding groups read as 0."""
    offs = _chunk_offsets(NB, GB_P2, BLOCK, _HAD, 8) + o * 8
    if GB == GB_P2:
        return tl.load(ptr + offs, eviction_policy=EVICT).to(tl.float32)
    else:
        return tl.load(ptr + offs, mask=_chunk_mask(NB, GB, GB_P2, 8), other=0,
                       eviction_policy=EVICT).to(tl.float32)


@triton.jit
def _store_chunk(ptr, val, o: tl.constexpr, NB: tl.constexpr, GB: tl.constexpr, GB_P2: tl.constexpr,
                 BLOCK: tl.constexpr, LANES: tl.constexpr):
    """Store [NB, GB_P2, LANES] at chunk o of every group (LANES elements per chunk)."""
    offs = _chunk_offsets(NB, GB_P2, BLOCK, 8 * LANES, LANES) + o * LANES
    if GB == GB_P2:
        tl.store(ptr + offs, val)
    else:
        tl.store(ptr + offs, val, mask=_chunk_mask(NB, GB, GB_P2, LANES))


@triton.jit
def _quantize_chunk(c, o: tl.constexpr, inv, scale, pay_ptr, r_ptr, NB: tl.constexpr, GB: tl.constexpr,
                    GB_P2: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr, HAS_RES: tl.constexpr,
                    SQUARE: tl.constexpr):
    """Quantize chunk tile o, store its payload bytes and (HAS_RES) its new residual."""
    if SQUARE and BITS == 4:
        q = _square_q(c, inv)
    else:
        q = _round_bits(c, inv)
    if BITS == 8:
        _store_chunk(pay_ptr, q.to(tl.int8).to(tl.uint8, bitcast=True), o, NB, GB, GB_P2, BLOCK, 8)
    else:
        lo, hi = tl.split(tl.reshape(q, [NB, GB_P2, 4, 2]))
        byte = (lo & 0xF) | (hi << 4)
        _store_chunk(pay_ptr, byte.to(tl.int8).to(tl.uint8, bitcast=True), o, NB, GB, GB_P2, BLOCK // 2, 4)
    if HAS_RES:
        qf = (q - _MAGIC_BITS).to(tl.float32)
        if SQUARE and BITS == 4:
            qf = qf * tl.abs(qf)
        _store_chunk(r_ptr, c - qf * scale, o, NB, GB, GB_P2, BLOCK, 8)


@triton.jit
def _quantize_chunks(x_ptr, r_ptr, pay_ptr, scale_ptr, NB: tl.constexpr, BITS: tl.constexpr,
                     BLOCK: tl.constexpr, BLOCK_P2: tl.constexpr, QMAX: tl.constexpr, TINY: tl.constexpr,
                     HAS_RES: tl.constexpr, SQUARE: tl.constexpr, HADAMARD: tl.constexpr, EVICT: tl.constexpr):
    """_quantize_kernel's work for NB blocks of x (HADAMARD: of H x), plus the residual, in
    chunk tiles (BLOCK a multiple of 64)."""
    GB: tl.constexpr = BLOCK // _HAD
    GB_P2: tl.constexpr = BLOCK_P2 // _HAD
    c0 = _load_chunk(x_ptr, 0, NB, GB, GB_P2, BLOCK, EVICT)
    c1 = _load_chunk(x_ptr, 1, NB, GB, GB_P2, BLOCK, EVICT)
    c2 = _load_chunk(x_ptr, 2, NB, GB, GB_P2, BLOCK, EVICT)
    c3 = _load_chunk(x_ptr, 3, NB, GB, GB_P2, BLOCK, EVICT)
    c4 = _load_chunk(x_ptr, 4, NB, GB, GB_P2, BLOCK, EVICT)
    c5 = _load_chunk(x_ptr, 5, NB, GB, GB_P2, BLOCK, EVICT)
    c6 = _load_chunk(x_ptr, 6, NB, GB, GB_P2, BLOCK, EVICT)
    c7 = _load_chunk(x_ptr, 7, NB, GB, GB_P2, BLOCK, EVICT)
    if HADAMARD:
        c0, c1, c2, c3, c4, c5, c6, c7 = _hadamard_chunks(c0, c1, c2, c3, c4, c5, c6, c7, NB, GB_P2)
    if HAS_RES:  # padding groups read as 0 here too, so they stay out of the absmax
        c0 = c0 + _load_chunk(r_ptr, 0, NB, GB, GB_P2, BLOCK, "")
        c1 = c1 + _load_chunk(r_ptr, 1, NB, GB, GB_P2, BLOCK, "")
        c2 = c2 + _load_chunk(r_ptr, 2, NB, GB, GB_P2, BLOCK, "")
        c3 = c3 + _load_chunk(r_ptr, 3, NB, GB, GB_P2, BLOCK, "")
        c4 = c4 + _load_chunk(r_ptr, 4, NB, GB, GB_P2, BLOCK, "")
        c5 = c5 + _load_chunk(r_ptr, 5, NB, GB, GB_P2, BLOCK, "")
        c6 = c6 + _load_chunk(r_ptr, 6, NB, GB, GB_P2, BLOCK, "")
        c7 = c7 + _load_chunk(r_ptr, 7, NB, GB, GB_P2, BLOCK, "")
    absmax = tl.max(tl.max(_abs_max8(c0, c1, c2, c3, c4, c5, c6, c7), axis=2), axis=1)
    if SQUARE and BITS == 4:
        scale, inv = _scale_rule(absmax, absmax < TINY, _SQUARE_QMAX, _SQUARE_DROP)
    else:
        scale, inv = _scale_rule(absmax, absmax < TINY, QMAX, _SCALE_DROP)
    _store_scales(scale_ptr, scale, NB)
    inv = inv[:, None, None]
    s3 = scale[:, None, None]
    _quantize_chunk(c0, 0, inv, s3, pay_ptr, r_ptr, NB, GB, GB_P2, BITS, BLOCK, HAS_RES, SQUARE)
    _quantize_chunk(c1, 1, inv, s3, pay_ptr, r_ptr, NB, GB, GB_P2, BITS, BLOCK, HAS_RES, SQUARE)
    _quantize_chunk(c2, 2, inv, s3, pay_ptr, r_ptr, NB, GB, GB_P2, BITS, BLOCK, HAS_RES, SQUARE)
    _quantize_chunk(c3, 3, inv, s3, pay_ptr, r_ptr, NB, GB, GB_P2, BITS, BLOCK, HAS_RES, SQUARE)
    _quantize_chunk(c4, 4, inv, s3, pay_ptr, r_ptr, NB, GB, GB_P2, BITS, BLOCK, HAS_RES, SQUARE)
    _quantize_chunk(c5, 5, inv, s3, pay_ptr, r_ptr, NB, GB, GB_P2, BITS, BLOCK, HAS_RES, SQUARE)
    _quantize_chunk(c6, 6, inv, s3, pay_ptr, r_ptr, NB, GB, GB_P2, BITS, BLOCK, HAS_RES, SQUARE)
    _quantize_chunk(c7, 7, inv, s3, pay_ptr, r_ptr, NB, GB, GB_P2, BITS, BLOCK, HAS_RES, SQUARE)


@triton.jit
def _hadamard_kernel(x_ptr, out_ptr, sign_ptr, NB: tl.constexpr, INVERSE: tl.constexpr):
    # NB groups of 64 per program, fp32 output.
    pid = tl.program_id(0).to(tl.int64)
    x = _load_tile(x_ptr + pid * NB * _HAD, NB, _HAD, _HAD).to(tl.float32)
    _store_tile(out_ptr + pid * NB * _HAD, _hadamard_tile(x, sign_ptr, NB, _HAD, INVERSE), NB, _HAD, _HAD)


# int4 through 32-bit words (the default whenever the block is a multiple of 8 and the
# buffers are 4-byte aligned): each thread loads whole words (16-byte vectors) and keeps
# the 8 nibbles of a word as 8 separate [NB, W] tiles (element 8j + i is nibble i of word
# j), so nothing moves between threads until an fp output is interleaved for its store.


@triton.jit
def _nibble_at(we, P: tl.constexpr, BIAS: tl.constexpr):
    """q * 2^P (exact fp32) for the nibble at bits P..P+3 of w (P <= 16), where w was
    xored with 0x88888888 so that the nibble holds u = q + 8 in 0..15, and we = w |
    0x4B000000: the bits we & (0x4B000000 | 0xF << P) = 0x4B000000 | (u << P) are the
    fp32 2^23 + u * 2^P, and BIAS = 2^23 + 8 * 2^P is subtracted exactly. One LOP3 and
    one FADD, no shift and no int -> float conversion."""
    return (we & (0x4B000000 | (0xF << P))).to(tl.float32, bitcast=True) - BIAS


@triton.jit
def _nibble(w, SHIFT: tl.constexpr):
    """Nibble SHIFT / 4 of int32 words as fp32 q through an int -> float conversion."""
    return ((w << (28 - SHIFT)) >> 28).to(tl.float32)


@triton.jit
def _word_nibbles(w):
    """int32 words -> their 8 nibbles as exact fp32 q * 2^P, P = 0, 4, 8, 12, 16, 8, 12,
    16 (nibble i read in place at bit 4i for i <= 4, from the word shifted right by 12
    for i >= 5, so P <= 16 always)."""
    w = w ^ -2004318072  # 0x88888888 as int32: every nibble u = q + 8 (padding: q = 0)
    hi = (w >> 12) | 0x4B000000  # nibbles 5, 6, 7 at bits 8, 12, 16
    w = w | 0x4B000000  # the exponent bits of 2^23, set once per word
    return (_nibble_at(w, 0, 8388616.0), _nibble_at(w, 4, 8388736.0), _nibble_at(w, 8, 8390656.0),
            _nibble_at(w, 12, 8421376.0), _nibble_at(w, 16, 8912896.0), _nibble_at(hi, 8, 8390656.0),
            _nibble_at(hi, 12, 8421376.0), _nibble_at(hi, 16, 8912896.0))


@triton.jit
def _nibble_scales(s):
    """scale * 2^-P for P = 0, 4, 8, 12, 16: exact (scales are 0 or >= TINY / 7, so
    scale * 2^-16 is a normal number)."""
    return s, s * 0.0625, s * 0.00390625, s * 0.000244140625, s * 0.0000152587890625


@triton.jit
def _word_program(in_ptr, in_blocks_per_out, out_row_groups, NB: tl.constexpr):
    """This program's output row and first block, its first input block, and the input
    buffer as int32 words and as fp32 words (scales)."""
    pid = tl.program_id(0).to(tl.int64)
    orow = pid // out_row_groups
    ob = (pid % out_row_groups) * NB
    in_blk = orow * in_blocks_per_out + ob
    return orow, ob, in_blk, in_ptr.to(tl.pointer_type(tl.int32)), in_ptr.to(tl.pointer_type(tl.float32))


@triton.jit
def _square_word_levels(w):
    """int32 words -> the square code's levels of their 8 nibbles, q |q| * 4^P exactly
    (fp32), P = 0, 4, 8, 12 for nibbles 0-3 in place and 4-7 from the word shifted right
    by 16: each nibble decoded as in _nibble_at (one LOP3, one FADD, no int -> float
    conversion), then one FMUL by its own absolute value. P <= 12 keeps the matching
    scale * 4^-P normal (scales are 0 or >= TINY / 49, so >= 2^-120 after 2^-24)."""
    w = w ^ -2004318072  # 0x88888888: every nibble u = q + 8 (padding: q = 0)
    hi = (w >> 16) | 0x4B000000
    w = w | 0x4B000000
    n0 = _nibble_at(w, 0, 8388616.0)
    n1 = _nibble_at(w, 4, 8388736.0)
    n2 = _nibble_at(w, 8, 8390656.0)
    n3 = _nibble_at(w, 12, 8421376.0)
    n4 = _nibble_at(hi, 0, 8388616.0)
    n5 = _nibble_at(hi, 4, 8388736.0)
    n6 = _nibble_at(hi, 8, 8390656.0)
    n7 = _nibble_at(hi, 12, 8421376.0)
    return (n0 * tl.abs(n0), n1 * tl.abs(n1), n2 * tl.abs(n2), n3 * tl.abs(n3),
            n4 * tl.abs(n4), n5 * tl.abs(n5), n6 * tl.abs(n6), n7 * tl.abs(n7))


@triton.jit
def _square_read_scale(s):
    """A square-code scale as read (format.SQUARE_SCALE_FLOOR): its top 18 bits, 0 below
    the floor."""
    s = (s.to(tl.int32, bitcast=True) & ~_SQUARE_DROP).to(tl.float32, bitcast=True)
    return tl.where(s < _SQUARE_FLOOR, 0.0, s)


@triton.jit
def _square_scales(s):
    """The read scale times 4^-P for P = 0, 4, 8, 12: exact, >= 2^-124 or 0 (see
    _square_word_levels and format.SQUARE_SCALE_FLOOR)."""
    s = _square_read_scale(s)
    return s, s * 0.00390625, s * 0.0000152587890625, s * 5.9604644775390625e-08


@triton.jit
def _load_words(w_ptr, f_ptr, NB: tl.constexpr, W: tl.constexpr, W_P2: tl.constexpr, MAGIC: tl.constexpr,
                SQUARE: tl.constexpr):
    """NB int4 blocks (W words each) as 8 fp32 tiles [NB, W_P2] (q * scale, nibble i in
    tile i; SQUARE: q |q| * scale, exact); padding words read as 0 and dequantize to 0.

    MAGIC: each nibble comes from _word_nibbles as q * 2^P and is multiplied by scale *
    2^-P: the same real product q * scale, hence the same fp32 rounding."""
    w = _load_tile(w_ptr, NB, W_P2, W)
    s = tl.load(f_ptr + tl.arange(0, NB))[:, None]
    if SQUARE:  # q |q| 4^P times scale 4^-P: the exact level q |q| scale
        v0, v1, v2, v3, v4, v5, v6, v7 = _square_word_levels(w)
        s0, s4, s8, s12 = _square_scales(s)
        return v0 * s0, v1 * s4, v2 * s8, v3 * s12, v4 * s0, v5 * s4, v6 * s8, v7 * s12
    elif MAGIC:
        n0, n1, n2, n3, n4, n5, n6, n7 = _word_nibbles(w)
        s0, s4, s8, s12, s16 = _nibble_scales(s)
        return n0 * s0, n1 * s4, n2 * s8, n3 * s12, n4 * s16, n5 * s8, n6 * s12, n7 * s16
    else:
        return (_nibble(w, 0) * s, _nibble(w, 4) * s, _nibble(w, 8) * s, _nibble(w, 12) * s,
                _nibble(w, 16) * s, _nibble(w, 20) * s, _nibble(w, 24) * s, _nibble(w, 28) * s)


@triton.jit
def _interleave8(a0, a1, a2, a3, a4, a5, a6, a7, NB: tl.constexpr, BLOCK_P2: tl.constexpr):
    """8 nibble tiles [NB, W_P2] -> [NB, 8 * W_P2] in element order: the join order puts
    tile 4c + 2b + a at position 4c + 2b + a of each word's 8 lanes."""
    x = tl.join(tl.join(tl.join(a0, a4), tl.join(a2, a6)), tl.join(tl.join(a1, a5), tl.join(a3, a7)))
    return tl.reshape(x, [NB, BLOCK_P2])


@triton.jit
def _subnormal_nibble(w, P: tl.constexpr):
    """u * 2^(P - 149), exactly, for the nibble u at bits P..P+3 (P <= 16) of w: with
    the exponent field zero, the masked bits are a subnormal fp32. One LOP3."""
    return (w & (0xF << P)).to(tl.float32, bitcast=True)


@triton.jit
def _abs_max8(a0, a1, a2, a3, a4, a5, a6, a7):
    """Elementwise max |a| over 8 tiles: one cross-thread reduction after it, not 8."""
    return tl.maximum(tl.maximum(tl.maximum(tl.abs(a0), tl.abs(a1)), tl.maximum(tl.abs(a2), tl.abs(a3))),
                      tl.maximum(tl.maximum(tl.abs(a4), tl.abs(a5)), tl.maximum(tl.abs(a6), tl.abs(a7))))


@triton.jit
def _store_words(out_ptr, out_row, ob, out_payload_words, word, scale, NB: tl.constexpr, W: tl.constexpr,
                 W_P2: tl.constexpr):
    """An int4 hop's output: NB blocks of W payload words from block ob of the row that
    starts at word out_row, and their NB fp32 scales."""
    _store_tile(out_ptr.to(tl.pointer_type(tl.int32)) + out_row + ob * W, word, NB, W_P2, W)
    tl.store(out_ptr.to(tl.pointer_type(tl.float32)) + out_row + out_payload_words + ob + tl.arange(0, NB), scale)


@triton.jit
def _linear_hop_sum(in_w, in_f, orow, in_blk, in_row_words, in_payload_words, in_rows_per_out,
                    NB: tl.constexpr, N_SUM: tl.constexpr, W: tl.constexpr, W_P2: tl.constexpr,
                    HOP_FLUSH: tl.constexpr):
    """The linear hop's sum (reference._int4_hop operation for operation), as 8 nibble
    tiles in units of 2^(e_max + 22), and 2^e_max. Per element and row: one LOP3 (the
    nibble u as a subnormal u * 2^(P-149)) and one FFMA with t = s_r / 2^e_max * 2^(127 -
    P), adding the exact u * s_r / 2^(e_max + 22)."""
    first = in_f + orow * in_rows_per_out * in_row_words + in_payload_words + in_blk  # row 0's scales
    pow2, norm, bias = _hop_prologue(first, in_row_words, NB, N_SUM, HOP_FLUSH, False)
    a0 = tl.zeros([NB, W_P2], tl.float32) - bias[:, None]
    a1 = a0
    a2 = a0
    a3 = a0
    a4 = a0
    a5 = a0
    a6 = a0
    a7 = a0
    for r in tl.static_range(N_SUM):
        row = (orow * in_rows_per_out + r) * in_row_words
        w = _load_tile(in_w + row + in_blk * W, NB, W_P2, W) ^ -2004318072  # 0x88888888: u = q + 8
        sn = _hop_row_scale(first, r, in_row_words, norm, NB, HOP_FLUSH, False)
        t0 = (sn * 1.7014118346046923e38)[:, None]  # 2^127
        t4 = (sn * 1.0633823966279327e37)[:, None]  # 2^123
        t8 = (sn * 6.646139978924579e35)[:, None]  # 2^119
        t12 = (sn * 4.1538374868278621e34)[:, None]  # 2^115
        t16 = (sn * 2.5961484292674138e33)[:, None]  # 2^111
        hi = w >> 12  # nibbles 5, 6, 7 at bits 8, 12, 16
        a0 = tl.fma(_subnormal_nibble(w, 0), t0, a0)
        a1 = tl.fma(_subnormal_nibble(w, 4), t4, a1)
        a2 = tl.fma(_subnormal_nibble(w, 8), t8, a2)
        a3 = tl.fma(_subnormal_nibble(w, 12), t12, a3)
        a4 = tl.fma(_subnormal_nibble(w, 16), t16, a4)
        a5 = tl.fma(_subnormal_nibble(hi, 8), t8, a5)
        a6 = tl.fma(_subnormal_nibble(hi, 12), t12, a6)
        a7 = tl.fma(_subnormal_nibble(hi, 16), t16, a7)
    return pow2, a0, a1, a2, a3, a4, a5, a6, a7


@triton.jit
def _square_hop_sum(in_w, in_f, orow, in_blk, in_row_words, in_payload_words, in_rows_per_out,
                    NB: tl.constexpr, N_SUM: tl.constexpr, W: tl.constexpr, W_P2: tl.constexpr):
    """The square hop's sum as 8 nibble tiles: the reference's generic hop (dequantize each
    row, q |q| s exact; sum in row order from +0.0). Per element and row: the level q |q|
    4^P (_square_word_levels: LOP3, FADD, FMUL) and one FFMA with scale 4^-P, an exact
    product plus the add, which rounds as the reference's add of the dequantized row. The
    linear hop's bias form does not apply (the biased level q |q| + 49 needs 7 bits)."""
    row = orow * in_rows_per_out * in_row_words
    a0, a1, a2, a3, a4, a5, a6, a7 = _load_words(in_w + row + in_blk * W, in_f + row + in_payload_words + in_blk,
                                                 NB, W, W_P2, False, True)
    for r in tl.static_range(1, N_SUM):
        row = (orow * in_rows_per_out + r) * in_row_words
        v0, v1, v2, v3, v4, v5, v6, v7 = _square_word_levels(_load_tile(in_w + row + in_blk * W, NB, W_P2, W))
        s0, s4, s8, s12 = _square_scales(tl.load(in_f + row + in_payload_words + in_blk + tl.arange(0, NB))[:, None])
        a0 = tl.fma(v0, s0, a0)
        a1 = tl.fma(v1, s4, a1)
        a2 = tl.fma(v2, s8, a2)
        a3 = tl.fma(v3, s12, a3)
        a4 = tl.fma(v4, s0, a4)
        a5 = tl.fma(v5, s4, a5)
        a6 = tl.fma(v6, s8, a6)
        a7 = tl.fma(v7, s12, a7)
    return a0, a1, a2, a3, a4, a5, a6, a7


@triton.jit
def _pack_nibbles(q0, q1, q2, q3, q4, q5, q6, q7):
    """8 tiles of q as _round_bits gives them (0x4B400000 + q) -> int32 words, q_i in
    nibble i: sum of (0x4B400000 + q_i) * 16^i = sum q_i * 16^i + 0x4B400000 * 0x11111111
    (mod 2^32); adding 0x88888888 - that constant gives nibbles u_i = q_i + 8 without
    carries, and xor 0x88888888 turns them into q_i's two's-complement nibbles."""
    word = (q0 + q1 * 16 + q2 * 256 + q3 * 4096 + q4 * 65536 + q5 * 1048576 + q6 * 16777216 + q7 * 268435456)
    return (word + 1229490312) ^ -2004318072


@triton.jit
def _int4_hop_kernel(
    in_ptr, out_ptr,
    in_row_words, in_payload_words, in_rows_per_out, in_blocks_per_out,
    out_row_groups, out_row_words, out_payload_words,
    NB: tl.constexpr, N_SUM: tl.constexpr, W: tl.constexpr, W_P2: tl.constexpr, TINY: tl.constexpr,
    HOP_FLUSH: tl.constexpr, HOP_FLOOR: tl.constexpr, SQUARE: tl.constexpr,
):
    # int4 -> int4, the qgZ hop, in 32-bit words: the sum in 8 nibble tiles (linear code:
    # _linear_hop_sum, square code: _square_hop_sum), requantized per tile with the code's
    # rule and packed with integer multiply-adds (no interleave).
    orow, ob, in_blk, in_w, in_f = _word_program(in_ptr, in_blocks_per_out, out_row_groups, NB)
    if SQUARE:
        a0, a1, a2, a3, a4, a5, a6, a7 = _square_hop_sum(in_w, in_f, orow, in_blk, in_row_words, in_payload_words,
                                                         in_rows_per_out, NB, N_SUM, W, W_P2)
        # padding words dequantize to 0 in every row, so they never raise the absmax
        absmax = tl.max(_abs_max8(a0, a1, a2, a3, a4, a5, a6, a7), axis=1)
        scale, inv = _scale_rule(absmax, absmax < TINY, _SQUARE_QMAX, _SQUARE_DROP)
        inv = inv[:, None]
        word = _pack_nibbles(_square_q(a0, inv), _square_q(a1, inv), _square_q(a2, inv), _square_q(a3, inv),
                             _square_q(a4, inv), _square_q(a5, inv), _square_q(a6, inv), _square_q(a7, inv))
    else:
        pow2, a0, a1, a2, a3, a4, a5, a6, a7 = _linear_hop_sum(in_w, in_f, orow, in_blk, in_row_words,
                                                               in_payload_words, in_rows_per_out, NB, N_SUM, W,
                                                               W_P2, HOP_FLUSH)
        amax = _abs_max8(a0, a1, a2, a3, a4, a5, a6, a7)
        if W != W_P2:  # padding words (u = 8 in every row) sum to rounding noise: keep it out
            amax = tl.where((tl.arange(0, W_P2) < W)[None, :], amax, 0.0)
        scale, inv = _hop_requant_scale(tl.max(amax, axis=1), pow2, 7, TINY, HOP_FLOOR)
        inv = inv[:, None]
        word = _pack_nibbles(_round_bits(a0, inv), _round_bits(a1, inv), _round_bits(a2, inv), _round_bits(a3, inv),
                             _round_bits(a4, inv), _round_bits(a5, inv), _round_bits(a6, inv), _round_bits(a7, inv))
    _store_words(out_ptr, orow * out_row_words, ob, out_payload_words, word, scale, NB, W, W_P2)


@triton.jit
def _int4_words_kernel(
    in_ptr, out_ptr, sign_ptr,
    in_row_words, in_payload_words, in_rows_per_out, in_blocks_per_out,
    out_row_groups, factor,
    NB: tl.constexpr, N_SUM: tl.constexpr, BLOCK: tl.constexpr, BLOCK_P2: tl.constexpr, W: tl.constexpr,
    W_P2: tl.constexpr, HAS_FACTOR: tl.constexpr, ACCUMULATE: tl.constexpr, MANUAL_BF16: tl.constexpr,
    MAGIC: tl.constexpr, SQUARE: tl.constexpr, HADAMARD: tl.constexpr,
):
    # int4 -> float (dequantize, the final reduce): the same indexing and summation
    # order as _dequant_reduce_kernel, in 32-bit words: a block is W = BLOCK // 8 payload
    # words, a scale one word.
    orow, ob, in_blk, in_w, in_f = _word_program(in_ptr, in_blocks_per_out, out_row_groups, NB)
    row = orow * in_rows_per_out * in_row_words
    a0, a1, a2, a3, a4, a5, a6, a7 = _load_words(in_w + row + in_blk * W, in_f + row + in_payload_words + in_blk,
                                                 NB, W, W_P2, MAGIC, SQUARE)
    for r in tl.static_range(1, N_SUM):
        row = (orow * in_rows_per_out + r) * in_row_words
        e0, e1, e2, e3, e4, e5, e6, e7 = _load_words(in_w + row + in_blk * W,
                                                     in_f + row + in_payload_words + in_blk, NB, W, W_P2, MAGIC,
                                                     SQUARE)
        a0 = a0 + e0
        a1 = a1 + e1
        a2 = a2 + e2
        a3 = a3 + e3
        a4 = a4 + e4
        a5 = a5 + e5
        a6 = a6 + e6
        a7 = a7 + e7
    o = out_ptr + (orow * out_row_groups * NB + ob) * BLOCK
    if ACCUMULATE or HADAMARD:
        acc = _interleave8(a0, a1, a2, a3, a4, a5, a6, a7, NB, BLOCK_P2)
        if HAS_FACTOR:
            acc = acc * factor
        if HADAMARD:  # in element order: H^T of the scaled sum (as the byte kernel)
            acc = _hadamard_tile(acc, sign_ptr, NB, BLOCK_P2, True)
        if ACCUMULATE:
            acc = _load_tile(o, NB, BLOCK_P2, BLOCK) + acc
        _store_tile(o, _cast_out(acc, out_ptr.dtype.element_ty, MANUAL_BF16), NB, BLOCK_P2, BLOCK)
    else:  # scale and cast per nibble tile, then interleave the (narrower) outputs
        if HAS_FACTOR:
            a0 = a0 * factor
            a1 = a1 * factor
            a2 = a2 * factor
            a3 = a3 * factor
            a4 = a4 * factor
            a5 = a5 * factor
            a6 = a6 * factor
            a7 = a7 * factor
        y = _interleave8(_cast_out(a0, out_ptr.dtype.element_ty, MANUAL_BF16),
                         _cast_out(a1, out_ptr.dtype.element_ty, MANUAL_BF16),
                         _cast_out(a2, out_ptr.dtype.element_ty, MANUAL_BF16),
                         _cast_out(a3, out_ptr.dtype.element_ty, MANUAL_BF16),
                         _cast_out(a4, out_ptr.dtype.element_ty, MANUAL_BF16),
                         _cast_out(a5, out_ptr.dtype.element_ty, MANUAL_BF16),
                         _cast_out(a6, out_ptr.dtype.element_ty, MANUAL_BF16),
                         _cast_out(a7, out_ptr.dtype.element_ty, MANUAL_BF16), NB, BLOCK_P2)
        _store_tile(o, y, NB, BLOCK_P2, BLOCK)


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
    QMAX: tl.constexpr, TINY: tl.constexpr, HAS_RES: tl.constexpr, SQUARE: tl.constexpr,
    HADAMARD: tl.constexpr, CHUNKED: tl.constexpr, EVICT: tl.constexpr, PLAIN: tl.constexpr,
    ONE_ROW: tl.constexpr,
):
    # Program g handles output blocks b .. b + NB - 1 of row `row`; output block b reads
    # source block ((b // cb) * m + row) * cb + b % cb (NB divides cb, so the NB source
    # blocks are consecutive). With k = 1 (PLAIN: cb = blocks per row) that is g * NB, the
    # rows back to back, and with one row (ONE_ROW) b = g * NB too. Those cases keep the
    # integer divisions off the path from a program's start to its loads (ONE_ROW: no
    # divisions at all): they cost the int8 quantize of one row 2-4% per call at 16M-64M
    # elements with 2048-blocks, up to 0.7% with 4096 (docs/PERFORMANCE.md, "Per call").
    pid = tl.program_id(0).to(tl.int64)
    if ONE_ROW:
        row = 0
        b = pid * NB
    else:
        row = pid // row_groups
        b = (pid % row_groups) * NB
    if PLAIN:
        src = pid * NB
    else:
        src = ((b // chunk_blocks) * m + row) * chunk_blocks + b % chunk_blocks
    x_blk = x_ptr + src * BLOCK
    r_blk = res_ptr + src * BLOCK
    row_ptr = out_ptr + row * row_bytes
    pay_ptr = row_ptr + b * (BLOCK * BITS // 8)
    scale_ptr = row_ptr + payload_bytes + b * 4
    if HADAMARD or CHUNKED:  # HADAMARD: quantize H x (the residual is in H's domain)
        _quantize_chunks(x_blk, r_blk, pay_ptr, scale_ptr, NB, BITS, BLOCK, BLOCK_P2, QMAX, TINY, HAS_RES,
                         SQUARE, HADAMARD, EVICT)
        return
    x = _load_tile_evict(x_blk, NB, BLOCK_P2, BLOCK, EVICT).to(tl.float32)
    if HAS_RES:
        x = x + _load_tile(r_blk, NB, BLOCK_P2, BLOCK)
    if SQUARE and BITS == 4:
        q, scale = _quantize_tile_square(x, TINY)
    else:
        q, scale = _quantize_tile(x, QMAX, TINY)
    _store_blocks(pay_ptr, scale_ptr, q, scale, NB, BITS, BLOCK, BLOCK_P2)
    if HAS_RES:
        qf = (q - _MAGIC_BITS).to(tl.float32)
        if SQUARE and BITS == 4:
            qf = qf * tl.abs(qf)
        _store_tile(r_blk, x - qf * scale[:, None], NB, BLOCK_P2, BLOCK)


@triton.jit
def _quantize8_tma_kernel(out_ptr, x_desc, q_desc, payload_bytes, ROWS: tl.constexpr, NB: tl.constexpr,
                          QMAX: tl.constexpr, TINY: tl.constexpr):
    # The int8 quantize of one row through the tensor memory accelerator (Hopper's bulk
    # tensor copies; _quantize_into): x and the payload are viewed as [*, 64] rows; a
    # program moves ROWS of them (NB blocks) with one copy in and one out, and writes the
    # NB scales after the payload. The arithmetic is _quantize_tile's, so the bytes are
    # the same.
    pid = tl.program_id(0)
    x = tl.reshape(x_desc.load([pid * ROWS, 0]).to(tl.float32), [NB, ROWS // NB, 64])
    absmax = tl.max(tl.max(tl.abs(x), axis=2), axis=1)
    scale, inv = _scale_rule(absmax, absmax < TINY, QMAX, _SCALE_DROP)
    q = _round_bits(x, inv[:, None, None]).to(tl.int8).to(tl.uint8, bitcast=True)
    q_desc.store([pid * ROWS, 0], tl.reshape(q, [ROWS, 64]))
    _store_scales(out_ptr + payload_bytes + pid * NB * 4, scale, NB)


@triton.jit
def _dequant_reduce_kernel(
    in_ptr, out_ptr, sign_ptr,
    in_row_bytes, in_payload_bytes, in_rows_per_out, in_blocks_per_out,
    out_row_groups, out_row_bytes, out_payload_bytes, factor,
    NB: tl.constexpr, N_SUM: tl.constexpr, BITS_IN: tl.constexpr, BITS_OUT: tl.constexpr, BLOCK: tl.constexpr,
    BLOCK_P2: tl.constexpr, QMAX_OUT: tl.constexpr, TINY: tl.constexpr, HAS_FACTOR: tl.constexpr,
    ACCUMULATE: tl.constexpr, MANUAL_BF16: tl.constexpr, HOP_FLUSH: tl.constexpr, HOP_FLOOR: tl.constexpr,
    SQUARE: tl.constexpr, HADAMARD: tl.constexpr,
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
    if BITS_IN == 4 and BITS_OUT != 0 and not SQUARE:
        # int4 -> requantized (the qgZ hop): reference._int4_hop, as _int4_hop_kernel
        first = row_ptr + in_payload_bytes + in_blk * 4  # row 0's scales
        pow2, norm, bias = _hop_prologue(first, in_row_bytes, NB, N_SUM, HOP_FLUSH, True)
        acc = tl.zeros([NB, BLOCK_P2], tl.float32) - bias[:, None]
        for r in tl.static_range(N_SUM):
            row_ptr = in_ptr + (orow * in_rows_per_out + r) * in_row_bytes
            sn = _hop_row_scale(first, r, in_row_bytes, norm, NB, HOP_FLUSH, True)
            u = _load_q(row_ptr + in_blk * (BLOCK // 2), NB, 4, BLOCK, BLOCK_P2) + 8.0
            acc = tl.fma(u, (sn * 2.384185791015625e-07)[:, None], acc)  # u * sn * 2^-22, exact
        amax = tl.abs(acc)
        if BLOCK != BLOCK_P2:  # padding lanes (u = 8 in every row) sum to rounding noise
            amax = tl.where((tl.arange(0, BLOCK_P2) < BLOCK)[None, :], amax, 0.0)
        scale, inv = _hop_requant_scale(tl.max(amax, axis=1), pow2, QMAX_OUT, TINY, HOP_FLOOR)
        row_ptr = out_ptr + orow * out_row_bytes
        _store_blocks(row_ptr + ob * (BLOCK * BITS_OUT // 8), row_ptr + out_payload_bytes + ob * 4,
                      _round_bits(acc, inv[:, None]), scale, NB, BITS_OUT, BLOCK, BLOCK_P2)
        return
    acc = _load_blocks(row_ptr + in_blk * (BLOCK * BITS_IN // 8), row_ptr + in_payload_bytes + in_blk * 4,
                       NB, BITS_IN, BLOCK, BLOCK_P2, SQUARE)
    for r in tl.static_range(1, N_SUM):
        row_ptr = in_ptr + (orow * in_rows_per_out + r) * in_row_bytes
        acc = acc + _load_blocks(row_ptr + in_blk * (BLOCK * BITS_IN // 8), row_ptr + in_payload_bytes + in_blk * 4,
                                 NB, BITS_IN, BLOCK, BLOCK_P2, SQUARE)
    if BITS_OUT != 0:
        if BLOCK != BLOCK_P2:  # padding lanes must not touch the absmax
            acc = tl.where((tl.arange(0, BLOCK_P2) < BLOCK)[None, :], acc, 0.0)
        if SQUARE and BITS_OUT == 4:
            q, scale = _quantize_tile_square(acc, TINY)
        else:
            q, scale = _quantize_tile(acc, QMAX_OUT, TINY)
        row_ptr = out_ptr + orow * out_row_bytes
        _store_blocks(row_ptr + ob * (BLOCK * BITS_OUT // 8), row_ptr + out_payload_bytes + ob * 4,
                      q, scale, NB, BITS_OUT, BLOCK, BLOCK_P2)
    else:
        if HAS_FACTOR:
            acc = acc * factor
        if HADAMARD:  # the rows were summed in H's domain: back with H^T, then accumulate
            acc = _hadamard_tile(acc, sign_ptr, NB, BLOCK_P2, True)
        o = out_ptr + (orow * out_row_groups * NB + ob) * BLOCK
        if ACCUMULATE:
            acc = _load_tile(o, NB, BLOCK_P2, BLOCK) + acc
        _store_tile(o, _cast_out(acc, out_ptr.dtype.element_ty, MANUAL_BF16), NB, BLOCK_P2, BLOCK)


# One cached launcher per kernel (kernels/launch.py): after the first call of a
# specialization, a call costs the compiled kernel's own launcher, not the JIT's binding.
QUANTIZE = CachedLauncher(_quantize_kernel)
DEQUANT_REDUCE = CachedLauncher(_dequant_reduce_kernel)
INT4_HOP = CachedLauncher(_int4_hop_kernel)
INT4_WORDS = CachedLauncher(_int4_words_kernel)
HADAMARD = CachedLauncher(_hadamard_kernel)
QUANTIZE8_TMA = CachedLauncher(_quantize8_tma_kernel)

# Decorated under TRITON_INTERPRET=1 (the CPU tests): the float outputs round to bf16 by
# hand there (_cast_out's MANUAL_BF16).
INTERPRETED = interpreted(_quantize_kernel)
