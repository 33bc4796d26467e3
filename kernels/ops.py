"""The ops megaq calls, and the registry of every kernel (OPS).

Quantization for ZeRO++ (docs/KERNELS.md): quantize, dequantize, reorder_quantize,
dequant_reduce_quantize, dequant_reduce, hadamard, packed_len, here. The fused model
ops sit beside their references (fused_rmsnorm.rms_norm, fused_rope.apply_rotary,
fused_swiglu.swiglu, fused_cross_entropy.cross_entropy), as do the optimizer's
fused_adamw.adamw_step and FP8's transpose.transpose. Each goes through its Op, and
kernels/dispatch.py alone chooses Triton or the torch reference (MEGAQ_KERNELS).
"""

import torch

from . import fused_adamw, fused_cross_entropy, fused_rmsnorm, fused_rope, fused_swiglu, reference, transpose
from .dispatch import Op
from .format import KERNEL_API
from .format import packed_len as _packed_len

__all__ = [*KERNEL_API, "OPS"]
packed_len = _packed_len  # part of every backend's API (format.KERNEL_API)


def _quant_op(name: str) -> Op:
    """kernels/reference.py's function `name` against kernels/quant.py's. The quantization
    ops run outside compiled code (the ZeRO engine's gathers and reductions), so a trace
    keeps the device rule."""
    return Op(name, getattr(reference, name), f"quant.{name}", under_compile="triton")


QUANTIZE = _quant_op("quantize")
DEQUANTIZE = _quant_op("dequantize")
REORDER_QUANTIZE = _quant_op("reorder_quantize")
DEQUANT_REDUCE_QUANTIZE = _quant_op("dequant_reduce_quantize")
DEQUANT_REDUCE = _quant_op("dequant_reduce")
HADAMARD = _quant_op("hadamard")

# Every kernel of the package (tests/test_kernel_dispatch.py holds each to its reference's
# signature and to the dispatch rule).
OPS = (QUANTIZE, DEQUANTIZE, REORDER_QUANTIZE, DEQUANT_REDUCE_QUANTIZE, DEQUANT_REDUCE, HADAMARD,
       fused_rmsnorm.RMS_NORM, fused_rope.ROTARY, fused_rope.ROTARY_BACKWARD, fused_swiglu.SWIGLU, fused_swiglu.SWIGLU_BACKWARD,
       fused_swiglu.SWIGLU_BACKWARD_FP8, fused_rope.QKV_ROPE_BACKWARD_FP8,
       fused_cross_entropy.CROSS_ENTROPY, fused_adamw.ADAMW_STEP, transpose.TRANSPOSE)


# code: the int4 code, "linear" (q * s) or "square" (q |q| s; format.INT4_CODES); int8
# segments are always linear.


# hadamard: the blockwise randomized Hadamard transform of qgZ (reference.hadamard):
# quantize / reorder_quantize transform their input first, dequant_reduce applies the
# inverse to its result.


def quantize(x, bits, block, code="linear", hadamard=False):
    return QUANTIZE.pick(x)(x, bits, block, code, hadamard)


def dequantize(packed, L, bits, block, dtype=torch.float32, code="linear"):
    return DEQUANTIZE.pick(packed)(packed, L, bits, block, dtype, code)


def reorder_quantize(grad, k, m, bits, block, residual=None, code="linear", hadamard=False):
    return REORDER_QUANTIZE.pick(grad)(grad, k, m, bits, block, residual, code, hadamard)


def dequant_reduce_quantize(recv, k, S, bits_in, bits_out, block, code="linear"):
    return DEQUANT_REDUCE_QUANTIZE.pick(recv)(recv, k, S, bits_in, bits_out, block, code)


def dequant_reduce(recv, S, bits, block, scale=1.0, out=None, code="linear", hadamard=False):
    return DEQUANT_REDUCE.pick(recv)(recv, S, bits, block, scale, out, code, hadamard)


def hadamard(x, inverse=False):
    """fp32 [..., L]: H x (H^T x with inverse) per 64 consecutive elements."""
    return HADAMARD.pick(x)(x, inverse)
