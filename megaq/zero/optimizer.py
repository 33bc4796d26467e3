"""Sharded fp32 optimizers: master weights and optimizer state for this rank's shards
only, and the update (clip factor applied). ``build_optimizer`` picks one by
``OptimizerSettings.optimizer`` (megaq.zero.config): ``ShardedAdamW`` ("adam", Megatron's default) or
``ShardedSGD`` ("sgd": momentum SGD, L2 weight decay, as Megatron's --optimizer sgd).

Both share :class:`ShardedOptimizer`, which owns the partition logic. Per partition
this rank holds ``shard_numel`` fp32 elements of master weights (aliasing the model
shard itself when the gather dtype is fp32) and one buffer per *named* optimizer
state (``STATE_NAMES``: AdamW's ``exp_avg`` / ``exp_avg_sq``, SGD's
``momentum_buffer``), in ``PartitionState.state``; checkpoints iterate
``PartitionState.buffers()`` = {"param": master, **state} by name. The gradient is the
fp32 accumulator that megaq.zero.grads.GradState owns (read here, and multiplied by the
clip factor where the update cannot apply it itself). The update runs on *leaf
tensors that view* these buffers, one per (partition, decay group): at most two per
partition because partitions are laid out decay-first; the inner torch optimizer's
per-parameter state is pointed at views of the same named buffers, so it updates them
in place. AdamW on CUDA runs megaq's one-pass step (megaq.kernels.fused_adamw;
``OptimizerSettings.fused_step``): per leaf one kernel reads the fp32 grad, master and
moments, applies the clip factor, and writes the master, the moments and the
gather-dtype weights (the bf16 model copy) in the same pass. Otherwise the inner
optimizer is apex FusedAdam (adam_w_mode; ``use_apex``), or torch.optim.AdamW with
``fused=True`` on CUDA (``fused_adamw``) and ``foreach=True`` elsewhere;
torch's fused one also applies the clip factor (as AMP's ``grad_scale``). SGD is
torch.optim.SGD (foreach). After an inner optimizer's update the new weights are
written back into the gather-dtype shards as a separate pass.

The clip factor is an argument of :meth:`ShardedOptimizer.step`: the engine holds the
step's clipping state (megaq.zero.engine), GradState computes the norm.
"""

from __future__ import annotations

import torch

from megaq.kernels import fused_adamw
from megaq.zero.grads import GradState
from megaq.zero.partition import FlatPartition


def _apex_fused_adam():
    try:
        from apex.optimizers import FusedAdam  # type: ignore
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return None
    return FusedAdam


_FINITE_SLICE = 1 << 24  # elements per reduction of local_params_finite (keeps each a bounded pass)

class PartitionState:
    """The fp32 master weights and the optimizer's named state buffers of one partition
    on this rank."""

    def __init__(self, part: FlatPartition, state_names: tuple[str, ...]):
        self.part = part
        if part.dtype == torch.float32:
            self.master = part.shard
        else:
            self.master = part.initial_master
        part.initial_master = None
        self.state = {name: torch.zeros_like(self.master) for name in state_names}

    def buffers(self) -> dict[str, torch.Tensor]:
        """{"param": master, <state name>: buffer, ...}: what a checkpoint holds, by name."""
        return {"param": self.master, **self.state}

    def write_back(self) -> None:
        """The gather-dtype weights from the master (replicated FP8 weights, which have
        none, are cast by megaq.zero.fp8_resident)."""
        if self.master is not self.part.shard:
            self.part.shard.copy_(self.master[self.part.shard_from:])


def _split_at(groups: list[tuple[int, int, bool]], cut: int) -> list[tuple[int, int, bool]]:
    """The (start, end, decay) groups cut at `cut`, so that no leaf spans both the
    elements without a gather-dtype copy (replicated FP8 weights) and those with one."""
    out = []
    for a, b, decay in groups:
        if a < cut < b:
            out += [(a, cut, decay), (cut, b, decay)]
        else:
            out.append((a, b, decay))
    return out


class ShardedOptimizer:
    """The partition logic every sharded optimizer shares: leaves viewing the master
    and grad buffers, decay groups, the inner optimizer's state pointed at the named
    buffers, grad norm and clipping, step and write-back. A subclass names its state
    (``STATE_NAMES``) and builds its inner torch optimizer (``_build_inner``)."""

    NAME = ""
    STATE_NAMES: tuple[str, ...] = ()

    def __init__(self, partitions: list[FlatPartition], opt, topo, grads: GradState):
        # opt: the update rule (OptimizerSettings, or a run's megaq.config.run.OptimizerConfig)
        self.opt, self.topo, self.grads = opt, topo, grads
        self.states = [PartitionState(p, self.STATE_NAMES) for p in partitions]
        self.step_count = 0
        # the update's amax ranges (_amax_segments), built once per set of amax buffers
        self._segments_key = self._segments = None
        device = partitions[0].device if partitions else torch.device("cpu")
        groups = {True: [], False: []}
        self._leaves: list[tuple[torch.nn.Parameter, PartitionState, int, int]] = []
        for st in self.states:
            pieces = _split_at(st.part.local_groups(), st.part.shard_from)
            views = grads.accumulator_views(st.part.name, [(a, b) for a, b, _ in pieces])
            for (a, b, decay), grad in zip(pieces, views):
                leaf = torch.nn.Parameter(st.master[a:b])  # aliases the master buffer
                leaf.grad = grad  # a view: GradState writes it
                groups[decay].append(leaf)
                self._leaves.append((leaf, st, a, b))
        param_groups = [{"params": groups[d], "weight_decay": opt.weight_decay if d else 0.0}
                        for d in (True, False) if groups[d]]
        self.kind = "foreach"  # how the step runs (ShardedAdamW: also "fused", "apex", "onepass")
        self.inner = self._build_inner(param_groups, device) if param_groups else None
        if self.inner is not None:
            self._install_state(0)

    def _build_inner(self, param_groups: list[dict], device: torch.device):
        raise NotImplementedError

    def _install_step(self, state: dict, leaf, step: int) -> None:
        """Set the inner optimizer's per-parameter step counter (if it keeps one)."""

    def _install_state(self, step: int) -> None:
        """Point the inner optimizer's state at views of our flat named buffers."""
        for leaf, st, a, b in self._leaves:
            state = self.inner.state[leaf]
            for name in self.STATE_NAMES:
                state[name] = st.state[name][a:b]
            self._install_step(state, leaf, step)

    def set_step(self, step: int) -> None:
        self.step_count = step
        if self.inner is not None:
            self._install_state(step)

    # ------------------------------------------------------------------ norms
    def local_param_sq_norm(self) -> torch.Tensor:
        """Sum of squares of the fp32 master weights this rank owns (counted once over
        DP, TP and tied copies, as the grad norm): the --log-params-norm summand."""
        dev = self.states[0].master.device if self.states else torch.device("cpu")
        total = torch.zeros((), dtype=torch.float32, device=dev)
        for st in self.states:
            if not st.part.sharded and self.topo.dp.rank != 0:
                continue
            for a, b in st.part.counted_ranges():
                w = st.master[a:b]
                total += torch.dot(w, w)
        return total

    def local_params_finite(self) -> torch.Tensor:
        """0-d float tensor, 1.0 when every fp32 master weight this rank holds is finite,
        else 0.0 (no host sync). A slice's min and max are finite iff all of it is (both
        propagate NaN): one reduction pass with no temporary, where ``isfinite().all()``
        writes a bool copy first (on CPU 5-20x slower: seconds per save at 1.3B)."""
        dev = self.states[0].master.device if self.states else torch.device("cpu")
        ok = torch.ones((), dtype=torch.bool, device=dev)
        for st in self.states:
            for piece in st.master.split(_FINITE_SLICE):
                lo, hi = torch.aminmax(piece)
                ok &= torch.isfinite(lo) & torch.isfinite(hi)
        return ok.to(torch.float32)

    # ------------------------------------------------------------------ update
    def step(self, lr: float, grad_scale: torch.Tensor | None = None,
             weight_amax: dict[str, torch.Tensor] | None = None) -> bool:
        """One update from the gradients GradState holds, times `grad_scale` (the clip
        factor, a 0-d tensor: no host sync; None: no clipping). The update applies it in
        its own pass where it can (:meth:`_applies_grad_scale`: a read and a write of
        every grad less), else the grads are multiplied in place first.

        `weight_amax`: {partition name: fp32 tensor, one element per FP8 slot of that
        replicated partition} to receive each slot's max |master| after the update, where
        the update takes it in its own pass (megaq's one-pass AdamW:
        :meth:`_update_amax`). Returns whether it did; if not, the caller reads the
        masters for it (megaq.zero.fp8_resident)."""
        self.step_count += 1
        if not self._leaves:
            return False
        # settled; fp32 unless the update reads 16-bit gradients (the leaves' .grad view
        # the fp32 accumulators)
        grads = self.grads.read_any() if self.reads_16bit_grads else self.grads.read()
        if grad_scale is not None and not self._applies_grad_scale():
            for g in grads.values():
                g.mul_(grad_scale)
            grad_scale = None
        segments = self._amax_segments(weight_amax) if weight_amax else None
        self._update(lr, grad_scale, grads, segments)
        return segments is not None

    def _amax_segments(self, weight_amax: dict[str, torch.Tensor]) -> dict | None:
        """{leaf index: fused_adamw.Segments} that fill `weight_amax` in the update's pass,
        or None where the update cannot (another kernel, or a slot cut by a leaf edge)."""
        if not self._update_amax:
            return None
        key = tuple((name, t.data_ptr()) for name, t in sorted(weight_amax.items()))
        if self._segments_key != key:
            self._segments_key, self._segments = key, self._build_segments(weight_amax)
        return self._segments

    def _build_segments(self, weight_amax):
        out, covered = {}, set()
        for i, (leaf, st, a, b) in enumerate(self._leaves):
            amax = weight_amax.get(st.part.name)
            if amax is None or st.part.sharded:
                continue
            slots = [(k, s) for k, s in enumerate(st.part.fp8_slots)
                     if a <= s.offset and s.offset + s.numel <= b]
            if slots:
                k0, k1 = slots[0][0], slots[-1][0] + 1
                out[i] = fused_adamw.Segments(
                    [(s.offset - a, s.offset + s.numel - a) for _, s in slots], amax[k0:k1])
                covered.update((st.part.name, k) for k, _ in slots)
        want = {(name, k) for name, t in weight_amax.items() for k in range(t.numel())}
        return out if covered == want else None

    _update_amax = False  # does _update take segments? (ShardedAdamW's one-pass kernel)

    @property
    def reads_16bit_grads(self) -> bool:
        """Does :meth:`_update` read a 16-bit gradient as its exact fp32 value (so GradState
        may keep one: megaq.zero.grads, keep_16bit)? Not by default: a torch optimizer
        wants its leaves' fp32 .grad."""
        return False

    def _applies_grad_scale(self) -> bool:
        """Does :meth:`_update` apply a clip factor itself? (Not by default.)"""
        return False

    def _update(self, lr: float, grad_scale: torch.Tensor | None,
                grads: dict[str, torch.Tensor], segments: dict | None = None) -> None:
        """The inner optimizer's step on the leaves, then the gather-dtype write-back.
        `grads`: GradState's settled gradients by partition name (the leaves' .grad view
        the fp32 ones); `segments`: None here (:meth:`_amax_segments`)."""
        for g in self.inner.param_groups:
            g["lr"] = lr
        self.inner.step()
        for st in self.states:
            st.write_back()

    def memory_bytes(self) -> int:
        """Optimizer state + fp32 master (when it is not the model shard itself)."""
        def nb(t):
            return t.numel() * t.element_size()
        opt = sum(nb(buf) for st in self.states for buf in st.state.values())
        master = sum(nb(st.master) for st in self.states if st.master is not st.part.shard)
        return opt + master


class ShardedAdamW(ShardedOptimizer):
    """AdamW (decoupled weight decay), --optimizer adam."""

    NAME = "adam"
    STATE_NAMES = ("exp_avg", "exp_avg_sq")

    @property
    def _betas(self) -> tuple[float, float]:
        return self.opt.adam_beta1, self.opt.adam_beta2

    def _build_inner(self, param_groups, device):
        opt = self.opt
        on_cuda = device.type == "cuda"
        # The kernel: OptimizerSettings may pin one; a run's OptimizerConfig has no flag for
        # it (none of the three names), and the device decides, as None does.
        fused_step, use_apex, fused_adamw = (getattr(opt, name, None)
                                             for name in ("fused_step", "use_apex", "fused_adamw"))
        if fused_step or (fused_step is None and on_cuda and not use_apex):
            self.kind = "onepass"  # no inner optimizer: _update runs megaq's kernel
            self._leaf_decay = {id(p): g["weight_decay"] for g in param_groups for p in g["params"]}
            return None
        fused_adam = _apex_fused_adam() if (use_apex is not False and on_cuda) else None
        if use_apex and fused_adam is None:
            raise RuntimeError("use_apex=True but apex.optimizers.FusedAdam is not importable on "
                               "CUDA; install apex or leave use_apex unset")
        fused = on_cuda if fused_adamw is None else fused_adamw
        self.kind = "apex" if fused_adam else ("fused" if fused else "foreach")
        if fused_adam is not None:
            return fused_adam(param_groups, lr=opt.lr, betas=self._betas, eps=opt.adam_eps,
                              adam_w_mode=True)
        return torch.optim.AdamW(param_groups, lr=opt.lr, betas=self._betas, eps=opt.adam_eps,
                                 fused=fused or None, foreach=None if fused else True)

    def _applies_grad_scale(self):
        return self.kind in ("fused", "onepass")

    @property
    def reads_16bit_grads(self) -> bool:
        return self.kind == "onepass"  # megaq's kernel upcasts as it loads

    @property
    def _update_amax(self) -> bool:
        return self.kind == "onepass"

    def _update(self, lr: float, grad_scale: torch.Tensor | None,
                grads: dict[str, torch.Tensor], segments: dict | None = None) -> None:
        if self.kind == "fused":  # torch's fused AdamW divides by it, as AMP's unscale
            self.inner.grad_scale = None if grad_scale is None else (1.0 / grad_scale).to(torch.float32)
        if self.kind != "onepass":
            return super()._update(lr, None, grads)
        scale = None if grad_scale is None else grad_scale.to(torch.float32)  # megaq's kernel multiplies
        scalars = {wd: fused_adamw.step_scalars(lr, wd, self._betas, self.opt.adam_eps,
                                                self.step_count)
                   for wd in set(self._leaf_decay.values())}
        for i, (leaf, st, a, b) in enumerate(self._leaves):
            f = st.part.shard_from  # elements before it have no gather-dtype copy
            out = None if (st.master is st.part.shard or b <= f) else st.part.shard[a - f:b - f]
            fused_adamw.adamw_step(leaf.data, grads[st.part.name][a:b], st.state["exp_avg"][a:b],
                                   st.state["exp_avg_sq"][a:b], out, scale,
                                   scalars[self._leaf_decay[id(leaf)]],
                                   segments.get(i) if segments else None)

    def _install_step(self, state, leaf, step):
        if self.kind == "apex":  # apex keeps one step per param group
            for g in self.inner.param_groups:
                g["step"] = step
            return
        state["step"] = torch.full((), float(step), dtype=torch.float32, device=leaf.device)


class ShardedSGD(ShardedOptimizer):
    """SGD with momentum and L2 weight decay (added to the gradient, not decoupled):
    Megatron's --optimizer sgd with --sgd-momentum, i.e. torch.optim.SGD.

    The momentum buffer starts at zero rather than torch's "copy of the first grad":
    momentum * 0 + grad is exactly that copy, and the buffer stays ours (a view)."""

    NAME = "sgd"
    STATE_NAMES = ("momentum_buffer",)

    def __init__(self, partitions, opt, topo, grads: GradState):
        if opt.sgd_momentum == 0:
            self.STATE_NAMES = ()  # plain SGD keeps no state
        super().__init__(partitions, opt, topo, grads)

    def _build_inner(self, param_groups, device):
        return torch.optim.SGD(param_groups, lr=self.opt.lr, momentum=self.opt.sgd_momentum,
                               foreach=True)


OPTIMIZERS = {cls.NAME: cls for cls in (ShardedAdamW, ShardedSGD)}


def optimizer_state_names(optimizer: str, sgd_momentum: float = 0.9) -> tuple[str, ...]:
    """The per-element state `--optimizer` keeps beside the weights (what a checkpoint
    stores for each parameter besides "param"), e.g. for tools without an engine."""
    if optimizer == "sgd" and sgd_momentum == 0:
        return ()  # plain SGD (ShardedSGD drops its buffer likewise)
    return OPTIMIZERS[optimizer].STATE_NAMES


def build_optimizer(partitions, opt, topo, grads: GradState) -> ShardedOptimizer:
    """The sharded optimizer ``opt.optimizer`` names ("adam" or "sgd")."""
    return OPTIMIZERS[opt.optimizer](partitions, opt, topo, grads)
