"""Replay the project's own measurements against the step model: predicted / measured.

Three kinds of row, each with the bound docs/PLANNING.md states for it:

- `step`: one H200, bench_train.py's measured step (median of its timed steps), 1.3B
  and 3B, bf16 and FP8, ZeRO stage 0 and stage 3 at DP 1; within 10%. Files measured on
  another GPU (an H100) are predicted for that GPU's preset from the H200 calibration,
  their label naming the GPU: the check of carrying the calibration to other hardware.
- `memory`: the same runs' peak allocated memory; within 10%. The model follows the
  current code (memory.py); the files measured on an earlier tree (before the engine
  handed its fp32 gradient accumulators back between steps, and before FP8 and attention
  kept fewer tensors for backward) stay in the table, marked, out of the bound. The
  largest-model runs (full recompute, 7-8B at micro-batch 1) are memory rows too: their
  peak is at backward's end either way.
- `emulated`: the two-node emulation (docs/CLUSTER_EMULATION.md): GPU-speed ranks, two
  per "node", over a tc-shaped veth link at 250 Mbit/s and 1 Gbit/s (two runs); within
  20%, and the fastest configuration at each rate named correctly (or one whose
  measured step is within the pass-to-pass spread of the fastest: a tie).

The files the calibration was fitted on (megaq.planner.calibrate.FIT_*) are not
replayed here, except the emulated ZeRO-3 rows, which are marked `fitted`: the held-out
rows are the check. Nothing here is tuned per row.
"""

from __future__ import annotations

import json
import os

from megaq.planner.bench_rows import bench_argv, file_gpu, read_train_rows
from megaq.planner.calibrate import (EMULATED_FIT_CONFIGS, FIT_EMULATED_FILE, REFERENCE_GPU,
                                     RESULTS, _allocated_gib, _predict, emulated_calibration,
                                     emulated_cluster, emulated_rows)
from megaq.planner.hardware import Cluster, gpu_preset

# held-out bench_train.py files: the current tree's steps, the earlier final FP8 / bf16
# runs (fp8final*) and the ZeRO-3 / FP8-gather runs at DP 1; no 3B run is in the
# calibration's files
CURRENT_TREE_FILES = ("bench_train_h200_1.3B_current.json", "bench_train_h200_3B_current.json")
# the same steps on an H100 (_current, bf16 gradients; _fused_fp8_bwd, its FP8 SwiGLU backward
# before the kernel's tiles changed; _gpu_fp8_cvt, with the GPU's FP8 conversion; _fused_cvt and
# _ref, the committed kernel at both sizes and bf16 against plain PyTorch; _same_run, the
# same code again, all of 1.3B's variants in one process; _mb12, _mb16_*, the same code at
# micro-batch 12 and 16; _cast_transposed*, backward's casts straight into the GEMM layout,
# with the old route, -otr, and CUDA graphs, -cg, beside it, which the model does not tell
# apart from the plain variants): predicted for the H100-SXM preset
OTHER_GPU_FILES = ("bench_train_h100_1.3B_current.json", "bench_train_h100_3B_current.json",
                   "bench_train_h100_1.3B_fused_fp8_bwd.json", "bench_train_h100_3B_fused_fp8_bwd.json",
                   "bench_train_h100_1.3B_gpu_fp8_cvt.json", "bench_train_h100_1.3B_fused_cvt.json",
                   "bench_train_h100_3B_fused_cvt.json", "bench_train_h100_1.3B_ref.json",
                   "bench_train_h100_1.3B_same_run.json", "bench_train_h100_3B_same_run.json",
                   "bench_train_h100_1.3B_mb12.json", "bench_train_h100_1.3B_mb16_cdt.json",
                   "bench_train_h100_1.3B_mb16_fp8.json", "bench_train_h100_1.3B_cast_transposed.json",
                   "bench_train_h100_1.3B_cast_transposed_ab.json")
EARLIER_TREE_FILES = ("fp8final_h200_1.3B.json", "fp8final_h200_1.3B_recheck.json",
                      "fp8final_h200_3B.json", "fp8_gather_h200_1.3B.json")
VALIDATE_TRAIN_FILES = CURRENT_TREE_FILES + OTHER_GPU_FILES + EARLIER_TREE_FILES
EARLIER_TREE = ("earlier tree: memory measured before the engine freed its gradient "
                "accumulators between steps and before FP8 / attention kept fewer tensors")
# files measured before stage 0 held its FP8 GEMMs' weights in E4M3 only
# (megaq.zero.fp8_resident): their stage-0 tensorwise / delayed FP8 memory is shown, not bounded
BEFORE_E4M3_FILES = ("largest_model_h200.json",)
BEFORE_E4M3 = ("earlier tree: stage-0 FP8 memory measured before the GEMMs' weights were "
               "held in E4M3 only")
# largest_model.py: megaq's variants at the largest depth that trained (full recompute); the
# H200's stage-0 FP8 again with E4M3-only weights (largest_model_h200_fp8.json); the H100's
# with bf16 gradients (largest_model_h100_fp8.json, whose rows say grad_bytes 2)
VALIDATE_LARGEST_FILES = ("largest_model_h200.json", "largest_model_h200_fp8.json",
                          "largest_model_h100.json", "largest_model_h100_fp8.json")
# the emulated runs: both rates in one process (the rate switched in place), and 1 Gbit/s
# alone in another device call; the first holds the ZeRO-3 rows the link was fitted on
VALIDATE_EMULATED_FILES = ("emulated_cluster_gpu.json", "emulated_cluster_gpu_1gbit.json")
BOUNDS = {"step": 0.10, "memory": 0.10, "emulated": 0.20}
OUT = os.path.join(RESULTS, "planner_validation.json")


def _row(kind, label, source, predicted, measured, fitted=False, excluded=None, **extra):
    """`excluded`: why the row is shown but held to no bound (None: it is)."""
    ratio = predicted / measured
    return {"kind": kind, "label": label, "source": source, "predicted": round(predicted, 4),
            "measured": round(measured, 4), "ratio": round(ratio, 4), "bound": BOUNDS[kind],
            "within": abs(ratio - 1) <= BOUNDS[kind], "fitted": fitted, "excluded": excluded,
            **extra}


def _before_e4m3(name: str, argv: list[str]) -> bool:
    """A stage-0 tensorwise / delayed FP8 run in a file measured before E4M3-only weights."""
    def flag(f):
        return argv[argv.index(f) + 1] if f in argv else None
    return (os.path.basename(name) in BEFORE_E4M3_FILES and flag("--zero-stage") == "0"
            and flag("--fp8-recipe") in ("tensorwise", "delayed"))


def _on_its_gpu(path: str):
    """(the one-GPU cluster a file was measured on, the suffix its row labels carry: the
    GPU's name where it is not the calibration's)."""
    gpu = file_gpu(path) or REFERENCE_GPU
    cluster = Cluster(gpu_preset(gpu), num_nodes=1, gpus_per_node=1)
    return cluster, "" if gpu == REFERENCE_GPU else f" ({gpu})"


def single_gpu_rows(calibration, files=None) -> list[dict]:
    out = []
    for name in files or VALIDATE_TRAIN_FILES:
        path = name if os.path.isabs(name) else os.path.join(RESULTS, name)
        cluster, suffix = _on_its_gpu(path)
        for r in read_train_rows(path):
            if r.fp8 is not None and r.fp8[1] == "rowwise":
                continue
            label = r.label + suffix
            p = _predict(r.argv, calibration, cluster, as_measured=r.as_measured())
            out.append(_row("step", label, r.source, p.step_time_s * 1e3, r.step_ms, unit="ms"))
            earlier = os.path.basename(name) in EARLIER_TREE_FILES
            out.append(_row("memory", label, r.source, _allocated_gib(p), r.peak_mem_gib,
                            excluded=EARLIER_TREE if earlier else
                            BEFORE_E4M3 if _before_e4m3(name, r.argv) else None, unit="GiB"))
    return out


def largest_model_rows(calibration, paths=None) -> list[dict]:
    """Peak memory of largest_model.py's megaq runs at the largest depth that trained."""
    out = []
    for path in paths or [os.path.join(RESULTS, name) for name in VALIDATE_LARGEST_FILES]:
        out += _largest_rows(calibration, path)
    return out


def _largest_rows(calibration, path: str) -> list[dict]:
    with open(path) as f:
        doc = json.load(f)
    fam = doc["family"]
    cluster, suffix = _on_its_gpu(path)
    out = []
    for name, res in doc["results"].items():
        variant, best = res.get("variant", ""), res.get("largest")
        if not variant.startswith("megaq") or not best:
            continue
        shape = (best["layers"], fam["hidden"], fam["heads"], fam["micro_batch"])
        argv = bench_argv(f"L{best['layers']}", variant, shape=shape) + [
            "--recompute-granularity", "full", "--recompute-method", "uniform",
            "--recompute-num-layers", "1"]
        label = f"{best['layers']}x{fam['hidden']} {variant} (recompute){suffix}"
        # (files from before 16-bit gradients say nothing: the fp32 accumulators, 4)
        p = _predict(argv, calibration, cluster, as_measured=dict(grad_bytes=best.get("grad_bytes", 4)))
        out.append(_row("memory", label,
                        os.path.basename(path), _allocated_gib(p), best["peak_gib"], unit="GiB",
                        excluded=BEFORE_E4M3 if _before_e4m3(path, argv) else None))
    return out


def emulated_validation(calibration, link: dict, path: str) -> tuple[list[dict], list[dict]]:
    """One emulated file's rows and, per link rate, the measured and predicted winner.

    The passes of a row spread by 5-20% (GPU ranks, gloo through host memory), so a
    configuration whose measured step is within the larger pass spread of the fastest
    is tied with it: the prediction is right when it names the fastest or one tied."""
    rows, by_rate = [], {}
    fitted_file = os.path.basename(path) == FIT_EMULATED_FILE
    for r in emulated_rows(path):
        p = _predict(r["argv"], emulated_calibration(calibration, link, r["config"]),
                     emulated_cluster(r["rate_gbit"], link))
        spread = (max(r["passes_ms"]) - min(r["passes_ms"])) / r["step_ms"]
        row = _row("emulated", f"{r['rate']} {r['config']}", os.path.basename(path),
                   p.step_time_s * 1e3, r["step_ms"],
                   fitted=fitted_file and r["config"] in EMULATED_FIT_CONFIGS,
                   unit="ms", pass_spread=round(spread, 3))
        rows.append(row)
        by_rate.setdefault(r["rate"], []).append(row)
    winners = []
    for rate, rs in by_rate.items():
        m = sorted(rs, key=lambda x: x["measured"])
        pr = min(rs, key=lambda x: x["predicted"])
        margin = m[1]["measured"] / m[0]["measured"] - 1
        noise = max(x["pass_spread"] for x in m[:2])
        tied = [x for x in m if x["measured"] / m[0]["measured"] - 1 <= noise]
        name = lambda x: x["label"].split(" ", 1)[1]  # noqa: E731
        winners.append({"rate": rate, "source": os.path.basename(path),
                        "measured_winner": name(m[0]), "runner_up": name(m[1]),
                        "tied_with_winner": [name(x) for x in tied[1:]],
                        "predicted_winner": name(pr),
                        "measured_margin": round(margin, 3), "pass_spread": round(noise, 3),
                        "right": any(pr is x for x in tied),
                        "margin_within_noise": margin <= noise})
    return rows, winners


def validate(calibration=None, link=None) -> dict:
    from megaq.planner.calibration import DEFAULT_PATH, load_calibration
    cal = calibration or load_calibration()
    if link is None:
        with open(DEFAULT_PATH) as f:
            link = json.load(f).get("emulated_link")
    rows = single_gpu_rows(cal) + largest_model_rows(cal)
    winners = []
    if link:
        for name in VALIDATE_EMULATED_FILES:
            emu, won = emulated_validation(cal, link, os.path.join(RESULTS, name))
            rows += emu
            winners += won
    held = [r for r in rows if not r["fitted"] and not r["excluded"]]
    summary = {kind: {"rows": sum(r["kind"] == kind for r in held),
                      "within": sum(r["kind"] == kind and r["within"] for r in held),
                      "worst_ratio": max((r["ratio"] for r in held if r["kind"] == kind),
                                         key=lambda x: abs(x - 1), default=None),
                      "excluded": sorted({r["excluded"] for r in rows
                                          if r["kind"] == kind and r["excluded"]})}
               for kind in BOUNDS}
    return {"what": "the step model's predictions against the project's measured runs "
                    "(tools/plan.py validate)",
            "bounds": BOUNDS, "calibration": cal.source, "rows": rows, "winners": winners,
            "summary": summary}


def table(doc: dict) -> str:
    lines = ["| kind | run | file | predicted | measured | pred / meas | within |",
             "|---|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        mark = ("yes" if r["within"] else "no" if r["excluded"] else "**no**") + (
            " (fitted)" if r["fitted"] else " (earlier tree: not bounded)" if r["excluded"] else "")
        lines.append(f"| {r['kind']} | {r['label']} | {r['source']} | {r['predicted']:.4g} {r['unit']} "
                     f"| {r['measured']:.4g} {r['unit']} | {r['ratio']:.3f} | {mark} |")
    for w in doc["winners"]:
        tie = f"; tied within it: {', '.join(w['tied_with_winner'])}" if w["tied_with_winner"] else ""
        lines.append(f"\nat {w['rate']} ({w['source']}): measured fastest {w['measured_winner']} "
                     f"(then {w['runner_up']}, {100 * w['measured_margin']:.1f}% slower; pass "
                     f"spread {100 * w['pass_spread']:.1f}%{tie}), predicted {w['predicted_winner']}: "
                     f"{'right' if w['right'] else 'WRONG'}")
    return "\n".join(lines)
