"""The largest Llama-style model that trains on one GPU, per variant: megaq bf16 and FP8
(stage 0, and ZeRO-3 at DP=1, which is what each rank of a sharded run holds) and
torchao's FP8 on plain PyTorch, all with full recompute, seq 2048, micro-batch 1.

The family is Llama-2-7B's layer (hidden 4096, 32 heads, SwiGLU 11008, vocab 32000)
with the number of layers grown one at a time: each layer is 0.2B parameters. For each
variant the search starts at the largest depth megaq's planner (megaq.planner) says fits
(its memory model; the torchao variant starts there too), trains `--steps` steps there,
and goes up a layer while that trains, or down while it runs out of memory. Models are
initialised on the GPU (bench_train.device_megaq_model), so a 7B attempt takes seconds,
not the minutes a CPU init would. Step time and peak memory come from bench_train's own
timer (CUDA events, median step; torch.cuda.max_memory_allocated).

    python tools/bench/largest_model.py --out docs/results/largest_model_h200.json

Prints a table and writes JSON: per variant, each attempt (layers, parameters, fits,
step ms, peak GiB) and the largest that trained, with the planner's prediction beside it.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys

import torch

import bench_train as bt

HIDDEN, HEADS = 4096, 32
VARIANTS = {  # name: (bench_train variant, planner flags)
    "megaq bf16": ("megaq-s0-comp", ["--zero-stage", "0"]),
    "megaq FP8": ("megaq-fp8dl-comp", ["--zero-stage", "0", "--fp8-format", "hybrid",
                                       "--fp8-recipe", "delayed"]),
    "megaq ZeRO-3 bf16": ("megaq-s3-comp", ["--zero-stage", "3"]),
    "megaq ZeRO-3 FP8": ("megaq-s3-fp8dl-fp8g-comp", ["--zero-stage", "3", "--fp8-format",
                                                       "hybrid", "--fp8-recipe", "delayed",
                                                       "--zero-quantized-weights", "fp8"]),
    "torchao FP8 (plain PyTorch)": ("ao-tw-comp", ["--zero-stage", "0"]),
}


def planner_fits(layers: int, flags: list[str], gpu: str) -> tuple[bool, float]:
    """(fits, predicted GiB) of megaq's planner for this depth and variant."""
    from megaq.plan_cli import plan_main

    argv = ["--num-layers", str(layers), "--hidden-size", str(HIDDEN), "--num-attention-heads",
            str(HEADS), "--seq-length", str(bt.SEQ), "--vocab-size", str(bt.VOCAB), "--swiglu",
            "--normalization", "RMSNorm", "--position-embedding-type", "rope",
            "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--bf16",
            "--micro-batch-size", "1", "--global-batch-size", "1", "--recompute-granularity",
            "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
            "--compile-blocks", "--gpu", gpu, "--num-nodes", "1", "--gpus-per-node", "1",
            "--json", *flags]
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        plan_main(argv)
    plan = json.loads(out.getvalue())
    return bool(plan["fits"]), float(plan["memory_gib"])


def predicted_largest(flags: list[str], gpu: str, lo: int = 8, hi: int = 96) -> int:
    best = lo
    for layers in range(lo, hi + 1):
        if not planner_fits(layers, flags, gpu)[0]:
            break
        best = layers
    return best


def attempt(variant: str, layers: int, dev, steps: int, warmup: int) -> dict:
    """Train `steps` steps of the `layers`-deep model; {'fits': False} when out of memory."""
    size = f"L{layers}"
    bt.SIZES[size] = (layers, HIDDEN, HEADS, 1)
    row = {"layers": layers}
    try:
        res = bt.time_variant(size, variant, dev, steps, warmup, recompute=True,
                              init_on_device=True)
        row.update(fits=True, step_ms=res["step_ms"], peak_gib=res["peak_mem_gib"],
                   tokens_per_s=res["tokens_per_s"], mfu=res["mfu"],
                   loss_first=res["loss_first"], loss_last=res["loss_last"])
        if "grad_bytes" in res:
            row["grad_bytes"] = res["grad_bytes"]
    except torch.OutOfMemoryError:
        row.update(fits=False)
    finally:
        bt.free_gpu()
    row["params_b"] = params_of(layers) / 1e9
    return row


def params_of(layers: int) -> int:
    bt.SIZES["_count"] = (layers, HIDDEN, HEADS, 1)
    return bt.nonembedding_params("_count") + 2 * bt.VOCAB * HIDDEN


def search(name: str, variant: str, start: int, dev, steps: int, warmup: int) -> dict:
    rows, layers = [], start
    first = attempt(variant, layers, dev, steps, warmup)
    rows.append(first)
    step = 1 if first["fits"] else -1
    while True:
        layers += step
        row = attempt(variant, layers, dev, steps, warmup)
        rows.append(row)
        print(f"  {name}: {layers} layers {'trains' if row['fits'] else 'out of memory'}",
              flush=True)
        if row["fits"] != first["fits"] or layers <= 1:
            break
    fitting = [r for r in rows if r["fits"]]
    best = max(fitting, key=lambda r: r["layers"]) if fitting else None
    return {"variant": variant, "attempts": rows, "largest": best}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS),
                   metavar="NAME", help=f"of: {', '.join(VARIANTS)}")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--gpu", default=None, help="the planner's preset for the start depths "
                   "(default: this GPU's, else H200)")
    p.add_argument("--out", default=None, help="JSON results")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("largest_model.py needs a CUDA GPU")
    dev = torch.device("cuda")
    if args.gpu is None:
        from megaq.planner.hardware import DEFAULT_GPU, preset_of_device
        args.gpu = preset_of_device(torch.cuda.get_device_name(dev)) or DEFAULT_GPU
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "hbm_gib": torch.cuda.get_device_properties(dev).total_memory / 2**30,
              "family": {"hidden": HIDDEN, "heads": HEADS, "seq": bt.SEQ, "vocab": bt.VOCAB,
                         "micro_batch": 1, "recompute": "full, every layer"},
              "command": " ".join(["largest_model.py"] + (argv or sys.argv[1:])), "results": {}}
    for name in args.variants:
        variant, flags = VARIANTS[name]
        start = predicted_largest(flags, args.gpu)
        print(f"{name}: the planner's largest fitting depth is {start} layers "
              f"({params_of(start) / 1e9:.2f}B)", flush=True)
        res = search(name, variant, start, dev, args.steps, args.warmup)
        res["planner_largest_layers"] = start
        # the planner models megaq; torchao's search only starts at megaq bf16's depth
        res["planner_gib_at_largest"] = (planner_fits(res["largest"]["layers"], flags, args.gpu)[1]
                                         if res["largest"] and variant.startswith("megaq") else None)
        report["results"][name] = res
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)) or ".", exist_ok=True)
            with open(args.out + ".tmp", "w") as f:
                json.dump(report, f, indent=1)
            os.replace(args.out + ".tmp", args.out)
    print("\n| variant | largest model | layers | step ms | tokens/s | MFU | peak GiB | planner: layers / GiB |")
    print("|---|---|---|---|---|---|---|---|")
    for name, res in report["results"].items():
        b, gib = res["largest"], res["planner_gib_at_largest"]
        planner = ("(megaq's model only)" if not res["variant"].startswith("megaq") else
                   f"{res['planner_largest_layers']} / {gib:.1f}" if gib is not None else
                   f"{res['planner_largest_layers']} / -")
        if b is None:
            print(f"| {name} | none fits | | | | | | {planner} |")
            continue
        print(f"| {name} | {b['params_b']:.2f}B | {b['layers']} | {b['step_ms']:.0f} | "
              f"{b['tokens_per_s'] / 1e3:.1f}K | {100 * b['mfu']:.1f}% | {b['peak_gib']:.1f} | "
              f"{planner} |")


if __name__ == "__main__":
    main()
