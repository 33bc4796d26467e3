"""ZeRO++ on top of the ZeRO-3 engine: qwZ, hpZ (weights.py), qgZ (grads.py), and
weight deltas over hpZ's persistent references (deltas.py).

Each is switched on by itself with DeepSpeed's names, as fields of the engine's
megaq.zero.ZeroConfig. megaq.zero.collectives picks these classes for its two seams
(``make_gatherer`` / ``make_reducer``) when a switch is on. docs/ZEROPP.md holds the
protocol, the error bounds and the byte model (volume.py).
"""

from __future__ import annotations

from megaq.zero.partition import padded

from . import volume
from .grads import QuantizedGradReducer, chunk_bounds
from .rails import RailOrderError, Rails, rails_of
from .fp8_weights import FP8WeightGatherer
from .weights import ZeroPPWeightGatherer
from .deltas import WeightDeltaGatherer

__all__ = [
    "ZeroPPWeightGatherer", "FP8WeightGatherer", "WeightDeltaGatherer", "QuantizedGradReducer",
    "RailOrderError", "Rails", "rails_of", "padded", "chunk_bounds", "volume",
]
