"""qwZ and hpZ: how a unit's full weights are gathered from the DP shards.

qwZ (``--zero-quantized-weights``): my shard is quantized blockwise (int8 by default)
once per optimizer step and cached; the all-gather over ``topo.dp`` moves the packed
buffers (payload and fp32 scales in one buffer, so one collective), and each row is
dequantized straight into the gather dtype (bf16 stays bf16). A shard that is not a
block multiple is zero-padded before quantizing; the padding is dropped on unpack.

hpZ (``--zero-hpz-partition-size h``, h > 1): once a unit's forward gather has
landed (``on_forward_gathered``), I keep my 1/h slice of the full weights *as used
in forward* (after qwZ's dequantization, so backward sees exactly forward's
weights) over ``topo.hpz``, h DP ranks inside my node. Every later gather of that
unit, backward or another micro-batch's forward, all-gathers these slices over
``topo.hpz``: in-node, unquantized. ``invalidate()`` drops every slice and every
cached packed shard; the engine calls it after each optimizer step, after a
checkpoint load and after any other write to the weights.

Memory: hpZ holds (full unit bytes) / h per unit for the units gathered since the
last invalidate; qwZ holds one packed shard per unit. ``memory_bytes()`` reports
both.
"""

from __future__ import annotations

import torch

from megaq.kernels import ops
from megaq.parallel import comm
from megaq.parallel.comm import Handle
from megaq.zero.config import ZeroConfig
from megaq.zero.partition import padded


class ZeroPPWeightGatherer:
    """Engine seam: ``start_gather(part, phase)``, ``on_forward_gathered(part)``,
    ``invalidate()``, ``memory_bytes()``.

    A partition brings its ``name`` (the key of everything cached for it), its
    ``shard`` (``S`` elements of the gather dtype, the values to gather) and its
    ``full`` buffer (``n * S`` elements, n = DP size).
    """

    def __init__(self, topo, cfg: ZeroConfig):
        self.cfg = cfg
        self.dp, self.hpz = topo.dp, topo.hpz
        self._packed: dict[str, torch.Tensor] = {}     # name -> my packed shard (qwZ)
        self._secondary: dict[str, torch.Tensor] = {}  # name -> my hpZ slice of the full unit
        self._stamp: dict[str, tuple] = {}  # name -> the shard's (storage, version) when cached

    # ------------------------------------------------------------------ engine seam
    def start_gather(self, part, phase: str) -> Handle:
        return self.start_gather_flat(part.name, part.shard, part.full, phase)

    def on_forward_gathered(self, part) -> None:
        self.keep_secondary(part.name, part.full, part.shard)

    def invalidate(self) -> None:
        """Forget every cached packed shard and hpZ slice (the shards changed)."""
        self._packed.clear()
        self._secondary.clear()
        self._stamp.clear()

    def _forget(self, key: str) -> None:
        self._packed.pop(key, None)
        self._secondary.pop(key, None)
        self._stamp.pop(key, None)

    def memory_bytes(self) -> dict[str, int]:
        nb = lambda d: sum(t.numel() * t.element_size() for t in d.values())  # noqa: E731
        return {"hpz_secondary": nb(self._secondary), "qwz_packed_shards": nb(self._packed)}

    # ---------------------------------------------------------------------- protocol
    def start_gather_flat(self, key: str, shard: torch.Tensor, full: torch.Tensor, phase: str) -> Handle:
        n, S = self.dp.size, shard.numel()
        if full.numel() != n * S:
            raise ValueError(f"ZeRO++ gather: full buffer has {full.numel()} elements, expected "
                             f"DP size {n} x shard {S} = {n * S}")
        self._drop_if_written(key, shard)
        sec = self._secondary.get(key)
        if sec is not None:  # hpZ: in-node, the weights exactly as forward used them
            return comm.all_gather(full.reshape(-1), sec, self.hpz, phase, async_op=True)
        if not self.cfg.quantized_weights:
            return comm.all_gather(full.reshape(-1), shard.reshape(-1), self.dp, phase, async_op=True)
        packed = self._packed_shard(key, shard)
        gathered = torch.empty(n * packed.numel(), dtype=torch.uint8, device=packed.device)
        h = comm.all_gather(gathered, packed, self.dp, phase, async_op=True)

        def unpack():
            B, bits = self.cfg.block_size, self.cfg.weight_bits
            rows = ops.dequantize(gathered.view(n, -1), padded(S, B), bits, B, full.dtype)
            full.reshape(n, S).copy_(rows[:, :S])

        return Handle(h, unpack)

    def keep_secondary(self, key: str, full: torch.Tensor, shard: torch.Tensor) -> None:
        """After a forward gather: keep my hpZ slice of the full weights (once per step)."""
        if not self.cfg.hpz or key in self._secondary:
            return
        self._stamp.setdefault(key, _stamp(shard))
        h = self.hpz.size
        if full.numel() % h:
            raise ValueError(f"hpZ: unit of {full.numel()} elements does not split over {h} "
                             f"ranks; pad the unit to a multiple of the DP size")
        self._secondary[key] = full.reshape(h, -1)[self.hpz.rank].clone()

    def _packed_shard(self, key: str, shard: torch.Tensor) -> torch.Tensor:
        packed = self._packed.get(key)
        if packed is None:
            B, bits, S = self.cfg.block_size, self.cfg.weight_bits, shard.numel()
            x = shard.reshape(-1)
            if S % B:
                x = torch.zeros(padded(S, B), dtype=shard.dtype, device=shard.device)
                x[:S] = shard.reshape(-1)
            packed = self._packed[key] = ops.quantize(x, bits, B)
            self._stamp.setdefault(key, _stamp(shard))
        return packed

    def _drop_if_written(self, key: str, shard: torch.Tensor) -> None:
        """Safety net for weight writes the engine did not announce with invalidate():
        every in-place write to the shard bumps its version counter. (All DP ranks
        write their shards together, so all of them drop the copies together.)"""
        st = self._stamp.get(key)
        if st is not None and st != _stamp(shard):
            self._forget(key)


def _stamp(shard: torch.Tensor) -> tuple:
    return shard.data_ptr(), shard._version
