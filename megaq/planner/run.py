"""The planner as pretrain_gpt.py and tools/plan.py use it: hardware flags, the plan of
a parsed run, the metrics file's plan record and the end-of-run comparison line."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from megaq.config.flags import add_flags, flag

from .calibration import Calibration, load_calibration
from .hardware import (DEFAULT_GPU, DEFAULT_INTER_NODE_GBIT_PER_S, DEFAULT_INTER_NODE_LATENCY_S,
                       DEFAULT_INTRA_NODE_LATENCY_S, PRESETS, Cluster, HardwareError, gpu_preset,
                       preset_of_device)
from .step import PlanInput, Prediction, predict


@dataclass(frozen=True)
class HardwareFlags:
    """The machine a plan is for (pretrain_gpt.py --dry-run, tools/plan.py). With
    pretrain_gpt.py the node count defaults to the world size / --gpus-per-node."""

    FLAG_GROUP: ClassVar[str] = "hardware (for the plan: --dry-run, tools/plan.py)"

    gpu: str | None = flag(
        "--gpu", f"GPU preset: {', '.join(PRESETS)} (default: the GPU pretrain_gpt.py trains "
        f"on, where a preset describes it; else {DEFAULT_GPU})", metavar="NAME")
    num_nodes: int | None = flag(
        "--num-nodes", "nodes of the cluster (pretrain_gpt.py: default world size / "
        "--gpus-per-node; tools/plan.py: default 1)", type=int)
    inter_node_bandwidth: float = flag(
        "--inter-node-bandwidth", "Gbit/s between nodes per node, all NICs together",
        DEFAULT_INTER_NODE_GBIT_PER_S, type=float, metavar="GBIT_S")
    inter_node_latency: float = flag(
        "--inter-node-latency", "microseconds of one cross-node message",
        DEFAULT_INTER_NODE_LATENCY_S * 1e6, type=float, metavar="US")
    intra_node_bandwidth: float | None = flag(
        "--intra-node-bandwidth", "GB/s per GPU, one direction, inside a node (default: the "
        "preset's NVLink)", type=float, metavar="GB_S")
    intra_node_latency: float = flag(
        "--intra-node-latency", "microseconds of one in-node message",
        DEFAULT_INTRA_NODE_LATENCY_S * 1e6, type=float, metavar="US")

    @property
    def preset(self) -> str:
        return self.gpu or DEFAULT_GPU

    def on_device(self, device_name: str | None) -> "HardwareFlags":
        """These flags for a run training on the CUDA device `device_name`: without --gpu,
        its preset, so the end-of-run comparison is against the machine that ran."""
        detected = preset_of_device(device_name) if device_name else None
        return self if self.gpu or not detected else replace(self, gpu=detected)

    def cluster(self, num_nodes: int, gpus_per_node: int) -> Cluster:
        return Cluster(gpu_preset(self.preset), num_nodes, gpus_per_node,
                       self.inter_node_bandwidth, self.inter_node_latency * 1e-6,
                       self.intra_node_bandwidth, self.intra_node_latency * 1e-6)


def add_planning_flags(parser, dry_run: bool = True) -> None:
    """The hardware flags (and pretrain_gpt.py's --dry-run) as one --help group."""
    group = add_flags(parser, HardwareFlags)
    if dry_run:
        group.add_argument("--dry-run", action="store_true", help=(
            "check the flags, the data and tokenizer files and --load, printing every "
            "problem at once (one error: line each), else print the plan of this run on "
            "the hardware above (step time, throughput, memory per GPU; default --gpu "
            "H200, nodes from the world size); exit 0 when it fits, 2 when not or on a "
            "problem; starts no process group"))


def cluster_of_run(run, hw: HardwareFlags) -> Cluster:
    """The cluster a parsed run (megaq.config.run.RunConfig) lies on: its world size and node
    map, the hardware flags' GPU and links."""
    layout = run.parallel.layout
    if hw.num_nodes is not None and hw.num_nodes != layout.num_nodes:
        raise HardwareError(f"--num-nodes {hw.num_nodes} disagrees with the run's "
                            f"{layout.num_nodes} node(s) of {layout.ranks_per_node} "
                            f"(world size {layout.world_size}); drop --num-nodes or fix "
                            f"--gpus-per-node")
    return hw.cluster(layout.num_nodes, layout.ranks_per_node)


def plan_of_run(run, hw: HardwareFlags, cal: Calibration | None = None) -> Prediction:
    cal = cal or load_calibration()
    return predict(PlanInput.from_config(run), cluster_of_run(run, hw), cal)


def plan_record(run, hw: HardwareFlags) -> dict:
    """The metrics file's first record: {"type": "plan", ...the prediction} (or the
    reason there is none: a plan never stops a run)."""
    try:
        pred = plan_of_run(run, hw)
    except (ValueError, HardwareError) as e:
        return {"type": "plan", "error": str(e)}
    return {"type": "plan", "gpu": hw.preset, **pred.to_json()}


def comparison_line(record: dict | None, step_s: float | None, peak_bytes: int | None) -> str:
    """' plan: step 251 ms measured / 246 ms predicted (1.02x); peak memory ...'."""
    if not record or "step_time_s" not in record:
        why = (record or {}).get("error", "no plan")
        return f" plan: no prediction to compare with ({why})"
    parts = []
    pred_s = record["step_time_s"]
    if step_s:
        parts.append(f"step {step_s * 1e3:.0f} ms measured / {pred_s * 1e3:.0f} ms predicted "
                     f"({step_s / pred_s:.2f}x)")
    pred_gib = record["memory_gib"]
    if peak_bytes:  # torch's max allocated: against the prediction without allocator slack
        gib = peak_bytes / 2 ** 30
        allocated = pred_gib - record.get("memory_parts_gib", {}).get("allocator_slack", 0.0)
        parts.append(f"peak memory allocated {gib:.1f} GiB measured / {allocated:.1f} GiB "
                     f"predicted ({gib / allocated:.2f}x)")
    else:
        parts.append(f"peak memory {pred_gib:.1f} GiB predicted (not measured on CPU ranks)")
    return f" plan ({record.get('gpu', '?')}): " + "; ".join(parts)
