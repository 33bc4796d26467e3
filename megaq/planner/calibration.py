"""The efficiency tables the step model consumes, measured on one reference GPU.

The model turns work into time with these numbers: FLOPs at a GEMM efficiency that
depends on the GEMM's shape and dtype, attention FLOPs at the attention kernel's
efficiency, bytes of element-wise, optimizer and quantization kernels at a fraction of
HBM bandwidth, a fixed cost per layer (kernel launches), and links at a fraction of
their nominal bandwidth. Efficiencies are fractions of the reference GPU's peaks; on
another GPU the same fractions of *its* peaks apply (time scales with the peak ratio).

The committed table (calibration_h200.json) is package data; ``tools/plan.py
calibrate`` regenerates it from bench_train.py / bench_kernels.py JSON.
"""

from __future__ import annotations

import bisect
import json
import math
import os
from dataclasses import MISSING, dataclass, field, fields

DEFAULT_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "calibration_h200.json")


class CalibrationError(ValueError):
    """A calibration file that cannot be read or lacks a table; one line."""


@dataclass(frozen=True)
class Calibration:
    reference_gpu: str
    # dtype ("bf16", "fp8") -> ((smallest GEMM dimension, efficiency), ...), ascending;
    # efficiency = achieved / peak of that dtype; interpolated in log(dimension)
    gemm_efficiency: dict
    attention_efficiency: float   # SDPA fwd+bwd, model FLOPs (full s x s) / 16-bit peak
    hbm_efficiency: float         # element-wise / optimizer / quantize kernels: / HBM peak
    # analytic element-wise bytes x this (eager runs unfused kernels, compiled fuses)
    elementwise_bytes_scale: dict   # {"eager": .., "compiled": ..}
    layer_overhead_s: dict          # per layer per micro-batch, fwd + bwd: launches, hooks
    optimizer_bytes_per_param: float  # HBM bytes the fused AdamW step + grad norm move
    allocator_slack: float          # reserved beyond live tensors, fraction of the peak
    link_efficiency: dict           # {"intra_node": .., "inter_node": ..} of nominal
    runtime_reserved_gib: float = 1.5  # device memory the CUDA context / NCCL take
    # HBM bytes per element of a unit's full buffer that the ZeRO++ kernels move per
    # micro-batch: {"qwz": quantize + dequantize, "qgz": the gradient path}
    quantize_bytes: dict = field(default_factory=lambda: {"qwz": 3.0, "qgz": 11.0})
    fixed_step_overhead_s: float = 0.0  # per step: data loader, loss sync, logging
    source: str = ""                # provenance: the measurements it was fitted on

    def gemm(self, dtype: str, smallest_dim: int) -> float:
        """Efficiency of a GEMM whose smallest dimension is `smallest_dim`."""
        table = self.gemm_efficiency.get(dtype) or self.gemm_efficiency["bf16"]
        dims = [d for d, _ in table]
        if smallest_dim <= dims[0]:
            return table[0][1] * max(smallest_dim, 1) / dims[0]  # tiny GEMMs: linear fall-off
        if smallest_dim >= dims[-1]:
            return table[-1][1]
        i = bisect.bisect_right(dims, smallest_dim)
        (d0, e0), (d1, e1) = table[i - 1], table[i]
        t = (math.log(smallest_dim) - math.log(d0)) / (math.log(d1) - math.log(d0))
        return e0 + t * (e1 - e0)

    def to_json(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def calibration_from_dict(d: dict, where: str = "calibration") -> Calibration:
    names = {f.name for f in fields(Calibration)}
    required = {f.name for f in fields(Calibration) if f.default is MISSING}
    missing = sorted(required - set(d))
    if missing:
        raise CalibrationError(f"{where} lacks {', '.join(missing)}; regenerate it with "
                               f"`tools/plan.py calibrate`")
    kw = {k: v for k, v in d.items() if k in names}
    kw["gemm_efficiency"] = {k: tuple(tuple(p) for p in sorted(v)) for k, v in
                             kw["gemm_efficiency"].items()}
    return Calibration(**kw)


def load_calibration(path: str | None = None) -> Calibration:
    """The calibration in `path` (default: the committed H200 one)."""
    path = path or DEFAULT_PATH
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except (OSError, ValueError) as e:
        raise CalibrationError(f"cannot read the calibration {path}: {e}") from None
    if not isinstance(d, dict):
        raise CalibrationError(f"{path} is not a calibration (a JSON object)")
    return calibration_from_dict(d, path)
