"""Tensor-parallel building blocks (Megatron style), on top of megaq.parallel.comm.

Activations are sequence-first, ``[s, b, h]``. A TP group of n ranks splits:

* ``ColumnParallelLinear``: the weight's output rows (each rank computes ``out/n``
  features of the full input). Its input is replicated over TP, or, under sequence
  parallelism, split along s and all-gathered here.
* ``RowParallelLinear``: the weight's input columns (each rank holds ``in/n`` features
  of the input, as a column-parallel layer left them); the partial outputs are
  all-reduced, or under sequence parallelism reduce-scattered along s.
* ``VocabParallelEmbedding``: the vocabulary rows; ``vocab_parallel_cross_entropy``
  computes the loss from the local logit shard without ever gathering ``[s, b, V]``.

The communication regions are autograd functions whose backward is the transposed
collective (all-reduce <-> identity, all-gather <-> reduce-scatter, split <-> gather).
Every collective goes through ``comm`` with phase tag ``"tp"``.

The GEMM of a linear layer is ``F.linear``, or the module in its ``gemm`` slot when one
is set there from outside (megaq.parallelize puts FP8 GEMMs there: megaq.parallel.fp8);
the layers themselves know one way to multiply.

Parameter attributes read by the DP / PP engines (see docs/ARCHITECTURE.md, "Model"):
``tensor_model_parallel`` (the tensor is a TP shard, with ``partition_dim`` and
``partition_stride``), ``sequence_parallel`` (replicated over TP but its gradient is
partial under sequence parallelism: the engines all-reduce it over TP before the DP
reduction), ``shared_embedding`` (tied word embedding split over pipeline stages).
"""

from __future__ import annotations

import contextlib
import math
import types
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megaq.parallel import comm
from megaq.parallel.comm import Group

PHASE = "tp"
MODEL_PARALLEL_RNG = "model-parallel-rng"
MODEL_PARALLEL_SEED_OFFSET = 2718  # Megatron's offset of the model-parallel stream


def single_rank_group() -> Group:
    """A one-member TP group (no process group needed): TP=1 on one process."""
    return Group(ranks=[0], nodes=[0], pg=None, rank_index=0)


# ------------------------------------------------------------------ tensor helpers
def divide(numerator: int, denominator: int, what: str = "size") -> int:
    if numerator % denominator:
        raise ValueError(f"{what} {numerator} is not divisible by the tensor-parallel size "
                         f"{denominator}; choose sizes divisible by --tensor-model-parallel-size")
    return numerator // denominator


def pad_vocab_size(vocab_size: int, divisible_by: int, tp_size: int) -> int:
    """Megatron's padding: round the vocab up to a multiple of divisible_by x TP."""
    multiple = divisible_by * tp_size
    return int(math.ceil(vocab_size / multiple) * multiple)


def shard_of(full: torch.Tensor, dim: int, rank: int, size: int, stride: int = 1) -> torch.Tensor:
    """This rank's TP shard of a full tensor along `dim`.

    With stride k the dimension is read as k consecutive blocks (e.g. [gate; up] of a
    SwiGLU fc1, k=2) and the rank takes its chunk of *each* block, so a fused layer
    keeps the same meaning at every TP size.
    """
    blocks = full.chunk(stride, dim=dim)
    return torch.cat([b.chunk(size, dim=dim)[rank] for b in blocks], dim=dim).contiguous()


def set_tp_attributes(param: torch.Tensor, is_parallel: bool, dim: int = 0, stride: int = 1,
                      sequence_parallel: bool = False) -> None:
    param.tensor_model_parallel = is_parallel
    param.partition_dim = dim if is_parallel else -1
    param.partition_stride = stride
    param.sequence_parallel = sequence_parallel
    if not hasattr(param, "shared_embedding"):
        param.shared_embedding = False


# ------------------------------------------------------------ raw collectives on TP
def _all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    if group.size == 1:
        return x
    x = x.contiguous()
    comm.all_reduce(x, group, PHASE)
    return x


def _gather_dim0(x: torch.Tensor, group: Group) -> torch.Tensor:
    if group.size == 1:
        return x
    x = x.contiguous()
    out = torch.empty((x.shape[0] * group.size,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    comm.all_gather(out, x, group, PHASE)
    return out


def _reduce_scatter_dim0(x: torch.Tensor, group: Group) -> torch.Tensor:
    if group.size == 1:
        return x
    x = x.contiguous()
    rows = divide(x.shape[0], group.size, "sequence length")
    out = torch.empty((rows,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    comm.reduce_scatter(out, x, group, PHASE)
    return out


def _split_dim0(x: torch.Tensor, group: Group) -> torch.Tensor:
    if group.size == 1:
        return x
    rows = divide(x.shape[0], group.size, "sequence length")
    return x[group.rank * rows:(group.rank + 1) * rows].contiguous()


def _gather_last(x: torch.Tensor, group: Group) -> torch.Tensor:
    # comm gathers flat buffers along dim 0: gather [n, ...] then move n next to the last dim.
    if group.size == 1:
        return x
    x = x.contiguous()
    out = _gather_dim0(x, group).view((group.size,) + tuple(x.shape))
    return out.movedim(0, -2).reshape(tuple(x.shape[:-1]) + (group.size * x.shape[-1],))


def _split_last(x: torch.Tensor, group: Group) -> torch.Tensor:
    if group.size == 1:
        return x
    return x.chunk(group.size, dim=-1)[group.rank].contiguous()


# ------------------------------------------------------------------ autograd regions
def _region(name: str, doc: str, forward: Callable, backward: Callable) -> type:
    """An autograd Function of (x, group): forward(x, group), backward(g, group).

    Made by types.new_class so torch names its backward node after `name`."""

    def body(ns):
        def fwd(ctx, x, group):
            ctx.group = group
            return forward(x, group)

        def bwd(ctx, g):
            return backward(g, ctx.group), None

        ns.update(__doc__=doc, __module__=__name__, forward=staticmethod(fwd), backward=staticmethod(bwd))

    return types.new_class(name, (torch.autograd.Function,), exec_body=body)


def _identity(x, group):
    return x


_CopyToTP = _region("_CopyToTP", "Identity forward; all-reduce the gradient (the input feeds n shards).",
                    _identity, lambda g, group: _all_reduce(g.clone(), group))
_ReduceFromTP = _region("_ReduceFromTP", "All-reduce forward (sum the partial outputs); identity backward.",
                        lambda x, group: _all_reduce(x.clone(), group), _identity)
_GatherFromTP = _region("_GatherFromTP", "Gather the last dim forward; keep my slice of the gradient backward.",
                        _gather_last, _split_last)
_ScatterToSP = _region("_ScatterToSP", "Keep my chunk of the sequence forward; gather the gradient backward.",
                       _split_dim0, _gather_dim0)
_ReduceScatterToSP = _region("_ReduceScatterToSP", "Reduce-scatter partial outputs along the sequence "
                             "forward; all-gather backward.", _reduce_scatter_dim0, _gather_dim0)


class _GatherFromSP(torch.autograd.Function):
    """All-gather the sequence forward.

    Backward: reduce-scatter when the consumer is tensor-parallel (each rank's
    gradient w.r.t. the full sequence is partial), else keep my chunk.
    """

    @staticmethod
    def forward(ctx, x, group, output_grad_is_partial):
        ctx.group, ctx.partial = group, output_grad_is_partial
        return _gather_dim0(x, group)

    @staticmethod
    def backward(ctx, g):
        if ctx.partial:
            return _reduce_scatter_dim0(g, ctx.group), None, None
        return _split_dim0(g, ctx.group), None, None


def copy_to_tp_region(x, group: Group):
    return x if group.size == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp_region(x, group: Group):
    return x if group.size == 1 else _ReduceFromTP.apply(x, group)


def gather_from_tp_region(x, group: Group):
    """[..., d/n] shards -> [..., d] on every rank (used by tests and generation)."""
    return x if group.size == 1 else _GatherFromTP.apply(x, group)


def scatter_to_sequence_parallel_region(x, group: Group):
    return x if group.size == 1 else _ScatterToSP.apply(x, group)


def gather_from_sequence_parallel_region(x, group: Group, output_grad_is_partial: bool = True):
    return x if group.size == 1 else _GatherFromSP.apply(x, group, output_grad_is_partial)


def reduce_scatter_to_sequence_parallel_region(x, group: Group):
    return x if group.size == 1 else _ReduceScatterToSP.apply(x, group)


# --------------------------------------------------------------------- RNG tracker
class TPRngTracker:
    """Named RNG streams that can be swapped in for the default generator.

    Megatron's rule: activations replicated over TP draw dropout masks from the
    default stream (seeded identically on every TP rank, so masks agree); activations
    split over TP (attention heads, sequence-parallel chunks) draw from the
    ``model-parallel-rng`` stream, seeded ``seed + 2718 + tp_rank`` (masks differ).

    A stream holds the CPU generator state and, once CUDA is in use in this process,
    the CUDA one (created lazily from the stream's seed, so CPU ranks on a GPU host
    never touch the GPU); ``fork()`` swaps them into the default generators and stores
    the advanced states back on exit. Nested forks of the active stream are no-ops.
    """

    def __init__(self):
        self.states: dict[str, dict[str, torch.Tensor]] = {}
        self._active: str | None = None

    def reset(self) -> None:
        self.states.clear()
        self._active = None

    def is_initialized(self) -> bool:
        return MODEL_PARALLEL_RNG in self.states

    def add(self, name: str, seed: int) -> None:
        if name in self.states:
            raise ValueError(f"RNG stream {name!r} already exists; reset the tracker first")
        self.states[name] = {"seed": torch.tensor(seed, dtype=torch.int64),
                             "cpu": torch.Generator().manual_seed(seed).get_state()}

    def get_states(self) -> dict[str, dict[str, torch.Tensor]]:
        """A copy of every stream (for checkpoints and activation recomputation)."""
        return {n: {k: v.clone() for k, v in s.items()} for n, s in self.states.items()}

    def set_states(self, states: dict[str, dict[str, torch.Tensor]]) -> None:
        self.states = {n: {k: v.clone() for k, v in s.items()} for n, s in states.items()}

    @staticmethod
    def _cuda_in_use() -> bool:
        return torch.cuda.is_available() and torch.cuda.is_initialized()

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        if self._active == name:
            yield
            return
        if name not in self.states:
            raise RuntimeError(f"RNG stream {name!r} is not seeded; call "
                               f"megaq.parallel.tensor_parallel.model_parallel_manual_seed(seed, tp_rank)")
        stream = self.states[name]
        use_cuda = self._cuda_in_use()
        saved_cpu = torch.get_rng_state()
        saved_cuda = torch.cuda.get_rng_state() if use_cuda else None
        if use_cuda and "cuda" not in stream:  # dropout on GPU tensors draws from CUDA's generator
            torch.cuda.manual_seed(int(stream["seed"]))
            stream["cuda"] = torch.cuda.get_rng_state()
        torch.set_rng_state(stream["cpu"])
        if use_cuda:
            torch.cuda.set_rng_state(stream["cuda"])
        outer, self._active = self._active, name
        try:
            yield
        finally:
            self._active = outer
            stream["cpu"] = torch.get_rng_state()
            torch.set_rng_state(saved_cpu)
            if use_cuda:
                stream["cuda"] = torch.cuda.get_rng_state()
                torch.cuda.set_rng_state(saved_cuda)


# One per process, like the default generator it shadows (which is process-global too).
_RNG_TRACKER = TPRngTracker()


def get_rng_tracker() -> TPRngTracker:
    return _RNG_TRACKER


def model_parallel_manual_seed(seed: int, tp_rank: int) -> None:
    """Seed the default stream with `seed` (identical across TP) and the model-parallel
    stream with seed + 2718 + tp_rank (distinct per TP rank). Megatron callers pass
    seed + 100 * pp_rank so pipeline stages draw different masks."""
    torch.manual_seed(seed)  # also seeds every CUDA device
    _RNG_TRACKER.reset()
    _RNG_TRACKER.add(MODEL_PARALLEL_RNG, seed + MODEL_PARALLEL_SEED_OFFSET + tp_rank)


def ensure_rng_seeded(seed: int, tp_rank: int) -> None:
    """Add the model-parallel stream if nobody seeded it yet (leaves the default alone)."""
    if not _RNG_TRACKER.is_initialized():
        _RNG_TRACKER.add(MODEL_PARALLEL_RNG, seed + MODEL_PARALLEL_SEED_OFFSET + tp_rank)


class TPDropout(nn.Module):
    """Dropout that draws from the stream matching its activations' TP layout.

    split=False: the activation is replicated over TP -> default stream, same mask
    on every TP rank. split=True: each rank holds a different piece (heads, sequence
    chunk) -> model-parallel stream, independent masks.
    """

    def __init__(self, p: float, split: bool):
        super().__init__()
        self.p, self.split = p, split

    def forward(self, x):
        if not self.training or self.p == 0.0:
            return x
        ctx = get_rng_tracker().fork() if self.split else contextlib.nullcontext()
        with ctx:
            return F.dropout(x, self.p, training=True)

    def extra_repr(self) -> str:
        return f"p={self.p}, split={self.split}"


# --------------------------------------------------------------------------- layers
InitFn = Callable[[tuple[int, ...]], torch.Tensor]  # full shape -> full fp32 tensor


class ColumnParallelLinear(nn.Module):
    """y = x A^T + b with A's output rows split over TP: y is [..., out/n] per rank.

    `init_weight(full_shape)` returns the full (un-split) weight, which is sliced here,
    so every TP size starts from the same weights. `stride` > 1 keeps fused blocks
    (e.g. SwiGLU's [gate; up]) whole per rank. With `skip_weight=True` the weight is
    passed to forward (the tied output layer uses the word embedding's). `gemm`: None
    (F.linear), or a module computing gemm(x, weight, bias) set from outside (module
    docstring).
    """

    def __init__(self, input_size: int, output_size: int, tp_group: Group, *,
                 init_weight: InitFn | None, bias: bool = True, gather_output: bool = False,
                 sequence_parallel: bool = False, stride: int = 1, skip_weight: bool = False,
                 params_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.tp_group, self.gather_output, self.sequence_parallel = tp_group, gather_output, sequence_parallel
        self.output_size_per_partition = divide(output_size, tp_group.size, "output size")
        if skip_weight:
            self.weight = None
        else:
            full = init_weight((output_size, input_size))
            self.weight = nn.Parameter(shard_of(full, 0, tp_group.rank, tp_group.size, stride).to(params_dtype))
            set_tp_attributes(self.weight, True, 0, stride)
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.output_size_per_partition, dtype=params_dtype))
            set_tp_attributes(self.bias, True, 0, stride)
        else:
            self.register_parameter("bias", None)
        self.gemm = None

    def forward(self, x, weight: torch.Tensor | None = None, **gemm_kw):
        """`gemm_kw`: for the ``gemm`` module (an FP8 GEMM's epilogue, megaq.parallel.fp8)."""
        weight = self.weight if weight is None else weight
        if self.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, self.tp_group, output_grad_is_partial=True)
        else:
            x = copy_to_tp_region(x, self.tp_group)
        y = F.linear(x, weight, self.bias) if self.gemm is None else self.gemm(x, weight, self.bias, **gemm_kw)
        return gather_from_tp_region(y, self.tp_group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """y = x A^T + b with A's input columns split over TP; x arrives split [..., in/n].

    The partial products are summed with an all-reduce, or reduce-scattered along
    the sequence under sequence parallelism. The bias is added once, after the sum;
    it is replicated, so under sequence parallelism its gradient is partial. `gemm`: as
    in ColumnParallelLinear.
    """

    def __init__(self, input_size: int, output_size: int, tp_group: Group, *,
                 init_weight: InitFn, bias: bool = True, sequence_parallel: bool = False,
                 params_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self.input_size_per_partition = divide(input_size, tp_group.size, "input size")
        full = init_weight((output_size, input_size))
        self.weight = nn.Parameter(shard_of(full, 1, tp_group.rank, tp_group.size).to(params_dtype))
        set_tp_attributes(self.weight, True, 1)
        if bias:
            self.bias = nn.Parameter(torch.zeros(output_size, dtype=params_dtype))
            set_tp_attributes(self.bias, False, sequence_parallel=sequence_parallel)
        else:
            self.register_parameter("bias", None)
        self.gemm = None

    def forward(self, x):
        # no bias here: it is added once, after the partial products are summed
        y = F.linear(x, self.weight, None) if self.gemm is None else self.gemm(x, self.weight, None)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(y, self.tp_group)
        else:
            y = reduce_from_tp_region(y, self.tp_group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Word embedding with the (padded) vocabulary split over TP.

    Takes token ids [b, s] and returns sequence-first embeddings [s, b, h]: each
    rank looks up the ids in its vocab range (zeros elsewhere), then the partial
    rows are all-reduced, or reduce-scattered along s under sequence parallelism.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, tp_group: Group, *,
                 init_weight: InitFn, sequence_parallel: bool = False,
                 params_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        per_rank = divide(num_embeddings, tp_group.size, "padded vocab size")
        self.vocab_start, self.vocab_end = tp_group.rank * per_rank, (tp_group.rank + 1) * per_rank
        full = init_weight((num_embeddings, embedding_dim))
        self.weight = nn.Parameter(shard_of(full, 0, tp_group.rank, tp_group.size).to(params_dtype))
        set_tp_attributes(self.weight, True, 0)

    def forward(self, input_ids):
        ids = input_ids.t()  # [s, b]: lay the output out sequence-first directly
        if self.tp_group.size > 1:
            outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
            local = (ids - self.vocab_start).masked_fill(outside, 0)
            emb = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        else:
            emb = F.embedding(ids, self.weight)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(emb, self.tp_group)
        return reduce_from_tp_region(emb, self.tp_group)


# ------------------------------------------------------------- cross-entropy loss
class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token loss from vocab-sharded logits; fp32 math; only [s, b] scalars cross TP.

    Columns at or beyond `vocab_size` (vocab padding) are excluded from the softmax,
    so the loss does not depend on how much padding the TP size implies.
    """

    @staticmethod
    def forward(ctx, logits, labels, group: Group, vocab_size: int | None):
        ctx.in_dtype = logits.dtype
        logits = logits.float()
        per_rank = logits.shape[-1]
        start = group.rank * per_rank
        logits_max = logits.max(dim=-1).values
        if group.size > 1:
            comm.all_reduce(logits_max, group, PHASE, op=dist.ReduceOp.MAX)
        shifted = logits - logits_max.unsqueeze(-1)  # a new tensor: safe to edit in place

        outside = (labels < start) | (labels >= start + per_rank)
        local_labels = (labels - start).masked_fill(outside, 0)
        predicted = shifted.gather(-1, local_labels.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)

        exp_logits = shifted.exp_()
        valid_here = per_rank if vocab_size is None else max(0, min(per_rank, vocab_size - start))
        if valid_here < per_rank:
            exp_logits[..., valid_here:] = 0.0
        sum_exp = exp_logits.sum(dim=-1)
        if group.size > 1:
            both = torch.stack([predicted, sum_exp])  # one all-reduce for the two sums
            comm.all_reduce(both, group, PHASE)
            predicted, sum_exp = both[0], both[1]
        loss = torch.log(sum_exp) - predicted

        softmax = exp_logits.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_labels, outside)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_labels, outside = ctx.saved_tensors
        grad = softmax  # reuse the buffer: softmax is not needed after this
        grad.scatter_add_(-1, local_labels.unsqueeze(-1), -(~outside).to(grad.dtype).unsqueeze(-1))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.in_dtype), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, tp_group: Group,
                                 vocab_size: int | None = None) -> torch.Tensor:
    """Cross-entropy per token (fp32) from this rank's logit shard [..., V/n].

    labels hold global token ids with the logits' leading shape. Padded vocab
    columns (index >= vocab_size) are excluded from the softmax.
    """
    return _VocabParallelCrossEntropy.apply(logits, labels, tp_group, vocab_size)


__all__ = [
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "TPDropout",
    "TPRngTracker", "vocab_parallel_cross_entropy", "pad_vocab_size", "shard_of",
    "copy_to_tp_region", "reduce_from_tp_region", "gather_from_tp_region",
    "scatter_to_sequence_parallel_region", "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region", "get_rng_tracker",
    "model_parallel_manual_seed", "ensure_rng_seeded", "single_rank_group",
]
