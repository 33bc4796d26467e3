"""Plain-torch reference of every kernel (same signatures as kernels/quant.py).

CPU runs use these; the Triton kernels must match them bit for bit. Rounding rule
(docs/KERNELS.md): per block, absmax = max |x| in fp32; if absmax < TINY the block
is all zeros with scale 0; else scale = absmax / qmax (IEEE fp32 division) rounded up
to SCALE_BITS (20) significant bits and inv = 1 / scale (IEEE); q = the exact product
x * inv rounded half to even (|q| <= qmax always). Dequantize: q * scale in fp32 (an
exact product), then one cast to the requested dtype. Sums run over rows in order 0,
1, ... starting from +0.0, one fp32 add per row, except the int4 -> requantized hop,
which sums in the exactly reproducible form of _int4_hop.

The square-law int4 code (`code="square"`, format.INT4_CODES; int8 is always linear):
scale = absmax / 49 rounded up to SQUARE_SCALE_BITS (18) bits, y = |x| * inv (exact),
c = the number of thresholds t^2 + t + 1/2 (t = 0..6) that y reaches, q = sign(x) c;
dequantize q |q| * scale (exact). Its hop dequantizes, sums the rows in order from +0.0
and requantizes (no exact-product form: q |q| + 49 needs 7 bits).

The Hadamard transform (`hadamard`, and `hadamard=True` of quantize / reorder_quantize /
dequant_reduce; format.HADAMARD_SIZE): per group of 64 elements, forward = signs, then the
butterfly, then * 1/8; inverse = butterfly, * 1/8, then signs. The butterfly has six
stages h = 1, 2, 4, ..., 32; stage h replaces each pair (a, b) = (x[i], x[i + h]) (i with
bit h clear) by (a + b, a - b), one fp32 add each. Sign flips and the power-of-two 1/8
are exact, so the only roundings are the 6 x 64 adds, in the same order in both backends.

Note: never write `qmax / tensor`: torch computes a python-scalar numerator as
reciprocal(tensor) * qmax, which is not the IEEE quotient.
"""

import torch

from .format import (
    HOP_FLOOR,
    HOP_FLUSH,
    QMAX,
    SCALE_DROP,
    SQUARE_QMAX,
    SQUARE_SCALE_DROP,
    SQUARE_SCALE_FLOOR,
    HADAMARD_SIGNS,
    HADAMARD_SIZE,
    KERNEL_API,
    SQUARE_THRESHOLDS,
    TINY,
    check_code,
    check_hadamard,
    check_float_input,
    check_format,
    check_out,
    check_packed,
    check_reorder,
    check_residual,
)
from .format import packed_len as _packed_len

__all__ = list(KERNEL_API)
packed_len = _packed_len  # part of every backend's API (format.KERNEL_API)


def _round_up_scale(s: torch.Tensor, drop: int = SCALE_DROP) -> torch.Tensor:
    """Positive fp32 -> the smallest value >= it with SCALE_BITS significant bits (the
    low bits `drop` zero)."""
    return ((s.view(torch.int32) + drop) & ~drop).view(torch.float32)


def _square(bits: int, code: str) -> bool:
    """Whether a segment of `bits` uses the square-law code (only int4 has one)."""
    check_code(code)
    return bits == 4 and code == "square"


def _scale_rule(absmax: torch.Tensor, is_zero: torch.Tensor, bits: int, square: bool = False):
    """(scale, inv) per block: scale = absmax / qmax rounded up to SCALE_BITS bits (the
    square code: / 49, SQUARE_SCALE_BITS bits), inv = 1 / scale (IEEE divisions); both 0
    for zero blocks."""
    qmax = torch.full_like(absmax, float(SQUARE_QMAX if square else QMAX[bits]))
    safe = torch.where(is_zero, torch.ones_like(absmax), absmax)
    scale = _round_up_scale(torch.div(safe, qmax), SQUARE_SCALE_DROP if square else SCALE_DROP)
    inv = torch.where(is_zero, torch.zeros_like(absmax), torch.div(torch.ones_like(scale), scale))
    return torch.where(is_zero, torch.zeros_like(scale), scale), inv


def _round_q(blocks: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """q = the exact product blocks * inv rounded half to even (exact in fp64: two
    24-bit significands), as int8. |q| <= qmax: absmax * inv <= qmax * (1 + 2^-23).
    In place on the one fp64 copy: on CPU every fresh full-size tensor costs more than
    the arithmetic."""
    return blocks.double().mul_(inv.double().unsqueeze(-1)).round_().to(torch.int8)


# Entry 99 + n (n = -99..99) is sign(n) #{t : 2 (t^2 + t + 1/2) <= |n|}: _square_q's table.
_SQUARE_COUNTS = tuple(sum(2 * thr <= n for thr in SQUARE_THRESHOLDS) for n in range(100))
_SQUARE_TABLE = tuple(-c for c in _SQUARE_COUNTS[:0:-1]) + _SQUARE_COUNTS


# Byte b of a square-code payload -> its two levels q |q| (low nibble, high nibble).
_SQUARE_BYTE_LEVELS = tuple(
    tuple(float(q * abs(q)) for q in (((b & 0xF) ^ 8) - 8, ((b >> 4) ^ 8) - 8)) for b in range(256))


def _square_q(blocks: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """The square code's q = sign(x) c, c = #{t : |x| * inv >= t^2 + t + 1/2} (the
    product exact in fp64), as int8.

    Computed as one table look-up: with v = 2 x inv (exact in fp64) and n = v truncated
    toward zero, |x| inv >= t^2 + t + 1/2 <=> |v| >= 2t^2 + 2t + 1 (an integer) <=>
    |n| >= 2t^2 + 2t + 1; so q = table[99 + n] (n clamped to +-99: every |v| >= 85
    counts all 7; NaN -> 0 as the comparisons give). Bit-identical to counting the 7
    comparisons, about 5x cheaper on CPU (one fp64 copy, in-place ops, one gather)."""
    v = blocks.double().mul_((2.0 * inv.double()).unsqueeze(-1))
    n = v.nan_to_num_(0.0).clamp_(-99.0, 99.0).to(torch.int32).add_(99)
    table = torch.tensor(_SQUARE_TABLE, dtype=torch.int8, device=blocks.device)
    return table.index_select(0, n.reshape(-1)).reshape(n.shape)


def _pack(q: torch.Tensor, scale: torch.Tensor, bits: int) -> torch.Tensor:
    """int8 q [..., L] and fp32 scales [..., L/block] -> the packed uint8 format."""
    if bits == 8:
        payload = q.view(torch.uint8)
    else:
        nib = q.view(torch.uint8) & 0xF
        payload = nib[..., 0::2] | (nib[..., 1::2] << 4)
    return torch.cat([payload, scale.contiguous().view(torch.uint8)], dim=-1)


def _quantize_fp32(xf: torch.Tensor, bits: int, block: int, code: str = "linear") -> torch.Tensor:
    """xf: fp32 [..., L] -> packed uint8 [..., packed_len]."""
    lead, L = xf.shape[:-1], xf.shape[-1]
    blocks = xf.reshape(*lead, L // block, block)
    absmax = blocks.abs().amax(dim=-1)
    square = _square(bits, code)
    scale, inv = _scale_rule(absmax, absmax < TINY, bits, square)
    q = _square_q(blocks, inv) if square else _round_q(blocks, inv)
    return _pack(q.reshape(*lead, L), scale, bits)


def _dequantize_fp32(packed: torch.Tensor, L: int, bits: int, block: int, code: str = "linear") -> torch.Tensor:
    """packed uint8 [..., P] -> fp32 [..., L] (q * scale, one fp32 multiply; the square
    code q |q| * scale, exact)."""
    nbytes = L * bits // 8
    payload = packed[..., :nbytes]
    scale = packed[..., nbytes:].contiguous().view(torch.float32)
    lead = packed.shape[:-1]
    if _square(bits, code):
        # each byte's two levels q |q| (low nibble first) from a 256-entry table: one
        # gather instead of unpacking, converting and squaring (the same exact values)
        table = torch.tensor(_SQUARE_BYTE_LEVELS, dtype=torch.float32, device=packed.device)
        qf = table.index_select(0, payload.reshape(-1).to(torch.int32)).reshape(*lead, L // block, block)
        scale = (scale.view(torch.int32) & ~SQUARE_SCALE_DROP).view(torch.float32)  # format.SQUARE_SCALE_FLOOR
        scale = torch.where(scale < SQUARE_SCALE_FLOOR, torch.zeros_like(scale), scale)
    else:
        if bits == 8:
            q = payload.view(torch.int8)
        else:
            lo = (payload << 4).view(torch.int8) >> 4
            hi = payload.view(torch.int8) >> 4
            q = torch.stack([lo, hi], dim=-1).flatten(-2)
        qf = q.to(torch.float32).reshape(*lead, L // block, block)
    return qf.mul_(scale.unsqueeze(-1)).reshape(*lead, L)   # qf is a fresh tensor


def _hadamard_fp32(x: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """fp32 [..., L] (L a multiple of 64) -> H x, or H^T x with inverse (module note)."""
    shape = x.shape
    signs = torch.tensor(HADAMARD_SIGNS, dtype=torch.float32, device=x.device)
    y = x.reshape(-1, HADAMARD_SIZE)
    if not inverse:
        y = y * signs
    h = 1
    while h < HADAMARD_SIZE:
        y = y.reshape(-1, HADAMARD_SIZE // (2 * h), 2, h)
        a, b = y[:, :, 0], y[:, :, 1]
        y = torch.stack([a + b, a - b], dim=2)
        h *= 2
    y = y.reshape(-1, HADAMARD_SIZE) * 0.125
    if inverse:
        y = y * signs
    return y.reshape(shape)


def hadamard(x: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """x [..., L] (bf16/fp16/fp32, L a multiple of 64) -> fp32 [..., L]: the blockwise
    randomized Hadamard transform H of every 64 consecutive elements (H^T with inverse)."""
    check_float_input(x)
    check_hadamard(x.shape[-1] if x.dim() else 0)
    return _hadamard_fp32(x.to(torch.float32), inverse)


def _sum_rows(rows: torch.Tensor) -> torch.Tensor:
    """Sum over dim 0 in row order from +0.0: the order the Triton kernels use."""
    acc = torch.zeros_like(rows[0])
    for r in range(rows.shape[0]):
        acc = acc + rows[r]
    return acc


def quantize(x: torch.Tensor, bits: int, block: int, code: str = "linear",
             hadamard: bool = False) -> torch.Tensor:
    """x [..., L] (bf16/fp16/fp32) -> uint8 [..., packed_len(L, bits, block)].
    code: the int4 code ("linear" or "square"; int8 is always linear). hadamard: quantize
    H x (the blockwise transform above; L and block multiples of 64)."""
    check_float_input(x)
    check_format(x.shape[-1] if x.dim() else 0, bits, block)
    xf = x.to(torch.float32)
    if hadamard:
        check_hadamard(block)
        xf = _hadamard_fp32(xf)
    return _quantize_fp32(xf, bits, block, code)


def dequantize(
    packed: torch.Tensor, L: int, bits: int, block: int, dtype: torch.dtype = torch.float32,
    code: str = "linear",
) -> torch.Tensor:
    """uint8 [..., packed_len(L)] -> [..., L] of `dtype` (rounded once from fp32)."""
    check_packed(packed, L, bits, block)
    return _dequantize_fp32(packed, L, bits, block, code).to(dtype)


def reorder_quantize(
    grad: torch.Tensor,
    k: int,
    m: int,
    bits: int,
    block: int,
    residual: torch.Tensor | None = None,
    code: str = "linear",
    hadamard: bool = False,
) -> torch.Tensor:
    """grad [n*S] (n = k*m chunks; chunk a*m + j belongs to node a, local rank j)
    -> uint8 [m, packed_len(k*S)]: row j holds chunks j, m + j, ..., (k-1)*m + j.

    residual (optional, fp32 [n*S], error feedback): grad + residual is quantized
    and residual is overwritten in place with (grad + residual) - dequant(q).
    hadamard: H grad is quantized instead of grad (block a multiple of 64, so the groups
    never straddle chunks); the residual then lives in the transformed domain:
    H grad + residual is quantized.
    """
    check_float_input(grad)
    S = check_reorder(grad.numel(), k, m, block)
    x = grad.reshape(-1).to(torch.float32)
    if hadamard:
        check_hadamard(block)
        x = _hadamard_fp32(x)
    if residual is not None:
        check_residual(residual, grad)
        x = x + residual
    xr = x.reshape(k, m, S).transpose(0, 1).reshape(m, k * S)
    packed = _quantize_fp32(xr, bits, block, code)
    if residual is not None:
        err = xr - _dequantize_fp32(packed, k * S, bits, block, code)
        residual.copy_(err.reshape(m, k, S).transpose(0, 1).reshape(-1))
    return packed




def dequant_reduce_quantize(
    recv: torch.Tensor, k: int, S: int, bits_in: int, bits_out: int, block: int,
    code: str = "linear",
) -> torch.Tensor:
    """recv uint8 [m, packed_len(k*S, bits_in)] -> uint8 [k, packed_len(S, bits_out)]:
    dequantize the m rows, sum them in fp32, requantize each of the k chunks of S.
    code: the int4 code of the int4 side(s)."""
    check_format(S, bits_out, block)
    check_packed(recv, k * S, bits_in, block)
    if bits_in == 4 and not _square(4, code):
        return _int4_hop(recv.reshape(-1, recv.shape[-1]), k, S, bits_out, block)
    rows = _dequantize_fp32(recv.reshape(-1, recv.shape[-1]), k * S, bits_in, block, code)
    return _quantize_fp32(_sum_rows(rows).reshape(k, S), bits_out, block, code)


def _int4_hop(recv: torch.Tensor, k: int, S: int, bits_out: int, block: int) -> torch.Tensor:
    """The int4 -> requantized hop (docs/KERNELS.md, "The qgZ hop"): per block, sum
    u_r * s_r - 8 * s_r over the m rows (u = q + 8, the nibble xor 8) in units of
    2^e_max, the power of two of the largest (20-bit-truncated) scale, starting from
    -(sum of the 8 * s_r) and adding one exact product per row; then the rule of
    _quantize_fp32 on the sum. The GPU kernel does the same operations in the same
    order (a fused multiply-add of an exact product rounds like the add alone)."""
    m, L = recv.shape[0], k * S
    nb = L // block
    payload = recv[:, :L // 2]
    u = torch.stack([(payload & 0xF) ^ 8, (payload >> 4) ^ 8], dim=-1).reshape(m, nb, block).to(torch.float32)
    s = (recv[:, L // 2:].contiguous().view(torch.int32) & ~SCALE_DROP).view(torch.float32)  # [m, nb]
    ebits = s.amax(0).view(torch.int32) & 0x7F800000  # 2^e_max's bits
    ebits = torch.where(ebits == 0, torch.full_like(ebits, 127 << 23), ebits)  # all-zero block: 2^0
    pow2 = ebits.view(torch.float32)
    sn = s * (0x7F000000 - ebits).view(torch.float32)  # s_r / 2^e_max, exact
    sn = torch.where(sn < HOP_FLUSH, torch.zeros_like(sn), sn)
    bias = torch.zeros_like(pow2)
    for r in range(m):
        bias = bias + sn[r] * 2.0 ** -19  # 8 * s_r * 2^-22
    acc = (-bias).unsqueeze(-1).expand(nb, block)
    for r in range(m):
        acc = acc + u[r] * (sn[r] * 2.0 ** -22).unsqueeze(-1)  # exact products
    absmax = acc.abs().amax(-1)  # of the sum / 2^(e_max + 22)
    a22 = absmax * 2.0 ** 22
    scale, inv = _scale_rule(absmax, (a22 < HOP_FLOOR) | (a22 * pow2 < TINY), bits_out)
    q = _round_q(acc, inv).reshape(k, S)
    return _pack(q, ((scale * 2.0 ** 22) * pow2).reshape(k, S // block), bits_out)


def dequant_reduce(
    recv: torch.Tensor,
    S: int,
    bits: int,
    block: int,
    scale: float = 1.0,
    out: torch.Tensor | None = None,
    code: str = "linear",
    hadamard: bool = False,
) -> torch.Tensor:
    """recv uint8 [k, packed_len(S)] -> fp32 [S] = scale * sum of the k rows.
    With `out` (fp32 [S]) the result is ADDED into out (gradient accumulation).
    hadamard: the rows are in the transformed domain; H^T (scale * sum) is the result."""
    check_packed(recv, S, bits, block)
    rows = _dequantize_fp32(recv.reshape(-1, recv.shape[-1]), S, bits, block, code)
    res = _sum_rows(rows) * float(scale)  # fp32 tensor * python float: fp32(scale) multiply
    if hadamard:
        check_hadamard(block)
        res = _hadamard_fp32(res, inverse=True)
    if out is None:
        return res
    check_out(out, S)
    return out.add_(res)
