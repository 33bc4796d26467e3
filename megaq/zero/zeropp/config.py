"""ZeRO++ settings, from the engine's ZeroConfig or the argument namespace.

The engine passes its megaq.zero.ZeroConfig (quantized_weights, hpz_partition_size,
quantized_gradients, grad_bits_intra, grad_bits_inter, block_size, error_feedback;
optional weight_bits, grad_chunk). From the command line (DeepSpeed's names):

Flags (megaq/arguments.py) -> fields:

    --zero-quantized-weights             quantized_weights    (qwZ)
    --zero-hpz-partition-size N          hpz_size             (hpZ when N > 1)
    --zero-quantized-gradients           quantized_gradients  (qgZ)
    --zero-quantized-gradients-bits B    grad_bits_intra and grad_bits_inter (default 4)
    --zero-quantization-block-size B     block                (default kernels.DEFAULT_BLOCK)
    --zero-gradient-error-feedback       error_feedback
    --zero-quantized-gradients-intra-bits B   grad_bits_intra (default: the bits above)
    --zero-quantized-gradients-quantize-own-rows   exact_own_rows = False

Optional attributes the namespace may carry (not flags yet; per-hop control):
``zero_quantized_weights_bits`` (8), ``zero_quantized_gradients_inter_bits``
(defaults to the intra bits), ``zero_quantized_gradients_chunk`` (elements of each
rank's shard per pipelined qgZ chunk).
"""

from __future__ import annotations

from dataclasses import dataclass

from megaq.kernels.format import DEFAULT_BLOCK, QMAX

# Elements of each rank's shard per qgZ chunk: big enough that one chunk's collectives
# outweigh their fixed per-call cost, small enough that a large unit gives several
# chunks whose hops overlap. Measured on 2 H200s split into 2 "nodes" over NCCL's socket
# transport (1.1B model, docs/PERFORMANCE.md "Several GPUs"): 2^20 -> 476 ms per step,
# 2^22 -> 408 ms, 2^24 -> 405 ms. A chunk never exceeds the unit's shard, so a larger
# value costs no memory beyond the unit's own gradient.
DEFAULT_GRAD_CHUNK = 1 << 22


@dataclass(frozen=True)
class ZeroPPConfig:
    quantized_weights: bool = False
    hpz_size: int = 1
    quantized_gradients: bool = False
    weight_bits: int = 8
    grad_bits_intra: int = 4
    grad_bits_inter: int = 4
    block: int = DEFAULT_BLOCK
    error_feedback: bool = False
    grad_chunk: int = DEFAULT_GRAD_CHUNK
    # qgZ: the row of each all-to-all that a rank keeps for itself never crosses a link;
    # True keeps it exact (fp32) instead of quantizing it (docs/ZEROPP.md "Fidelity").
    exact_own_rows: bool = True

    def __post_init__(self):
        for name in ("weight_bits", "grad_bits_intra", "grad_bits_inter"):
            if getattr(self, name) not in QMAX:
                raise ValueError(f"ZeRO++ {name}={getattr(self, name)} is not supported; use 8 or 4")
        if self.block <= 0 or self.block % 2:
            raise ValueError(f"ZeRO++ quantization block {self.block} must be a positive even "
                             f"number (e.g. {DEFAULT_BLOCK}); set --zero-quantization-block-size")
        if self.hpz_size < 1:
            raise ValueError(f"--zero-hpz-partition-size {self.hpz_size} must be >= 1 (1 = off)")
        if self.grad_chunk < 1:
            raise ValueError(f"qgZ chunk {self.grad_chunk} must be >= 1 element")
        if self.error_feedback and not self.quantized_gradients:
            raise ValueError("--zero-gradient-error-feedback needs --zero-quantized-gradients")

    @property
    def hpz(self) -> bool:
        return self.hpz_size > 1

    @property
    def any_on(self) -> bool:
        return self.quantized_weights or self.hpz or self.quantized_gradients

    @property
    def gatherer_needed(self) -> bool:
        return self.quantized_weights or self.hpz

    @classmethod
    def from_zero_config(cls, z) -> "ZeroPPConfig":
        """From the engine's megaq.zero.ZeroConfig (what the engine's factory passes)."""
        return cls(
            quantized_weights=bool(z.quantized_weights),
            hpz_size=int(z.hpz_partition_size),
            quantized_gradients=bool(z.quantized_gradients),
            weight_bits=int(getattr(z, "weight_bits", 8)),
            grad_bits_intra=int(z.grad_bits_intra),
            grad_bits_inter=int(z.grad_bits_inter),
            block=int(z.block_size),
            error_feedback=bool(z.error_feedback),
            grad_chunk=int(z.grad_chunk),
            exact_own_rows=bool(getattr(z, "grad_exact_own_rows", True)),
        )

    @classmethod
    def from_args(cls, args) -> "ZeroPPConfig":
        """Build from an argparse namespace (or any object with those attributes)."""
        g = lambda name, default: (getattr(args, name, None)  # noqa: E731
                                   if getattr(args, name, None) is not None else default)
        bits = g("zero_quantized_gradients_bits", 4)
        return cls(
            quantized_weights=bool(g("zero_quantized_weights", False)),
            hpz_size=int(g("zero_hpz_partition_size", 1)),
            quantized_gradients=bool(g("zero_quantized_gradients", False)),
            weight_bits=int(g("zero_quantized_weights_bits", 8)),
            grad_bits_intra=int(g("zero_quantized_gradients_intra_bits", bits)),
            grad_bits_inter=int(g("zero_quantized_gradients_inter_bits", bits)),
            block=int(g("zero_quantization_block_size", DEFAULT_BLOCK)),
            error_feedback=bool(g("zero_gradient_error_feedback", False)),
            grad_chunk=int(g("zero_quantized_gradients_chunk", DEFAULT_GRAD_CHUNK)),
            exact_own_rows=not bool(g("zero_quantized_gradients_quantize_own_rows", False)),
        )


def padded(n: int, block: int) -> int:
    """Smallest multiple of `block` that holds n elements (at least one block)."""
    return max(1, -(-n // block)) * block
