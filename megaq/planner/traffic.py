"""Bytes each collective of a step moves, per phase and link, and the time they take.

Bytes come from the ZeRO byte model (megaq.zero.zeropp.volume), which the tests hold
equal to megaq.parallel.comm's accounting: per unit and DP group, for one gather or
reduction. A step repeats them as the engine does: every micro-batch gathers each unit
in forward and again in backward and reduces its gradient (``grad_sync`` per
micro-batch, the default; stage 1 and ``last_microbatch`` reduce it once per step);
with hpZ only the step's first forward gather crosses nodes, later ones read the
in-node secondary copy; with weight deltas each step sends one quantized difference
per shard and every gather is in-node.

Time: a collective's bytes go over the slowest of its links. DP groups run their
collectives at the same time, so a node's NICs carry the cross-node bytes of every
group with members on the node; an in-node link carries its GPU's own bytes. Rings take
one latency per step (n - 1 steps); all-to-all hops and the weight-delta exchange one
per message a rank posts (a hop: one to every other member of its group; the exchange:
one per hpZ group it sends to), one after another on the sender.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from megaq.parallel.comm import INTER, INTRA
from megaq.zero.config import ZeroConfig
from megaq.zero.zeropp import volume
from megaq.zero.zeropp.grads import chunk_bounds

from .hardware import Cluster
from .shapes import UnitShape

# comm's phase tags (weight deltas: the forward gather is weight_ref_gather)
PHASES = ("weight_gather_fwd", "weight_ref_gather", "weight_delta_gather", "weight_gather_bwd",
          "grad_reduce", "weight_gather_step")
ZERO = {INTRA: 0, INTER: 0}


@dataclass(frozen=True)
class DPGroupShape:
    """A DP group laid over nodes: k nodes, m members on each; `groups_per_node` DP groups
    share a node (and its NICs)."""
    k: int
    m: int
    groups_per_node: int

    @property
    def n(self) -> int:
        return self.k * self.m


def fp8_split(u: UnitShape, dp: int, block: int) -> tuple[int, int]:
    """(S, R) of an FP8-gathered unit: E4M3 elements per rank's shard, and the longest
    rest piece (megaq.zero.zeropp.fp8_weights.rest_layout)."""
    S = u.shard_numel(dp, block)
    F = u.fp8_numel
    rest = [max(min((r + 1) * S, u.numel) - max(r * S, F), 0) for r in range(dp)]
    return S, max(rest)


@functools.lru_cache(maxsize=4096)
def unit_phase_bytes(u: UnitShape, g: DPGroupShape, cfg: ZeroConfig, elem: int, grad_elem: int,
                     *, backward: bool) -> dict[str, dict[str, int]]:
    """One micro-batch's bytes of one unit over one DP group, per phase (summed over the
    group's members, as volume.* and comm's counters give them). `backward` picks the
    gather that follows the step's first forward (hpZ's in-node gather)."""
    n, k, m = g.n, g.k, g.m
    if cfg.stage == 0:  # replicated weights; gradients all-reduced (two ring passes)
        return {"grad_reduce": volume.ring(n, k, 2 * u.numel * grad_elem)}
    S = u.shard_numel(n, cfg.block_size)
    out = {}
    if cfg.fp8_weights and u.fp8_numel:
        S8, R = fp8_split(u, n, cfg.block_size)
        gather = volume.fp8_weight_gather(S8, R, k, m, elem, cfg, backward)
    elif cfg.weight_deltas:
        gather = volume.reference_gather(S, k, m, elem, cfg)
    else:
        gather = volume.weight_gather(S, k, m, elem, cfg, backward)
    out["weight_gather_bwd" if backward else "weight_gather_fwd"] = gather
    if backward:
        out["grad_reduce"] = volume.grad_reduce(S, k, m, grad_elem, cfg)
    return out


def step_phase_bytes(units: list[UnitShape], g: DPGroupShape, cfg: ZeroConfig, elem: int,
                     grad_elem: int, micro_batches: int, fp8_tensors: int = 0
                     ) -> dict[str, dict[str, int]]:
    """One step's bytes of these units over one DP group, per phase and link."""
    total: dict[str, dict[str, int]] = {}

    def add(phase, links, times=1):
        d = total.setdefault(phase, dict(ZERO))
        for link in (INTRA, INTER):
            d[link] += times * links[link]

    same: dict[UnitShape, int] = {}  # units of equal size move equal bytes: once each
    for u in units:
        key = UnitShape("", u.numel, u.fp8_numel)
        same[key] = same.get(key, 0) + 1
    # grads_reduced_once: every unit's gradient reduced once, in finish_grad_sync
    reductions = 1 if cfg.grads_reduced_once else micro_batches
    for u, count in same.items():
        if cfg.stage == 0:
            add("grad_reduce", unit_phase_bytes(u, g, cfg, elem, grad_elem, backward=True)
                ["grad_reduce"], reductions * count)
            continue
        if cfg.weights_resident:  # stages 1, 2: one gather after the step, no per-site ones
            S = u.shard_numel(g.n, cfg.block_size)
            one = volume.step(S, g.k, g.m, elem, grad_elem, cfg)
            add("weight_gather_step", one["weight_gather_step"], count)
            add("grad_reduce", one["grad_reduce"], reductions * count)
            continue
        first = unit_phase_bytes(u, g, cfg, elem, grad_elem, backward=False)
        later = unit_phase_bytes(u, g, cfg, elem, grad_elem, backward=True)
        S = u.shard_numel(g.n, cfg.block_size)
        # the first forward gather of the step; later forwards gather like backward
        # does under hpZ (the secondary copy), like the first without it
        fwd_phase = "weight_ref_gather" if cfg.weight_deltas else "weight_gather_fwd"
        add(fwd_phase, first["weight_gather_fwd"], count)
        fwd_later = later["weight_gather_bwd"] if cfg.hpz else first["weight_gather_fwd"]
        add(fwd_phase, fwd_later, (micro_batches - 1) * count)
        add("weight_gather_bwd", later["weight_gather_bwd"], micro_batches * count)
        add("grad_reduce", later["grad_reduce"], reductions * count)
        if cfg.weight_deltas:
            add("weight_delta_gather", _weight_deltas(S, g.k, g.m, cfg), count)
    if cfg.stage == 3 and cfg.fp8_weights and fp8_tensors:
        add("weight_gather_fwd", volume.fp8_amax_reduce(fp8_tensors, g.k, g.m))
    return total


# --------------------------------------------------------------------------- time
@dataclass(frozen=True)
class LinkTime:
    """Seconds a collective keeps each link busy, and its fixed latency."""
    intra: float = 0.0
    inter: float = 0.0
    latency: float = 0.0

    @property
    def total(self) -> float:
        return max(self.intra, self.inter) + self.latency

    def __add__(self, other: "LinkTime") -> "LinkTime":
        return LinkTime(self.intra + other.intra, self.inter + other.inter,
                        self.latency + other.latency)


def overlapped(a: LinkTime, b: LinkTime, same_group: bool) -> float:
    """Two collectives in flight together: on one communicator they run one after the
    other; on two, each link carries both at once."""
    if same_group:
        return a.total + b.total
    return (a + b).total


def link_seconds(links: dict[str, int], g: DPGroupShape, cluster: Cluster, link_eff: dict,
                 latency: float = 0.0) -> LinkTime:
    """Bytes summed over one DP group's members, every DP group at once, as link time."""
    intra_senders = max(g.n - (g.k if g.k > 1 else 0), 1)
    t_intra = links[INTRA] / intra_senders / (cluster.intra_node_bytes_per_s
                                              * link_eff[INTRA])
    t_inter = 0.0
    if links[INTER]:
        per_node = links[INTER] / g.k * g.groups_per_node
        t_inter = per_node / (cluster.inter_node_bytes_per_s * link_eff[INTER])
    return LinkTime(t_intra, t_inter, latency)


def ring_latency(n: int, crosses_nodes: bool, cluster: Cluster) -> float:
    if n <= 1:
        return 0.0
    return (n - 1) * (cluster.inter_node_latency_s if crosses_nodes
                      else cluster.intra_node_latency_s)


def gather_time(u: UnitShape, g: DPGroupShape, cfg: ZeroConfig, elem: int, cluster: Cluster,
                link_eff: dict, backward: bool) -> LinkTime:
    """One gather of one unit: a ring over the DP group, or over the in-node hpZ group
    for hpZ's later gathers and every gather with weight deltas (two rings for FP8
    weight gathers: E4M3 and the rest)."""
    if cfg.stage == 0:
        return LinkTime()
    links = unit_phase_bytes(u, g, cfg, elem, 2, backward=backward)
    phase = "weight_gather_bwd" if backward else "weight_gather_fwd"
    in_node = backward and cfg.hpz or cfg.weight_deltas
    n = cfg.hpz_partition_size if in_node else g.n
    passes = 2 if (cfg.fp8_weights and u.fp8_numel) else 1
    return link_seconds(links[phase], g, cluster, link_eff,
                        passes * ring_latency(n, g.k > 1 and not in_node, cluster))


def reduce_time(u: UnitShape, g: DPGroupShape, cfg: ZeroConfig, grad_elem: int,
                cluster: Cluster, link_eff: dict) -> LinkTime:
    """One gradient reduction of one unit: a ring (reduce-scatter, or all-reduce under
    stage 0), or qgZ's two all-to-all hops per chunk, where chunk i's cross-node hop
    overlaps chunk i+1's in-node hop (each hop's link carries its bytes; the chunks add
    one chunk's shorter hop, and each hop a latency per message: m - 1 in the node,
    k - 1 across nodes)."""
    links = unit_phase_bytes(u, g, cfg, 2, grad_elem, backward=True)["grad_reduce"]
    if not cfg.quantized_gradients:
        passes = 2 if cfg.stage == 0 else 1
        return link_seconds(links, g, cluster, link_eff,
                            passes * ring_latency(g.n, g.k > 1, cluster))
    S = u.shard_numel(g.n, cfg.block_size)
    chunks = len(chunk_bounds(S, cfg.block_size, cfg.grad_chunk))
    t = link_seconds(links, g, cluster, link_eff)
    # each hop an all-to-all: one message to every other member of its group
    lat = (g.m - 1) * cluster.intra_node_latency_s + (g.k - 1) * cluster.inter_node_latency_s
    return LinkTime(t.intra, t.inter, min(t.intra, t.inter) / chunks + chunks * lat)


def delta_messages(g: DPGroupShape, cfg: ZeroConfig) -> dict[str, float]:
    """Messages one rank posts for one unit's difference exchange, per link, averaged
    over the DP group's members: one per hpZ group whose covering member is another
    rank (megaq.zero.zeropp.deltas.delta_routes), n/h - 1 or n/h. The byte count of
    one-byte differences is the message count."""
    counts = volume.weight_deltas(1, g.k, g.m, cfg, delta_elem_bytes=1)
    return {link: counts[link] / g.n for link in (INTRA, INTER)}


def delta_time(u: UnitShape, g: DPGroupShape, cfg: ZeroConfig, cluster: Cluster,
               link_eff: dict) -> LinkTime:
    """Weight deltas: each shard's packed difference to the members of every hpZ group.
    The engine posts one message per destination (one batch of point-to-point sends per
    unit); each pays its link's per-message latency, one after another on the sender,
    as a ring's steps do."""
    S = u.shard_numel(g.n, cfg.block_size)
    msgs = delta_messages(g, cfg)
    latency = (msgs[INTER] * cluster.inter_node_latency_s
               + msgs[INTRA] * cluster.intra_node_latency_s)
    return link_seconds(_weight_deltas(S, g.k, g.m, cfg), g, cluster, link_eff, latency)


def delta_kernel_bytes(u: UnitShape, g: DPGroupShape, cfg: ZeroConfig, elem: int) -> float:
    """HBM bytes one rank's weight-delta kernels move for one unit and step, as
    megaq.zero.zeropp.deltas runs them (each an eager kernel, fp32 in between): the owner
    takes shard - reference (two casts, a subtraction), quantizes it, decodes it and
    applies it to its own reference (cast, add, cast back, copy); the covering rank
    decodes and applies each of the n/h shards of its slice the same way."""
    S = u.shard_numel(g.n, cfg.block_size)
    packed = volume.delta_bytes(S, cfg) / max(S, 1)  # bytes per element on the wire
    apply = (elem + 4) + 12 + (4 + elem) + 2 * elem  # cast, add, cast back, copy
    owner = 2 * (elem + 4) + 12 + (4 + packed) + (packed + 4) + apply
    covering = (packed + 4) + apply
    return S * owner + S * (g.n // cfg.hpz_partition_size) * covering


@functools.lru_cache(maxsize=1024)
def _weight_deltas(S: int, k: int, m: int, cfg: ZeroConfig) -> dict[str, int]:
    return volume.weight_deltas(S, k, m, cfg)
