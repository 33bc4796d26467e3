"""Stage 0 with FP8 GEMMs: the GEMM weights held in E4M3 only, cast from the fp32 masters.

Under ZeRO stage 0 every rank holds every weight whole. The weight of a layer whose
GEMMs run in FP8 with a per-tensor weight scale (the tensorwise and delayed recipes of
megaq.parallel.fp8) is read by those GEMMs only as E4M3, forward and backward. So the
engine keeps no 16-bit copy of it: its replicated partition lays these weights out
first and holds them in ``full_fp8`` with one inverse scale each (megaq.zero.partition),
and :meth:`ResidentFP8Weights.refresh` casts them from the fp32 masters after every
optimizer step (and at build and after a load). Each layer reads its E4M3 view as
ZeRO-3's FP8 weight gathers deliver theirs (``fp8.use_fp8_weight``), so its GEMM casts
nothing. Per such parameter: 1 byte instead of 2, and no weight cast in forward or
backward.

The same bits as the GEMM's own cast of the 16-bit weight: the master is rounded to
the gather dtype first (the value the optimizer would have written into the 16-bit
copy), the amax is taken of that and MAX-reduced over TP (the GEMM reduces a weight's
amax over its TP group), and the scale and the cast are ``fp8.scale_from_amax`` and
``fp8.cast``. tests/test_fp8_resident.py checks that training is bit-identical.
"""

from __future__ import annotations

import math

import torch

from megaq.parallel import fp8


# HBM bytes per E4M3 weight element of one refresh after an optimizer step, net: the
# fused cast reads the fp32 master and writes E4M3 (4 + 1); the optimizer no longer
# writes a 16-bit copy (-2). The amaxes come from the optimizer's own pass (megaq's
# one-pass AdamW); where they do not, a pass over the masters reads them once more
# (AMAX_READ_BYTES_PER_PARAM). The planner charges both to the optimizer step
# (megaq.planner.step).
REFRESH_BYTES_PER_PARAM = (4 + 1) - 2
AMAX_READ_BYTES_PER_PARAM = 4


class ResidentFP8Weights:
    """The E4M3 weights of the engine's replicated partitions that have FP8 weights
    (``fp8_slots``), kept in step with the masters. `states`: the optimizer's
    PartitionStates (master and partition); `tp`: the TP group."""

    def __init__(self, states, tp):
        self.states = [st for st in states if st.part.fp8_numel and not st.part.sharded]
        self.tp = tp
        self._graph = None  # the casts as one CUDA graph (see refresh)
        self._graph_key = None
        self._scale = None  # the graph's input: this step's scales
        # per partition, its FP8 weights' max |master|, which the optimizer's update may
        # fill in its own pass (amax_buffers)
        self._amax = {st.part.name: torch.zeros(len(st.part.fp8_slots), dtype=torch.float32,
                                                device=st.master.device) for st in self.states}
        self.amax_from_step = False  # did the last refresh take its amaxes from the step?

    def amax_buffers(self) -> dict[str, torch.Tensor]:
        """{partition name: fp32 tensor, one per FP8 slot}: for the optimizer's step to fill
        with the new masters' max |x| (ShardedOptimizer.step's `weight_amax`), then
        handed to :meth:`refresh`. Empty when no weight is held in E4M3."""
        return self._amax

    def refresh(self, amax: dict[str, torch.Tensor] | None = None) -> None:
        """Cast every FP8 weight from its master: the amaxes (given: :meth:`amax_buffers`
        as the optimizer's step filled them; else one multi-tensor pass over the
        masters), one all-reduce over TP, then one fused round-and-cast pass per weight.

        On a GPU the casts are replayed from a CUDA graph: launched one by one they cost
        the host about 0.1 ms a weight (a compiled call each), and the host works through
        them right after the step's one sync (the loss), while the device waits (1.3B,
        96 weights: the device idled ~5 ms a step). The graph is recorded after the first
        eager pass, which compiles the cast and checks its rounding, and again whenever
        a buffer it reads or writes has moved."""
        if not self.states:
            return
        self.amax_from_step = amax is not None
        masters = [st.master[s.offset:s.offset + s.numel]
                   for st in self.states for s in st.part.fp8_slots]
        (dtype,) = {st.part.dtype for st in self.states}  # the engine's one gather dtype
        # the 16-bit copy's max |x| is max |x| rounded: rounding is monotonic
        amax = (torch.cat([amax[st.part.name] for st in self.states]) if amax is not None
                else torch.stack(torch._foreach_norm(masters, math.inf)))
        amax = amax.to(dtype).float()
        scale = fp8.weight_scales(amax, [(self.tp, fp8.PHASE)])
        if not scale.is_cuda:
            self._cast_all(masters, scale)
            return
        key = tuple((st.master.data_ptr(), st.part.full_fp8.data_ptr(),
                     st.part.fp8_inv_scales.data_ptr()) for st in self.states)
        if self._graph is not None and key == self._graph_key:
            self._scale.copy_(scale)
            self._graph.replay()
            return
        self._cast_all(masters, scale)  # eager: compiles the cast, checks its rounding
        self._scale = scale.clone()
        graph = torch.cuda.CUDAGraph()
        # records only (the eager pass above did the work); thread_local: a background
        # thread (an async checkpoint save) may use CUDA meanwhile
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            self._cast_all(masters, self._scale)
        self._graph, self._graph_key = graph, key

    def _cast_all(self, masters, scale) -> None:
        k = 0
        for st in self.states:
            part = st.part
            part.fp8_inv_scales.copy_(scale[k:k + len(part.fp8_slots)].reciprocal())
            for s in part.fp8_slots:
                fp8.cast_weight(part.full_fp8[s.offset:s.offset + s.numel], masters[k],
                                scale[k], via=part.dtype)
                k += 1
