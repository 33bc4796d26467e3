"""The gradient state's reduce back-pressure (megaq/zero/grads.py).

At most ``reduce_bucket_size`` bytes of gradient buckets may be in flight (reduce
started, not waited for); past it backward waits for the oldest reduction first. On 2
gloo ranks (DP=2), with the bound set to the largest unit's bucket, every reduction a
rank starts is logged with what is still in flight at that moment, and every wait is
logged: the bound holds at every start, waits come in start order (oldest first), and
some of them happen inside backward (the bound really pushed back). The run is then bit
for bit the run with an unbounded bucket: waiting earlier changes when, not what, is
added into the fp32 accumulators.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
import zero_harness as H  # noqa: E402

from megaq.testing.ranks import run_on_ranks  # noqa: E402
from megaq.parallel.pipeline import get_forward_backward_func, pipeline_tensor_shape  # noqa: E402
from megaq.parallelize import parallelize  # noqa: E402
from megaq.zero import ZeroConfig  # noqa: E402

STEPS, N_MICRO = 2, 2


class _Logged:
    """A reducer seam that logs its starts (with the bytes still in flight) and waits
    (the finish of each reduction)."""

    def __init__(self, inner, log: list, inflight: dict):
        self.inner, self.log, self.inflight = inner, log, inflight

    def start_reduce(self, name, flat, out):
        nbytes = flat.numel() * flat.element_size()
        key = (name, len(self.log))
        self.log.append(("start", key, nbytes, dict(self.inflight)))
        self.inflight[key] = nbytes
        return _LoggedReduction(self.inner.start_reduce(name, flat, out), self, key)


class _LoggedReduction:
    def __init__(self, inner, seam: _Logged, key):
        self.inner, self.seam, self.key = inner, seam, key

    def finish(self):
        self.inner.finish()
        self.seam.log.append(("wait", self.key))
        del self.seam.inflight[self.key]


def _train(topo, bucket: int | None):
    cfg = H.model_config()
    if bucket is None:  # the largest unit's bucket: two of them in flight are too many
        _, probe = parallelize(cfg, topo, ZeroConfig(block_size=8))
        bucket = max(p.padded_numel * 4 for p in probe.partitions)  # fp32 grads
        probe.remove_hooks()
    torch.manual_seed(0)
    zcfg, opt = H.engine_configs(dict(block_size=8, reduce_bucket_size=bucket,
                                      param_persistence_threshold=30))
    chunks, engine = parallelize(cfg, topo, zcfg, optimizer=opt)
    log, inflight = [], {}
    engine.grads.reducer = _Logged(engine.grads.reducer, log, inflight)
    engine.grads.replicated = _Logged(engine.grads.replicated, log, inflight)  # small params
    fb = get_forward_backward_func(1, 1)
    shape = pipeline_tensor_shape(H.SEQ, H.MBS, cfg.hidden_size, 1, False)
    losses = []
    for step in range(STEPS):
        log.append(("zero_grad",))
        engine.zero_grad()
        mbs = H.microbatches(step, topo.dp_rank, topo.dp.size, N_MICRO, cfg.vocab_size)
        losses.append([float(x) for x in fb(chunks, mbs, N_MICRO, topo, tensor_shape=shape)])
        log.append(("finish_grad_sync",))
        engine.finish_grad_sync()
        engine.clip_grad_norm(H.CLIP)
        engine.step(H.LR)
    return {"bucket": bucket, "log": log, "losses": losses, "state": engine.full_state()}


def _both(topo):
    return _train(topo, None), _train(topo, 10 ** 12)


def test_reduce_back_pressure_bounds_inflight_bytes_and_waits_oldest_first():
    for bounded, free in run_on_ranks(_both, 2):
        bucket, log = bounded["bucket"], bounded["log"]
        starts = [e for e in log if e[0] == "start"]
        waits = [e[1] for e in log if e[0] == "wait"]
        assert len(starts) == len(waits) > 2 * STEPS  # every reduction waited for, once
        # the bound: what was in flight when a reduction started is within it, or was a
        # single (oversized) bucket the engine had to let go through on its own
        for _, key, nbytes, before in starts:
            assert sum(before.values()) <= bucket or len(before) == 1, (key, before, bucket)
            assert nbytes <= bucket
        # oldest first: waits in the order the reductions were started
        assert waits == [key for _, key, _, _ in starts]
        # the bound pushed back: some waits happened inside backward, before
        # finish_grad_sync; without a bound every wait is left to finish_grad_sync
        assert _waits_in_backward(log) > 0, log
        assert _waits_in_backward(free["log"]) == 0, free["log"]
        # same numbers, bit for bit
        assert bounded["losses"] == free["losses"]
        for name, st in free["state"]["params"].items():
            for k, t in st.items():
                assert torch.equal(bounded["state"]["params"][name][k], t), (name, k)


def _waits_in_backward(log) -> int:
    """Waits logged between a step's zero_grad and its finish_grad_sync."""
    count, in_backward = 0, False
    for e in log:
        if e[0] in ("zero_grad", "finish_grad_sync"):
            in_backward = e[0] == "zero_grad"
        count += in_backward and e[0] == "wait"
    return count


def _accumulator_bytes_through_a_step(topo):
    """Bytes the fp32 gradient accumulators hold after zero_grad, after the forward, and
    after backward + finish_grad_sync, over two steps; and the losses."""
    cfg = H.model_config()
    torch.manual_seed(0)
    zcfg, opt = H.engine_configs({"stage": 0 if topo.dp.size == 1 else 3})
    chunks, engine = parallelize(cfg, topo, zcfg, optimizer=opt)
    held = lambda: sum(t.untyped_storage().nbytes() for t in engine.grads._accum.values())  # noqa: E731
    seen, losses = [], []
    for step in range(2):
        engine.zero_grad()
        after_zero = held()
        mb = H.microbatches(step, topo.dp_rank, topo.dp.size, 1, cfg.vocab_size)[0]
        loss = chunks[0](mb["tokens"], labels=mb["labels"]).float().mean()
        after_forward = held()
        loss.backward()
        engine.finish_grad_sync()
        engine.clip_grad_norm(H.CLIP)
        engine.step(opt.lr)
        seen.append((after_zero, after_forward, held()))
        losses.append(float(loss))
    full = sum(t.numel() * 4 for t in engine.grads._accum.values())
    return seen, full, losses


def test_gradient_accumulators_hold_no_memory_through_the_forward():
    """zero_grad hands the fp32 accumulators' memory back to the allocator, so the
    forward's activations never share the peak with a full set of gradients; backward
    takes it back and the step is the same as with accumulators held throughout."""
    for topo_ranks in (1, 2):
        for seen, full, losses in run_on_ranks(_accumulator_bytes_through_a_step, topo_ranks):
            assert full > 0 and all(np.isfinite(losses))
            for after_zero, after_forward, after_step in seen:
                assert after_zero == 0 and after_forward == 0
                assert after_step == full
