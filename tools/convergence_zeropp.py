"""ZeRO-3 vs ZeRO++ (vs ZeRO++ with error feedback): loss curves on the built-in corpus.

Trains the Llama-style model (RMSNorm, SwiGLU, RoPE, untied embeddings) through
megaq.pretrain.main (pretrain_gpt.py in-process) on CPU gloo ranks posing as 2 nodes, once per configuration, with
the same seed and data order, and reports the final validation losses, the relative
gap to ZeRO-3, the cross-node bytes per step, a PNG of the curves and a JSON file.

    python tools/convergence_zeropp.py --iters 300 --out convergence_zeropp
    python tools/convergence_zeropp.py --iters 20 --out /tmp/cz   # smoke run

Configurations: zero3 (plain), zeropp (qwZ int8 + hpZ + qgZ int4, DeepSpeed's
switches), zeropp_ef (the same + --zero-gradient-error-feedback). ``NAME@SEED`` runs
a configuration with another seed (model init and data order): e.g. ``zero3@1235``
measures the seed-to-seed noise that the ZeRO++ gaps should be compared with.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)  # a plain checkout: megaq/ lives at the repository root

CONFIGS = {
    "zero3": [],
    "zeropp": ["--zero-quantized-weights", "--zero-hpz-partition-size", "{hpz}",
               "--zero-quantized-gradients"],
    "zeropp_ef": ["--zero-quantized-weights", "--zero-hpz-partition-size", "{hpz}",
                  "--zero-quantized-gradients", "--zero-gradient-error-feedback"],
}


def model_argv(a) -> list[str]:
    return [
        "--num-layers", str(a.layers), "--hidden-size", str(a.hidden),
        "--num-attention-heads", str(a.heads), "--seq-length", str(a.seq),
        "--max-position-embeddings", str(a.seq), "--position-embedding-type", "rope",
        "--normalization", "RMSNorm", "--swiglu", "--untie-embeddings-and-output-weights",
        "--disable-bias-linear", "--attention-dropout", "0", "--hidden-dropout", "0",
        "--micro-batch-size", str(a.mbs), "--global-batch-size", str(a.mbs * a.world),
        "--train-iters", str(a.iters), "--lr", str(a.lr), "--min-lr", str(a.lr / 10),
        "--lr-decay-style", "cosine", "--lr-warmup-iters", str(max(1, a.iters // 20)),
        "--weight-decay", "0.1", "--adam-beta2", "0.95", "--clip-grad", "1.0",
        "--seed", str(a.seed), "--demo-corpus", "--split", "95,5,0",
        "--log-interval", str(a.log_interval), "--eval-interval", str(a.eval_interval),
        "--eval-iters", str(a.eval_iters), "--gpus-per-node", str(a.world // 2),
        "--zero-quantization-block-size", str(a.block),
    ] + (["--bf16"] if a.bf16 else [])


def _rank_main(topo, argv, metrics):
    import torch

    torch.set_num_threads(1)
    from megaq import pretrain
    if topo.rank == 0:
        argv = argv + ["--metrics-file", metrics]
    state = pretrain.main(argv, topo=topo)
    return {"losses": dict(state.losses), "val": dict(state.val_losses)}


def _split(name: str) -> tuple[str, int | None]:
    base, _, seed = name.partition("@")
    return base, (int(seed) if seed else None)


def run_config(name: str, a, workdir: str) -> dict:
    from megaq.parallel.launch import run_on_ranks

    hpz = a.world // 2
    base, seed = _split(name)
    extra = [x.format(hpz=hpz) for x in CONFIGS[base]]
    argv = model_argv(a) + extra + (["--seed", str(seed)] if seed is not None else [])
    metrics = os.path.join(workdir, f"{name}.jsonl")
    t0 = time.time()
    res = run_on_ranks(_rank_main, a.world, ranks_per_node=a.world // 2,
                       hpz_size=hpz if "--zero-hpz-partition-size" in extra else 1,
                       args=(argv, metrics), timeout=3600)[0]
    comm = {}
    with open(metrics) as f:
        for line in f:
            rec = json.loads(line)
            if rec.get("type") == "train" and rec.get("comm"):
                comm = rec["comm"]  # bytes per node per iteration, last interval
    inter = sum(v.get("inter_node", 0) for p, v in comm.items()
                if p in ("weight_gather_fwd", "weight_gather_bwd", "grad_reduce"))
    return {"train": {int(k): v for k, v in res["losses"].items()},
            "val": {int(k): v for k, v in res["val"].items()},
            "comm_per_node_per_iter": comm, "inter_node_bytes_per_node_per_iter": inter,
            "wall_s": time.time() - t0, "argv": argv}


def smooth(xs: list[float], w: int) -> list[float]:
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x
        if i >= w:
            acc -= xs[i - w]
        out.append(acc / min(i + 1, w))
    return out


def plot(results: dict, path: str, iters: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, r in results.items():
        its = sorted(r["train"])
        ax1.plot(its, smooth([r["train"][i] for i in its], 10), label=name, lw=1)
        v = sorted(r["val"])
        ax2.plot(v, [r["val"][i] for i in v], marker="o", label=name)
    ax1.set(title=f"training loss (10-step mean), {iters} steps", xlabel="iteration", ylabel="lm loss")
    ax2.set(title="validation loss", xlabel="iteration", ylabel="lm loss")
    for ax in (ax1, ax2):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    tmp = path + ".tmp.png"
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, path)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--world", type=int, default=4, help="ranks (2 nodes of world/2)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--mbs", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--block", type=int, default=2048, help="quantization block (elements)")
    p.add_argument("--bf16", action="store_true", help="bf16 weights (default fp32 on CPU)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--eval-interval", type=int, default=50)
    p.add_argument("--eval-iters", type=int, default=10)
    p.add_argument("--log-interval", type=int, default=10)
    p.add_argument("--configs", default="zero3,zeropp,zeropp_ef")
    p.add_argument("--out", default="convergence_zeropp", help="output prefix (.json, .png)")
    a = p.parse_args(argv)
    if a.world % 2 or a.world < 4:
        p.error("--world must be even and >= 4 (2 nodes of at least 2 ranks)")
    names = a.configs.split(",")
    for n in names:
        if _split(n)[0] not in CONFIGS:
            p.error(f"unknown config {n!r}; choose from {', '.join(CONFIGS)}")
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    results = {}
    with tempfile.TemporaryDirectory() as work:
        for n in names:
            results[n] = run_config(n, a, work)
            last = max(results[n]["val"]) if results[n]["val"] else None
            print(f"{n}: final val loss {results[n]['val'].get(last)} at {last}, "
                  f"{results[n]['wall_s']:.0f} s", flush=True)
    summary = {}
    base = results.get("zero3")
    for n, r in results.items():
        last = max(r["val"])
        s = {"final_val_loss": r["val"][last], "final_iteration": last,
             "final_train_loss_mean_last10": sum(r["train"][i] for i in sorted(r["train"])[-10:]) / 10,
             "inter_node_bytes_per_node_per_iter": r["inter_node_bytes_per_node_per_iter"],
             "wall_s": r["wall_s"]}
        if base:
            b = base["val"][max(base["val"])]
            s["val_gap_vs_zero3"] = (r["val"][last] - b) / b
            bi = base["inter_node_bytes_per_node_per_iter"]
            s["inter_node_ratio_vs_zero3"] = r["inter_node_bytes_per_node_per_iter"] / bi if bi else None
        summary[n] = s
    out = {"summary": summary, "settings": vars(a), "results": results}
    tmp = a.out + ".json.tmp"
    with open(tmp, "w") as f:
        json.dump(out, f, indent=1)
    os.replace(tmp, a.out + ".json")
    plot(results, a.out + ".png", a.iters)
    print(json.dumps(summary, indent=1))
    return out


if __name__ == "__main__":
    main()
