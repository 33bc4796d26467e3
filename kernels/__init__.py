"""Triton kernels, each with a plain-torch reference of the same signature.

Installed as `megaq.kernels` (never as a top-level `kernels`). CPU runs use the
references; tests compare both under TRITON_INTERPRET=1.

Blockwise int8/int4 quantization for ZeRO++ (docs/KERNELS.md): call `megaq.kernels.ops`
(quantize, dequantize, reorder_quantize, dequant_reduce_quantize, dequant_reduce,
packed_len), which dispatches to `quant` (Triton, CUDA tensors) or `reference` (torch).
"""
