"""What the planner knows of a machine: a GPU's peaks and a cluster's links.

A :class:`GPU` preset holds vendor datasheet figures for the SXM parts (dense tensor-core
throughput, no 2:4 sparsity), the device memory as the driver reports it (what a run can
allocate from), HBM bandwidth, and the in-node link per GPU in one direction (NVLink's
quoted "total" figure counts both directions, so it is halved here). A :class:`Cluster`
adds the node count and the links between nodes; every link figure can be overridden
from the command line (tools/plan.py, pretrain_gpt.py --dry-run).
"""

from __future__ import annotations

from dataclasses import dataclass, replace


class HardwareError(ValueError):
    """An unknown preset or an impossible hardware description; one line, with the fix."""


@dataclass(frozen=True)
class GPU:
    name: str
    peak_bf16_tflops: float     # dense 16-bit tensor-core peak (V100: fp16, it has no bf16)
    peak_fp8_tflops: float      # dense FP8 peak; 0 where the GPU has no FP8 tensor cores
    hbm_gib: float              # device memory a process can allocate from (driver's total)
    hbm_gb_per_s: float         # HBM bandwidth, GB/s (10^9 bytes)
    intra_node_gb_per_s: float  # NVLink per GPU, one direction, GB/s
    gpus_per_node: int = 8      # the usual board (HGX / DGX)


# Sources: NVIDIA's datasheets (V100: "NVIDIA Tesla V100 GPU Architecture" whitepaper,
# SXM2; A100: "NVIDIA A100 Tensor Core GPU" datasheet, SXM; H100 / H800: "NVIDIA H100
# Tensor Core GPU" datasheet and the H800 SXM5 product brief (NVLink 400 GB/s); H200:
# "NVIDIA H200 Tensor Core GPU" datasheet). Memory: the MiB nvidia-smi reports for the
# part (V100 32510, A100-40GB 40960, A100-80GB 81920, H100/H800 81559, H200 143771).
PRESETS: dict[str, GPU] = {g.name: g for g in (
    # V100 has no bf16: its 125 TFLOP/s are fp16 tensor cores (what the ZeRO++ paper used)
    GPU("V100-32GB", 125.0, 0.0, 32510 / 1024, 900.0, 150.0, 8),
    GPU("A100-40GB", 312.0, 0.0, 40.0, 1555.0, 300.0, 8),
    GPU("A100-80GB", 312.0, 0.0, 80.0, 2039.0, 300.0, 8),
    GPU("H100-SXM", 989.4, 1978.9, 81559 / 1024, 3350.0, 450.0, 8),
    GPU("H800", 989.4, 1978.9, 81559 / 1024, 3350.0, 200.0, 8),
    GPU("H200", 989.4, 1978.9, 143771 / 1024, 4800.0, 450.0, 8),
)}

# Between nodes, when not given: one 400 Gbit/s NIC per node (NDR InfiniBand / 400GbE),
# and the latencies of one small message on such fabrics (NCCL's base latencies are a
# few microseconds in-node, ~10 us across InfiniBand).
DEFAULT_INTER_NODE_GBIT_PER_S = 400.0
DEFAULT_INTER_NODE_LATENCY_S = 10e-6
DEFAULT_INTRA_NODE_LATENCY_S = 3e-6


DEFAULT_GPU = "H200"


def preset_of_device(device_name: str) -> str | None:
    """The preset of a CUDA device as torch names it (``"NVIDIA H100 80GB HBM3"`` ->
    ``"H100-SXM"``); None for a part no preset describes (PCIe and NVL boards: other
    clocks, memory and links; the Grace Hopper GH200; a 16 GB V100)."""
    name = device_name.upper()
    if any(other in name for other in ("PCIE", "NVL", "GH200")):
        return None
    for part, preset in (("H200", "H200"), ("H800", "H800"), ("H100", "H100-SXM"),
                         ("V100", "V100-32GB" if "32GB" in name else None)):
        if part in name:
            return preset
    if "A100" in name:
        return "A100-80GB" if "80GB" in name else "A100-40GB"
    return None


def gpu_preset(name: str) -> GPU:
    """The preset called `name` (case-insensitive)."""
    for key, gpu in PRESETS.items():
        if key.lower() == str(name).lower():
            return gpu
    raise HardwareError(f"--gpu {name!r} is not a known preset; use one of "
                        f"{', '.join(PRESETS)}")


@dataclass(frozen=True)
class Cluster:
    gpu: GPU
    num_nodes: int = 1
    gpus_per_node: int = 8
    inter_node_gbit_per_s: float = DEFAULT_INTER_NODE_GBIT_PER_S  # per node, all NICs
    inter_node_latency_s: float = DEFAULT_INTER_NODE_LATENCY_S
    intra_node_gb_per_s: float | None = None  # per GPU, one direction; None: the preset's
    intra_node_latency_s: float = DEFAULT_INTRA_NODE_LATENCY_S

    def __post_init__(self):
        if self.intra_node_gb_per_s is None:
            object.__setattr__(self, "intra_node_gb_per_s", self.gpu.intra_node_gb_per_s)
        for name, minimum in (("num_nodes", 1), ("gpus_per_node", 1)):
            if getattr(self, name) < minimum:
                raise HardwareError(f"--{name.replace('_', '-')} must be >= {minimum} "
                                    f"(got {getattr(self, name)})")
        for name, flag in (("inter_node_gbit_per_s", "--inter-node-bandwidth"),
                           ("intra_node_gb_per_s", "--intra-node-bandwidth")):
            if not getattr(self, name) > 0:
                raise HardwareError(f"{flag} must be > 0 (got {getattr(self, name)})")
        for name, flag in (("inter_node_latency_s", "--inter-node-latency"),
                           ("intra_node_latency_s", "--intra-node-latency")):
            if not getattr(self, name) >= 0:
                raise HardwareError(f"{flag} must be >= 0 (got {getattr(self, name)})")

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.gpus_per_node

    @property
    def inter_node_bytes_per_s(self) -> float:
        """One node's cross-node bandwidth, bytes/s, one direction."""
        return self.inter_node_gbit_per_s * 1e9 / 8

    @property
    def intra_node_bytes_per_s(self) -> float:
        return self.intra_node_gb_per_s * 1e9

    def with_nodes(self, num_nodes: int) -> "Cluster":
        return replace(self, num_nodes=num_nodes)

    def describe(self) -> str:
        return (f"{self.num_nodes} node(s) x {self.gpus_per_node} {self.gpu.name}, "
                f"{self.intra_node_gb_per_s:g} GB/s in-node per GPU, "
                f"{self.inter_node_gbit_per_s:g} Gbit/s between nodes per node")
