"""The collective layer: the only module that calls torch.distributed collectives.

Why one room: version shims, async handles, and byte accounting (per phase tag and
per link class) live here, so every other module just says *what* it moves.

Byte accounting model
---------------------
Each call is tagged with a *phase* (``weight_gather_fwd``, ``weight_gather_bwd``,
``grad_reduce``, ``tp``, ``pp``, ...) and each byte is charged to the rank that
sends it, as ``intra_node`` or ``inter_node`` depending on where the receiver lives.

* all-gather / reduce-scatter over a group of n ranks on k nodes, moving a full
  tensor of S bytes (the gathered output, or the reduce-scatter input): a ring laid
  out node by node. Every rank sends S(n-1)/n bytes to its ring successor; the last
  rank of each node sends across the node boundary. Summed per node: S(n-1)/n bytes
  inter-node and (n/k - 1) S(n-1)/n intra-node; with k == 1 the ring closes inside
  the node: n S(n-1)/n intra-node, nothing inter-node.
* all-reduce: reduce-scatter + all-gather, two ring passes, twice the above.
* all-to-all (equal splits): a rank sends S/n to every other member; each chunk is
  charged by where its receiver is.
* broadcast: a chain from the source along the ring, S bytes per link.
* send / recv: the bytes sent, charged by the receiver's node.

Counters are per rank; :func:`per_node_totals` sums them over each node.

Time per phase (optional)
-------------------------
With a group's timing on (``group.timing.on``: one :class:`CommTiming` per Topology,
shared by its groups; the training loop switches it for its run when
``pretrain_gpt.py --log-comm-time`` asks) every collective on the group runs
synchronously and is timed from a device synchronization before it to one after it,
so its seconds are charged to its phase without the compute it would otherwise
overlap. Steps get slower (no overlap), and a collective's time includes waiting for
peers that arrive later; the figures say where communication time goes, while the
step time to quote is the one measured with timing off.

A peer that vanished
--------------------
When a member's process ends (killed, crashed, its node down) or stops answering, the
backend fails the collective on the others with its own text ("Connection closed by
peer [addr]", a timeout). Every collective here translates that failure, where it is
issued and where its handle is waited on, into :class:`CollectiveFailed`, which
carries the phase tag and the group (its name: tp, dp, intra, inter, hpz, pp,
embedding, world) so that the failure layer (megaq.runtime.failure, megaq.runtime.peers) can
say in one line which rank was lost, where and when. Errors that are not the
transport's (a wrong shape, a wrong dtype: bugs) pass through unchanged.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

INTRA, INTER = "intra_node", "inter_node"


@dataclass
class CommTiming:
    """Whether collectives run synchronously and timed (--log-comm-time). A setting of
    one Topology, passed to each of its groups (Group.timing) by build_topology; the
    training loop turns it on for its run and off after."""

    on: bool = False


class CommStats:
    """bytes[phase][link] sent by this rank since the last reset, and seconds[phase]
    spent in synchronous, timed collectives (groups whose timing is on)."""

    def __init__(self):
        self.bytes: dict[str, dict[str, int]] = defaultdict(lambda: {INTRA: 0, INTER: 0})
        self.seconds: dict[str, float] = defaultdict(float)

    def add(self, phase: str, link: str, nbytes: int) -> None:
        if nbytes:
            self.bytes[phase][link] += int(nbytes)

    def add_time(self, phase: str, seconds: float) -> None:
        self.seconds[phase] += seconds

    def reset(self) -> None:
        self.bytes.clear()
        self.seconds.clear()

    def snapshot(self) -> dict[str, dict[str, int]]:
        return {p: dict(v) for p, v in self.bytes.items()}

    def seconds_snapshot(self) -> dict[str, float]:
        return dict(self.seconds)


STATS = CommStats()  # this process's counters (one process = one rank)
LAST_ENTERED: list = [None, 0.0]  # [what, time.time()] of the last collective issued (megaq.runtime.watchdog)


class CollectiveFailed(RuntimeError):
    """A collective failed in the transport: a peer's process ended, or a peer did not
    answer within the process-group timeout. `phase` is the call's phase tag, `group` the
    Group it ran on, `cause` the backend's exception; `iteration` (the last completed
    training iteration) is filled in by the training loop when it passes through."""

    def __init__(self, phase: str, group: "Group", cause: BaseException):
        first = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
        super().__init__(f"{phase} on {group.describe()} failed: {first}")
        self.phase, self.group, self.cause = phase, group, cause
        self.iteration: int | None = None

    @property
    def timed_out(self) -> bool:
        """The peer did not answer in time (rather than its connection closing)."""
        return "timed out" in str(self.cause).lower() or "timeout" in str(self.cause).lower()


# The transport's words for a peer that is gone or silent (gloo, NCCL, the c10d store).
_TRANSPORT_WORDS = ("connection closed", "connection reset", "connection refused", "broken pipe",
                    "timed out", "timeout", "remote worker", "socket", "peer", "nccl",
                    "communicator was aborted", "distnetworkerror")


def _transport_failure(e: BaseException) -> bool:
    if isinstance(e, CollectiveFailed) or not isinstance(e, RuntimeError):
        return False
    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(e, dist_error):
        return True
    text = str(e).lower()
    return any(w in text for w in _TRANSPORT_WORDS)


@contextlib.contextmanager
def _guarded(phase: str, group: "Group | None"):
    """Turn a transport failure inside the block into CollectiveFailed(phase, group)."""
    try:
        yield
    except RuntimeError as e:
        if group is None or not _transport_failure(e):
            raise
        raise CollectiveFailed(phase, group, e) from e


class Handle:
    """The one async handle of megaq: what every ``async_op=True`` collective here
    returns, and what the ZeRO seams return for work built on top of collectives.

    ``wait()`` waits for ``work`` (a torch ``Work``, another :class:`Handle`, a list of
    either, or None for work already done), then runs ``then`` (local work that needs
    the collective's result: an unpack, an accumulate, the rest of a pipeline) once.
    Waiting again is harmless.
    """

    def __init__(self, work=None, then: Callable[[], None] | None = None,
                 what: tuple | None = None):
        self._work, self._then = work, then
        self._what = what  # (phase, group) of the collective behind `work`, for its failure

    def wait(self) -> None:
        if self._work is not None:
            work, self._work = self._work, None
            with _guarded(*(self._what or ("", None))):
                for w in (work if isinstance(work, list) else (work,)):
                    w.wait()
        if self._then is not None:
            then, self._then = self._then, None
            then()


@dataclass
class Group:
    """A process group plus what accounting needs: members, their nodes, my index.

    Single-member groups get no torch process group: their collectives are local copies.
    """

    ranks: list[int]
    nodes: list[int]
    pg: object = None
    rank_index: int = field(default=-1)
    _backend: str | None = field(default=None, repr=False)
    name: str = ""  # what the group is for (tp, dp, intra, ...): failures name it
    # its topology's collective timing (shared by the topology's groups; off by default)
    timing: CommTiming = field(default_factory=CommTiming, repr=False, compare=False)

    @classmethod
    def create(cls, ranks: list[int], node_of: Callable[[int], int], world: bool = False,
               name: str = "", timeout: timedelta | None = None,
               timing: CommTiming | None = None) -> "Group":
        """timeout: the process-group timeout (--distributed-timeout-minutes, passed down
        by build_topology; None: torch's default for the backend); timing: the
        topology's CommTiming (None: a new one, off)."""
        pg = None
        if world:
            pg = dist.group.WORLD
        elif len(ranks) > 1:  # collective: every rank calls it for every group
            pg = dist.new_group(ranks, timeout=timeout)
        me = dist.get_rank() if dist.is_initialized() else 0
        idx = ranks.index(me) if me in ranks else -1
        return cls(ranks=list(ranks), nodes=[node_of(r) for r in ranks], pg=pg, rank_index=idx,
                   name=name or ("world" if world else ""), timing=timing or CommTiming())

    def describe(self) -> str:
        """'the dp group (ranks 0-3)', for error lines."""
        rs = self.ranks
        span = (f"{rs[0]}-{rs[-1]}" if len(rs) > 2 and rs == list(range(rs[0], rs[-1] + 1))
                else ",".join(map(str, rs)))
        return f"the {self.name} group (ranks {span})" if self.name else f"the group of ranks {span}"

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def rank(self) -> int:
        return self.rank_index

    @property
    def num_nodes(self) -> int:
        return len(set(self.nodes))

    @property
    def is_gloo(self) -> bool:
        if self._backend is None:
            self._backend = dist.get_backend(self.pg) if self.pg is not None else ""
        return self._backend == "gloo"

    def ring_order(self) -> list[int]:
        """Member indices in ring order: node by node, rank order inside a node."""
        return sorted(range(self.size), key=lambda i: (self.nodes[i], self.ranks[i]))

    def ring_successor_is_remote(self) -> bool:
        """In a node-contiguous ring, does my successor live on another node?"""
        order = self.ring_order()
        pos = order.index(self.rank_index)
        nxt = order[(pos + 1) % self.size]
        return self.nodes[nxt] != self.nodes[self.rank_index]

    def link_to(self, member_index: int) -> str:
        return INTRA if self.nodes[member_index] == self.nodes[self.rank_index] else INTER


# --------------------------------------------------------------------------- shims
# torch 2.13 deprecates *_into_tensor / *_tensor in favour of *_single, which
# torch 2.11 does not have. Pick once, here.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _charge_ring(group: Group, phase: str, full_bytes: int, passes: int = 1) -> None:
    n = group.size
    if n == 1:
        return
    sent = passes * full_bytes * (n - 1) // n
    STATS.add(phase, INTER if group.ring_successor_is_remote() else INTRA, sent)


def _run(fn, *args, async_op: bool, what: tuple | None = None, **kw) -> Handle | None:
    with _guarded(*(what or ("", None))):
        work = fn(*args, async_op=async_op, **kw)
    if async_op:
        return Handle(work, what=what)
    return None


def _done(async_op: bool) -> Handle | None:
    return Handle() if async_op else None


def _sync(t: torch.Tensor) -> None:
    if t.is_cuda:
        torch.cuda.synchronize(t.device)


@contextlib.contextmanager
def _timed(phase: str, t: torch.Tensor, group: Group):
    """Charge the block's wall time to `phase` when the group's timing is on (device
    synchronized on both sides, so queued compute is not counted)."""
    if not group.timing.on:
        yield
        return
    _sync(t)
    t0 = time.perf_counter()
    yield
    _sync(t)
    STATS.add_time(phase, time.perf_counter() - t0)


def _timed_run(phase: str, on: Group, t: torch.Tensor, fn, *args, async_op: bool,
               **kw) -> Handle | None:
    """_run on group `on`, synchronous and timed while its timing is on (a finished
    handle then); a transport failure becomes CollectiveFailed(phase, on)."""
    LAST_ENTERED[:] = [f"{getattr(fn, '__name__', fn)} ({phase}, {tuple(t.shape)})", time.time()]
    what = (phase, on)
    if not on.timing.on:
        return _run(fn, *args, async_op=async_op, what=what, **kw)
    with _timed(phase, t, on):
        _run(fn, *args, async_op=False, what=what, **kw)
    return _done(async_op)


# ------------------------------------------------------------ gloo with CUDA tensors
# gloo moves host memory only. With `--distributed-backend gloo --device cuda` (ranks
# sharing GPUs, e.g. the emulated cluster's GPU mode) each collective runs on host
# copies of its CUDA tensors, synchronously, and the results are copied back: the
# bytes on the wire and the accounting are those of the same collective on the CPU.
def _via_host(group: Group, t: torch.Tensor) -> bool:
    return t.is_cuda and group.is_gloo


def _host_empty(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device="cpu")


def _staged_out(phase: str, on: Group, fn, output: torch.Tensor, input: torch.Tensor,
                **kw) -> None:
    """fn(host output, host input) on host copies; then output <- host output."""
    host = _host_empty(output)
    _timed_run(phase, on, output, fn, host, input.cpu(), async_op=False, **kw)
    output.copy_(host)


def _staged_inplace(phase: str, on: Group, fn, tensor: torch.Tensor, **kw) -> None:
    """fn(host copy) for an in-place collective; then tensor <- host copy."""
    host = tensor.cpu()
    _timed_run(phase, on, tensor, fn, host, async_op=False, **kw)
    tensor.copy_(host)


# ---------------------------------------------------------------------- collectives
def all_gather(output: torch.Tensor, input: torch.Tensor, group: Group, phase: str,
               async_op: bool = False):
    """Gather equal flat shards: output = cat(input of member 0, 1, ...)."""
    if group.size == 1:
        output.copy_(input.reshape(output.shape))
        return _done(async_op)
    _charge_ring(group, phase, _nbytes(output))
    if _via_host(group, output):
        _staged_out(phase, group, _all_gather_flat, output, input, group=group.pg)
        return _done(async_op)
    return _timed_run(phase, group, output, _all_gather_flat, output, input, group=group.pg,
                      async_op=async_op)


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group: Group, phase: str,
                   op=dist.ReduceOp.SUM, async_op: bool = False):
    """output = (sum over members of input)[my chunk]."""
    if group.size == 1:
        output.copy_(input.reshape(output.shape))
        return _done(async_op)
    _charge_ring(group, phase, _nbytes(input))
    if group.is_gloo:  # synchronous: gloo's CPU ops gain nothing from overlap
        if op == dist.ReduceOp.SUM:
            fn, kw = _ring_reduce_scatter, {"group": group}
        else:
            fn, kw = _reduce_scatter_flat, {"op": op, "group": group.pg}
        if _via_host(group, input):
            _staged_out(phase, group, fn, output, input, **kw)
        else:
            _timed_run(phase, group, input, fn, output, input, async_op=False, **kw)
        return _done(async_op)
    return _timed_run(phase, group, input, _reduce_scatter_flat, output, input, op=op,
                      group=group.pg, async_op=async_op)


def _ring_reduce_scatter(output: torch.Tensor, input: torch.Tensor, group: Group,
                         async_op: bool = False) -> None:
    """Ring reduce-scatter from p2p, for gloo.

    gloo runs reduce_scatter as a full all-reduce (two ring passes), so on CPU runs it
    would move twice what the ring model (NCCL's algorithm) charges, and twice what
    the same job moves over NCCL. This ring moves exactly the model's bytes: n - 1
    steps over the node-contiguous ring; at step s the member at ring position p sends
    its running sum of chunk order[p-s-1] to its successor and adds its own share to
    chunk order[p-s-2] received from its predecessor, so it ends with chunk order[p]
    summed over all members. Synchronous (`async_op` is taken for _timed_run's call and
    ignored).
    """
    n = group.size
    order = group.ring_order()
    pos = order.index(group.rank_index)
    succ, pred = group.ranks[order[(pos + 1) % n]], group.ranks[order[(pos - 1) % n]]
    chunks = input.reshape(n, -1)
    send = chunks[order[(pos - 1) % n]].clone()
    recv = torch.empty_like(send)
    for s in range(n - 1):
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, succ, group=group.pg),
                                        dist.P2POp(dist.irecv, recv, pred, group=group.pg)])
        for w in works:
            w.wait()
        send, recv = recv.add_(chunks[order[(pos - s - 2) % n]]), send
    output.copy_(send.reshape(output.shape))


def all_reduce(tensor: torch.Tensor, group: Group, phase: str, op=dist.ReduceOp.SUM,
               async_op: bool = False):
    if group.size == 1:
        return _done(async_op)
    _charge_ring(group, phase, _nbytes(tensor), passes=2)
    if _via_host(group, tensor):
        _staged_inplace(phase, group, dist.all_reduce, tensor, op=op, group=group.pg)
        return _done(async_op)
    return _timed_run(phase, group, tensor, dist.all_reduce, tensor, op=op, group=group.pg,
                      async_op=async_op)


def all_to_all(output: torch.Tensor, input: torch.Tensor, group: Group, phase: str,
               async_op: bool = False):
    """Equal-split all-to-all over dim 0 of flat buffers: chunk j of input goes to member j."""
    n = group.size
    if n == 1:
        output.copy_(input)
        return _done(async_op)
    chunk = _nbytes(input) // n
    for j in range(n):
        if j != group.rank_index:
            STATS.add(phase, group.link_to(j), chunk)
    if _via_host(group, input):
        _staged_out(phase, group, dist.all_to_all_single, output, input, group=group.pg)
        return _done(async_op)
    return _timed_run(phase, group, input, dist.all_to_all_single, output, input, group=group.pg,
                      async_op=async_op)


def broadcast(tensor: torch.Tensor, src_index: int, group: Group, phase: str,
              async_op: bool = False):
    """Broadcast from member `src_index` (an index into group.ranks)."""
    n = group.size
    if n == 1:
        return _done(async_op)
    order = group.ring_order()
    start = order.index(src_index)
    chain = order[start:] + order[:start]
    pos = chain.index(group.rank_index)
    if pos < n - 1:
        STATS.add(phase, group.link_to(chain[pos + 1]), _nbytes(tensor))
    if _via_host(group, tensor):
        _staged_inplace(phase, group, dist.broadcast, tensor, src=group.ranks[src_index],
                        group=group.pg)
        return _done(async_op)
    return _timed_run(phase, group, tensor, dist.broadcast, tensor, src=group.ranks[src_index],
                      group=group.pg, async_op=async_op)


def batch_p2p(sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]],
              group: Group, phase: str) -> Handle:
    """Post sends (tensor, member index) and receives together; returns one handle."""
    ops, landing = [], []   # landing: (CUDA receive buffer, its host copy) under gloo
    for t, j in sends:
        STATS.add(phase, group.link_to(j), _nbytes(t))
        if _via_host(group, t):
            t = t.cpu()
        ops.append(dist.P2POp(dist.isend, t, group.ranks[j], group=group.pg))
    for t, j in recvs:
        if _via_host(group, t):
            landing.append((t, _host_empty(t)))
            t = landing[-1][1]
        ops.append(dist.P2POp(dist.irecv, t, group.ranks[j], group=group.pg))
    if not ops:
        return Handle()

    def land():
        for dst, host in landing:
            dst.copy_(host)
    if group.timing.on:
        with _timed(phase, (sends or recvs)[0][0], group), _guarded(phase, group):
            for w in dist.batch_isend_irecv(ops):
                w.wait()
            land()
        return Handle()
    with _guarded(phase, group):
        works = dist.batch_isend_irecv(ops)
    return Handle(works, then=land if landing else None, what=(phase, group))


def barrier(group: Group | None = None) -> None:
    LAST_ENTERED[:] = ["barrier", time.time()]
    if dist.is_initialized() and (group is None or group.size > 1):
        with _guarded("barrier", group or _world_group()):
            dist.barrier(group=None if group is None else group.pg)


def _world_group() -> Group:
    """The default group, described (for failures of a call given no Group)."""
    n = dist.get_world_size()
    return Group(ranks=list(range(n)), nodes=[0] * n, pg=None, rank_index=dist.get_rank(),
                 name="world")


# ------------------------------------------------------------------ reading counters
def _gather_objects(world: Group, local) -> list:
    """Every member's `local` (a small picklable object), in member order."""
    if world.size == 1:
        return [local]
    gathered = [None] * world.size
    LAST_ENTERED[:] = ["all_gather_object (objects)", time.time()]
    with _guarded("objects", world):
        dist.all_gather_object(gathered, local, group=world.pg)
    return gathered


def all_gather_objects(world: Group, local) -> list:
    """Collective over `world`: every member's small picklable `local`, in member order
    (not counted in the traffic statistics: log-time metadata, not training traffic)."""
    return _gather_objects(world, local)


def per_node_totals(world: Group, stats: CommStats = STATS) -> dict[int, dict[str, dict[str, int]]]:
    """Collective over `world`: {node: {phase: {intra_node, inter_node}}} summed per node."""
    gathered = _gather_objects(world, stats.snapshot())
    out: dict[int, dict[str, dict[str, int]]] = {}
    for node, snap in zip(world.nodes, gathered):
        node_d = out.setdefault(node, {})
        for phase, links in snap.items():
            d = node_d.setdefault(phase, {INTRA: 0, INTER: 0})
            for k, v in links.items():
                d[k] += v
    return out


def mean_seconds(world: Group, stats: CommStats = STATS) -> dict[str, float]:
    """Collective over `world`: {phase: seconds} averaged over the ranks of `world`."""
    gathered = _gather_objects(world, stats.seconds_snapshot())
    out: dict[str, float] = defaultdict(float)
    for snap in gathered:
        for phase, sec in snap.items():
            out[phase] += sec / len(gathered)
    return dict(sorted(out.items()))


@contextlib.contextmanager
def counting(stats: CommStats = STATS):
    """Reset the counters, run the block, leave the counts in `stats`."""
    stats.reset()
    yield stats
