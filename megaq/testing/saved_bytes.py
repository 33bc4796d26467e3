"""Bytes that autograd keeps for backward, per transformer block, measured on the CPU.

A GPU's peak training memory is the weights and optimizer state plus what the forward
keeps for backward, and the second part is what the FP8 GEMMs change. It can be counted
without a GPU: :class:`SavedBytes` is a ``saved_tensors_hooks`` pair that sees every
tensor autograd saves (each op's, each autograd.Function's ``save_for_backward``, and a
compiled region's saved values) and adds up the storages they keep alive, each storage
once (two views of one buffer keep one buffer; a view keeps its whole buffer), leaving
out the storages given as resident (parameters and buffers: they are in memory anyway).

:func:`block_saved_bytes` runs one block of a GPTConfig through one forward under it,
eager or compiled, and returns the count. Compiled, it follows the GPU's path where the
CPU's would differ in what is saved:

* backend ``aot_eager_decomp_partition``: inductor's decompositions and its min-cut
  partitioner (which, not ``save_for_backward``, decides what a compiled block keeps),
  without inductor's code generation (``backend="inductor"`` runs inductor itself on
  the CPU, slower; it also applies inductor's joint-graph passes, and keeps as much or
  less: on the tests' block the same in bf16, and with FP8 without the partitioner's
  one FP8 copy of the attention output);
* the FP8 GEMMs take the ``torch._scaled_mm`` path (torch's CPU build has the op) rather
  than the fp32 emulation, whose upcasts the partitioner would see as other ops;
* megaq's FP8 transpose is an opaque custom op, as the GPU's Triton kernel is to the
  partitioner (on the CPU the triton_op traces its torch reference, a copy that the
  partitioner may recompute, which the GPU kernel is not).

Where it is not the GPU: SDPA is the CPU kernel (it saves the same q, k, v, output and
log-sum-exp as the GPU's flash and cuDNN kernels); inductor may still lay out or fuse
what the partitioner saves differently (a saved view keeps its buffer in both); the
allocator's fragmentation and the backward's transient buffers are not counted.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from torch import nn

from megaq.kernels.dispatch import register_compiled_ops


@dataclasses.dataclass
class SavedBytes:
    """saved_tensors_hooks that add up the storages saved for backward (module docstring).
    ``resident``: storages not to count. ``by_dtype``: bytes per storage dtype name."""

    resident: set = dataclasses.field(default_factory=set)
    storages: dict = dataclasses.field(default_factory=dict)  # data_ptr -> (nbytes, dtype)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in self.resident and ptr not in self.storages:
                self.storages[ptr] = (storage.nbytes(), t.dtype)
        return t

    @contextlib.contextmanager
    def counting(self):
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            yield self

    @property
    def total(self) -> int:
        return sum(n for n, _ in self.storages.values())

    @property
    def by_dtype(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for n, dtype in self.storages.values():
            name = str(dtype).replace("torch.", "")
            out[name] = out.get(name, 0) + n
        return out


def resident_storages(*modules: nn.Module) -> set:
    """The storages of the modules' parameters and buffers."""
    return {t.untyped_storage().data_ptr() for m in modules
            for t in list(m.parameters()) + list(m.buffers()) if t is not None}


@torch.library.custom_op("megaq_testing::opaque_transpose", mutates_args=())
def opaque_transpose(x: torch.Tensor) -> torch.Tensor:
    """megaq.kernels.transpose as the partitioner sees the GPU's kernel: an op it cannot
    look into, fuse or recompute (the same bytes as the real op)."""
    return x.t().contiguous()


@opaque_transpose.register_fake
def _(x):
    return x.new_empty((x.shape[1], x.shape[0]))


@contextlib.contextmanager
def gpu_gemm_path():
    """FP8 GEMMs as on an FP8 GPU: torch._scaled_mm with megaq's transposed operand
    copies as an opaque op (module docstring)."""
    from megaq.parallel import fp8

    saved = fp8.fp8_gemm_available, fp8.transpose
    fp8.fp8_gemm_available, fp8.transpose = (lambda device: True), opaque_transpose
    try:
        yield
    finally:
        fp8.fp8_gemm_available, fp8.transpose = saved


PARTITIONED = "aot_eager_decomp_partition"  # inductor's partitioner, no code generation


def count_saved(fn, args, resident: set, compiled: bool, backend: str = PARTITIONED) -> SavedBytes:
    """One forward of fn(*args) (compiled with `backend`, or eager) under the counting
    hooks, then its backward (so a compiled region's backward is traced too)."""
    if compiled:  # as megaq.parallelize.compile_blocks: the ops inductor must not fuse into
        register_compiled_ops()
    run = torch.compile(fn, backend=backend, dynamic=False) if compiled else fn
    counter = SavedBytes(resident=resident)
    with counter.counting():
        out = run(*args)
    out.float().sum().backward()
    return counter


def block_saved_bytes(config, *, compiled: bool, micro_batch: int = 2, seed: int = 0,
                      backend: str = PARTITIONED) -> SavedBytes:
    """The bytes one transformer block of `config` (one process, TP 1, its FP8 recipe if
    any) keeps for backward at `micro_batch` x config.seq_length tokens (module docstring).
    The block's input counts (the residual stream each block keeps), the RoPE tables not
    (one pair for the whole model)."""
    from megaq.model import GPTModel
    from megaq.parallelize import apply_fp8

    torch._dynamo.reset()
    torch.manual_seed(seed)
    model = GPTModel(dataclasses.replace(config, num_layers=1))
    block = model.layers[0]
    if config.fp8 is not None:
        apply_fp8(block, config.fp8)
    s, h = config.seq_length, config.hidden_size
    x = (torch.randn(s, micro_batch, h) * 0.5).to(config.params_dtype).requires_grad_()
    rotary = model.rotary(s) if model.rotary is not None else None
    resident = resident_storages(block)
    if rotary is not None:
        resident |= {t.untyped_storage().data_ptr() for t in rotary}
    with gpu_gemm_path() if compiled else contextlib.nullcontext():
        return count_saved(block.forward, (x, rotary), resident, compiled, backend)


__all__ = ["SavedBytes", "resident_storages", "opaque_transpose", "gpu_gemm_path",
           "count_saved", "block_saved_bytes", "PARTITIONED"]
