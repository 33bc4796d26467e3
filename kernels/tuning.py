"""How the Triton kernels launch: one immutable value, the production settings as its
defaults.

A Triton implementation takes it as its keyword-only ``tuning`` argument (default
:data:`DEFAULT_TUNING`); megaq's own calls never pass one. The benchmarks and tests that
try other launches build a :class:`Tuning` and pass it down explicitly, e.g.
``quant.quantize(x, 8, block, tuning=Tuning(cached_launch=False))``. Nothing swaps a
setting at run time.

No setting changes what the quantization kernels compute: every one writes the
reference's bytes (tests/test_kernels.py). The fused model kernels' settings change at
most the order of fp32 roundings (within the tolerances of tests/test_fused_kernels.py).
The launch rules that nobody varies stay beside their kernels (kernels/quant.py's
QUANTIZE_PER_THREAD and the like, the fused kernels' block sizes).
"""

from __future__ import annotations

import dataclasses
import types
from typing import Mapping

# The quantize kernel's input is read once: below these many elements (per output
# width) its loads are marked evict-first. Per call (L2 flushed, in the same rounds as
# DeepSpeed's kernels on the H200; docs/PERFORMANCE.md, "Per call") that wins at 16M
# elements for int8 and at 16M and 32M for int4 (quantize4 and reorder_quantize4, 4-10%),
# ties at 64M and loses above. The price is graph replay of the int4 quantize at 16M,
# where back-to-back calls find their input in the L2 (down 15-19%).
EVICT_FIRST_BELOW = types.MappingProxyType({8: 1 << 25, 4: 1 << 26})
# From this many elements the int8 quantize of one row (a qwZ shard, the benchmark's
# case) moves its data with bulk tensor copies on Hopper: 0.8-1.3% faster than the
# register path from 64M in graph replay and as fast or faster per call; at 32M no faster
# per call, and its host path is longer (Triton encodes the copy descriptors in Python
# every call; docs/PERFORMANCE.md, "Per call"). One program moves one block with 4 warps.
BULK_COPIES_FROM = 1 << 26


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity: a cheap key for quant.py's plans
class Tuning:
    """Launch settings. Make one per setting and reuse it: kernels/quant.py memoises its
    launch plans per Tuning object.

    The quantization kernels (kernels/quant.py):
    warps / nb: warps and blocks per program (None: from the sizes, quant._launch_opts).
    The quantize kernel: chunked: reads every 64-group as 8 chunk tiles (the fused
    Hadamard transform's layout; blocks that are multiples of 64); evict: its input
    loads, "evict_first" or "" (None: evict-first below evict_first_below[bits]
    elements); tma: the int8 quantize of one row through bulk tensor copies
    (quant._quantize8_tma; None: from bulk_copies_from elements on Hopper).
    The int4 word kernels: words: used at all (False: the byte kernel); magic: their
    int -> float by the exponent trick (_nibble; False: conversion instructions).
    cached_launch: kernels/launch.py's launchers (False: every call through Triton's
    JIT, the benchmark's comparison). regs: registers a thread may use (Triton's
    maxnreg; 0: no cap; None: quant.QUANTIZE8_SMALL_REGS where that shape applies).

    The fused model kernels (kernels/fused_*_triton.py):
    fp_fusion: multiply-adds contract to FMAs, as Triton up to 3.9 does by default (3.9
    warns that 3.10 turns the default off). The figures in docs/PERFORMANCE.md were
    measured so, and the tests' tolerances hold either way; said here so that a Triton
    upgrade changes neither. (The quantization kernels and the fused AdamW always pass
    False: their results are defined bit for bit by plain fp32 roundings.)
    ce_fwd_block / ce_bwd_block: the vocabulary chunk of one cross-entropy program
    (forward: streamed with an online max and sum; backward: one chunk a program), at
    most the vocabulary's next power of two."""

    warps: int | None = None
    nb: int | None = None
    chunked: bool = False
    evict: str | None = None
    evict_first_below: Mapping[int, int] = dataclasses.field(default_factory=lambda: EVICT_FIRST_BELOW)
    tma: bool | None = None
    bulk_copies_from: int = BULK_COPIES_FROM
    words: bool = True
    magic: bool = True
    cached_launch: bool = True
    regs: int | None = None
    fp_fusion: bool = True
    ce_fwd_block: int = 2048
    ce_bwd_block: int = 4096


DEFAULT_TUNING = Tuning()  # the production launch
