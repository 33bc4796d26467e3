"""FP8 against bf16 convergence on one GPU, on the built-in corpus (no network).

Builds the built-in corpus (megaq.data.builtin: the Python standard library's text, a
SentencePiece BPE tokenizer of 4096 tokens trained on it, all on this machine), then
trains the same Llama-style model from the same seed on the same data order, once per
variant, each through pretrain_gpt.py's own entry point (megaq.pretrain.main) in a
fresh process, ZeRO-3 at DP=1 (--zero-stage), bf16 weights with fp32 masters, compiled blocks:

  bf16   bf16 GEMMs
  fp8    FP8 GEMMs in the blocks (--fp8-format hybrid --fp8-recipe tensorwise)
  fp8g   fp8 plus FP8 weight gathers (--zero-quantized-weights fp8)
  fp8dl  FP8 GEMMs with delayed scaling (--fp8-recipe delayed: x and dY from an amax history)

Default model (GPT-2 small's blocks; 91M parameters, 85M of them in the blocks, with
the 4096-token vocabulary): 12 layers, hidden 768, 12 heads, seq 1024, micro-batch 8, global batch 16 (two micro-batches, so the
FP8 gathers' one cast per step serves two forwards), 500 iterations (8.2M tokens),
lr 6e-4 -> 6e-5 cosine after 50 warm-up iterations, validation every 50 iterations on
the 5% validation split, and once more at the end.

Writes under --out: fp8_convergence.json (per-iteration training losses, validation
losses, tokens/s, the final validation loss of each variant and its relative
difference from bf16; the issue's criterion is |diff| <= 1%), metrics_<variant>.jsonl
and fp8_convergence.png (tools/plot_metrics.py; skipped with a note if matplotlib is
missing).

    python tools/bench/fp8_convergence.py --out $OUT
    python tools/bench/fp8_convergence.py --out /tmp/c --iters 20 --layers 2 --hidden 128 \\
        --heads 4 --seq 128 --eval-interval 10 --device cpu   # a quick CPU run of the script
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import _checkout  # noqa: E402  (a link to tools/_checkout.py: the checkout's megaq first)

_checkout.use_checkout()
REPO = _checkout.ROOT

VARIANTS = {
    "bf16": [],
    "fp8": ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"],
    "fp8g": ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--zero-quantized-weights", "fp8"],
    "fp8dl": ["--fp8-format", "hybrid", "--fp8-recipe", "delayed"],  # amax history, Megatron's defaults
}
CRITERION = 0.01  # issue 20: FP8 final validation loss within 1% of bf16


def train_argv(a, data_prefix: str, tokenizer: str, variant: str, metrics: str) -> list[str]:
    argv = [
        "--num-layers", str(a.layers), "--hidden-size", str(a.hidden),
        "--num-attention-heads", str(a.heads), "--seq-length", str(a.seq),
        "--max-position-embeddings", str(a.seq), "--position-embedding-type", "rope",
        "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
        "--untie-embeddings-and-output-weights", "--attention-dropout", "0",
        "--hidden-dropout", "0", "--micro-batch-size", str(a.micro_batch),
        "--global-batch-size", str(a.global_batch), "--train-iters", str(a.iters),
        "--lr", str(a.lr), "--min-lr", str(a.lr / 10), "--lr-decay-style", "cosine",
        "--lr-warmup-iters", str(min(50, a.iters // 10)), "--weight-decay", "0.1",
        "--adam-beta2", "0.95", "--clip-grad", "1.0", "--seed", str(a.seed),
        "--data-path", data_prefix, "--tokenizer-type", "SentencePieceTokenizer",
        "--tokenizer-model", tokenizer, "--split", "95,5,0",
        "--data-cache-path", os.path.join(a.cache_dir, "index_cache"),
        "--log-interval", "1", "--eval-interval", str(a.eval_interval),
        "--eval-iters", str(a.eval_iters), "--metrics-file", metrics, "--zero-stage", str(a.zero_stage),
    ]
    if a.device != "cpu":
        argv += ["--bf16", "--compile-blocks"]
    return argv + VARIANTS[variant]


def run_child(argv_json: str, result_path: str) -> int:
    """One training run in this (fresh) process: pretrain.main, losses to JSON."""
    from megaq import pretrain

    t0 = time.perf_counter()
    state = pretrain.main(json.loads(argv_json))
    out = {"losses": {int(k): float(v) for k, v in state.losses.items()},
           "val_losses": {int(k): float(v) for k, v in state.val_losses.items()},
           "seconds": time.perf_counter() - t0}
    with open(result_path + ".tmp", "w") as f:
        json.dump(out, f)
    os.replace(result_path + ".tmp", result_path)
    return 0


def tokens_per_s(metrics_path: str, skip: int) -> float | None:
    """Median tokens/s of the logged iterations after the first `skip` (compilation)."""
    vals = []
    with open(metrics_path) as f:
        for line in f:
            r = json.loads(line)
            if r.get("type", "train") == "train" and r["iteration"] > skip and r.get("tokens_per_s"):
                vals.append(r["tokens_per_s"])
    return sorted(vals)[len(vals) // 2] if vals else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory for the JSON, metrics files and PNG")
    p.add_argument("--variants", default="bf16,fp8,fp8g")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--iters", type=int, default=500)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--eval-interval", type=int, default=50)
    p.add_argument("--eval-iters", type=int, default=10)
    p.add_argument("--zero-stage", type=int, default=3, choices=[0, 1, 2, 3],
                   help="the engine's stage at DP=1 (0: stage 0 holds the FP8 GEMMs' weights "
                        "in E4M3 only, refreshed from the masters each step)")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--corpus-bytes", type=int, default=12_000_000,
                   help="standard-library text to take (about 11 MB is all of it)")
    p.add_argument("--cache-dir", default="/tmp/megaq_fp8_convergence",
                   help="corpus, tokenizer and index cache (kept out of --out: large)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--child", nargs=2, metavar=("ARGV_JSON", "RESULT"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        return run_child(*a.child)
    variants = a.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or "bf16" not in variants:
        print(f"error: --variants {a.variants}: use bf16 and any of {list(VARIANTS)}", file=sys.stderr)
        return 2
    os.makedirs(a.out, exist_ok=True)
    from megaq.data.builtin import ensure_builtin_corpus

    t0 = time.perf_counter()
    prefix, tokenizer = ensure_builtin_corpus(a.cache_dir, a.vocab, a.corpus_bytes)
    corpus_s = time.perf_counter() - t0
    print(f"[fp8-conv] corpus ready in {corpus_s:.0f} s: {prefix}", flush=True)
    with open(os.path.join(os.path.dirname(prefix), "manifest.json")) as f:
        manifest = json.load(f)
    report = {"config": {k: v for k, v in vars(a).items() if k != "child"}, "corpus": manifest,
              "corpus_seconds": corpus_s, "criterion_rel_diff": CRITERION, "runs": {}}
    env = dict(os.environ)
    if a.device == "cpu":
        env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "2"))
    for v in variants:
        metrics = os.path.join(a.out, f"metrics_{v}.jsonl")
        if os.path.exists(metrics):
            os.remove(metrics)  # the metrics file appends
        result = os.path.join(a.cache_dir, f"result_{v}.json")
        argv_v = train_argv(a, prefix, tokenizer, v, metrics)
        print(f"[fp8-conv] {v}: pretrain_gpt.py {' '.join(argv_v)}", flush=True)
        r = subprocess.run([sys.executable, os.path.abspath(__file__), "--out", a.out,
                            "--child", json.dumps(argv_v), result], env=env, cwd=REPO)
        if r.returncode:
            report["runs"][v] = {"error": f"exit status {r.returncode}"}
            print(f"[fp8-conv] {v} FAILED (exit {r.returncode})", flush=True)
            continue
        with open(result) as f:
            run = json.load(f)
        run["tokens_per_s_median"] = tokens_per_s(metrics, skip=min(20, a.iters // 4))
        run["final_val_loss"] = run["val_losses"][str(max(map(int, run["val_losses"])))] \
            if run["val_losses"] else None
        report["runs"][v] = run
        print(f"[fp8-conv] {v}: final val loss {run['final_val_loss']}, "
              f"{run['tokens_per_s_median']} tok/s, {run['seconds']:.0f} s", flush=True)
    base = report["runs"].get("bf16", {}).get("final_val_loss")
    for v, run in report["runs"].items():
        if v != "bf16" and base and run.get("final_val_loss") is not None:
            run["final_val_rel_diff_vs_bf16"] = (run["final_val_loss"] - base) / base
            run["within_criterion"] = abs(run["final_val_rel_diff_vs_bf16"]) <= CRITERION
            print(f"[fp8-conv] {v} vs bf16: final validation loss {run['final_val_loss']:.4f} vs "
                  f"{base:.4f} ({100 * run['final_val_rel_diff_vs_bf16']:+.2f}%, criterion "
                  f"+-{100 * CRITERION:.0f}%: {'met' if run['within_criterion'] else 'MISSED'})")
    out_json = os.path.join(a.out, "fp8_convergence.json")
    with open(out_json + ".tmp", "w") as f:
        json.dump(report, f, indent=1)
    os.replace(out_json + ".tmp", out_json)
    print(f"[fp8-conv] wrote {out_json}")
    done = [v for v in variants if "error" not in report["runs"].get(v, {"error": 1})]
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        print("[fp8-conv] matplotlib missing: no PNG (tools/plot_metrics.py can draw it from "
              "the metrics files)")
        return 0
    from megaq.cli import plot_metrics

    return plot_metrics.main([os.path.join(a.out, f"metrics_{v}.jsonl") for v in done]
                             + ["--output", os.path.join(a.out, "fp8_convergence.png"),
                                "--labels", *done])


if __name__ == "__main__":
    sys.exit(main())
