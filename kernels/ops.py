"""Dispatch: the Triton kernels for CUDA tensors, the torch reference otherwise.

megaq code calls megaq.kernels.ops.* only. MEGAQ_KERNELS (read on every call) forces
a backend: `triton` (e.g. CPU tests under TRITON_INTERPRET=1), `torch`, or `auto`
(default). Triton is imported lazily, so CPU-only runs never need a working Triton.
"""

import torch

from . import reference
from .fused_common import backend
from .format import DEFAULT_BLOCK, KERNEL_API
from .format import packed_len as _packed_len

__all__ = ["DEFAULT_BLOCK", *KERNEL_API, "backend_for"]
packed_len = _packed_len  # part of every backend's API (format.KERNEL_API)


def backend_for(t: torch.Tensor):
    """The module (kernels.quant or kernels.reference) that handles tensor t."""
    choice = backend()
    if choice == "torch" or (choice == "auto" and not t.is_cuda):
        return reference
    from . import quant  # lazy: importing triton is slow and needs a GPU or the interpreter

    return quant


# code: the int4 code, "linear" (q * s) or "square" (q |q| s; format.INT4_CODES); int8
# segments are always linear.


# hadamard: the blockwise randomized Hadamard transform of qgZ (reference.hadamard):
# quantize / reorder_quantize transform their input first, dequant_reduce applies the
# inverse to its result.


def quantize(x, bits=8, block=DEFAULT_BLOCK, code="linear", hadamard=False):
    return backend_for(x).quantize(x, bits, block, code, hadamard)


def dequantize(packed, L, bits=8, block=DEFAULT_BLOCK, dtype=torch.float32, code="linear"):
    return backend_for(packed).dequantize(packed, L, bits, block, dtype, code)


def reorder_quantize(grad, k, m, bits=4, block=DEFAULT_BLOCK, residual=None, code="linear", hadamard=False):
    return backend_for(grad).reorder_quantize(grad, k, m, bits, block, residual, code, hadamard)


def dequant_reduce_quantize(recv, k, S, bits_in=4, bits_out=4, block=DEFAULT_BLOCK, code="linear"):
    return backend_for(recv).dequant_reduce_quantize(recv, k, S, bits_in, bits_out, block, code)


def dequant_reduce(recv, S, bits=4, block=DEFAULT_BLOCK, scale=1.0, out=None, code="linear", hadamard=False):
    return backend_for(recv).dequant_reduce(recv, S, bits, block, scale, out, code, hadamard)


def hadamard(x, inverse=False):
    """fp32 [..., L]: H x (H^T x with inverse) per 64 consecutive elements."""
    return backend_for(x).hadamard(x, inverse)
