"""Gradient (and weight) syncs the pipeline split creates, for the plain non-ZeRO path.

* Tied word embeddings with PP > 1: the first stage's embedding and the last stage's
  output layer are two copies of one weight (params marked ``shared_embedding``); their
  gradients are summed over ``topo.embedding`` (first + last stage of my pipeline) so
  both copies take the same optimizer step.
* Sequence parallelism: params marked ``sequence_parallel`` (norms, biases between the
  SP regions) are replicated over TP but each rank only saw its sequence slice, so
  their gradients are summed over ``topo.tp``.

Call both after the schedule and before the DP reduction / optimizer step. ZeRO engines
do the same reductions inside their own gradient path.
"""

from __future__ import annotations

import torch

from megaq.parallel import comm


def _params(model_chunks, attr: str):
    for chunk in model_chunks:
        for p in chunk.parameters():
            if getattr(p, attr, False):
                yield p


def _allreduce_grads(params, group, phase: str) -> None:
    grads = [p.grad for p in params if p.grad is not None]
    if group.size == 1 or not grads:
        return
    # One flat all-reduce instead of one per tensor.
    flat = torch.cat([g.reshape(-1) for g in grads])
    comm.all_reduce(flat, group, phase)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def _embedding_group(topo):
    """My embedding group, or None where there is nothing to tie (PP = 1, middle stages)."""
    group = getattr(topo, "embedding", None)
    return None if group is None or group.size == 1 else group


def sync_shared_embedding_grads(model_chunks, topo) -> None:
    """All-reduce .grad of `shared_embedding` params over the embedding group."""
    group = _embedding_group(topo)
    if group is None:
        return
    params = list(_params(model_chunks, "shared_embedding"))
    if not params:
        return
    # Every member must call the collective with the same size; a member missing its
    # grad (no micro-batch touched it) contributes zeros.
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    _allreduce_grads(params, group, "embedding")


def sync_shared_embedding_weights(model_chunks, topo) -> None:
    """Make the tied copies identical: broadcast the first stage's copy to the last stage.

    They are initialised identically by construction (seeded on the full shape); this is
    for safety at start-up and after loading a checkpoint that stores only one copy.
    """
    group = _embedding_group(topo)
    if group is None:
        return
    with torch.no_grad():
        for p in _params(model_chunks, "shared_embedding"):
            comm.broadcast(p.data, 0, group, "embedding")


def allreduce_sequence_parallel_grads(model_chunks, topo) -> None:
    """All-reduce .grad of `sequence_parallel` params over TP (sequence parallelism only)."""
    params = list(_params(model_chunks, "sequence_parallel"))
    _allreduce_grads(params, topo.tp, "tp")
