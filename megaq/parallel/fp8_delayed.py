"""Delayed FP8 scaling (``--fp8-recipe delayed``): per-tensor scales of the GEMM inputs
x and the output gradients dY taken from an amax history, as Transformer Engine's
delayed-scaling recipe (Megatron's ``--fp8-amax-history-len``, ``--fp8-amax-compute-algo``).

Why: with current scaling a cast must wait for the amax of the tensor it casts, so
every activation and gradient is read twice (amax, then scale-and-cast) and written
in bf16 first. With a scale known in advance the cast is one pointwise op, which
inductor fuses into the kernel that produces x or dY (norm, SwiGLU, their backward,
RoPE's backward), and the amax of the same values is computed in that pass for the
history. The weight keeps its current per-tensor scale (its amax is a small read, and
ZeRO's FP8 weight gathers cast it that way).

The state of one FP8 linear layer is an :class:`AmaxState`, held by the layer's
megaq.parallel.fp8.FP8GEMM (fp32 buffers, not in the model's state_dict; checkpoints
carry the histories in their "extra" record: :func:`checkpoint_extra`, :func:`restore`):

* ``now`` [x, dY]: this step's running amax (max over micro-batches and recomputed
  forwards, local to the rank). x's is written by the forward; dY's comes out of the
  compiled backward as the gradient of ``grad_sink``, which a hook max-folds into
  ``now`` (a buffer mutated in backward would be a saved tensor bumped between two
  micro-batches' backwards);
* ``history`` [len, 2]: the amaxes of the last ``len`` steps, newest first;
* ``scale`` [x, dY]: ``fp8_max / amax`` of the history (its max, or its newest row),
  computed by :func:`scale_from_amax` as every other FP8 scale; 1 while a history
  holds only zeros.

:func:`step` runs once per optimizer step, as the post-step hook of the ZeRO engine
(megaq.zero.engine.ZeroEngine.step, applied or skipped alike): it MAX-reduces
every layer's ``now`` over TP and DP in one all-reduce each, so every rank holds the
same history and scales whatever the TP split (as current scaling reduces a sharded
tensor's amax), rolls it in and recomputes the scales. Until a layer's first step
(``ready`` False) its casts scale as the tensorwise recipe does and only record.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from megaq.parallel import comm
from megaq.parallel.comm import Group
from megaq.parallel.fp8 import FP8Recipe, scale_from_amax

PHASE = "tp"
ROLES = ("input", "grad_output")  # the columns of now / history / scale


class AmaxState(nn.Module):
    """One FP8 linear layer's delayed-scaling state (module docstring)."""

    def __init__(self, recipe: FP8Recipe):
        super().__init__()
        self.recipe = recipe
        self.register_buffer("now", torch.zeros(2), persistent=False)
        self.register_buffer("history", torch.zeros(recipe.amax_history_len, 2), persistent=False)
        self.register_buffer("scale", torch.ones(2), persistent=False)
        self.register_buffer("grad_sink", torch.zeros(1), persistent=False)
        self.ready = False  # a Python bool: compiled blocks guard on it (two graphs in all)
        self._arm_sink()

    def _arm_sink(self) -> None:
        # a leaf that requires grad: the FP8 GEMM's backward returns dY's amax as its grad
        self.grad_sink = self.grad_sink.detach().float().requires_grad_()
        self.grad_sink.register_hook(self._record_grad_amax)

    def _record_grad_amax(self, grad: torch.Tensor) -> None:
        self.now[1:].copy_(torch.maximum(self.now[1:], grad))

    def _apply(self, fn, recurse=True):
        # .to(device) / .to(dtype): the amaxes stay fp32 and the sink a leaf with its hook
        super()._apply(fn, recurse)
        for name in ("now", "history", "scale"):
            setattr(self, name, getattr(self, name).float())
        self._arm_sink()
        return self


def states(modules) -> list[AmaxState]:
    """Every AmaxState under `modules` (a module or a list of model chunks), in a fixed
    order (the modules' registration order, the same on every rank of a stage)."""
    modules = modules if isinstance(modules, (list, tuple)) else [modules]
    return [m for mod in modules for m in mod.modules() if isinstance(m, AmaxState)]


@torch.no_grad()
def step(modules, tp_group: Group | None, dp_group: Group | None = None,
         skipped: bool = False) -> None:
    """Once per optimizer step: reduce this step's amaxes over TP and DP, roll them into
    the histories, recompute the scales. `skipped` (a step with non-finite gradients):
    drop this step's amaxes instead, keeping histories and scales."""
    sts = states(modules)
    if not sts:
        return
    now = torch.stack([s.now for s in sts])  # [layers, 2]: one collective per group
    torch._foreach_zero_([s.now for s in sts])
    for s in sts:
        s.grad_sink.grad = None
    if skipped:
        return
    for group in (tp_group, dp_group):
        if group is not None and group.size > 1:
            comm.all_reduce(now, group, PHASE, op=dist.ReduceOp.MAX)
    hist = torch.stack([s.history for s in sts])  # [layers, len, 2]
    hist = torch.cat([now.unsqueeze(1), hist[:, :-1]], dim=1)
    torch._foreach_copy_([s.history for s in sts], list(hist.unbind(0)))
    _refresh_scales(sts, hist)
    for s in sts:
        s.ready = True


def _refresh_scales(sts: list[AmaxState], hist: torch.Tensor) -> None:
    """scale = fp8_max / amax per [x, dY] column, from `hist` [layers, len, 2]."""
    recipe = sts[0].recipe
    amax = hist.amax(dim=1) if recipe.amax_compute_algo == "max" else hist[:, 0]
    fwd = scale_from_amax(amax[:, 0], recipe.forward_dtype, pow2=False)
    grad = scale_from_amax(amax[:, 1], recipe.grad_dtype, pow2=False)
    scale = torch.where(amax > 0, torch.stack([fwd, grad], dim=1), torch.ones_like(amax))
    torch._foreach_copy_([s.scale for s in sts], list(scale.unbind(0)))


def checkpoint_extra(model_chunks, topo) -> list | None:
    """What a checkpoint's "extra" record carries: every pipeline stage's histories and
    readiness, indexed by PP rank ({"history": [layers, len, 2] on CPU, "ready": [...]}),
    gathered over the PP group (collective there); None without delayed scaling. After
    :func:`step` they are the same on every TP and DP rank, so any rank's record serves."""
    sts = states(model_chunks)
    mine = None if not sts else {"history": torch.stack([s.history for s in sts]).cpu(),
                                 "ready": [s.ready for s in sts]}
    if topo.pp.size == 1:
        return None if mine is None else [mine]
    stages = comm.all_gather_objects(topo.pp, mine)
    return None if all(st is None for st in stages) else stages


def restore(model_chunks, topo, saved: list | None) -> str | None:
    """Load :func:`checkpoint_extra`'s record into this stage's layers (their scales are
    recomputed from the histories, as :func:`step` computes them). Returns a note when
    the record does not fit this model (no record, another pipeline split or history
    length): the histories then start empty, as in a new run."""
    sts = states(model_chunks)
    if not sts:
        return None
    st = saved[topo.pp_rank] if saved is not None and len(saved) > topo.pp_rank else None
    want = (len(sts), sts[0].history.shape[0], 2)
    if st is None or tuple(st["history"].shape) != want:
        got = "none" if st is None else f"shape {tuple(st['history'].shape)}"
        return (f"the checkpoint's FP8 amax histories ({got}) do not fit this stage's {want}: "
                f"they start empty (one step of current scaling)")
    hist = st["history"].to(sts[0].history.device, torch.float32)
    torch._foreach_copy_([s.history for s in sts], list(hist.unbind(0)))
    torch._foreach_zero_([s.now for s in sts])
    _refresh_scales(sts, hist)
    for s, ready in zip(sts, st["ready"]):
        s.ready = bool(ready)
    return None


__all__ = ["AmaxState", "states", "step", "checkpoint_extra", "restore", "ROLES"]
