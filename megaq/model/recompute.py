"""Activation recomputation (Megatron's --recompute-granularity / --recompute-method).

The model runs without it; megaq.parallelize applies it from outside, through two
seams of the model: a chunk's ``run_layers`` (full: :class:`RecomputedLayers`) and
an attention layer's ``core_attention`` (selective: :func:`recomputed_in_training`).

``checkpointed(fn, *args)`` runs fn under torch.utils.checkpoint (non-reentrant): its
inner activations are dropped after the forward and recomputed in backward. The
default CPU/CUDA RNG is restored for the recompute (``preserve_rng_state``) and so are
the TP tracker's streams (a ``context_fn``), so recomputed dropout masks are those of
the forward and gradients are bit-identical with and without recomputation.

``layer_groups(n_layers, granularity, method, num_layers)`` says which layers of one
model chunk run checkpointed, as Megatron's TransformerBlock does:

- full + uniform: groups of ``num_layers`` consecutive layers, each group one
  checkpoint (only the group's input is kept); the last group may be shorter;
- full + block: the first ``num_layers`` layers one checkpoint each, the rest plain;
- selective (or none): no layer is checkpointed here; selective wraps the attention
  core inside each layer instead (megaq.model.attention).

Both run plainly when autograd records nothing (evaluation, no_grad): there is no
backward to recompute for.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils.checkpoint import checkpoint

from megaq.model.gpt import run_layers
from megaq.parallel.tensor_parallel import get_rng_tracker


def _keep_tp_rng_for_recompute():
    """torch.utils.checkpoint restores the default CPU/CUDA RNG for the recompute; this
    does the same for the TP tracker's streams, so recomputed dropout masks match."""
    tracker = get_rng_tracker()
    saved = tracker.get_states()  # taken when the checkpointed forward starts

    @contextlib.contextmanager
    def recompute():
        after = tracker.get_states()
        tracker.set_states(saved)
        try:
            yield
        finally:
            tracker.set_states(after)

    return contextlib.nullcontext(), recompute()


def checkpointed(fn, *args):
    """fn(*args), its activations recomputed in backward."""
    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True,
                      context_fn=_keep_tp_rng_for_recompute)


def layer_groups(n_layers: int, granularity: str | None, method: str | None,
                 num_layers: int | None) -> list[tuple[int, int, bool]]:
    """[(start, end, checkpointed)] covering layers 0..n_layers-1 of one model chunk."""
    if granularity != "full" or n_layers == 0:
        return [(0, n_layers, False)] if n_layers else []
    if method == "uniform":
        return [(a, min(a + num_layers, n_layers), True) for a in range(0, n_layers, num_layers)]
    if method == "block":
        first = min(num_layers, n_layers)
        return [(i, i + 1, True) for i in range(first)] + ([(first, n_layers, False)]
                                                           if first < n_layers else [])
    raise ValueError(f"recompute method {method!r}: use uniform or block")


def recomputed_in_training(fn):
    """fn, its activations recomputed in backward whenever autograd records (training)."""
    def run(*args):
        if torch.is_grad_enabled():
            return checkpointed(fn, *args)
        return fn(*args)
    return run


class RecomputedLayers:
    """A chunk's ``run_layers`` for --recompute-granularity full: the blocks in order,
    each group that :func:`layer_groups` marks as one checkpoint (training only)."""

    def __init__(self, groups: list[tuple[int, int, bool]]):
        self.groups = groups

    def __call__(self, layers, x: torch.Tensor, rotary) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return run_layers(layers, x, rotary)
        for start, end, recompute in self.groups:
            group = layers[start:end]
            if recompute:
                x = checkpointed(run_layers, group, x, rotary)
            else:
                x = run_layers(group, x, rotary)
        return x
