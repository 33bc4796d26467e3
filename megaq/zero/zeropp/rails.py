"""Where my DP rank sits in qgZ's node x local-index grid, checked against the groups.

qgZ's reorder kernel lays the gradient out so that chunk ``c = a*m + j`` ends on the
DP rank that is local index ``j`` on node ``a`` (k nodes, m DP ranks per node). That
is only right when the DP group's rank order *is* that grid: member ``a*m + j`` of
``topo.dp`` must be member ``j`` of node a's ``intra`` group and member ``a`` of rail
j's ``inter`` group. DeepSpeed assumes this from global ranks and silently
misplaces shards under TP/PP; we check it, for every DP group of the layout when the
layout is at hand (so every rank reaches the same verdict before any collective).
"""

from __future__ import annotations

from dataclasses import dataclass


class RailOrderError(ValueError):
    """The DP rank order does not match the node x local-index grid qgZ needs."""


@dataclass(frozen=True)
class Rails:
    k: int  # nodes spanned by my DP group
    m: int  # DP ranks of my DP group per node
    a: int  # my node's index among them
    j: int  # my local index inside the node

    @property
    def n(self) -> int:
        return self.k * self.m


def _check_grid(dp: list[int], intra: list[list[int]], inter: list[list[int]]) -> None:
    m, k = len(intra[0]), len(intra)
    problem = None
    if any(len(g) != m for g in intra) or k * m != len(dp):
        problem = f"{k} nodes with {[len(g) for g in intra]} ranks do not tile the {len(dp)} DP ranks"
    else:
        for a in range(k):
            for j in range(m):
                want = dp[a * m + j]
                if intra[a][j] != want or inter[j][a] != want:
                    problem = (f"DP member {a * m + j} is global rank {want}, but node {a} "
                               f"local index {j} is intra {intra[a][j]} / inter {inter[j][a]}")
                    break
            if problem:
                break
    if problem:
        raise RailOrderError(
            f"qgZ needs DP rank a*m+j to be local index j on node a; DP group {dp}: {problem}. "
            f"Fix: launch with node-contiguous ranks (block distribution) and a layout whose DP "
            f"groups list each node's ranks together, or turn off --zero-quantized-gradients")


def rails_of(topo) -> Rails:
    """My (k, m, a, j), after checking every DP group of the layout (or mine alone)."""
    layout = getattr(topo, "layout", None)
    if layout is not None and hasattr(layout, "dp_groups"):
        for g in layout.dp_groups():
            intra = layout.intra_groups(g)
            _check_grid(g, intra, layout.inter_groups(g))
    dp, intra, inter = topo.dp, topo.intra, topo.inter
    k, m = inter.size, intra.size
    a, j = inter.rank, intra.rank
    # My own groups, as built (the layout check above cannot see a mis-built group).
    ok = (k * m == dp.size and dp.rank == a * m + j
          and list(intra.ranks) == [dp.ranks[a * m + jj] for jj in range(m)]
          and list(inter.ranks) == [dp.ranks[aa * m + j] for aa in range(k)])
    if not ok:
        raise RailOrderError(
            f"qgZ needs DP rank a*m+j to be local index j on node a; my DP group "
            f"{list(dp.ranks)} (index {dp.rank}), intra {list(intra.ranks)} (index {j}), inter "
            f"{list(inter.ranks)} (index {a}) disagree. Fix: build intra/inter from the DP "
            f"group in DP order (megaq.parallel.topology), or turn off --zero-quantized-gradients")
    return Rails(k=k, m=m, a=a, j=j)
