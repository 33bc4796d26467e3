"""ZeRO++ on top of the ZeRO-3 engine: qwZ, hpZ (weights.py) and qgZ (grads.py).

Each is switched on by itself with DeepSpeed's names (see config.py). The engine
asks the factories below for its two seams:

    gatherer = make_gatherer(topo, cfg)   # qwZ and/or hpZ
    reducer  = make_reducer(topo, cfg)    # qgZ

(called by megaq.zero.collectives only when a switch of that seam is on). ``cfg`` is
the engine's ZeroConfig, the argument namespace, or a :class:`ZeroPPConfig`.
docs/ZEROPP.md holds the protocol, the error bounds and the byte model.
"""

from __future__ import annotations

from .config import ZeroPPConfig, padded
from . import volume
from .grads import QuantizedGradReducer, chunk_bounds
from .rails import RailOrderError, Rails, rails_of
from .weights import ZeroPPWeightGatherer

__all__ = [
    "ZeroPPConfig", "ZeroPPWeightGatherer", "QuantizedGradReducer", "RailOrderError", "Rails",
    "make_gatherer", "make_reducer", "zeropp_config", "rails_of", "padded",
    "chunk_bounds", "volume",
]


def zeropp_config(cfg) -> ZeroPPConfig:
    """A ZeroPPConfig from itself, the engine's ZeroConfig, or an argument namespace."""
    if isinstance(cfg, ZeroPPConfig):
        return cfg
    if hasattr(cfg, "hpz_partition_size"):
        return ZeroPPConfig.from_zero_config(cfg)
    return ZeroPPConfig.from_args(cfg)


def make_gatherer(topo, cfg) -> ZeroPPWeightGatherer:
    """The engine's weight-gather seam with qwZ and/or hpZ as switched in cfg (with
    both off it gathers exactly as plain ZeRO-3)."""
    return ZeroPPWeightGatherer(topo, zeropp_config(cfg))


def make_reducer(topo, cfg) -> QuantizedGradReducer:
    """The engine's gradient-reduce seam: qgZ (refuses when the switch is off)."""
    z = zeropp_config(cfg)
    if not z.quantized_gradients:
        raise ValueError("make_reducer: qgZ is off (--zero-quantized-gradients not given); "
                         "use the engine's plain reducer")
    return QuantizedGradReducer(topo, z)
