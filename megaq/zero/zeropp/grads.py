"""qgZ: the gradient reduce-scatter as two quantized all-to-all hops.

For a unit's full flat gradient of n*S elements (n = DP size = k nodes x m ranks per
node, S = my shard), DP rank ``a*m + j`` (node a, local index j) must end with
``sum over DP ranks / n`` of chunk ``a*m + j``:

1. reorder + quantize (int4 by default, in the int4 code ``cfg.grad_code``): row j' = chunks a'*m + j' for a' = 0..k-1,
   the part that in-node peer j' will forward to the rails;
2. in-node all-to-all over ``topo.intra`` (row j' -> local peer j');
3. dequantize the m rows, sum in fp32, requantize per chunk (one fused kernel) ->
   row a' = my node's partial sum of chunk a'*m + j;
4. cross-node all-to-all over ``topo.inter`` (row a' -> node a' on my rail);
5. dequantize the k rows, sum in fp32, times 1/n (n = DP size, not the node count),
   added into the fp32 accumulator shard.

Own rows exact (``grad_exact_own_rows``, opt-in): the row of each all-to-all that a rank
sends to itself crosses no link, so steps 3 and 5 add that row's exact fp32 values
(step 1's input, step 3's sum) to the dequantized rows of the peers, instead of
quantizing it: no byte changes, m-1 instead of m quantized contributions in hop 1 and
k-1 instead of k in hop 2. Off (the default), step 3 is one fused kernel
(dequant_reduce_quantize).

The shard is cut into chunks of ``grad_chunk`` elements (block aligned) and the two
hops are pipelined: chunk i+1's in-node all-to-all is issued before chunk i's
cross-node one is waited on. A shard that is not a multiple of the block size is
zero-padded per chunk; the padding never reaches the accumulator. One node: hop 4 is
empty and step 5 reduces hop 2's rows directly; one rank per node: hop 2 is empty
and step 1 quantizes straight into hop 4's layout (one quantization either way).

Error feedback (opt-in, ``error_feedback``): each rank keeps the residual
``x - dequant(quant(x))`` of both of its quantizations (hop 1 on the full reordered
gradient, hop 3 on its node partial sums) per (unit, chunk), in fp32 whatever the
gradient dtype (a bf16 residual stalls once it is large: tests/test_zeropp_fidelity.py),
and adds it to the same values next call; the exact own rows leave none. The
cumulative error over T calls is then one residual, not T errors. It is off by
default: the residuals are as large as each unit's full gradient on every rank
(4 bytes per parameter per rank), which undoes ZeRO-3's memory savings at scale.

Hadamard-smoothed gradients (``grad_hadamard``, opt-in): every 64 consecutive elements
of the flat gradient are multiplied by the same orthogonal H (fixed random signs, then the
normalised Walsh-Hadamard matrix; kernels/format.py) before step 1's quantization, fused
into it, and by H^T after step 5's sum, fused into the final dequantize. H is linear and
the same on every rank, and 64 divides the block, so the groups never straddle a chunk
or a block: the hops sum transformed values, and step 3's kernel is unchanged. Every
value in between (the own exact rows, the error-feedback residuals) lives in the
transformed domain; H^T is applied once, to the summed result.

Every collective here is tagged ``grad_reduce``.
"""

from __future__ import annotations

import torch

from megaq.kernels import ops
from megaq.parallel import comm
from megaq.zero.config import ZeroConfig
from megaq.zero.partition import padded

from .rails import Rails, rails_of

PHASE = "grad_reduce"


def chunk_bounds(S: int, block: int, chunk: int) -> list[tuple[int, int]]:
    """[lo, hi) per chunk over the block-padded shard; every hi - lo is a block multiple."""
    S_pad = padded(S, block)
    step = padded(min(chunk, S_pad), block)
    return [(lo, min(lo + step, S_pad)) for lo in range(0, S_pad, step)]


class QuantizedGradReducer:
    """Engine seam (megaq.zero.collectives): ``start_reduce(key, grad, out)`` quantizes
    chunk 0 of a unit's full flat gradient, posts its in-node hop and returns the
    :class:`QgzReduction` whose ``finish()`` does the rest and adds ``(sum over DP of
    my shard's slice) / n`` into ``out``.

    ``grad`` must stay untouched until then (chunks after the first are quantized from
    it in ``finish()``), and reductions must be finished in the order they were started
    on every rank (gloo and NCCL run a group's collectives in issue order).
    """

    def __init__(self, cfg: ZeroConfig, rails: Rails, intra, inter):
        """`rails`: my place in the k nodes x m ranks grid; `intra` / `inter`: the groups
        of hop 1 (my node's DP ranks) and hop 2 (my rail). A group of one member makes
        its all-to-all a local copy (tools/bench/bench_qgz_paths.py times one rank's
        compute that way)."""
        self.cfg = cfg
        self.rails = rails
        self.intra, self.inter = intra, inter
        self.n = rails.n
        self._res1: dict[tuple, torch.Tensor] = {}  # (part name, chunk) -> fp32 [n * s]
        self._res2: dict[tuple, torch.Tensor] = {}  # (part name, chunk) -> fp32 [k, s]

    @classmethod
    def for_topology(cls, topo, cfg: ZeroConfig) -> "QuantizedGradReducer":
        """The reducer of this rank's DP group (its grid checked against the layout)."""
        return cls(cfg, rails_of(topo), topo.intra, topo.inter)

    def memory_bytes(self) -> dict[str, int]:
        """Persistent memory this reducer holds (error-feedback residuals)."""
        res = sum(t.numel() * t.element_size() for d in (self._res1, self._res2) for t in d.values())
        return {"qgz_error_feedback": res}

    def reset_error_feedback(self) -> None:
        """Drop the residuals (e.g. after a checkpoint load changes the gradients' meaning)."""
        self._res1.clear()
        self._res2.clear()

    def error_feedback_state(self) -> dict[str, torch.Tensor]:
        """This rank's residuals by stable name, ``hop1|<unit>|<chunk>`` / ``hop2|...``
        (each rank quantizes its own gradient, so each rank saves its own)."""
        return {f"{hop}|{key}|{i}": t for hop, store in (("hop1", self._res1), ("hop2", self._res2))
                for (key, i), t in store.items()}

    def load_error_feedback_state(self, sd: dict[str, torch.Tensor], device) -> None:
        """Restore what error_feedback_state() returned (same layout and qgZ settings)."""
        self.reset_error_feedback()
        stores = {"hop1": self._res1, "hop2": self._res2}
        for name, t in sd.items():
            hop, rest = name.split("|", 1)
            key, i = rest.rsplit("|", 1)
            stores[hop][(key, int(i))] = t.to(device=device, dtype=torch.float32).clone()

    # ---------------------------------------------------------------------- protocol
    def start_reduce(self, key: str, grad: torch.Tensor, out: torch.Tensor) -> "QgzReduction":
        """Start reducing `grad` (the unit's padded flat gradient, n x S elements) into
        `out` (my fp32 shard of S elements, added into); `key` names the unit (its
        error-feedback residuals)."""
        n, S = self.n, out.numel()
        if grad.numel() != n * S:
            raise ValueError(f"qgZ: full gradient has {grad.numel()} elements but the DP size "
                             f"{n} x shard {S} = {n * S}; pass the unit's padded flat gradient")
        if out.dtype != torch.float32 or not out.is_contiguous():
            raise ValueError(f"qgZ: the accumulator shard must be contiguous float32 (got {out.dtype})")
        grad2d = grad.reshape(n, S)
        if n == 1:  # nothing to exchange: exact, and nothing left to finish
            out.add_(grad2d[0].to(torch.float32))
            return QgzReduction(self, key, grad2d, out, [])
        return QgzReduction(self, key, grad2d, out, chunk_bounds(S, self.cfg.block_size, self.cfg.grad_chunk))

    def _chunk_input(self, grad2d: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """Flat [n * (hi - lo)] in chunk order, zero-padded past the shard's end."""
        n, S = grad2d.shape
        if lo == 0 and hi == S:
            return grad2d.reshape(-1)
        x = torch.zeros(n, hi - lo, dtype=grad2d.dtype, device=grad2d.device)
        valid = min(hi, S) - lo
        x[:, :valid] = grad2d[:, lo:lo + valid]
        return x.reshape(-1)

    def _residual(self, store, key, i, shape, device):
        r = store.get((key, i))
        if r is None or tuple(r.shape) != tuple(shape):
            r = store[(key, i)] = torch.zeros(shape, dtype=torch.float32, device=device)
        return r

    def _issue_hop1(self, key, i, bounds, grad2d):
        """Quantize chunk i and post its in-node all-to-all; returns (recv, handle, own):
        own = my own row in fp32 ([k * s]) when own rows stay exact, else None."""
        lo, hi = bounds
        s = hi - lo
        cfg, r = self.cfg, self.rails
        had = cfg.grad_hadamard
        x = self._chunk_input(grad2d, lo, hi)
        if r.m == 1:
            # No in-node peers: quantize straight into the cross-node layout [k, P(s)].
            bits = cfg.grad_bits_inter
            if had and (cfg.error_feedback or cfg.grad_exact_own_rows):
                x = ops.hadamard(x)  # one pass; the residual / own row are in H's domain
                had = False
            own = x.reshape(r.k, s)[r.a].to(torch.float32) if cfg.grad_exact_own_rows else None
            if cfg.error_feedback:
                res = self._residual(self._res2, key, i, (r.k, s), x.device)
                y = x.reshape(r.k, s).to(torch.float32) + res
                q = ops.quantize(y, bits, cfg.block_size, cfg.grad_code)
                res.copy_(y - ops.dequantize(q, s, bits, cfg.block_size, torch.float32, cfg.grad_code))
                if own is not None:
                    res[r.a].zero_()  # my own row is used exactly: it leaves no residual
            else:
                q = ops.quantize(x.reshape(r.k, s), bits, cfg.block_size, cfg.grad_code, had)
            return q, None, own
        res = self._residual(self._res1, key, i, (x.numel(),), x.device) if cfg.error_feedback else None
        send = ops.reorder_quantize(x, r.k, r.m, cfg.grad_bits_intra, cfg.block_size, res, cfg.grad_code, had)
        own = None
        if cfg.grad_exact_own_rows:  # row j stays on this rank: keep it exact (fp32), not quantized
            own = x.reshape(r.k, r.m, s)[:, r.j].to(torch.float32)
            if had:  # the same transform the fused quantize applied, bit for bit
                own = ops.hadamard(own)
            own = own.reshape(-1)
            if res is not None:
                res.view(r.k, r.m, s)[:, r.j].zero_()
        recv = torch.empty_like(send)
        return recv, comm.all_to_all(recv, send, self.intra, PHASE, async_op=True), own

    def _issue_hop2(self, key, i, bounds, hop1):
        """Wait for chunk i's in-node rows, reduce + requantize, post the cross-node hop."""
        lo, hi = bounds
        s = hi - lo
        cfg, r = self.cfg, self.rails
        recv1, h1, own1 = hop1
        if h1 is not None:
            h1.wait()
        if r.k == 1:
            return recv1, None, cfg.grad_bits_intra, own1  # one node: the rows are final
        own2 = None
        if r.m == 1:
            send, own2 = recv1, own1
        elif cfg.error_feedback or own1 is not None:
            if own1 is not None:  # the peers' rows dequantized, plus my own row exactly
                y = _reduce_rows(recv1, r.j, r.k * s, cfg.grad_bits_intra, cfg.block_size, own1, cfg.grad_code)
            else:
                rows = ops.dequantize(recv1, r.k * s, cfg.grad_bits_intra, cfg.block_size, torch.float32,
                                      cfg.grad_code)
                y = _sum_rows(rows)
            y = y.reshape(r.k, s)
            if cfg.error_feedback:
                res = self._residual(self._res2, key, i, (r.k, s), recv1.device)
                y = y + res
            send = ops.quantize(y, cfg.grad_bits_inter, cfg.block_size, cfg.grad_code)
            if cfg.error_feedback:
                res.copy_(y - ops.dequantize(send, s, cfg.grad_bits_inter, cfg.block_size, torch.float32,
                                             cfg.grad_code))
            if own1 is not None:
                own2 = y[r.a].clone()  # my node's partial sum of my chunk: exact (no residual)
                if cfg.error_feedback:
                    res[r.a].zero_()
        else:
            send = ops.dequant_reduce_quantize(recv1, r.k, s, cfg.grad_bits_intra,
                                               cfg.grad_bits_inter, cfg.block_size, cfg.grad_code)
        recv2 = torch.empty_like(send)
        h2 = comm.all_to_all(recv2, send, self.inter, PHASE, async_op=True)
        return recv2, h2, cfg.grad_bits_inter, own2

    def _accumulate(self, bounds, hop2, out: torch.Tensor) -> None:
        """Wait for chunk i's cross-node rows, dequantize and sum them, / n, into `out`."""
        lo, hi = bounds
        recv, h, bits, own = hop2
        if h is not None:
            h.wait()
        S = out.numel()
        scale = 1.0 / self.n  # the DP size, exactly once
        if own is not None:  # the other rows dequantized plus my own exact row, then / n
            me = self.rails.j if self.rails.k == 1 else self.rails.a
            part = _reduce_rows(recv, me, hi - lo, bits, self.cfg.block_size, own, self.cfg.grad_code) * scale
            if self.cfg.grad_hadamard:
                part = ops.hadamard(part, inverse=True)
            out[lo:min(hi, S)].add_(part[:min(hi, S) - lo])
        elif hi <= S:
            ops.dequant_reduce(recv, hi - lo, bits, self.cfg.block_size, scale, out[lo:hi], self.cfg.grad_code,
                               self.cfg.grad_hadamard)
        else:  # the chunk reaches into the padding: only the real part is accumulated
            part = ops.dequant_reduce(recv, hi - lo, bits, self.cfg.block_size, scale, code=self.cfg.grad_code,
                                      hadamard=self.cfg.grad_hadamard)
            out[lo:S].add_(part[:S - lo])


class QgzReduction:
    """One unit's qgZ reduction in flight, from :meth:`QuantizedGradReducer.start_reduce`
    (which quantized chunk 0 and posted its in-node hop) to :meth:`finish`."""

    def __init__(self, reducer: QuantizedGradReducer, key: str, grad2d: torch.Tensor,
                 out: torch.Tensor, bounds: list[tuple[int, int]]):
        self.reducer, self.key, self.grad2d, self.out = reducer, key, grad2d, out
        self.bounds = bounds  # the chunks left to do ([] when finished)
        self._hop1 = reducer._issue_hop1(key, 0, bounds[0], grad2d) if bounds else None

    def finish(self) -> None:
        """The rest of the protocol, chunk by chunk, pipelined: for chunk i, chunk i+1's
        hop 1 is posted (quantize, in-node all-to-all), then chunk i's hop 2 (wait for
        its in-node rows, reduce and requantize, post the cross-node all-to-all), then
        chunk i-1's cross-node rows are waited for and accumulated into `out`. A second
        call does nothing."""
        red, key, bounds = self.reducer, self.key, self.bounds
        hop1, done = self._hop1, None  # chunk i's posted hop 1; chunk i-1's posted hop 2
        for i, chunk in enumerate(bounds):
            nxt = red._issue_hop1(key, i + 1, bounds[i + 1], self.grad2d) if i + 1 < len(bounds) else None
            hop2 = red._issue_hop2(key, i, chunk, hop1)
            if done is not None:
                red._accumulate(*done, self.out)
            done, hop1 = (chunk, hop2), nxt
        if done is not None:
            red._accumulate(*done, self.out)
        self.bounds, self._hop1 = [], None


def _reduce_rows(recv: torch.Tensor, mine: int, L: int, bits: int, block: int,
                 own: torch.Tensor, code: str) -> torch.Tensor:
    """fp32 [L]: the packed rows of ``recv`` other than row ``mine`` dequantized and
    summed in row order (one fused kernel), plus ``own`` (this rank's exact row, which
    never crossed a link and so was never quantized)."""
    # slices, not a list index: no host-to-device index copy (CUDA-graph capturable)
    rows = torch.cat([recv[:mine], recv[mine + 1:]]) if 0 < mine < recv.shape[0] - 1 else (
        recv[1:] if mine == 0 else recv[:mine])
    return ops.dequant_reduce(rows, L, bits, block, 1.0, code=code) + own


def _sum_rows(rows: torch.Tensor) -> torch.Tensor:
    """fp32 sum over dim 0 in row order (the order the fused kernel uses)."""
    acc = torch.zeros_like(rows[0])
    for r in range(rows.shape[0]):
        acc += rows[r]
    return acc

