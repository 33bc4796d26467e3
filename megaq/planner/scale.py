"""Internet scale on paper: megaq's step at 1,024-16,384 GPUs over slow links between sites.

A Llama-3-70B-shaped model (80 layers, hidden 8192, GQA 8, sequence 4096, full
recompute) on H100 nodes of 8, every node's cross-node bandwidth limited to 10, 25, 50
or 100 Gbit/s (a site-to-site share), with 400 Gbit/s (one datacenter NIC) as the
reference. Weak scaling: every GPU keeps the same tokens per step (16,384, micro-batches
of 4 sequences), so a perfect
system holds its per-GPU throughput as GPUs are added.

For each configuration and link the study reports model FLOP utilisation by GPU count,
the GPU count where scaling efficiency (per-GPU throughput against the smallest run)
first falls under 80% ("stops scaling"), and the largest term of the step besides the
GEMMs where it does (the next bottleneck), from the model's own breakdown.
"""

from __future__ import annotations

import os

from megaq.planner.calibrate import RESULTS, _predict

OUT = os.path.join(RESULTS, "planner_internet_scale.json")
GPU = "H100-SXM"
GPUS_PER_NODE = 8
GPU_COUNTS = (1024, 2048, 4096, 8192, 16384)
LINKS_GBIT = (10, 25, 50, 100, 400)
TOKENS_PER_GPU = 16384
MICRO_BATCH = 4  # sequences of 4096: 16K tokens per micro-batch, full recompute
STOPS_BELOW = 0.8
MODEL = ["--num-layers", "80", "--hidden-size", "8192", "--num-attention-heads", "64",
         "--group-query-attention", "--num-query-groups", "8", "--ffn-hidden-size", "28672",
         "--seq-length", "4096", "--max-position-embeddings", "4096", "--vocab-size", "128256",
         "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
         "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--bf16",
         "--recompute-granularity", "full", "--recompute-method", "uniform",
         "--recompute-num-layers", "1", "--micro-batch-size", str(MICRO_BATCH),
         "--lr", "1e-4", "--train-iters", "10", "--mock-data"]
# name -> (TP, PP, layout / switch flags)
CONFIGS = {
    "ZeRO-3": (1, 1, ["--zero-stage", "3"]),
    "ZeRO++": (1, 1, ["--zero-stage", "3", "--zero-quantized-weights",
                      "--zero-hpz-partition-size", str(GPUS_PER_NODE),
                      "--zero-quantized-gradients"]),
    "weight deltas": (1, 1, ["--zero-stage", "3", "--zero-hpz-partition-size", str(GPUS_PER_NODE),
                             "--zero-weight-deltas", "--zero-quantized-gradients"]),
    "TP8 + ZeRO-3": (8, 1, ["--zero-stage", "3"]),
    "TP8 + PP8 + ZeRO-0": (8, 8, ["--zero-stage", "0"]),
    "TP8 + PP8 + ZeRO-0, last_microbatch": (8, 8, ["--zero-stage", "0",
                                                   "--zero-grad-sync", "last_microbatch"]),
}
# the step's terms besides the GEMMs, in the model's breakdown, named for a reader
TERMS = {"weight_gather_fwd": "cross-node weight gathers (forward)",
         "weight_gather_bwd": "weight gathers (backward)",
         "weight_delta_gather": "weight-delta gathers",
         "grad_reduce": "gradient reduction", "tp": "tensor-parallel collectives",
         "pp": "pipeline sends", "bubble": "pipeline bubble", "optimizer": "optimizer step"}


def config_argv(name: str, gpus: int) -> list[str]:
    tp, pp, flags = CONFIGS[name]
    dp = gpus // (tp * pp)
    micro_batches = TOKENS_PER_GPU * tp * pp // (4096 * MICRO_BATCH)
    return MODEL + ["--tensor-model-parallel-size", str(tp),
                    "--pipeline-model-parallel-size", str(pp),
                    "--global-batch-size", str(dp * micro_batches * MICRO_BATCH), *flags]


def point(name: str, gpus: int, gbit: float, calibration) -> dict:
    from megaq.planner.hardware import Cluster, gpu_preset
    cluster = Cluster(gpu_preset(GPU), num_nodes=gpus // GPUS_PER_NODE,
                      gpus_per_node=GPUS_PER_NODE, inter_node_gbit_per_s=float(gbit))
    p = _predict(config_argv(name, gpus), calibration, cluster).to_json()
    b = p["breakdown_s"]
    terms = {**b["exposed_comm"], "bubble": b["bubble"], "optimizer": b["optimizer"]}
    top = max(terms, key=terms.get)
    return {"config": name, "gpus": gpus, "inter_node_gbit": gbit,
            "step_time_s": round(p["step_time_s"], 4), "mfu": round(p["mfu"], 4),
            "tokens_per_s_per_gpu": round(p["tokens_per_s"] / gpus, 2),
            "memory_gib": round(p["memory_gib"], 2), "fits": p["fits"],
            "compute_share": round(b["compute"] / p["step_time_s"], 3),
            "largest_other_term": TERMS.get(top, top),
            "largest_other_share": round(terms[top] / p["step_time_s"], 3)}


def study(calibration=None) -> dict:
    from megaq.planner.calibration import load_calibration
    cal = calibration or load_calibration()
    points = [point(n, g, b, cal) for n in CONFIGS for b in LINKS_GBIT for g in GPU_COUNTS]
    verdicts = []
    for n in CONFIGS:
        for b in LINKS_GBIT:
            row = [p for p in points if p["config"] == n and p["inter_node_gbit"] == b]
            base = row[0]["tokens_per_s_per_gpu"]
            for p in row:
                p["scaling_efficiency"] = round(p["tokens_per_s_per_gpu"] / base, 3)
            stop = next((p for p in row if p["scaling_efficiency"] < STOPS_BELOW), None)
            worst = row[-1]
            verdicts.append({
                "config": n, "inter_node_gbit": b,
                "mfu_at": {str(p["gpus"]): p["mfu"] for p in row},
                "fits": all(p["fits"] for p in row),
                "stops_scaling_at": stop["gpus"] if stop else None,
                "bottleneck": (stop or worst)["largest_other_term"],
                "bottleneck_share": (stop or worst)["largest_other_share"]})
    return {"what": "megaq's step on paper at 1,024-16,384 H100s, 10-400 Gbit/s per node "
                    "(tools/plan.py scale)",
            "model": "Llama-3-70B shape, seq 4096, full recompute, micro-batch 4",
            "gpu": GPU, "gpus_per_node": GPUS_PER_NODE, "tokens_per_gpu_per_step": TOKENS_PER_GPU,
            "stops_scaling_below": STOPS_BELOW, "calibration": cal.source,
            "points": points, "verdicts": verdicts}


def table(doc: dict) -> str:
    gpus = GPU_COUNTS
    lines = ["| config | Gbit/s per node | " + " | ".join(f"MFU at {g}" for g in gpus)
             + " | stops scaling at | largest term besides GEMMs (share of step) |",
             "|---|---|" + "---|" * len(gpus) + "---|---|"]
    for v in doc["verdicts"]:
        lines.append(f"| {v['config']} | {v['inter_node_gbit']:g} | "
                     + " | ".join(f"{100 * v['mfu_at'][str(g)]:.0f}%" for g in gpus)
                     + f" | {v['stops_scaling_at'] or 'beyond ' + str(gpus[-1])} | "
                     + f"{v['bottleneck']} ({100 * v['bottleneck_share']:.0f}%)"
                     + ("" if v["fits"] else " (does not fit)") + " |")
    return "\n".join(lines)


def plot(doc: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    links = LINKS_GBIT
    fig, axes = plt.subplots(1, len(links), figsize=(4 * len(links), 3.6), sharey=True)
    for ax, b in zip(axes, links):
        for n in CONFIGS:
            row = [p for p in doc["points"] if p["config"] == n and p["inter_node_gbit"] == b]
            ax.plot([p["gpus"] for p in row], [100 * p["mfu"] for p in row], marker="o", label=n)
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(GPU_COUNTS), [f"{g // 1024}K" for g in GPU_COUNTS])
        ax.set_title(f"{b:g} Gbit/s per node")
        ax.set_xlabel("H100 GPUs")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("predicted MFU, %")
    axes[-1].legend(fontsize=8)
    fig.suptitle("megaq on paper: 70B, 16K tokens per GPU per step (tools/plan.py scale)")
    fig.tight_layout()
    tmp = f"{path}.tmp{os.getpid()}.png"
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
