"""Sharded fp32 AdamW: master weights and moments for this rank's shards only, plus
global grad-norm clipping.

Per partition this rank holds three fp32 buffers of ``shard_numel`` elements: the
master weights (aliasing the model shard itself when the gather dtype is fp32),
``exp_avg`` and ``exp_avg_sq``; the gradient is the fp32 accumulator that
megaq.zero.grads.GradState owns (read, never written, here). The update runs on *leaf
tensors that view* these buffers, one per (partition, decay group): at most two per
partition because partitions are laid out decay-first. The inner optimizer is apex
FusedAdam (adam_w_mode) when importable on CUDA, else torch.optim.AdamW with
``fused=True`` on CUDA (``ZeroConfig.fused_adamw`` to choose) and ``foreach=True``
elsewhere; the fused one also applies the clip factor (``scale_grads``). After the update the new
weights are written back into the gather-dtype shards.

Global grad norm: each rank sums the squares of the gradient elements it *owns*
(its DP shard of sharded partitions; replicated partitions on DP rank 0 only;
TP-replicated params on TP rank 0 only; a tied embedding copy on the first stage
only), one all-reduce over the world adds them up.
"""

from __future__ import annotations

import torch

from megaq.parallel import comm
from megaq.zero.config import ZeroConfig
from megaq.zero.grads import GradState
from megaq.zero.partition import FlatPartition


def _apex_fused_adam():
    try:
        from apex.optimizers import FusedAdam  # type: ignore
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return None
    return FusedAdam


class PartitionState:
    """The fp32 master weights and AdamW moments of one partition on this rank."""

    def __init__(self, part: FlatPartition):
        self.part = part
        if part.dtype == torch.float32:
            self.master = part.shard
        else:
            self.master = part.initial_master
        part.initial_master = None
        self.exp_avg = torch.zeros_like(self.master)
        self.exp_avg_sq = torch.zeros_like(self.master)

    def write_back(self) -> None:
        if self.master is not self.part.shard:
            self.part.shard.copy_(self.master)


class ShardedAdamW:
    def __init__(self, partitions: list[FlatPartition], cfg: ZeroConfig, topo, grads: GradState):
        self.cfg, self.topo, self.grads = cfg, topo, grads
        self.states = [PartitionState(p) for p in partitions]
        self.step_count = 0
        device = partitions[0].device if partitions else torch.device("cpu")
        on_cuda = device.type == "cuda"
        groups = {True: [], False: []}
        self._leaves: list[tuple[torch.nn.Parameter, PartitionState, int, int]] = []
        for st in self.states:
            for a, b, decay in st.part.local_groups():
                leaf = torch.nn.Parameter(st.master[a:b])  # aliases the master buffer
                leaf.grad = grads.accumulator(st.part.name)[a:b]  # a view: GradState writes it
                groups[decay].append(leaf)
                self._leaves.append((leaf, st, a, b))
        param_groups = [{"params": groups[d], "weight_decay": cfg.weight_decay if d else 0.0}
                        for d in (True, False) if groups[d]]
        fused_adam = _apex_fused_adam() if (cfg.use_apex is not False and on_cuda) else None
        if cfg.use_apex and fused_adam is None:
            raise RuntimeError("use_apex=True but apex.optimizers.FusedAdam is not importable on "
                               "CUDA; install apex or leave use_apex unset")
        fused = on_cuda if cfg.fused_adamw is None else cfg.fused_adamw
        self.kind = "apex" if fused_adam else ("fused" if fused else "foreach")
        # the clip factor for the next step, applied inside torch's fused AdamW
        self._grad_scale: torch.Tensor | None = None
        if not param_groups:
            self.inner = None
            return
        if fused_adam is not None:
            self.inner = fused_adam(param_groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                                    adam_w_mode=True)
        else:
            self.inner = torch.optim.AdamW(param_groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                                           fused=fused or None, foreach=None if fused else True)
        self._install_state(0)

    def _install_state(self, step: int) -> None:
        """Point the inner optimizer's state at our flat moment buffers."""
        for leaf, st, a, b in self._leaves:
            state = self.inner.state[leaf]
            state["exp_avg"] = st.exp_avg[a:b]
            state["exp_avg_sq"] = st.exp_avg_sq[a:b]
            if self.kind == "apex":
                continue
            state["step"] = torch.full((), float(step), dtype=torch.float32, device=leaf.device)
        if self.kind == "apex":
            for g in self.inner.param_groups:
                g["step"] = step

    def set_step(self, step: int) -> None:
        self.step_count = step
        if self.inner is not None:
            self._install_state(step)

    # ------------------------------------------------------------------ grads
    def zero_grad(self) -> None:
        """A clip factor of a skipped step must not carry over."""
        self._grad_scale = None

    def local_sq_norm(self) -> torch.Tensor:
        grads = self.grads.read()
        dev = self.states[0].master.device if self.states else torch.device("cpu")
        total = torch.zeros((), dtype=torch.float32, device=dev)
        for st in self.states:
            if not st.part.sharded and self.topo.dp.rank != 0:
                continue  # replicated over DP: counted once per DP group
            grad = grads[st.part.name]
            for a, b in st.part.counted_ranges():
                g = grad[a:b]
                total += torch.dot(g, g)
        return total

    def global_grad_norm(self) -> torch.Tensor:
        sq = self.local_sq_norm()
        comm.all_reduce(sq, self.topo.world, "dp_misc")
        return sq.sqrt()

    def scale_grads(self, coef: torch.Tensor) -> None:
        """Multiply every grad by ``coef`` (0-d tensor: no host sync) before the next step.
        torch's fused AdamW does it inside its own pass, as AMP's unscale (grads divided
        by ``grad_scale = 1 / coef``), which saves a read and a write of every grad;
        the other optimizers get a separate in-place multiply."""
        if self.kind == "fused":
            self._grad_scale = (1.0 / coef).to(torch.float32)
            return
        self.grads.scale(coef)

    # ------------------------------------------------------------------ update
    def step(self, lr: float) -> None:
        self.step_count += 1
        if self.inner is None:
            return
        self.grads.read()  # settled: the leaves' .grad view these accumulators
        for g in self.inner.param_groups:
            g["lr"] = lr
        self.inner.grad_scale = self._grad_scale  # torch's fused AdamW reads it; else None
        self.inner.step()
        self._grad_scale = None
        for st in self.states:
            st.write_back()

    def memory_bytes(self) -> int:
        """AdamW moments + fp32 master (when it is not the model shard itself)."""
        def nb(t):
            return t.numel() * t.element_size()
        opt = sum(nb(st.exp_avg) + nb(st.exp_avg_sq) for st in self.states)
        master = sum(nb(st.master) for st in self.states if st.master is not st.part.shard)
        return opt + master
