"""The packed quantized format shared by the torch reference and the Triton kernels.

A segment of L elements (L a multiple of the block size B) quantized to `bits` in
{8, 4} is one uint8 buffer:

    [ payload: L * bits / 8 bytes ][ scales: L / B float32, 4 bytes each, little-endian ]

so that a single collective moves data and scales together. Leading dimensions are
independent segments: a tensor [..., L] packs to [..., packed_len(L, bits, B)].

int8 payload: one two's-complement byte per element. int4 payload: two's-complement
nibbles, element 2i in the low nibble of byte i, element 2i+1 in the high nibble.
See docs/KERNELS.md for the rounding rule and the error bounds.
"""

import sys

# Blocks whose absmax is below TINY quantize to all zeros with scale 0. Keeping every
# non-zero scale >= TINY / qmax (a normal fp32 number, far above the subnormal range)
# makes qmax / absmax finite and keeps every product and partial sum normal, so GPU
# flush-to-zero behaviour can never make the Triton and torch results differ.
TINY = 2.0 ** -90
QMAX = {8: 127, 4: 7}
# Scales carry at most SCALE_BITS significant bits (rounded up, i.e. the low 24 -
# SCALE_BITS mantissa bits are zero): then q * scale (q has at most 8 bits here, 4 for
# int4) is an exact fp32 product, so a fused multiply-add of it rounds exactly like a
# multiply and an add. The qgZ hop (docs/KERNELS.md) relies on this for int4 input.
SCALE_BITS = 20
SCALE_DROP = (1 << (24 - SCALE_BITS)) - 1  # the mantissa bits a scale leaves zero
# The int4 -> requantized hop sums relative to 2^e_max, the power of two of the block's
# largest input scale (docs/KERNELS.md, "The qgZ hop"): rows whose scale is below
# HOP_FLUSH * 2^e_max contribute nothing (their products would be subnormal), and a sum
# whose absmax is below HOP_FLOOR * 2^e_max is a zero block (that is below the fp32
# resolution of the sum, ~2^-20 * 2^e_max).
HOP_FLUSH = 2.0 ** -100
HOP_FLOOR = 2.0 ** -42
SCALE_BYTES = 4
# The functions every kernel backend (kernels/quant.py, kernels/reference.py) provides
# with the same signatures, and kernels/ops.py dispatches to.
KERNEL_API = ("packed_len", "quantize", "dequantize", "reorder_quantize", "dequant_reduce_quantize",
              "dequant_reduce", "hadamard")

# How an int4 nibble q (-7..7) maps to a value, given its block's scale s (int8 is always
# linear). "linear": q * s, s = absmax / 7 (rounded up to SCALE_BITS bits). "square":
# sign(q) q^2 s = q |q| s, s = absmax / 49 rounded up to SQUARE_SCALE_BITS bits, so the
# levels are 0, 1, 4, 9, ..., 49 steps and a value 7x smaller than the linear code's
# smallest level survives (the qgZ gradient code: docs/ZEROPP.md "The square-law code").
# A square scale has SQUARE_SCALE_BITS significant bits so that q |q| s (|q| |q| <= 49, six
# bits) is an exact fp32 product: every level is represented exactly.
INT4_CODES = ("linear", "square")
SQUARE_QMAX = 49
SQUARE_SCALE_BITS = 18
SQUARE_SCALE_DROP = (1 << (24 - SQUARE_SCALE_BITS)) - 1
# The square code picks the nearest level in units of s: level c for t^2 + t + 1/2 <= y <
# (t+1)^2 + (t+1) + 1/2, i.e. the thresholds SQUARE_THRESHOLDS[c-1] <= y < [c].
SQUARE_THRESHOLDS = tuple(t * t + t + 0.5 for t in range(7))
# Reading a square-code scale, both implementations keep its top SQUARE_SCALE_BITS bits
# and read one below SQUARE_SCALE_FLOOR as 0: no-ops for the scales quantize writes
# (18 bits, 0 or >= TINY / 49 > 2^-96), and for any other buffer they make every level
# q |q| s, and s * 2^-24 (the GPU's per-nibble scaling), exact fp32 numbers, so that a
# fused multiply-add of a level rounds exactly as the reference's multiply then add.
SQUARE_SCALE_FLOOR = 2.0 ** -100

# The randomized Hadamard transform of qgZ (--zero-hadamard-gradients, docs/ZEROPP.md
# "Hadamard-smoothed gradients"): every HADAMARD_SIZE consecutive elements x of a flat
# gradient buffer become H x = (1/8) W D x, W the 64 x 64 Sylvester Walsh-Hadamard matrix
# (entries +-1, W W = 64 I) and D = diag(HADAMARD_SIGNS), the same fixed random signs in
# every group and on every rank. H is orthogonal (H^T = (1/8) D W), so sums over ranks
# commute with it. 1/8 = 1/sqrt(64) is a power of two: the normalisation is exact.
HADAMARD_SIZE = 64
HADAMARD_SEED = 0x5EED21  # fixed: every rank, every run and every checkpoint agree


def _hadamard_signs(seed: int, n: int) -> tuple:
    """n signs +-1.0 from a fixed 32-bit LCG (Numerical Recipes constants), top bit: the
    same on every host and independent of torch's RNG."""
    out, state = [], seed
    for _ in range(n):
        state = (1664525 * state + 1013904223) % (1 << 32)
        out.append(-1.0 if state >> 31 else 1.0)
    return tuple(out)


HADAMARD_SIGNS = _hadamard_signs(HADAMARD_SEED, HADAMARD_SIZE)


def check_hadamard(L: int) -> None:
    """Raise one clear ValueError when a segment of L elements cannot be transformed."""
    if L <= 0 or L % HADAMARD_SIZE:
        raise ValueError(f"the Hadamard transform works on groups of {HADAMARD_SIZE} elements: length {L} "
                         f"(and the block size) must be a multiple of {HADAMARD_SIZE}")


if sys.byteorder != "little":  # the scale bytes are written as little-endian fp32
    raise ImportError("megaq.kernels assumes a little-endian host")


def check_format(L: int, bits: int, block: int) -> None:
    """Raise one clear ValueError when (L, bits, block) cannot be packed."""
    if bits not in QMAX:
        raise ValueError(f"bits={bits} is not supported: use 8 (int8) or 4 (int4)")
    if block <= 0 or block % 2:
        raise ValueError(f"block={block} must be a positive even number (e.g. 2048)")
    if L <= 0 or L % block:
        raise ValueError(
            f"length {L} is not a positive multiple of the block size {block}: "
            f"pad the buffer to a multiple of {block} before quantizing"
        )


def check_code(code: str) -> None:
    """Raise one clear ValueError for an unknown int4 code."""
    if code not in INT4_CODES:
        raise ValueError(f"int4 code {code!r} is not supported: use one of {', '.join(INT4_CODES)}")


def max_error_over_absmax(bits: int, code: str = "linear") -> float:
    """Worst |x - dequant(quant(x))| / absmax of x's block, for the rounding rule of
    docs/KERNELS.md (fp32 scale and reciprocal roundings included). linear: half a step,
    absmax / (2 qmax), times the scale's round-up (1 + 2^-(SCALE_BITS-1)). square: the
    widest gap between levels is 36 .. 49 steps, so at most 6.5 steps of absmax / 49
    (the scale rounded up by at most 2^-(SQUARE_SCALE_BITS-1), the reciprocal by 2^-24):
    6.5 / 49 ~ 0.1327 absmax, against 1/14 ~ 0.0714 for linear int4; near zero it is far
    smaller (sqrt(|x| s) + s / 2, and values down to absmax / 98 are kept, not absmax / 14)."""
    if bits == 4 and code == "square":
        return 6.5 / SQUARE_QMAX * (1 + 2.0 ** -(SQUARE_SCALE_BITS - 1)) + 49 * 2.0 ** -23 / SQUARE_QMAX
    return 1 / (2 * QMAX[bits]) * (1 + 2.0 ** -(SCALE_BITS - 1)) + 2.0 ** -23


def packed_len(L: int, bits: int, block: int) -> int:
    """Bytes of one packed segment of L elements: payload then one fp32 scale per block."""
    check_format(L, bits, block)
    return L * bits // 8 + SCALE_BYTES * (L // block)


def check_packed(packed, L: int, bits: int, block: int) -> int:
    """Validate a packed uint8 buffer [..., P] for segments of L elements; return P."""
    return check_packed_layout(packed.shape, packed.dtype, L, bits, block)


def check_packed_layout(shape, dtype, L: int, bits: int, block: int) -> int:
    """check_packed for a buffer of this shape and dtype."""
    import torch

    P = packed_len(L, bits, block)
    if dtype != torch.uint8:
        raise ValueError(f"packed buffer has dtype {dtype}; expected torch.uint8")
    if len(shape) == 0 or shape[-1] != P:
        raise ValueError(
            f"packed buffer has shape {tuple(shape)}; expected [..., {P}] "
            f"(packed_len(L={L}, bits={bits}, block={block}))"
        )
    return P


def check_float_input(x) -> None:
    check_float_dtype(x.dtype)


def check_float_dtype(dtype) -> None:
    import torch

    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"input dtype {dtype} is not supported: use float32, float16 or bfloat16")


def check_reorder(numel: int, k: int, m: int, block: int) -> int:
    """For a gradient of `numel` elements split over n = k * m ranks, return S."""
    if k <= 0 or m <= 0:
        raise ValueError(f"k={k} nodes and m={m} ranks per node must be positive")
    n = k * m
    if numel % n:
        raise ValueError(f"gradient of {numel} elements does not split into n={n} equal chunks: pad it")
    S = numel // n
    if S == 0 or S % block:
        raise ValueError(
            f"chunk size S={S} is not a positive multiple of the block size {block}: "
            f"pad the gradient to a multiple of n * block = {n * block}"
        )
    return S


def check_residual(residual, grad) -> None:
    """The qgZ error-feedback buffer: fp32, contiguous, one element per gradient element."""
    import torch

    if residual.dtype != torch.float32 or residual.numel() != grad.numel() or not residual.is_contiguous():
        raise ValueError(
            f"residual must be a contiguous float32 tensor of {grad.numel()} elements "
            f"(got {residual.dtype}, {residual.numel()} elements)"
        )


def check_out(out, S: int) -> None:
    """The fp32 accumulator dequant_reduce adds into: contiguous, S elements."""
    import torch

    if out.dtype != torch.float32 or out.numel() != S or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous float32 tensor of {S} elements (got {out.dtype}, {out.numel()})")
