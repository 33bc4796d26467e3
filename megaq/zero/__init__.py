"""Data-parallel engines: ZeRO-3 (stage 3) and plain DP (stage 0); see docs/ZERO.md.

The ZeRO++ protocols plug in through the two seams documented in
megaq.zero.collectives (weight gathering, gradient reduction).
"""

from megaq.zero.config import OptimizerSettings, ZeroConfig, ZeroConfigError, check_fp8_weight_gathers
from megaq.zero.engine import ZeroEngine, build_engine
from megaq.zero.partition import wants_weight_decay

__all__ = ["OptimizerSettings", "ZeroConfig", "ZeroConfigError", "check_fp8_weight_gathers",
           "ZeroEngine", "build_engine", "wants_weight_decay"]
