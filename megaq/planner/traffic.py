"""Bytes each collective of a step moves, per phase and link, and the time they take.

Bytes come from the ZeRO byte model (megaq.zero.zeropp.volume), which the tests hold
equal to megaq.parallel.comm's accounting: per unit and DP group, for one gather or
reduction. A step repeats them as the engine does: every micro-batch gathers each unit
in forward and again in backward and reduces its gradient (``grad_sync`` per
micro-batch, the default); with hpZ only the step's first forward gather crosses nodes,
later ones read the in-node secondary copy; with weight deltas each step sends one
quantized difference per shard and every gather is in-node.

Time: a collective's bytes go over the slowest of its links. DP groups run their
collectives at the same time, so a node's NICs carry the cross-node bytes of every
group with members on the node; an in-node link carries its GPU's own bytes. Rings take
one latency per step (n - 1 steps), all-to-all hops one per hop.
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
          "grad_reduce")
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
    for u, count in same.items():
        if cfg.stage == 0:
            add("grad_reduce", unit_phase_bytes(u, g, cfg, elem, grad_elem, backward=True)
                ["grad_reduce"], micro_batches * count)
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
        add("grad_reduce", later["grad_reduce"], micro_batches * count)
        if cfg.weight_deltas:
            add("weight_delta_gather", _weight_deltas(S, g.k, g.m, cfg), count)
    if cfg.stage == 3 and cfg.fp8_weights and fp8_tensors:
        add("weight_gather_fwd", volume.fp8_amax_reduce(fp8_tensors, g.k, g.m))
    return total


# --------------------------------------------------------------------------- time
def link_time(links: dict[str, int], g: DPGroupShape, cluster: Cluster, link_eff: dict,
              gpus_per_node: int) -> float:
    """Seconds for bytes summed over one DP group's members, every DP group at once."""
    intra_senders = max(g.n - (g.k if g.k > 1 else 0), 1)
    t_intra = links[INTRA] / intra_senders / (cluster.intra_node_bytes_per_s
                                              * link_eff[INTRA])
    t_inter = 0.0
    if links[INTER]:
        per_node = links[INTER] / g.k * g.groups_per_node
        t_inter = per_node / (cluster.inter_node_bytes_per_s * link_eff[INTER])
    return max(t_intra, t_inter)


def ring_latency(n: int, crosses_nodes: bool, cluster: Cluster) -> float:
    if n <= 1:
        return 0.0
    return (n - 1) * (cluster.inter_node_latency_s if crosses_nodes
                      else cluster.intra_node_latency_s)


def gather_time(u: UnitShape, g: DPGroupShape, cfg: ZeroConfig, elem: int, cluster: Cluster,
                link_eff: dict, backward: bool) -> float:
    """One gather of one unit (bandwidth + latency)."""
    links = unit_phase_bytes(u, g, cfg, elem, 2, backward=backward)
    phase = "weight_gather_bwd" if backward else "weight_gather_fwd"
    if cfg.stage == 0:
        return 0.0
    inter = backward and (cfg.hpz or cfg.weight_deltas) or cfg.weight_deltas
    n = cfg.hpz_partition_size if inter else g.n
    passes = 2 if (cfg.fp8_weights and u.fp8_numel) else 1
    return (link_time(links[phase], g, cluster, link_eff, cluster.gpus_per_node)
            + passes * ring_latency(n, g.k > 1 and not inter, cluster))


def reduce_time(u: UnitShape, g: DPGroupShape, cfg: ZeroConfig, grad_elem: int,
                cluster: Cluster, link_eff: dict) -> float:
    """One gradient reduction of one unit: a ring (reduce-scatter, or all-reduce under
    stage 0), or qgZ's two all-to-all hops per chunk, where chunk i's cross-node hop
    overlaps chunk i+1's in-node hop."""
    links = unit_phase_bytes(u, g, cfg, 2, grad_elem, backward=True)["grad_reduce"]
    if cfg.stage == 0:
        return (link_time(links, g, cluster, link_eff, cluster.gpus_per_node)
                + 2 * ring_latency(g.n, g.k > 1, cluster))
    if not cfg.quantized_gradients:
        return (link_time(links, g, cluster, link_eff, cluster.gpus_per_node)
                + ring_latency(g.n, g.k > 1, cluster))
    S = u.shard_numel(g.n, cfg.block_size)
    chunks = len(chunk_bounds(S, cfg.block_size, cfg.grad_chunk))
    t1 = link_time({INTRA: links[INTRA], INTER: 0}, g, cluster, link_eff, cluster.gpus_per_node)
    t2 = link_time({INTRA: 0, INTER: links[INTER]}, g, cluster, link_eff, cluster.gpus_per_node)
    lat = (cluster.intra_node_latency_s if g.m > 1 else 0.0) + (
        cluster.inter_node_latency_s if g.k > 1 else 0.0)
    return max(t1, t2) + min(t1, t2) / chunks + chunks * lat


def delta_time(u: UnitShape, g: DPGroupShape, cfg: ZeroConfig, cluster: Cluster,
               link_eff: dict) -> float:
    S = u.shard_numel(g.n, cfg.block_size)
    links = _weight_deltas(S, g.k, g.m, cfg)
    return link_time(links, g, cluster, link_eff, cluster.gpus_per_node) + (
        cluster.inter_node_latency_s if g.k > 1 else cluster.intra_node_latency_s)


@functools.lru_cache(maxsize=1024)
def _weight_deltas(S: int, k: int, m: int, cfg: ZeroConfig) -> dict[str, int]:
    return volume.weight_deltas(S, k, m, cfg)

