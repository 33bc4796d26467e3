"""The ZeRO engine (stages 0 to 3), wrapped around the model from outside with hooks.

What is sharded over DP (``ZeroConfig.stage``): 0 nothing (plain DP: replicated
partitions, gradients all-reduced); 1 the optimizer state; 2 the optimizer state and
the gradients; 3 the weights too. Stages 1 to 3 share the same sharded flat partitions,
optimizer, gradient reducer (megaq.zero.collectives.make_reducer: plain or qgZ) and
weight gatherer (make_gatherer: plain or qwZ); they differ in when they run:

* stage 3 gathers each site's weights before its forward and backward and releases
  them after (the hooks below);
* stages 1 and 2 keep every partition's gathered buffer resident (the model's
  weights, whole on every rank) and refill it once after each optimizer step, and
  once at build and after a state load ('weight_gather_step');
* stages 2 and 3 reduce-scatter each micro-batch's gradients in buckets as backward
  produces them; stage 1 keeps the full fp32 gradients across the step's
  micro-batches and reduce-scatters them once in ``finish_grad_sync``
  (``ZeroConfig.grads_reduced_once``), as Megatron's distributed optimizer does.

Per step::

    engine.zero_grad()
    for each micro-batch: forward; torch.autograd.backward(...)   # hooks do the rest
    engine.finish_grad_sync()
    norm = engine.clip_grad_norm(max_norm)       # tensor, no host sync
    result = engine.step(lr, loss=loss)   # or step(lr): applied whatever the grads hold

``step`` with the step's loss (a float the caller already has on the host) reads the
grad norm and skips the update when either is not finite (the grads are dropped);
either way its post-step hooks run: the weight gatherer learns the shards moved (stage
0 casts its FP8 GEMM weights from the masters: megaq.zero.fp8_resident), and
delayed FP8 scaling rolls this step's amaxes into its histories (or drops them).
The clipping state (the norm, the factor) lives in the engine, from
``clip_grad_norm`` to the optimizer's step; the norm is GradState's
(megaq.zero.grads), the optimizer applies the factor.

Hooks (stage 3; see units.py for sites and units):

* forward pre-hook of a site's first module: wait for / start the all-gather of its
  units ('weight_gather_fwd') and prefetch the next ``cfg.prefetch`` sites of the
  chunk (a side CUDA stream on GPU, async handles on CPU);
* forward post-hook of its last module: release the gathered weights (storage
  resized to 0) and hook the output tensors for backward; a unit that a later site of
  the same forward also uses (the embedding, read again by a tied head on the same
  stage) is kept until that site is done, and in backward until its first user's
  grads are in, so it is gathered once per pass;
* output-tensor hook (fires before the site's backward): gather again
  ('weight_gather_bwd') and prefetch the previous sites;
* post-accumulate-grad hook on every parameter: hand the grad to the gradient state
  (megaq.zero.grads.GradState: it fills the partition's reduce bucket and starts the
  reduction into the fp32 shard accumulator once the bucket is complete) and drop
  ``param.grad``; when all of a site's own parameters have their grads, release the
  site's weights;
* an end-of-backward callback flushes partially filled buckets (unused params) and
  releases anything still gathered, so each micro-batch's backward starts clean.

Micro-batches (PP and gradient accumulation): weights are gathered per micro-batch
in forward and again in backward, and (``grad_sync="per_microbatch"``, default)
each micro-batch's grads are reduce-scattered into the fp32 accumulator as they
become ready: lowest memory, and any interleaving of forwards and backwards of
different micro-batches (1F1B keeps several forwards in flight) is fine because no
state crosses a micro-batch boundary. ``grad_sync="last_microbatch"`` instead keeps
full fp32 grads per partition across micro-batches and reduces once in
``finish_grad_sync`` (one grad reduction per step, full-size grad memory).

Activation recompute (non-reentrant checkpoint): a forward that runs inside
backward is recognised and neither releases weights nor hooks outputs.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from megaq.parallel import comm, fp8_delayed
from megaq.parallel.comm import Handle
from megaq.zero import state as state_io
from megaq.zero.collectives import ReplicatedReducer, make_gatherer, make_reducer
from megaq.zero.config import OptimizerSettings, ZeroConfig
from megaq.zero.fp8_resident import ResidentFP8Weights
from megaq.zero.grads import GradState
from megaq.zero.optimizer import build_optimizer
from megaq.zero.partition import FlatPartition
from megaq.zero.units import Site, Unit, all_partitions, build_sites, check_params

FWD, BWD = "weight_gather_fwd", "weight_gather_bwd"
STEP_GATHER = "weight_gather_step"  # stages 1 and 2: the one gather after each step


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)


@dataclass(frozen=True)
class StepResult:
    """What :meth:`ZeroEngine.step` did."""

    skipped: bool             # the update was not applied (non-finite loss or grad norm)
    grad_norm: float | None   # the step's global grad norm, read to the host when the
    #                           step was given the loss to check (else None: no sync)


@dataclass
class _Clip:
    """A step's clipping state, in one place: the global grad norm (computed once, when
    first asked for) and the factor clip_grad_norm chose (None: no clipping)."""

    norm: torch.Tensor | None = None
    coef: torch.Tensor | None = None


def _weak_hook(method, *bound):
    """`method(*bound, *args)` called through a weak reference to its object. A
    parameter's hooks are held where Python's garbage collector cannot see them
    (autograd's C++ side), so a strong reference there would keep the engine, and
    through it the model, alive after the user drops both."""
    ref = weakref.WeakMethod(method)

    def hook(*args):
        target = ref()
        if target is not None:
            target(*bound, *args)
    return hook


class ZeroEngine:
    def __init__(self, model_chunks: list[nn.Module], topo, cfg: ZeroConfig, optimizer=None):
        if isinstance(model_chunks, nn.Module):
            model_chunks = [model_chunks]
        check_params(model_chunks, cfg)
        self.chunks, self.topo, self.cfg = list(model_chunks), topo, cfg
        self.stage3 = cfg.stage == 3            # per-site gathers and releases
        self.resident = cfg.weights_resident    # stages 1, 2: one gather after each step
        self.reducer = make_reducer(topo, cfg) if cfg.stage else None
        self.sites: list[Site] = build_sites(self.chunks, topo, cfg)
        # Sites, units and partitions are keyed by name (unique on a rank) everywhere.
        self._site_index = {s.name: i for i, s in enumerate(self.sites)}
        # Sites using each unit, in forward order: more than one when a tied head on the
        # embedding's stage borrows the embedding unit. Such a unit stays gathered
        # between its uses (forward: first -> last user; backward: last -> first), so it
        # is gathered once per pass, not once per user.
        self._users: dict[str, list[int]] = {}
        for i, site in enumerate(self.sites):
            for unit in site.gathered_units:
                self._users.setdefault(unit.name, []).append(i)
        # What each site releases: after its forward, the units no later site of the
        # forward needs; once its own grads are in, the units no earlier site's backward
        # needs. As (unit name, sharded partition), fixed at build.
        self._release_after_fwd: dict[str, list[tuple[str, FlatPartition]]] = {}
        self._release_after_bwd: dict[str, list[tuple[str, FlatPartition]]] = {}
        for i, site in enumerate(self.sites):
            units = site.gathered_units
            self._release_after_fwd[site.name] = [
                (u.name, u.sharded) for u in units if self._users[u.name][-1] == i]
            self._release_after_bwd[site.name] = [
                (u.name, u.sharded) for u in units if self._users[u.name][0] == i]
        self.partitions = all_partitions(self.sites)
        self.gatherer = make_gatherer(topo, cfg, self.partitions) if cfg.stage else None
        self._owner: dict[str, tuple[FlatPartition, Site]] = {  # partition name -> (it, its site)
            part.name: (part, site) for site in self.sites for unit in site.owned for part in unit.parts}
        # The one owner of gradient state: reduce buckets, fp32 accumulators, staleness.
        replicated = ReplicatedReducer(topo.dp, "dp_misc" if cfg.stage else "grad_reduce")
        self.grads = GradState(self.partitions, topo, cfg, self.reducer, replicated)
        self.optimizer = build_optimizer(self.partitions, optimizer or OptimizerSettings(),
                                         topo, self.grads)
        # DP = 1: a step's gradients stay 16-bit while written once each (the fp32 value
        # exactly), if the update reads them so (megaq.zero.grads, keep_16bit)
        self.grads.keep_16bit = self.grads.direct and self.optimizer.reads_16bit_grads
        # stage 0 with FP8 GEMMs: their weights in E4M3 only, cast from the masters
        self.fp8_resident = ResidentFP8Weights(self.optimizer.states, topo.tp)
        self.fp8_resident.refresh()
        # M: bytes of the weights this DP group shards, in the gather dtype (padded).
        self.zero_model_bytes = sum(p.model_bytes for p in self.partitions if p.sharded)
        self._clip = _Clip()
        # unit name -> (unit, its gather's handle, phase)
        self._pending_gathers: dict[str, tuple[Unit, Handle, str]] = {}
        self._in_backward = False
        self._bwd_started: set[str] = set()
        self._site_remaining: dict[str, int] = {}
        self.device = self.partitions[0].device if self.partitions else torch.device("cpu")
        self._stream = (torch.cuda.Stream(self.device)
                        if (self.stage3 and self.device.type == "cuda") else None)
        self._hooks = []
        self._register_hooks()
        if self.resident:  # every rank's weights from the shards, as after every step
            self._gather_resident()

    # ================================================================ hooks
    def _register_hooks(self) -> None:
        for site in self.sites:
            self._hooks.append(site.modules[0].register_forward_pre_hook(
                lambda mod, args, site=site: self._pre_forward(site)))
            self._hooks.append(site.modules[-1].register_forward_hook(
                lambda mod, args, out, site=site: self._post_forward(site, out)))
        for name, (part, _) in self._owner.items():
            for i, slot in enumerate(part.slots):  # bound by name and index: no strong refs
                self._hooks.append(slot.param.register_post_accumulate_grad_hook(
                    _weak_hook(self._on_grad, name, i)))

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def _neighbours(self, site: Site, step: int) -> list[Site]:
        i = self._site_index[site.name]
        out = []
        for k in range(1, self.cfg.prefetch + 1):
            j = i + step * k
            if 0 <= j < len(self.sites) and self.sites[j].chunk == site.chunk:
                out.append(self.sites[j])
        return out

    def _pre_forward(self, site: Site) -> None:
        if not self.stage3:
            return
        if self._in_backward:  # activation recompute inside backward
            self._ensure(site.gathered_units, BWD)
            return
        self._ensure(site.gathered_units, FWD)
        for nxt in self._neighbours(site, +1):
            self._prefetch(nxt.gathered_units, FWD)

    def _post_forward(self, site: Site, output) -> None:
        if self._in_backward:
            return
        if torch.is_grad_enabled():
            for t in _tensors(output):
                if t.requires_grad:
                    t.register_hook(lambda grad, site=site: self._pre_backward(site))
        if self.stage3:
            for name, part in self._release_after_fwd[site.name]:
                if name not in self._pending_gathers:  # a prefetch for a later site: keep it
                    part.release()

    def _pre_backward(self, site: Site) -> None:
        if not self._in_backward:
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        if site.name in self._bwd_started:
            return
        self._bwd_started.add(site.name)
        if self.stage3:
            self._site_remaining.setdefault(site.name, site.owned_param_count)
            self._ensure(site.gathered_units, BWD)
            for prev in self._neighbours(site, -1):
                self._prefetch(prev.gathered_units, BWD)

    def _on_grad(self, part_name: str, slot_index: int, param: torch.Tensor) -> None:
        part, site = self._owner[part_name]
        self.grads.add(part, part.slots[slot_index], param.grad)
        param.grad = None
        if self.stage3:
            left = self._site_remaining.setdefault(site.name, site.owned_param_count) - 1
            self._site_remaining[site.name] = left
            if left == 0 and self._in_backward:  # the site's backward is done with its weights
                for name, gathered in self._release_after_bwd[site.name]:
                    if name not in self._pending_gathers:  # a prefetch for another site: keep it
                        gathered.release()

    def _end_backward(self) -> None:
        self._in_backward = False
        self._bwd_started.clear()
        self._site_remaining.clear()
        if self.stage3:
            self._release_all()
        self.grads.flush()

    # ================================================================ gathers
    def _start_gather(self, unit: Unit, phase: str) -> None:
        part = unit.sharded
        part.materialize()
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._stream):
                handle = self.gatherer.start_gather(part, phase)
        else:
            handle = self.gatherer.start_gather(part, phase)
        self._pending_gathers[unit.name] = (unit, handle, phase)

    def _wait_gather(self, unit: Unit) -> None:
        _, handle, phase = self._pending_gathers.pop(unit.name)
        if self._stream is not None:
            with torch.cuda.stream(self._stream):
                handle.wait()
            torch.cuda.current_stream().wait_stream(self._stream)
            for buf in unit.sharded.gathered_buffers():
                buf.record_stream(torch.cuda.current_stream())
        else:
            handle.wait()
        if phase == FWD:
            self.gatherer.on_forward_gathered(unit.sharded)

    def _prefetch(self, units: list[Unit], phase: str) -> None:
        for u in units:
            if u.name not in self._pending_gathers and not u.sharded.is_materialized:
                self._start_gather(u, phase)

    def _ensure(self, units: list[Unit], phase: str) -> None:
        self._prefetch(units, phase)
        for u in units:
            if u.name in self._pending_gathers:
                self._wait_gather(u)

    def _release_all(self) -> None:
        for unit, _, _ in list(self._pending_gathers.values()):
            self._wait_gather(unit)
        for part in self.partitions:
            part.release()

    def _gather_resident(self) -> None:
        """Stages 1 and 2: refill every sharded partition's resident weights from the
        DP shards (all gathers in flight together, then waited in order)."""
        if self.gatherer is None:
            return
        self.gatherer.invalidate()  # qwZ's packed shards are of the old weights
        pending = [self.gatherer.start_gather(p, STEP_GATHER) for p in self.partitions if p.sharded]
        for handle in pending:
            handle.wait()

    def live_gathered_bytes(self) -> int:
        return sum(p.full_storage_bytes() for p in self.partitions)

    # ================================================================ grads
    def finish_grad_sync(self) -> None:
        """Finish every gradient reduction of the step (call after the last backward):
        the fp32 accumulators are then complete, settled, and tied copies summed."""
        self.grads.finish()
        if self.stage3:
            self._release_all()

    # ================================================================ step
    def zero_grad(self) -> None:
        self.grads.zero()
        self._clip = _Clip()
        # A step that died mid-forward/backward (exception) must not leak state into this one.
        self._in_backward = False
        self._bwd_started.clear()
        self._site_remaining.clear()
        if self.stage3:
            self._release_all()

    def grad_norm(self) -> torch.Tensor:
        if self._clip.norm is None:
            self._clip.norm = self.grads.global_norm()
        return self._clip.norm

    def params_norm(self) -> torch.Tensor:
        """L2 norm of all fp32 master weights over every TP / PP / DP shard, each element
        counted once (--log-params-norm); one all-reduce, no weight gather."""
        sq = self.optimizer.local_param_sq_norm()
        comm.all_reduce(sq, self.topo.world, "dp_misc")
        return sq.sqrt()

    def params_finite(self) -> bool:
        """Collective over the world: is every fp32 master weight finite, on every TP / PP
        / DP shard? One all-reduce of one number (what a save checks before it writes)."""
        ok = self.optimizer.local_params_finite()
        comm.all_reduce(ok, self.topo.world, "dp_misc", op=dist.ReduceOp.MIN)
        return bool(ok.item())

    def clip_grad_norm(self, max_norm: float | None) -> torch.Tensor:
        """Global grad norm over DP shards, TP and PP ranks (no host sync); the next
        :meth:`step` scales the grads to `max_norm` (a later call replaces the factor)."""
        norm = self.grad_norm()
        if max_norm:
            # as torch.nn.utils.clip_grad_norm_: coef = max_norm / (norm + 1e-6), at most 1
            self._clip.coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        return norm

    def grads_finite(self) -> torch.Tensor:
        """Bool tensor: is the global grad norm finite (no inf/nan in any grad)?"""
        return torch.isfinite(self.grad_norm())

    def step(self, lr: float, loss: float | None = None) -> StepResult:
        """The optimizer's update with the clip factor of :meth:`clip_grad_norm`, or no
        update: given `loss` (the step's global loss, a float already on the host), a
        step whose loss or grad norm is not finite is skipped and its grads dropped.
        Then the post-step hooks, applied or skipped alike: the weight gatherer learns
        the shards moved (not after a skip), delayed FP8 scaling rolls the step's amaxes
        into its histories (or drops them)."""
        grad_norm, skipped = None, False
        if loss is not None:  # the caller synchronised for the loss: reading the norm is cheap
            grad_norm = float(self.grad_norm())
            skipped = not (math.isfinite(loss) and math.isfinite(grad_norm))
        if not skipped:
            # stage 0's E4M3-only weights follow the masters (their amaxes from the update's
            # own pass where it takes them)
            amax = self.fp8_resident.amax_buffers()
            took_amax = self.optimizer.step(lr, self._clip.coef, weight_amax=amax)
            self.fp8_resident.refresh(amax if took_amax else None)
        # the post-step hooks (torchtitan's post-optimizer hooks), applied or skipped alike
        if not skipped and self.resident:  # the shards moved: every rank's weights follow
            self._gather_resident()
        elif not skipped and self.gatherer is not None:  # the shards moved
            # weight deltas keep their references (after_step); the others drop copies
            getattr(self.gatherer, "after_step", self.gatherer.invalidate)()
        # delayed FP8 scaling: this step's amaxes into the histories (dropped when skipped)
        fp8_delayed.step(self.chunks, self.topo.tp, self.topo.dp, skipped=skipped)
        if skipped:
            self.zero_grad()
        self._clip = _Clip()
        return StepResult(skipped, grad_norm)

    @property
    def step_count(self) -> int:
        return self.optimizer.step_count

    # ================================================================ state
    def full_state(self) -> dict:
        return state_io.full_state(self)

    def load_full_state(self, sd: dict) -> None:
        state_io.load_full_state(self, sd)
        self.state_loaded()

    def sharded_state(self, optim: bool = True) -> state_io.ShardedState:
        """This rank's shard of every parameter: views into the fp32 master (and, with
        `optim`, the optimizer state) buffers with their flat ranges and TP partitions
        (megaq.zero.state.ShardedState). No copy, no collective."""
        return state_io.sharded_state(self, optim)

    def load_sharded_state(self, sd: state_io.ShardedState) -> None:
        """Take a sharded_state() filled in place (or its like) as this rank's state;
        optimizer state it does not carry starts from zero, the step is sd.step."""
        state_io.load_sharded_state(self, sd)
        self.state_loaded()

    def state_loaded(self) -> None:
        """Call after the shard buffers were overwritten (load_full_state,
        load_sharded_state)."""
        self._clip = _Clip()
        self.fp8_resident.refresh()
        if self.resident:
            self._gather_resident()  # the model's weights from the loaded shards
        elif self.gatherer is not None:
            self.gatherer.invalidate()  # hpZ / qwZ copies of the old weights are stale
        reset = getattr(self.reducer, "reset_error_feedback", None)
        if reset is not None:  # qgZ residuals belong to the old trajectory
            reset()

    def checkpoint_taken(self) -> None:
        """Call when a checkpoint of the current weights was taken. Weight deltas
        (--zero-weight-deltas) keep references that trail the weights by a quantization
        error, and a load re-synchronises them at full precision; re-synchronising them
        here too makes a resumed run continue exactly as the uninterrupted one (one
        full-precision gather per save)."""
        if self.gatherer is not None and self.cfg.weight_deltas:
            self.gatherer.invalidate()

    def error_feedback_state(self) -> dict[str, torch.Tensor]:
        """qgZ's error-feedback residuals of this rank ({} when there are none)."""
        get = getattr(self.reducer, "error_feedback_state", None)
        return get() if get is not None else {}

    def load_error_feedback_state(self, sd: dict[str, torch.Tensor]) -> None:
        """Restore this rank's residuals (call after load_full_state, which drops them)."""
        self.reducer.load_error_feedback_state(sd, self.device)

    def num_parameters(self) -> int:
        """The parameters of this rank's model chunks (its TP and PP part, whole: not
        this DP rank's shard), unpadded; a tied embedding counts on each stage that holds
        it, as Megatron counts it."""
        return sum(p.numel for p in self.partitions)

    def memory_report(self) -> dict[str, int]:
        """Bytes on this rank: params (model shards + live gathered: under stages 1 and 2
        the resident whole weights), grads, optimizer,
        and whatever the ZeRO++ seams report holding (``zeropp``, itemised too)."""
        shards = sum(p.own_weight_bytes for p in self.partitions)
        gathered = self.live_gathered_bytes()
        rep = {"params": shards + gathered, "gathered": gathered,
               "grads": self.grads.memory_bytes(), "optimizer": self.optimizer.memory_bytes()}
        # ZeRO++ state (hpZ secondary shards, qwZ packed shards, qgZ residuals), itemised
        zeropp = {}
        for seam in (self.gatherer, self.reducer):
            zeropp.update(getattr(seam, "memory_bytes", dict)())
        rep.update(zeropp)
        rep["zeropp"] = sum(zeropp.values())
        rep["total"] = rep["params"] + rep["grads"] + rep["optimizer"] + rep["zeropp"]
        return rep


def build_engine(model_chunks, topo, cfg: ZeroConfig | None = None, optimizer=None) -> ZeroEngine:
    """Wrap the model chunks of this rank in a ZeRO engine (cfg.stage: 0 to 3). `optimizer`:
    the update rule beside the engine's settings, an OptimizerSettings or a run's
    megaq.config.run.OptimizerConfig (the same attribute names); None: OptimizerSettings()."""
    return ZeroEngine(model_chunks, topo, cfg or ZeroConfig(), optimizer)
