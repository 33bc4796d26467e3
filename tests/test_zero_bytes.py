"""Counted bytes against the bytes actually handed to torch.distributed.

comm.py counts bytes per phase and link from its ring model (tests/test_zero_engine.py
and tests/test_zeropp_training.py check those counts against the model's formulas).
This test checks the counts against a different source: the buffers each rank really
passes to torch.distributed in one ZeRO-3 or ZeRO++ (qwZ + hpZ + qgZ) step on 8 gloo
ranks posing as 2 nodes x 4 (DP=8), per rank, per phase and per link:

* point-to-point sends (gloo's reduce-scatter is a ring of isend/irecv in comm.py):
  the bytes of every tensor sent, charged to the receiver's node;
* all-to-all (qgZ's hops): input bytes / group size to every other member, charged to
  that member's node;
* all-gather: a ring member forwards its own shard and n - 2 relayed ones to its
  successor on the node-by-node ring: (n - 1) x the bytes of the input it handed in.

The node of a rank is rank // 4 here (computed by the test, not read from comm), and the
phase of a collective is where it happens: all-gathers in the forward pass are
weight_gather_fwd, in the backward pass weight_gather_bwd; every send and all-to-all
of backward and finish_grad_sync is grad_reduce.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megaq.parallel import comm
from megaq.parallel.comm import INTER, INTRA
from megaq.testing.ranks import run_on_ranks
from megaq.parallel.pipeline import masked_mean_loss
from megaq.parallelize import parallelize
from megaq.zero import ZeroConfig

from zero_harness import MBS, SEQ, model_config

PER_NODE = 4
MODEL = dict(params_dtype=torch.bfloat16, hidden_size=32, num_attention_heads=4,
             untie_embeddings_and_output_weights=True)
ZERO3 = dict(block_size=64, gather_dtype=torch.bfloat16)
ZEROPP = dict(ZERO3, quantized_weights=True, hpz_partition_size=PER_NODE, quantized_gradients=True,
              grad_chunk=128)
PHASES = ("weight_gather_fwd", "weight_gather_bwd", "grad_reduce")
# (window of the step, kind of collective) -> the phase it belongs to
PHASE_OF = {("forward", "gather"): "weight_gather_fwd", ("backward", "gather"): "weight_gather_bwd",
            ("backward", "send"): "grad_reduce", ("finish", "send"): "grad_reduce"}


def _link(me: int, other: int) -> str:
    return INTRA if me // PER_NODE == other // PER_NODE else INTER


class _Sent:
    """Wraps the torch.distributed entry points comm.py calls and adds up, per phase
    and link, the bytes of the buffers this rank hands them to send."""

    def __init__(self):
        self.window = "forward"
        self.bytes: dict[str, dict[str, int]] = {}
        self.unexpected: list[str] = []
        self.me = dist.get_rank()
        self._saved = []

    def _add(self, kind: str, link: str, n: int) -> None:
        phase = PHASE_OF.get((self.window, kind))
        if phase is None:
            self.unexpected.append(f"{kind} in {self.window}")
            return
        d = self.bytes.setdefault(phase, {INTRA: 0, INTER: 0})
        d[link] += n

    def __enter__(self):
        me = self.me

        def all_gather(out, inp, group=None, async_op=False):
            ranks = dist.get_process_group_ranks(group)
            ring = sorted(ranks, key=lambda r: (r // PER_NODE, r))  # node by node
            succ = ring[(ring.index(me) + 1) % len(ring)]
            self._add("gather", _link(me, succ), (len(ranks) - 1) * inp.numel() * inp.element_size())
            return real["gather"](out, inp, group=group, async_op=async_op)

        def all_to_all_single(out, inp, *args, group=None, async_op=False, **kw):
            ranks = dist.get_process_group_ranks(group)
            chunk = inp.numel() * inp.element_size() // len(ranks)
            for r in ranks:
                if r != me:
                    self._add("send", _link(me, r), chunk)
            return real["a2a"](out, inp, *args, group=group, async_op=async_op, **kw)

        def batch_isend_irecv(ops):
            for op in ops:
                if op.op is dist.isend:
                    self._add("send", _link(me, op.peer), op.tensor.numel() * op.tensor.element_size())
            return real["p2p"](ops)

        def all_reduce(t, *args, **kw):
            self.unexpected.append(f"all_reduce in {self.window}")
            return real["ar"](t, *args, **kw)

        real = {"gather": comm._all_gather_flat, "a2a": dist.all_to_all_single,
                "p2p": dist.batch_isend_irecv, "ar": dist.all_reduce}
        self._saved = list(real.items())
        comm._all_gather_flat = all_gather
        dist.all_to_all_single, dist.batch_isend_irecv, dist.all_reduce = (
            all_to_all_single, batch_isend_irecv, all_reduce)
        return self

    def __exit__(self, *exc):
        real = dict(self._saved)
        comm._all_gather_flat = real["gather"]
        dist.all_to_all_single, dist.batch_isend_irecv, dist.all_reduce = real["a2a"], real["p2p"], real["ar"]


def _one_step(topo, zero_kw: dict):
    cfg = model_config(**MODEL)
    torch.manual_seed(0)
    (model,), engine = parallelize(cfg, topo, ZeroConfig(**zero_kw))
    g = torch.Generator().manual_seed(topo.dp_rank)
    data = torch.randint(0, cfg.vocab_size, (MBS, SEQ + 1), generator=g)
    engine.zero_grad()
    comm.STATS.reset()
    with _Sent() as sent:
        loss = masked_mean_loss(model(input_ids=data[:, :-1], labels=data[:, 1:]), torch.ones(MBS, SEQ))
        sent.window = "backward"
        loss.backward()
        sent.window = "finish"
        engine.finish_grad_sync()
    return {"counted": comm.STATS.snapshot(), "sent": sent.bytes, "unexpected": sent.unexpected}


def _both(topo):
    return {"zero3": _one_step(topo, ZERO3), "zeropp": _one_step(topo, ZEROPP)}


def test_counted_bytes_equal_the_buffers_handed_to_the_collectives():
    results = run_on_ranks(_both, 8, ranks_per_node=PER_NODE, hpz_size=PER_NODE)
    for rank, res in enumerate(results):
        for name, r in res.items():
            assert not r["unexpected"], (rank, name, r["unexpected"])
            assert set(r["counted"]) == set(PHASES), (rank, name, r["counted"])
            for phase in PHASES:
                assert r["counted"][phase] == r["sent"][phase], (rank, name, phase, r)
    # both links carry bytes, and ZeRO++ moves what it promises: backward gathers stay
    # in the node (hpZ) and cross-node bytes shrink (qwZ, qgZ)
    for name in ("zero3", "zeropp"):
        for phase in PHASES:
            assert sum(r[name]["sent"][phase][INTRA] for r in results) > 0, (name, phase)
    inter = {name: sum(r[name]["sent"][p][INTER] for r in results for p in PHASES)
             for name in ("zero3", "zeropp")}
    assert sum(r["zeropp"]["sent"]["weight_gather_bwd"][INTER] for r in results) == 0
    assert 0 < inter["zeropp"] < inter["zero3"] / 3, inter
