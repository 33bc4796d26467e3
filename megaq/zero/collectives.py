"""The two seams where ZeRO++ plugs into the ZeRO-3 engine, and their plain versions.

Seam 1, weight gathering (:class:`WeightGatherer`)
    ``start_gather(part, phase) -> comm.Handle``: fill ``part.full`` (already
    allocated, ``part.padded_numel`` elements of ``part.dtype``) from every DP rank's
    ``part.shard``; ``handle.wait()`` returns once ``part.full`` holds the weights.
    ``phase`` is ``"weight_gather_fwd"`` or ``"weight_gather_bwd"``.
    ``on_forward_gathered(part)``: called once ``part.full`` is complete in forward
    (hpZ keeps its secondary in-node shard from it).
    ``invalidate()``: called after every state load and other weight write (the shards
    changed: drop secondary copies), and after every optimizer step unless the
    gatherer has ``after_step()``, which the engine then calls instead (weight deltas
    keep their references across steps).
    Plain: one ``comm.all_gather`` over ``topo.dp``. ZeRO++ (qwZ and/or hpZ):
    megaq.zero.zeropp.weights.ZeroPPWeightGatherer. Weight deltas (hpZ references +
    quantized differences): megaq.zero.zeropp.deltas.WeightDeltaGatherer. FP8 weight gathers:
    megaq.zero.zeropp.fp8_weights.FP8WeightGatherer (``part.full_fp8`` filled too).

Seam 2, gradient reduction (:class:`GradReducer`)
    ``start_reduce(part, full_grad_flat, grads) -> comm.Handle``: ``full_grad_flat`` is
    this rank's padded flat gradient of the unit (``part.padded_numel`` elements, grad
    dtype); by the time ``handle.wait()`` returns, the reducer has added ``(sum over DP
    of my shard's slice) / dp_size`` into ``grads.accumulator_for_add(part.name)`` (the
    fp32 accumulator of :class:`megaq.zero.grads.GradState`, the only way in). The
    reducer owns ``full_grad_flat`` until then (it may reuse it as scratch).
    Plain: one ``comm.reduce_scatter`` over ``topo.dp``, tag ``"grad_reduce"``. ZeRO++
    (qgZ): megaq.zero.zeropp.grads.QuantizedGradReducer.
    Replicated partitions (stage 0, and parameters under the persistence threshold)
    go through :class:`ReplicatedReducer` (an all-reduce) instead.

Selection: :func:`make_gatherer` / :func:`make_reducer`, from the ZeroConfig switches.
"""

from __future__ import annotations

import torch

from megaq.parallel import comm
from megaq.parallel.comm import Handle
from megaq.zero.config import ZeroConfig
from megaq.zero.zeropp.deltas import WeightDeltaGatherer
from megaq.zero.zeropp.fp8_weights import FP8WeightGatherer
from megaq.zero.zeropp.grads import QuantizedGradReducer
from megaq.zero.zeropp.weights import ZeroPPWeightGatherer


class WeightGatherer:
    """Plain ZeRO-3 weight gather: all-gather the shards over the DP group."""

    def __init__(self, topo, cfg: ZeroConfig):
        self.topo, self.cfg = topo, cfg

    def start_gather(self, part, phase: str) -> Handle:
        return comm.all_gather(part.full, part.shard, self.topo.dp, phase, async_op=True)

    def on_forward_gathered(self, part) -> None:
        """Plain ZeRO-3 keeps nothing after the forward gather (hpZ does)."""

    def invalidate(self) -> None:
        """Nothing cached from the weights, so nothing to drop after a weight write."""


class GradReducer:
    """Plain ZeRO-3 gradient reduction: reduce-scatter over DP, average once, add in fp32."""

    def __init__(self, topo, cfg: ZeroConfig):
        self.topo, self.cfg = topo, cfg

    def start_reduce(self, part, full_grad_flat: torch.Tensor, grads) -> Handle:
        dp = self.topo.dp
        accum = grads.accumulator_for_add(part.name)
        if dp.size == 1:  # nothing to reduce: accumulate the flat grad directly (no copies)
            accum.add_(full_grad_flat)
            return Handle()
        out = torch.empty(part.shard_numel, dtype=full_grad_flat.dtype, device=full_grad_flat.device)
        work = comm.reduce_scatter(out, full_grad_flat, dp, "grad_reduce", async_op=True)
        # add_ upcasts a bf16 operand element-wise: no fp32 temporary of the shard
        return Handle(work, lambda: accum.add_(out, alpha=1.0 / dp.size))


class ReplicatedReducer:
    """Replicated partitions: all-reduce the flat grad over `group`, add it / group size
    into the fp32 accumulator. Tagged 'grad_reduce' under stage 0 (it is the gradient
    reduction) and 'dp_misc' for stage 3's small persistent params (outside M)."""

    def __init__(self, group, phase: str):
        self.group, self.phase = group, phase

    def start_reduce(self, part, flat: torch.Tensor, grads) -> Handle:
        accum = grads.accumulator_for_add(part.name)
        work = comm.all_reduce(flat, self.group, self.phase, async_op=True)
        return Handle(work, lambda: accum.add_(flat, alpha=1.0 / self.group.size))


def make_gatherer(topo, cfg: ZeroConfig, partitions=()):
    """Stage 3's weight gatherer: FP8 gathers (of `partitions`' FP8 weights) when
    cfg.fp8_weights, ZeRO++'s when qwZ or hpZ is on, else the plain one."""
    if cfg.fp8_weights:
        return FP8WeightGatherer(topo, cfg, partitions)
    if cfg.weight_deltas:
        return WeightDeltaGatherer(topo, cfg, partitions)
    if cfg.weights_need_zeropp:
        return ZeroPPWeightGatherer(topo, cfg)
    return WeightGatherer(topo, cfg)


def make_reducer(topo, cfg: ZeroConfig):
    """Stage 3's reducer of sharded partitions: qgZ when it is on, else the plain one."""
    if cfg.quantized_gradients:
        return QuantizedGradReducer(topo, cfg)
    return GradReducer(topo, cfg)
