"""The analytical byte model of ZeRO stages 1 to 3 and ZeRO++ for one unit, per DP group.

It follows megaq.parallel.comm's accounting: gathers and reduce-scatters are
node-contiguous rings (each member sends (g-1)/g of the full tensor to its ring
successor; one member per node sends across the node boundary), all-to-alls charge
each chunk to where its receiver lives. Returned figures are bytes *summed over the
members of one DP group* for one call, as {"intra_node": .., "inter_node": ..}.
Tests compare them with comm's counters; docs/ZEROPP.md tabulates them.
"""

from __future__ import annotations

from megaq.kernels.format import packed_len
from megaq.parallel.comm import INTER, INTRA

from megaq.zero.config import ZeroConfig
from megaq.zero.partition import padded

from .grads import chunk_bounds


def ring(size: int, nodes: int, full_bytes: int) -> dict[str, int]:
    """Bytes one ring all-gather / reduce-scatter of `full_bytes` sends, over its members."""
    if size <= 1:
        return {INTRA: 0, INTER: 0}
    per = full_bytes * (size - 1) // size
    remote = nodes if nodes > 1 else 0
    return {INTRA: per * (size - remote), INTER: per * remote}


def add(*parts: dict[str, int], times: int = 1) -> dict[str, int]:
    return {link: times * sum(p[link] for p in parts) for link in (INTRA, INTER)}


def qgz_rank(S: int, k: int, m: int, cfg: ZeroConfig) -> dict[str, int]:
    """Bytes one DP rank sends for one qgZ call on a unit of shard S (all chunks)."""
    intra = inter = 0
    for lo, hi in chunk_bounds(S, cfg.block_size, cfg.grad_chunk):
        s = hi - lo
        if m > 1:
            intra += (m - 1) * packed_len(k * s, cfg.grad_bits_intra, cfg.block_size)
        if k > 1:
            inter += (k - 1) * packed_len(s, cfg.grad_bits_inter, cfg.block_size)
    return {INTRA: intra, INTER: inter}


def weight_gather(S: int, k: int, m: int, elem: int, cfg: ZeroConfig, backward: bool) -> dict[str, int]:
    """One gather of a unit (shard S elements of `elem` bytes) over one DP group.

    backward=True: a gather after the forward one in the same step (hpZ applies).
    """
    n = k * m
    if backward and cfg.hpz:
        return reference_gather(S, k, m, elem, cfg)
    if cfg.quantized_weights:
        return ring(n, k, n * packed_len(padded(S, cfg.block_size), cfg.weight_bits, cfg.block_size))
    return ring(n, k, n * S * elem)


def fp8_weight_gather(S: int, R: int, k: int, m: int, elem: int, cfg: ZeroConfig,
                      backward: bool) -> dict[str, int]:
    """One gather of a unit with FP8 weights (megaq.zero.zeropp.fp8_weights): per rank S
    E4M3 bytes and R rest elements of `elem` bytes (rest_layout), two all-gathers."""
    n = k * m
    if backward and cfg.hpz:
        h = cfg.hpz_partition_size
        return add(ring(h, 1, n * S), ring(h, 1, n * R * elem), times=n // h)
    return add(ring(n, k, n * S), ring(n, k, n * R * elem))


def fp8_amax_reduce(tensors: int, k: int, m: int) -> dict[str, int]:
    """The once-per-step MAX all-reduce over DP of one fp32 amax per FP8 weight tensor
    (charged to weight_gather_fwd; an all-reduce is two ring passes)."""
    return ring(k * m, k, 2 * 4 * tensors)


def grad_reduce(S: int, k: int, m: int, grad_elem: int, cfg: ZeroConfig) -> dict[str, int]:
    """One gradient reduction of a unit over one DP group (plain = ring reduce-scatter)."""
    if cfg.quantized_gradients:
        return add(qgz_rank(S, k, m, cfg), times=k * m)
    return ring(k * m, k, k * m * S * grad_elem)


def delta_bytes(S: int, cfg: ZeroConfig) -> int:
    """Bytes of one shard's packed difference (weight deltas)."""
    return packed_len(padded(S, cfg.block_size), cfg.weight_delta_bits, cfg.block_size)


def weight_deltas(S: int, k: int, m: int, cfg: ZeroConfig, delta_elem_bytes: int | None = None
                  ) -> dict[str, int]:
    """Weight deltas: one unit's differences, each owner's packed shard sent to the member
    of every hpZ group that covers it (megaq.zero.zeropp.deltas.delta_routes), over one DP
    group whose member a*m + j is local index j on node a. delta_elem_bytes: bytes per
    element on the wire instead of the packed format (the exact codec sends 4).

    Counted per (hpZ slot, node) rather than per pair of ranks, O(h + k), so that it stays
    cheap at thousands of ranks: the owners r in [q*per, (q+1)*per) all send to the members
    g*h + q (g < n/h), so the sends that stay in node a are (owners of slot q on node a)
    x (destinations of slot q on node a), less the owners that are their own destination.
    """
    n, h = k * m, cfg.hpz_partition_size
    per = n // h
    P = S * delta_elem_bytes if delta_elem_bytes else delta_bytes(S, cfg)
    same_node = to_self = 0
    for q in range(h):
        lo, hi = q * per, (q + 1) * per  # the owners whose shard slot q covers
        for a in range(lo // m, (hi - 1) // m + 1):  # the nodes that hold those owners
            owners = max(0, min(hi, (a + 1) * m) - max(lo, a * m))
            same_node += owners * _count_slot(q, h, per, a * m, (a + 1) * m)
        to_self += _count_slot(q, h, per, lo, hi)
    return {INTRA: P * (same_node - to_self), INTER: P * (n * per - same_node)}


def _count_slot(q: int, h: int, groups: int, lo: int, hi: int) -> int:
    """How many of the members g*h + q (0 <= g < groups) lie in [lo, hi)."""
    first = max(0, -((q - lo) // h))            # smallest g with g*h + q >= lo
    last = min(groups, (hi - 1 - q) // h + 1) if hi > q else 0  # one past the largest
    return max(0, last - first)


def reference_gather(S: int, k: int, m: int, elem: int, cfg: ZeroConfig) -> dict[str, int]:
    """One gather of a unit from hpZ slices (hpZ's later gathers; every gather with weight
    deltas): each hpZ group all-gathers the full unit in-node."""
    h = cfg.hpz_partition_size
    return add(ring(h, 1, k * m * S * elem), times=k * m // h)


def step(S: int, k: int, m: int, elem: int, grad_elem: int, cfg: ZeroConfig) -> dict[str, dict[str, int]]:
    """Per phase, one step with one micro-batch: forward gather, backward gather, reduce.
    Weight deltas: a step after the first (the first re-synchronises with a plain forward
    gather, ``weight_gather(..., backward=False)`` without qwZ). Stages 1 and 2: the
    reduce and the one gather after the optimizer step (qwZ's when it is on)."""
    if cfg.weights_resident:
        return {
            "grad_reduce": grad_reduce(S, k, m, grad_elem, cfg),
            "weight_gather_step": weight_gather(S, k, m, elem, cfg, backward=False),
        }
    if cfg.weight_deltas:
        return {
            "weight_delta_gather": weight_deltas(S, k, m, cfg),
            "weight_ref_gather": reference_gather(S, k, m, elem, cfg),
            "weight_gather_bwd": reference_gather(S, k, m, elem, cfg),
            "grad_reduce": grad_reduce(S, k, m, grad_elem, cfg),
        }
    return {
        "weight_gather_fwd": weight_gather(S, k, m, elem, cfg, backward=False),
        "weight_gather_bwd": weight_gather(S, k, m, elem, cfg, backward=True),
        "grad_reduce": grad_reduce(S, k, m, grad_elem, cfg),
    }
