"""Rank grid (TP x DP x PP) and node map -> every process group megaq uses.

Rank order follows Megatron: TP varies fastest, then DP, then PP:

    rank = tp_rank + tp * (dp_rank + dp * pp_rank)          (order "tp-dp-pp", default)

or, as Megatron's ``--use-tp-pp-dp-mapping``, DP outermost:

    rank = tp_rank + tp * (pp_rank + pp * dp_rank)          (order "tp-pp-dp")

With the default order and PP > 1, each pipeline stage fills a contiguous block of
ranks, so on 2 nodes a stage's DP groups never leave one node; "tp-pp-dp" spreads
every DP group over all nodes (what ZeRO++'s cross-node paths need).

Nodes hold contiguous global ranks (`ranks_per_node` each), which is what torchrun
and slurm's block distribution give. Inside each DP group we build the ZeRO++
subgroups from the *global ranks of that DP group* (DeepSpeed builds them from
global ranks, which is wrong as soon as TP or PP > 1):

- ``intra``: the members of this DP group that share my node (qgZ hop 1);
- ``inter``: the members with my local index on every node ("rails", qgZ hop 2);
- ``hpz``:   consecutive chunks of ``intra`` of hpZ's size (hpZ secondary shard). That size
  is a ZeRO setting (ZeroConfig.hpz_partition_size, its one home): build_topology takes
  it as an argument, and the Layout does not hold it.

Everything that decides membership is a pure function of a :class:`Layout`, so it
can be tested without starting any process; :func:`build_topology` then creates the
torch.distributed groups (every rank creates every group, in the same order, as
``new_group`` requires).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta

from megaq.parallel.comm import CommTiming, Group


class LayoutError(ValueError):
    """An impossible parallel layout; the message names the problem and the fix."""


@dataclass(frozen=True)
class Layout:
    world_size: int
    tp: int = 1
    pp: int = 1
    ranks_per_node: int | None = None  # None: the whole world is one node
    order: str = "tp-dp-pp"  # or "tp-pp-dp" (Megatron's --use-tp-pp-dp-mapping)

    def __post_init__(self):
        if self.ranks_per_node is None:
            object.__setattr__(self, "ranks_per_node", self.world_size)
        validate_layout(self)

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp)

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(tp_rank, dp_rank, pp_rank) of a global rank."""
        t, rest = rank % self.tp, rank // self.tp
        if self.order == "tp-dp-pp":
            return t, rest % self.dp, rest // self.dp
        return t, rest // self.pp, rest % self.pp

    def rank_at(self, tp_rank: int, dp_rank: int, pp_rank: int) -> int:
        if self.order == "tp-dp-pp":
            return tp_rank + self.tp * (dp_rank + self.dp * pp_rank)
        return tp_rank + self.tp * (pp_rank + self.pp * dp_rank)

    # ---- group membership (lists of global ranks) -------------------------------
    def tp_groups(self) -> list[list[int]]:
        return [[self.rank_at(t, d, p) for t in range(self.tp)]
                for p in range(self.pp) for d in range(self.dp)]

    def dp_groups(self) -> list[list[int]]:
        return [[self.rank_at(t, d, p) for d in range(self.dp)]
                for p in range(self.pp) for t in range(self.tp)]

    def pp_groups(self) -> list[list[int]]:
        return [[self.rank_at(t, d, p) for p in range(self.pp)]
                for d in range(self.dp) for t in range(self.tp)]

    def embedding_groups(self) -> list[list[int]]:
        """First and last stage of each PP group (tied embeddings); every middle stage
        gets a group of its own, so each rank belongs to exactly one."""
        out = []
        for g in self.pp_groups():
            out.append([g[0], g[-1]] if len(g) > 1 else [g[0]])
            out.extend([r] for r in g[1:-1])
        return out

    def intra_groups(self, dp_group: list[int]) -> list[list[int]]:
        """Split one DP group by node (node order, rank order inside a node)."""
        by_node: dict[int, list[int]] = {}
        for r in dp_group:
            by_node.setdefault(self.node_of(r), []).append(r)
        return [by_node[n] for n in sorted(by_node)]

    def inter_groups(self, dp_group: list[int]) -> list[list[int]]:
        intra = self.intra_groups(dp_group)
        return [[members[i] for members in intra] for i in range(len(intra[0]))]

    def hpz_groups(self, dp_group: list[int], h: int) -> list[list[int]]:
        """Consecutive chunks of h ranks of each node's part of one DP group."""
        return [m[i:i + h] for m in self.intra_groups(dp_group) for i in range(0, len(m), h)]


def validate_layout(layout: Layout) -> None:
    w, tp, pp, rpn = layout.world_size, layout.tp, layout.pp, layout.ranks_per_node
    if layout.order not in ("tp-dp-pp", "tp-pp-dp"):
        raise LayoutError(f"unknown rank order {layout.order!r}; use 'tp-dp-pp' (Megatron's "
                          f"default) or 'tp-pp-dp' (--use-tp-pp-dp-mapping)")
    if min(w, tp, pp, rpn) < 1:
        raise LayoutError(f"world size, TP, PP and ranks per node must be >= 1 "
                          f"(got world={w}, tp={tp}, pp={pp}, ranks_per_node={rpn})")
    if w % (tp * pp):
        raise LayoutError(f"world size {w} is not divisible by TP x PP = {tp} x {pp} = {tp * pp}; "
                          f"choose sizes whose product divides the number of ranks")
    if w % rpn:
        raise LayoutError(f"world size {w} is not a multiple of the ranks per node {rpn}; "
                          f"set --gpus-per-node to a divisor of the world size")
    # Every DP group must have the same number of members on each node it touches
    # (qgZ's two hops and the hpZ partition assume a rectangular node x local grid).
    for g in layout.dp_groups():
        counts = sorted({len(m) for m in layout.intra_groups(g)})
        if len(counts) > 1:
            raise LayoutError(
                f"DP group {g} has an uneven number of ranks per node ({counts}); with "
                f"TP={tp}, PP={pp} and {rpn} ranks per node, pick --gpus-per-node divisible by "
                f"TP ({tp}) whose DP groups split evenly over nodes, or change the rank order "
                f"(--use-tp-pp-dp-mapping)")


def check_hpz_size(layout: Layout, hpz_size: int) -> None:
    """hpZ's groups split each node's part of every DP group into chunks of hpz_size."""
    if hpz_size < 1:
        raise LayoutError(f"--zero-hpz-partition-size {hpz_size} must be >= 1 (1 = off)")
    for g in layout.dp_groups():
        per_node = len(layout.intra_groups(g)[0])  # the same on every node (validate_layout)
        if per_node % hpz_size:
            raise LayoutError(
                f"--zero-hpz-partition-size {hpz_size} does not divide the {per_node} DP "
                f"ranks per node of DP group {g}; use a divisor of {per_node}")


def check_model_fits_tp(tp: int, num_heads: int, num_query_groups: int | None = None) -> None:
    if num_heads % tp:
        raise LayoutError(f"--num-attention-heads {num_heads} is not divisible by "
                          f"--tensor-model-parallel-size {tp}; use a TP size dividing the heads")
    if num_query_groups is not None and num_query_groups % tp:
        raise LayoutError(f"--num-query-groups {num_query_groups} is not divisible by "
                          f"--tensor-model-parallel-size {tp}; use a TP size dividing the groups")


def ranks_per_node_from_env(world_size: int, rank: int, gpus_per_node: int | None = None) -> int:
    """The node map: --gpus-per-node, else torchrun's, else slurm's, else one node.

    When the launcher also says which node this rank is on (GROUP_RANK, SLURM_NODEID)
    we check it agrees with contiguous placement instead of silently mis-grouping.
    """
    if gpus_per_node:
        return gpus_per_node
    env = os.environ
    if "LOCAL_WORLD_SIZE" in env:
        n, node_var = int(env["LOCAL_WORLD_SIZE"]), "GROUP_RANK"
    elif "SLURM_NTASKS_PER_NODE" in env:
        # slurm writes e.g. "4" or "4(x2)"
        n, node_var = int(env["SLURM_NTASKS_PER_NODE"].split("(")[0]), "SLURM_NODEID"
    else:
        return world_size
    if node_var in env and int(env[node_var]) != rank // n:
        raise LayoutError(f"rank {rank} is on node {env[node_var]} ({node_var}) but contiguous "
                          f"placement of {n} ranks per node puts it on node {rank // n}; launch "
                          f"with block distribution or pass --gpus-per-node")
    return n


@dataclass
class Topology:
    """The groups this rank belongs to, plus its coordinates."""

    layout: Layout
    rank: int
    tp: Group
    dp: Group
    pp: Group
    embedding: Group
    intra: Group   # DP ranks of my DP group on my node
    inter: Group   # DP ranks of my DP group with my local index, one per node
    hpz: Group     # hpZ partition (a slice of intra; one rank when hpZ is off)
    world: Group
    # the process-group timeout every group here got (--distributed-timeout-minutes);
    # groups made later for this topology (DCP's checkpoint group) take it too
    timeout: timedelta | None = None
    # --log-comm-time: whether collectives on these groups run synchronously and timed
    # (every group above holds this object; the training loop switches it for its run)
    comm_timing: CommTiming = field(default_factory=CommTiming)

    @property
    def tp_rank(self) -> int:
        return self.layout.coords(self.rank)[0]

    @property
    def dp_rank(self) -> int:
        return self.layout.coords(self.rank)[1]

    @property
    def pp_rank(self) -> int:
        return self.layout.coords(self.rank)[2]

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.layout.pp - 1


def build_topology(layout: Layout, rank: int, hpz_size: int = 1,
                   timeout: timedelta | None = None) -> Topology:
    """Create every process group (collectively) and keep the ones holding `rank`;
    hpz_size: the hpZ groups' size (ZeroConfig.hpz_partition_size; 1 = hpZ off);
    timeout: every group's process-group timeout (launch.group_timeout; None: torch's).

    torch.distributed must already be initialised with `layout.world_size` ranks. `timeout`
    is the process-group timeout (the world group's, --distributed-timeout-minutes);
    None leaves torch's default for new groups.
    """
    check_hpz_size(layout, hpz_size)
    mine: dict[str, Group] = {}
    timing = CommTiming()  # off; shared by every group of this topology

    def make(kind: str, groups: list[list[int]]):
        for ranks in groups:
            g = Group.create(ranks, layout.node_of, name=kind, timeout=timeout, timing=timing)
            if rank in ranks:
                mine[kind] = g

    make("tp", layout.tp_groups())
    make("dp", layout.dp_groups())
    make("pp", layout.pp_groups())
    make("embedding", layout.embedding_groups())
    for dp_group in layout.dp_groups():
        make("intra", layout.intra_groups(dp_group))
        make("inter", layout.inter_groups(dp_group))
        make("hpz", layout.hpz_groups(dp_group, hpz_size))
    world = Group.create(list(range(layout.world_size)), layout.node_of, world=True, timing=timing)
    return Topology(layout=layout, rank=rank, world=world, timeout=timeout, comm_timing=timing,
                    **mine)
