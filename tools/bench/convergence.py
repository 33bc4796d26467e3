"""Paired convergence comparison of ZeRO(++) configurations over several seeds.

Trains a tiny Llama-style model (RMSNorm, SwiGLU, RoPE, untied embeddings; 4 layers,
hidden 64 by default) through megaq.pretrain.main on CPU gloo ranks posing as 2 nodes
(4 ranks = 2 nodes x 2), once per (configuration, seed, precision), and compares each
configuration with the baseline (ZeRO-3) *on the same seed*: same model init, same
data order, so the seed-to-seed spread of the loss (~3% here) cancels and a 0.5%
effect becomes visible.

    python tools/bench/convergence.py --configs zero3,qgz,zeropp --out docs/results/conv
    python tools/bench/convergence.py --iters 20 --seeds 1234 --out /tmp/cv  # smoke run
    python tools/bench/convergence.py --data-path PREFIX --tokenizer-model tok.model ...

Metric: the mean training loss of the last --tail iterations (default 20); per seed the
relative difference (config - baseline) / baseline; over seeds their mean and a 95%
confidence interval from Student's t distribution with (seeds - 1) degrees of freedom
(mean +- t_0.975 * sd / sqrt(seeds)); 3 seeds give t = 4.30, a wide interval: its
upper end is the conservative figure. The final validation loss is compared the same
way. Bytes per iteration (in-node and cross-node, the sum over the gradient and weight
phases, per node) come from the run's metrics file.

A configuration is ``zero3`` or tokens joined by ``+`` (each maps to flags):

    qwz        --zero-quantized-weights (int8 weight gathers)
    hpz        --zero-hpz-partition-size <ranks per node> (in-node secondary shard)
    qgz        --zero-quantized-gradients (two-hop quantized gradient reduce)
    g4 / g8    --zero-quantized-gradients-bits (both hops; the cross-node hop's width)
    i4 / i8    --zero-quantized-gradients-intra-bits (the in-node hop's width)
    b<N>       --zero-quantization-block-size N
    ef         --zero-gradient-error-feedback (opt-in: an fp32 residual of 4 bytes per
               parameter per rank)
    xown       --zero-quantized-gradients-exact-own-rows (opt-in: keep the row a rank
               keeps for itself in each all-to-all exact, fp32, instead of int4)
    wd         --zero-weight-deltas (needs hpz: only int4 weight differences cross nodes)
    d4 / d8    --zero-weight-delta-bits (the width of those differences)
    sq / lin   --zero-quantized-gradients-code square / linear (the int4 code of the
               gradient hops); without either, a qgz configuration passes the shipped
               default code explicitly, so a cached run's argv says which code it ran
    had        --zero-hadamard-gradients (qgZ quantizes after a blockwise randomized
               Hadamard transform; the inverse after the final reduce)

and the aliases ``zeropp`` (qwz+hpz+qgz with the shipped defaults: int4 both hops, block
2048, own rows quantized, no error feedback) and ``deltas`` (hpz+wd+qgz); an alias may start a composite
(``zeropp+xown+ef``; a later token overrides an earlier one). The names ``qgz_v1`` and
``zeropp_v1`` of older tables are today's ``qgz`` and ``zeropp``. Runs are cached by their exact argv (and CACHE_EPOCH)
under --cache-dir, so a table can be extended or re-plotted without re-training.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import time

import _checkout  # noqa: E402  (a link to tools/_checkout.py: the checkout's megaq first)

_checkout.use_checkout()
REPO = _checkout.ROOT

DEFAULT_SEEDS = "1234,4321,777"  # issue 22's seeds
# Part of every run's cache key: bump it when the same argv starts to mean another
# configuration. 2: error feedback became opt-in again (under epoch 1, a bare
# --zero-quantized-gradients ran with it), so no epoch-1 run is read as a current one.
# 3: exact own rows became opt-in (under epoch 2, a bare --zero-quantized-gradients
# kept them exact).
CACHE_EPOCH = 3

TOKENS = {
    "qwz": ["--zero-quantized-weights"],
    "hpz": ["--zero-hpz-partition-size", "{hpz}"],
    "qgz": ["--zero-quantized-gradients"],
    "ef": ["--zero-gradient-error-feedback"],
    "xown": ["--zero-quantized-gradients-exact-own-rows"],
    "wd": ["--zero-weight-deltas"],
    "sq": ["--zero-quantized-gradients-code", "square"],
    "lin": ["--zero-quantized-gradients-code", "linear"],
    "had": ["--zero-hadamard-gradients"],
}
CODE_FLAG = "--zero-quantized-gradients-code"
PREFIX_TOKENS = {  # token prefix + integer -> flag
    "g": "--zero-quantized-gradients-bits",
    "i": "--zero-quantized-gradients-intra-bits",
    "b": "--zero-quantization-block-size",
    "d": "--zero-weight-delta-bits",
}
ALIASES = {
    "zeropp": "qwz+hpz+qgz",
    "deltas": "hpz+wd+qgz",
}
GRAD_ONLY = ("ef", "xown", "sq", "lin", "had")  # need qgz

# Student's t, two-sided 95% (0.975 quantile), by degrees of freedom
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
        9: 2.262, 10: 2.228, 12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042}


class ConfigError(ValueError):
    """A configuration name the harness cannot parse; the message says which token."""


def config_flags(name: str, hpz: int) -> list[str]:
    """The flags of one configuration name (see the module docstring)."""
    spec = ALIASES.get(name, name)
    if spec == "zero3":
        return []
    tokens = spec.split("+")
    for a, b in ALIASES.items():  # an alias may start a composite: zeropp+ef
        if tokens[0] == a:
            tokens = b.split("+") + tokens[1:]
    flags: list[str] = []
    for t in tokens:
        if t in TOKENS:
            flags += [x.format(hpz=hpz) for x in TOKENS[t]]
        elif t[:1] in PREFIX_TOKENS and t[1:].isdigit():
            flags += [PREFIX_TOKENS[t[0]], t[1:]]
        else:
            raise ConfigError(f"unknown token {t!r} in configuration {name!r}; use zero3, an alias "
                              f"({', '.join(ALIASES)}) or tokens {', '.join(TOKENS)}, g<bits>, "
                              f"i<bits>, b<block> joined by '+'")
        if (t in GRAD_ONLY or t[:1] in "gi") and "qgz" not in tokens:
            raise ConfigError(f"token {t!r} in {name!r} sets qgZ options: add 'qgz'")
        if (t == "wd" or t[:1] == "d") and "hpz" not in tokens:
            raise ConfigError(f"token {t!r} in {name!r} needs hpZ's reference weights: add 'hpz'")
        if t[:1] == "d" and "wd" not in tokens:
            raise ConfigError(f"token {t!r} in {name!r} sets weight-delta options: add 'wd'")
    if "qgz" in tokens and CODE_FLAG not in flags:  # pin the default: the argv names the code
        from megaq.zero.config import ZeroConfig
        flags += [CODE_FLAG, ZeroConfig.grad_code]
    return flags


def t975(df: int) -> float:
    if df in T975:
        return T975[df]
    below = [d for d in T975 if d < df]
    return T975[max(below)] if df < 30 else 1.96


def mean_ci(xs: list[float]) -> dict:
    """Mean and the 95% t interval (None with one sample)."""
    n = len(xs)
    m = sum(xs) / n
    if n < 2:
        return {"mean": m, "sd": None, "ci95": None, "n": n}
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1))
    h = t975(n - 1) * sd / math.sqrt(n)
    return {"mean": m, "sd": sd, "ci95": [m - h, m + h], "n": n}


def model_argv(a, seed: int, precision: str) -> list[str]:
    data = (["--data-path", a.data_path, "--tokenizer-model", a.tokenizer_model]
            if a.data_path else ["--demo-corpus"])
    return [
        "--num-layers", str(a.layers), "--hidden-size", str(a.hidden),
        "--num-attention-heads", str(a.heads), "--seq-length", str(a.seq),
        "--max-position-embeddings", str(a.seq), "--position-embedding-type", "rope",
        "--normalization", "RMSNorm", "--swiglu", "--untie-embeddings-and-output-weights",
        "--disable-bias-linear", "--attention-dropout", "0", "--hidden-dropout", "0",
        "--micro-batch-size", str(a.mbs), "--global-batch-size", str(a.gbs),
        "--train-iters", str(a.iters), "--lr", str(a.lr), "--min-lr", str(a.lr / 10),
        "--lr-decay-style", "cosine", "--lr-warmup-iters", str(max(1, a.iters // 20)),
        "--weight-decay", "0.1", "--adam-beta2", "0.95", "--clip-grad", "1.0",
        "--seed", str(seed), "--split", "95,5,0",
        "--log-interval", str(a.log_interval), "--eval-interval", str(a.iters),
        "--eval-iters", str(a.eval_iters), "--gpus-per-node", str(a.world // 2),
    ] + data + (["--bf16"] if precision == "bf16" else [])


def _rank_main(topo, argv, metrics):
    import torch

    torch.set_num_threads(1)
    from megaq import pretrain
    if topo.rank == 0:
        argv = argv + ["--metrics-file", metrics]
    state = pretrain.main(argv, topo=topo)
    return {"losses": dict(state.losses), "val": dict(state.val_losses)}


def _bytes_per_iter(metrics: str) -> dict:
    """In-node / cross-node bytes per node per iteration (gradient + weight phases),
    from the last logged interval."""
    comm = {}
    with open(metrics) as f:
        for line in f:
            rec = json.loads(line)
            if rec.get("type") == "train" and rec.get("comm"):
                comm = rec["comm"]
    phases = ("weight_gather_fwd", "weight_gather_bwd", "grad_reduce", "weight_delta_gather",
              "weight_ref_gather")
    return {"intra_node": sum(v.get("intra_node", 0) for p, v in comm.items() if p in phases),
            "inter_node": sum(v.get("inter_node", 0) for p, v in comm.items() if p in phases),
            "by_phase": comm}


def run_one(argv: list[str], a, label: str) -> dict | None:
    """Train once (or read the cached result of the same argv; None with --cached-only
    when there is none)."""
    from megaq.testing.ranks import run_on_ranks

    key = hashlib.sha256(json.dumps([argv, a.world, CACHE_EPOCH]).encode()).hexdigest()[:16]
    cache = os.path.join(a.cache_dir, f"{key}.json")
    if os.path.exists(cache):
        with open(cache) as f:
            return json.load(f)
    if a.cached_only:
        return None
    os.makedirs(a.cache_dir, exist_ok=True)
    metrics = os.path.join(a.cache_dir, f"{key}.metrics.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)  # a half-finished earlier attempt
    hpz = a.world // 2 if "--zero-hpz-partition-size" in argv else 1
    t0 = time.time()
    res = run_on_ranks(_rank_main, a.world, ranks_per_node=a.world // 2, hpz_size=hpz,
                       args=(argv, metrics), timeout=7200)[0]
    out = {"label": label, "argv": argv, "wall_s": time.time() - t0,
           "train": {int(k): v for k, v in res["losses"].items()},
           "val": {int(k): v for k, v in res["val"].items()},
           "bytes_per_node_per_iter": _bytes_per_iter(metrics)}
    tmp = cache + ".tmp"
    with open(tmp, "w") as f:
        json.dump(out, f)
    os.replace(tmp, cache)
    with open(cache) as f:  # JSON keys are strings: read back for one representation
        return json.load(f)


def tail_mean(run: dict, tail: int) -> float:
    its = sorted(run["train"], key=int)[-tail:]
    return sum(run["train"][i] for i in its) / len(its)


def final_val(run: dict) -> float | None:
    if not run["val"]:
        return None
    return run["val"][max(run["val"], key=int)]


def paired_seeds(runs: dict, c: str, seeds: list[int], prec: str, baseline: str) -> list[int]:
    """The seeds on which both the config and the baseline have a run."""
    return [s for s in seeds if (c, s, prec) in runs and (baseline, s, prec) in runs]


def summarize(runs: dict, configs: list[str], seeds: list[int], precisions: list[str],
              baseline: str, tail: int) -> dict:
    table = {}
    for prec in precisions:
        for c in configs:
            seeds_c = paired_seeds(runs, c, seeds, prec, baseline)
            if not seeds_c:
                continue
            rows = [runs[(c, s, prec)] for s in seeds_c]
            base = [runs[(baseline, s, prec)] for s in seeds_c]
            d_train = [(tail_mean(r, tail) - tail_mean(b, tail)) / tail_mean(b, tail)
                       for r, b in zip(rows, base)]
            d_val = [(final_val(r) - final_val(b)) / final_val(b) for r, b in zip(rows, base)
                     if final_val(r) is not None and final_val(b) is not None]
            by = rows[0]["bytes_per_node_per_iter"]
            table[f"{c}/{prec}"] = {
                "config": c, "precision": prec, "seeds": seeds_c,
                "tail_loss": [tail_mean(r, tail) for r in rows],
                "diff_train_tail": d_train, "diff_train_tail_stats": mean_ci(d_train),
                "diff_val": d_val, "diff_val_stats": mean_ci(d_val) if d_val else None,
                "intra_node_bytes_per_node_per_iter": by["intra_node"],
                "inter_node_bytes_per_node_per_iter": by["inter_node"],
                "wall_s": [r["wall_s"] for r in rows],
            }
    return table


def _pct(x):
    return "n/a" if x is None else f"{100 * x:+.2f}%"


def print_table(table: dict, baseline: str, tail: int, table_seeds: list[int]) -> str:
    lines = [f"paired difference of the last-{tail}-iteration mean training loss vs {baseline} "
             f"(per seed; mean; 95% t interval over seeds)",
             "| config | prec | per-seed | mean | 95% CI | val mean | in-node B/it | cross-node B/it |",
             "|---|---|---|---|---|---|---|---|"]
    for row in table.values():
        st = row["diff_train_tail_stats"]
        ci = st["ci95"]
        vs = row["diff_val_stats"]
        seeds = "" if len(row["seeds"]) == len(table_seeds) else f" (seeds {','.join(map(str, row['seeds']))})"
        lines.append(
            f"| {row['config']}{seeds} | {row['precision']} | {', '.join(_pct(x) for x in row['diff_train_tail'])} "
            f"| {_pct(st['mean'])} | {'n/a' if ci is None else f'[{_pct(ci[0])}, {_pct(ci[1])}]'} "
            f"| {_pct(vs['mean']) if vs else 'n/a'} "
            f"| {row['intra_node_bytes_per_node_per_iter']:.0f} | {row['inter_node_bytes_per_node_per_iter']:.0f} |")
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def smooth(xs: list[float], w: int) -> list[float]:
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x
        if i >= w:
            acc -= xs[i - w]
        out.append(acc / min(i + 1, w))
    return out


def plot(runs: dict, configs, seeds, precisions, baseline: str, path: str, title: str) -> None:
    """Left: seed-mean training loss (20-step mean); right: seed-mean paired relative
    difference to the baseline (50-step mean), one line per config and precision."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = plt.get_cmap("tab20").colors
    for pi, prec in enumerate(precisions):
        for ci, c in enumerate(configs):
            color = colors[(ci + 10 * pi) % len(colors)]  # one colour per line in both panels
            seeds_c = paired_seeds(runs, c, seeds, prec, baseline)
            if not seeds_c:
                continue
            rs = [runs[(c, s, prec)] for s in seeds_c]
            bs = [runs[(baseline, s, prec)] for s in seeds_c]
            its = sorted(rs[0]["train"], key=int)
            mean = [sum(r["train"][i] for r in rs) / len(rs) for i in its]
            rel = [sum((r["train"][i] - b["train"][i]) / b["train"][i] for r, b in zip(rs, bs)) / len(rs)
                   for i in its]
            x = [int(i) for i in its]
            label = f"{c} ({prec})" if len(precisions) > 1 else c
            if len(seeds_c) < len(seeds):
                label += f" [{len(seeds_c)} seeds]"
            ax1.plot(x, smooth(mean, 20), label=label, lw=1, color=color)
            if c != baseline:
                ax2.plot(x, [100 * v for v in smooth(rel, 50)], label=label, lw=1, color=color)
    ax1.set(title="training loss, mean over seeds (20-it mean)", xlabel="iteration",
            ylabel="lm loss")
    ax2.axhline(0, color="k", lw=0.5)
    ax2.set(title=f"paired difference vs {baseline} (50-it mean)", xlabel="iteration",
            ylabel="% of baseline loss")
    for ax in (ax1, ax2):
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    tmp = path + ".tmp.png"
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, path)


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="zero3,qwz+hpz,qgz,zeropp",
                   help="comma-separated configurations (module docstring); the baseline is added")
    p.add_argument("--baseline", default="zero3")
    p.add_argument("--seeds", default=DEFAULT_SEEDS, help=f"comma-separated (default {DEFAULT_SEEDS})")
    p.add_argument("--precision", default="bf16", help="bf16, fp32 or bf16,fp32")
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--tail", type=int, default=20, help="iterations averaged for the metric")
    p.add_argument("--data-path", default=None, help="dataset prefix (default: the built-in corpus)")
    p.add_argument("--tokenizer-model", default=None, help="SentencePiece model of --data-path")
    p.add_argument("--world", type=int, default=4, help="ranks (2 nodes of world/2)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--mbs", type=int, default=2)
    p.add_argument("--gbs", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--eval-iters", type=int, default=10)
    p.add_argument("--log-interval", type=int, default=10)
    p.add_argument("--cache-dir", default=os.path.join(REPO, "data_cache", "convergence_runs"),
                   help="finished runs by argv hash (reused; delete to re-train)")
    p.add_argument("--cached-only", action="store_true",
                   help="train nothing: report the runs already in --cache-dir (a table over "
                        "the seeds each config has; the row's seeds say which)")
    p.add_argument("--out", default="convergence", help="output prefix (.json, .png)")
    a = p.parse_args(argv)
    if a.world % 2 or a.world < 4:
        p.error("--world must be even and >= 4 (2 nodes of at least 2 ranks)")
    if bool(a.data_path) != bool(a.tokenizer_model):
        p.error("--data-path and --tokenizer-model go together (the built-in corpus needs neither)")
    if a.data_path and not os.path.exists(a.data_path + ".idx"):
        p.error(f"--data-path {a.data_path}: no {a.data_path}.idx (pass the prefix without .bin/.idx)")
    try:
        a.seed_list = [int(s) for s in a.seeds.split(",")]
    except ValueError:
        p.error(f"--seeds {a.seeds!r}: write comma-separated integers, e.g. {DEFAULT_SEEDS}")
    a.precisions = a.precision.split(",")
    if not set(a.precisions) <= {"bf16", "fp32"}:
        p.error(f"--precision {a.precision!r}: use bf16, fp32 or bf16,fp32")
    a.config_list = list(dict.fromkeys([a.baseline] + a.configs.split(",")))
    for c in a.config_list:
        try:
            config_flags(c, a.world // 2)
        except ConfigError as e:
            p.error(str(e))
    if a.tail < 1 or a.tail > a.iters:
        p.error(f"--tail {a.tail} must be in 1..--iters ({a.iters})")
    return a


def main(argv=None) -> dict:
    a = parse(argv)
    runs = {}
    for s in a.seed_list:  # seed-major: a partial sweep already has complete pairs
        for prec in a.precisions:
            for c in a.config_list:
                argv_c = model_argv(a, s, prec) + config_flags(c, a.world // 2)
                r = run_one(argv_c, a, f"{c}@{s}/{prec}")
                if r is None:
                    print(f"{c} seed {s} {prec}: no cached run (--cached-only)", flush=True)
                    continue
                runs[(c, s, prec)] = r
                print(f"{c} seed {s} {prec}: last-{a.tail} loss {tail_mean(r, a.tail):.4f}, "
                      f"{r['wall_s']:.0f} s", flush=True)
    table = summarize(runs, a.config_list, a.seed_list, a.precisions, a.baseline, a.tail)
    text = print_table(table, a.baseline, a.tail, a.seed_list)
    corpus = a.data_path or "built-in corpus"
    out = {"settings": {k: v for k, v in vars(a).items()}, "corpus": corpus,
           "metric": f"relative difference of the mean training loss of the last {a.tail} "
                     f"iterations vs {a.baseline}, paired by seed; 95% CI = Student t over seeds",
           "table": table, "table_markdown": text,
           "flags": {c: config_flags(c, a.world // 2) for c in a.config_list},
           "runs": {f"{c}@{s}/{p}": r for (c, s, p), r in runs.items()}}
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    tmp = a.out + ".json.tmp"
    with open(tmp, "w") as f:
        json.dump(out, f, indent=1)
    os.replace(tmp, a.out + ".json")
    plot(runs, a.config_list, a.seed_list, a.precisions, a.baseline, a.out + ".png",
         f"{corpus}; {a.iters} its; seeds {a.seeds}; {a.world} ranks as 2 nodes")
    return out


if __name__ == "__main__":
    main()
