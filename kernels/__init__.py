"""Triton kernels, each with a plain-torch reference of the same signature.

Imported as `megaq.kernels` (megaq/kernels is a symbolic link to this folder), never as
a top-level `kernels`. CPU runs use the references; tests compare both under
TRITON_INTERPRET=1.

`ops.OPS` lists every kernel as an Op (kernels/dispatch.py: the one place that chooses
Triton or the reference, MEGAQ_KERNELS). Blockwise int8/int4 quantization for ZeRO++
(docs/KERNELS.md): `megaq.kernels.ops` (quantize, dequantize, reorder_quantize,
dequant_reduce_quantize, dequant_reduce, hadamard, packed_len), dispatching to `quant`
(Triton) or `reference` (torch). The model's fused ops: fused_rmsnorm, fused_rope,
fused_swiglu, fused_cross_entropy; the optimizer's: fused_adamw; FP8's: transpose. How
the Triton kernels launch is one value, kernels/tuning.py's Tuning.
"""
