"""The two seams where ZeRO++ plugs into the ZeRO-3 engine, and their plain versions.

Seam 1, weight gathering (:class:`WeightGatherer`)
    ``start_gather(part, phase) -> handle``: fill ``part.full`` (already allocated,
    ``part.padded_numel`` elements of ``part.dtype``) from every DP rank's
    ``part.shard``; ``handle.wait()`` returns once ``part.full`` holds the weights.
    ``phase`` is ``"weight_gather_fwd"`` or ``"weight_gather_bwd"``.
    ``on_forward_gathered(part)``: called once ``part.full`` is complete in forward
    (hpZ keeps its secondary in-node shard from it).
    ``invalidate()``: called after every optimizer step and state load (the shards
    changed: drop secondary copies).
    Plain: one ``comm.all_gather`` over ``topo.dp``.

Seam 2, gradient reduction (:class:`GradReducer`)
    ``start_reduce(part, full_grad_flat, out_accum) -> handle``: ``full_grad_flat`` is
    this rank's padded flat gradient of the unit (``part.padded_numel`` elements, grad
    dtype); after ``handle.wait()``, ``out_accum`` (fp32, ``part.shard_numel``) has had
    ``(sum over DP of my shard's slice) / dp_size`` added to it. The reducer owns
    ``full_grad_flat`` until then (it may reuse it as scratch).
    Plain: one ``comm.reduce_scatter`` over ``topo.dp``, tag ``"grad_reduce"``.

Selection: :func:`make_gatherer` / :func:`make_reducer` return the plain versions
unless a ZeRO++ switch is on, in which case they import ``megaq.zero.zeropp`` and call
its ``make_gatherer(topo, cfg)`` / ``make_reducer(topo, cfg)`` (the registration point).
"""

from __future__ import annotations

import importlib
from typing import Callable

import torch

from megaq.parallel import comm
from megaq.zero.config import ZeroConfig, ZeroConfigError


class Handle:
    """Waits on a comm handle (if any), then runs a finishing step once."""

    def __init__(self, inner=None, then: Callable[[], None] | None = None):
        self._inner, self._then = inner, then

    def wait(self) -> None:
        if self._inner is not None:
            inner, self._inner = self._inner, None
            inner.wait()
        if self._then is not None:
            then, self._then = self._then, None
            then()


class WeightGatherer:
    """Plain ZeRO-3 weight gather: all-gather the shards over the DP group."""

    def __init__(self, topo, cfg: ZeroConfig):
        self.topo, self.cfg = topo, cfg

    def start_gather(self, part, phase: str) -> Handle:
        return Handle(comm.all_gather(part.full, part.shard, self.topo.dp, phase, async_op=True))

    def on_forward_gathered(self, part) -> None:
        """Plain ZeRO-3 keeps nothing after the forward gather (hpZ does)."""

    def invalidate(self) -> None:
        """Nothing cached from the weights, so nothing to drop after a weight write."""


class GradReducer:
    """Plain ZeRO-3 gradient reduction: reduce-scatter over DP, average once, add in fp32."""

    def __init__(self, topo, cfg: ZeroConfig):
        self.topo, self.cfg = topo, cfg

    def start_reduce(self, part, full_grad_flat: torch.Tensor, out_accum: torch.Tensor) -> Handle:
        dp = self.topo.dp
        if dp.size == 1:  # nothing to reduce: accumulate the flat grad directly (no copies)
            out_accum.add_(full_grad_flat)
            return Handle(None)
        out = torch.empty(part.shard_numel, dtype=full_grad_flat.dtype, device=full_grad_flat.device)
        work = comm.reduce_scatter(out, full_grad_flat, dp, "grad_reduce", async_op=True)
        # add_ upcasts a bf16 operand element-wise: no fp32 temporary of the shard
        return Handle(work, lambda: out_accum.add_(out, alpha=1.0 / dp.size))


def start_allreduce_mean(flat: torch.Tensor, out_accum: torch.Tensor, group, phase: str) -> Handle:
    """Replicated params: all-reduce `flat`, add flat / group size into the fp32 accumulator."""
    work = comm.all_reduce(flat, group, phase, async_op=True)
    return Handle(work, lambda: out_accum.add_(flat, alpha=1.0 / group.size))


def _zeropp(cfg: ZeroConfig, factory: str, what: str):
    try:
        mod = importlib.import_module("megaq.zero.zeropp")
    except ImportError as e:
        raise ZeroConfigError(f"ZeRO++ {what} requested but megaq.zero.zeropp cannot be imported "
                              f"({e}); turn the switch off or install a megaq with ZeRO++") from e
    fn = getattr(mod, factory, None)
    if fn is None:
        raise ZeroConfigError(f"ZeRO++ {what} requested but megaq.zero.zeropp has no {factory}(); "
                              f"turn the switch off until it is implemented")
    return fn


def make_gatherer(topo, cfg: ZeroConfig):
    if cfg.weights_need_zeropp:
        what = " + ".join(n for n, on in (("qwZ (quantized_weights)", cfg.quantized_weights),
                                          ("hpZ (hpz_partition_size > 1)", cfg.hpz_partition_size > 1))
                          if on)
        return _zeropp(cfg, "make_gatherer", what)(topo, cfg)
    return WeightGatherer(topo, cfg)


def make_reducer(topo, cfg: ZeroConfig):
    if cfg.quantized_gradients:
        return _zeropp(cfg, "make_reducer", "qgZ (quantized_gradients)")(topo, cfg)
    return GradReducer(topo, cfg)
