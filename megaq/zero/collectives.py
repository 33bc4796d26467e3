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
    ``start_reduce(key, flat, out) -> pending``: ``flat`` is this rank's padded flat
    gradient of unit ``key`` (``part.padded_numel`` elements, grad dtype) and ``out``
    the fp32 accumulator of my shard (``part.shard_numel`` elements, settled by
    :class:`megaq.zero.grads.GradState`, which hands it over). Once ``pending.finish()``
    returns, the reducer has added ``(sum over DP of my shard's slice) / dp_size`` into
    ``out``; it writes nothing else and knows nothing of the gradient state. It owns
    ``flat`` until then (it may reuse it as scratch), and reductions are finished in
    the order they were started, on every rank.
    Plain: one ``comm.reduce_scatter`` over ``topo.dp``, tag ``"grad_reduce"``
    (:class:`PendingAdd`). ZeRO++ (qgZ): megaq.zero.zeropp.grads.QuantizedGradReducer
    (its :class:`~megaq.zero.zeropp.grads.QgzReduction` runs the two hops of every
    chunk after the first in ``finish()``). Replicated partitions (stage 0, and
    parameters under the persistence threshold) go through :class:`ReplicatedReducer`
    (an all-reduce) instead.

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


class PendingAdd:
    """A plain reduction in flight: ``finish()`` waits for the collective (``work``), then
    adds ``src * alpha`` into ``out`` (add_ upcasts a bf16 ``src`` element-wise: no fp32
    temporary of the shard). ``PendingAdd()``: nothing left to do."""

    def __init__(self, work=None, src: torch.Tensor | None = None, out: torch.Tensor | None = None,
                 alpha: float = 1.0):
        self.work, self.src, self.out, self.alpha = work, src, out, alpha

    def finish(self) -> None:
        if self.work is not None:
            self.work.wait()
        if self.out is not None:
            self.out.add_(self.src, alpha=self.alpha)
        self.work = self.src = self.out = None


class GradReducer:
    """Plain ZeRO-3 gradient reduction: reduce-scatter over DP, average once, add in fp32."""

    def __init__(self, topo, cfg: ZeroConfig):
        self.topo, self.cfg = topo, cfg

    def start_reduce(self, key: str, flat: torch.Tensor, out: torch.Tensor) -> PendingAdd:
        dp = self.topo.dp
        if dp.size == 1:  # nothing to reduce: accumulate the flat grad directly (no copies)
            out.add_(flat)
            return PendingAdd()
        shard = torch.empty(out.numel(), dtype=flat.dtype, device=flat.device)
        work = comm.reduce_scatter(shard, flat, dp, "grad_reduce", async_op=True)
        return PendingAdd(work, shard, out, 1.0 / dp.size)


class ReplicatedReducer:
    """Replicated partitions: all-reduce the flat grad over `group`, add it / group size
    into the fp32 accumulator. Tagged 'grad_reduce' under stage 0 (it is the gradient
    reduction) and 'dp_misc' for stage 3's small persistent params (outside M)."""

    def __init__(self, group, phase: str):
        self.group, self.phase = group, phase

    def start_reduce(self, key: str, flat: torch.Tensor, out: torch.Tensor) -> PendingAdd:
        work = comm.all_reduce(flat, self.group, self.phase, async_op=True)
        return PendingAdd(work, flat, out, 1.0 / self.group.size)


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
        return QuantizedGradReducer.for_topology(topo, cfg)
    return GradReducer(topo, cfg)
