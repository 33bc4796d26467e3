"""The independent check: ZeRO++ / ZeRO-3 speedups others measured, predicted from hardware alone.

docs/results/published_clusters.json holds the ZeRO++ blog's 20 cells (384 V100s, 24
DGX-2 nodes of 16, 100-800 Gbit/s per node, 1K / 2K tokens per GPU, 18B-138B). Each
cell is turned into pretrain_gpt.py flags (the cell's model, batch, recompute and the two
systems' switches) and a cluster (the V100-32GB preset, the cell's node count and link),
and the step model predicts both systems' step times with the H200 calibration carried
to the V100 by its peaks. Nothing is fitted on these cells.

Both systems measured are DeepSpeed's, so the check models DeepSpeed's overlap, not
megaq's: DeepSpeed's ZeRO-3 fetches at most stage3_prefetch_bucket_size parameter
elements ahead of use (default 5e7, which the blog's runs did not change), so of a
layer's gather only that many elements are issued behind the previous layer's compute
and the rest is fetched when the layer starts, exposed. These layers hold 0.45-1.8
billion elements, so most of each gather is exposed, and less of it the larger the
model. megaq issues a whole unit's gather ahead; its own predictions keep that.

The comparison is the speedup, cell by cell (the stated tolerance: 25%), and its
ordering: across bandwidth at a fixed model and batch, and across tokens per GPU at a
fixed model and bandwidth. A pair whose published gap is under twice its reading
uncertainty is reported but not counted as an ordering the model must get right.
"""

from __future__ import annotations

import json
import os

from megaq.planner.calibrate import RESULTS, _predict

DATA = os.path.join(RESULTS, "published_clusters.json")
OUT = os.path.join(RESULTS, "planner_published.json")
TOLERANCE = 0.25
# DeepSpeed's default stage3_prefetch_bucket_size ("maximum number of parameter elements
# to fetch ahead of use", deepspeed/runtime/zero/config.py)
DEEPSPEED_PREFETCH_ELEMENTS = 50_000_000


class PublishedError(ValueError):
    """The published-cells file is missing or malformed; one line."""


def cell_argv(cell: dict, system: dict) -> list[str]:
    """pretrain_gpt.py's flags for one system of one published cell."""
    m, b = cell["model"], cell["batch"]
    hw = cell["hardware"]
    world = hw["num_gpus"]
    dp = system["dp"]
    argv = ["--num-layers", str(m["layers"]), "--hidden-size", str(m["hidden_size"]),
            "--num-attention-heads", str(m["num_attention_heads"]),
            "--ffn-hidden-size", str(m["ffn_hidden_size"]),
            "--seq-length", str(m["seq_length"]), "--max-position-embeddings", str(m["seq_length"]),
            "--vocab-size", str(m["vocab_size"]),
            "--position-embedding-type", m.get("position_embedding", "learned_absolute"),
            "--micro-batch-size", str(b["micro_batch_size"]),
            "--global-batch-size", str(b["micro_batch_size"] * b["gradient_accumulation_steps"] * dp),
            "--tensor-model-parallel-size", str(system["tp"]),
            "--pipeline-model-parallel-size", str(system["pp"]),
            # fp16 in the source: the same 16-bit tensor-core peak (megaq has no fp16 path)
            "--bf16", "--lr", "1e-4", "--train-iters", "10", "--mock-data",
            "--zero-stage", str(system["zero_stage"])]
    if m.get("activation", "gelu") == "swiglu":
        argv.append("--swiglu")
    if cell.get("activation_checkpointing") == "full":
        argv += ["--recompute-granularity", "full", "--recompute-method", "uniform",
                 "--recompute-num-layers", "1"]
    if system.get("zero_quantized_weights"):
        argv.append("--zero-quantized-weights")
    if system.get("zero_hpz_partition_size", 1) > 1:
        argv += ["--zero-hpz-partition-size", str(system["zero_hpz_partition_size"])]
    if system.get("zero_quantized_gradients"):
        argv.append("--zero-quantized-gradients")
    assert system["tp"] * system["pp"] * dp == world, cell["id"]
    return argv


def cell_cluster(cell: dict):
    from megaq.planner.hardware import Cluster, gpu_preset
    hw = cell["hardware"]
    return Cluster(gpu_preset(hw["gpu_preset"]), num_nodes=hw["num_nodes"],
                   gpus_per_node=hw["gpus_per_node"],
                   inter_node_gbit_per_s=float(hw["inter_node_gbps"]),
                   intra_node_gb_per_s=hw["intra_node_gb_s_per_gpu"] / 2)  # per direction


def zeropp_cells(path: str = DATA) -> list[dict]:
    try:
        with open(path) as f:
            doc = json.load(f)
        return [c for c in doc["cells"] if c["source"] == "zeropp_blog"]
    except OSError as e:
        raise PublishedError(f"cannot read {path}: {e.strerror}") from None
    except (ValueError, KeyError, TypeError):
        raise PublishedError(f"{path} is not the published-cells file (cells with a source)") from None


def _mds_tflops(cell: dict, step_s: float) -> float:
    """TFLOP/s per GPU in the cell's own convention (Megatron-DeepSpeed, recompute counted)."""
    m, b = cell["model"], cell["batch"]
    B, s, L, h, V = (b["micro_batch_size"], m["seq_length"], m["layers"], m["hidden_size"],
                     m["padded_vocab_size"])
    f = 4 if cell.get("activation_checkpointing") == "full" else 3
    flops = 24 * f * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))
    return flops / step_s / 1e12


def predict_cells(calibration, cells=None) -> list[dict]:
    out = []
    cells = cells if cells is not None else zeropp_cells()
    for c in cells:
        cluster = cell_cluster(c)
        steps, mem, fits = {}, {}, {}
        for key in ("zero3", "zeropp"):
            p = _predict(cell_argv(c, c["systems"][key]), calibration, cluster,
                         prefetch_limit=DEEPSPEED_PREFETCH_ELEMENTS)
            steps[key], mem[key], fits[key] = p.step_time_s, p.memory_gib, p.fits
        pub = c["published"]
        sp_pub = pub["speedup_zeropp_over_zero3"]["value"]
        sp = steps["zero3"] / steps["zeropp"]
        out.append({
            "id": c["id"], "model": c["model"]["params_label"],
            "tokens_per_gpu": c["batch"]["tokens_per_gpu_per_microstep"],
            "inter_node_gbps": c["hardware"]["inter_node_gbps"],
            "published_speedup": sp_pub, "published_uncertainty":
                pub["speedup_zeropp_over_zero3"]["uncertainty"],
            "predicted_speedup": round(sp, 4), "ratio": round(sp / sp_pub, 4),
            "within": abs(sp / sp_pub - 1) <= TOLERANCE,
            "predicted_step_s": {k: round(v, 4) for k, v in steps.items()},
            "predicted_tflops_mds": {k: round(_mds_tflops(c, v), 3) for k, v in steps.items()},
            "published_tflops_mds": {"zero3": pub["zero3_tflops_per_gpu"]["value"],
                                     "zeropp": pub["zeropp_tflops_per_gpu"]["value"]},
            "predicted_memory_gib": {k: round(v, 2) for k, v in mem.items()}, "fits": fits})
    return out


def orderings(rows: list[dict]) -> list[dict]:
    """Every pair of cells that differs in bandwidth alone or in tokens per GPU alone."""
    pairs = []
    for i, a in enumerate(rows):
        for b in rows[i + 1:]:
            same_model = a["model"] == b["model"]
            if not same_model:
                continue
            if a["tokens_per_gpu"] == b["tokens_per_gpu"] and a["inter_node_gbps"] != b["inter_node_gbps"]:
                axis = "bandwidth"
            elif a["inter_node_gbps"] == b["inter_node_gbps"] and a["tokens_per_gpu"] != b["tokens_per_gpu"]:
                axis = "tokens"
            else:
                continue
            gap = a["published_speedup"] - b["published_speedup"]
            significant = abs(gap) > 2 * (a["published_uncertainty"] + b["published_uncertainty"])
            pgap = a["predicted_speedup"] - b["predicted_speedup"]
            pairs.append({"axis": axis, "a": a["id"], "b": b["id"],
                          "published_gap": round(gap, 4), "predicted_gap": round(pgap, 4),
                          "significant": significant, "same_order": (gap > 0) == (pgap > 0)})
    return pairs


def published_check(calibration=None) -> dict:
    from megaq.planner.calibration import load_calibration
    cal = calibration or load_calibration()
    rows = predict_cells(cal)
    pairs = orderings(rows)
    sig = [p for p in pairs if p["significant"]]
    return {"what": "ZeRO++ / ZeRO-3 speedups of the ZeRO++ blog (384 V100), predicted from "
                    "the hardware description with the H200 calibration (tools/plan.py published)",
            "tolerance": TOLERANCE, "calibration": cal.source, "cells": rows,
            "orderings": pairs,
            "summary": {"cells": len(rows), "within": sum(r["within"] for r in rows),
                        "worst_ratio": max((r["ratio"] for r in rows), key=lambda x: abs(x - 1)),
                        "significant_orderings": len(sig),
                        "same_order": sum(p["same_order"] for p in sig)}}


def table(doc: dict) -> str:
    lines = ["| model | tokens/GPU | Gbit/s per node | published | predicted | pred / pub | "
             "ZeRO-3 TFLOP/s pub / pred | ZeRO++ TFLOP/s pub / pred |",
             "|---|---|---|---|---|---|---|---|"]
    for r in sorted(doc["cells"], key=lambda r: (r["inter_node_gbps"], r["tokens_per_gpu"],
                                                 float(r["model"].rstrip("B")))):
        pub, pred = r["published_tflops_mds"], r["predicted_tflops_mds"]
        lines.append(f"| {r['model']} | {r['tokens_per_gpu'] // 1024}K | {r['inter_node_gbps']} | "
                     f"{r['published_speedup']:.2f} | {r['predicted_speedup']:.2f} | "
                     f"{r['ratio']:.2f}{'' if r['within'] else ' (miss)'} | "
                     f"{pub['zero3']:.1f} / {pred['zero3']:.1f} | {pub['zeropp']:.1f} / {pred['zeropp']:.1f} |")
    return "\n".join(lines)
