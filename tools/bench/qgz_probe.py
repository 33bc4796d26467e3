"""Diagnostic runs for issue 22 (qgZ fidelity): not a training feature.

One run of tools/bench/convergence.py's setup (same model, data, seeds, 4 CPU ranks as
2 nodes x 2; same result format, so its tables and plots can read it) with one
experimental change that has no flag in megaq, applied inside each rank:

  --units REGEX   qgZ only for the units whose name matches (embedding, layers.N,
                  head); the others take ZeRO-3's plain reduce-scatter: which unit's
                  gradient carries the cost.
  --sr            stochastic rounding in the torch reference's int4/int8 rounding
                  (floor(x / step + U[0,1)), seeded per rank) instead of nearest.

The square-law int4 code is a setting, not a probe: `--zero-quantized-gradients-code
square` (convergence.py's `+sq` token).

    python tools/bench/qgz_probe.py --config qgz --seed 1234 --units head

Runs are cached under --cache-dir by (argv, units, sr). A table of every cached
probe against the harness's ZeRO-3 runs of the same seed and corpus (paired difference
of the last-20-iteration training loss and of the final validation loss, mean and 95%
t interval as convergence.py reports them):

    python tools/bench/qgz_probe.py --report --harness-cache data_cache/convergence_runs [--out probes.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import time

import _checkout  # noqa: E402  (a link to tools/_checkout.py: the checkout's megaq first)

_checkout.use_checkout()

import convergence as cv  # noqa: E402


def patch_stochastic_rounding(rank: int):
    import torch

    import megaq.kernels.reference as R

    gen = torch.Generator().manual_seed(1000 + rank)

    def _round_q(blocks, inv):
        y = blocks.double() * inv.double().unsqueeze(-1)
        return torch.floor(y + torch.rand(y.shape, generator=gen, dtype=torch.float64)).to(torch.int8)

    R._round_q = _round_q


def rank_main(topo, argv, metrics, units, sr):
    import torch

    torch.set_num_threads(1)
    from megaq.zero import collectives
    from megaq.zero.zeropp import grads

    if units:
        quantized = grads.QuantizedGradReducer.start_reduce

        def start_reduce(self, name, flat, out):
            if re.fullmatch(units, name):
                return quantized(self, name, flat, out)
            return collectives.GradReducer(topo, self.cfg).start_reduce(name, flat, out)

        grads.QuantizedGradReducer.start_reduce = start_reduce
    if sr:
        patch_stochastic_rounding(topo.rank)
    from megaq import pretrain

    if topo.rank == 0:
        argv = argv + ["--metrics-file", metrics]
    state = pretrain.main(argv, topo=topo)
    return {"losses": dict(state.losses), "val": dict(state.val_losses)}


def _load_dir(d: str) -> list[dict]:
    runs = []
    for name in sorted(os.listdir(d)):
        if name.endswith(".json"):
            with open(os.path.join(d, name)) as f:
                runs.append(json.load(f))
    return runs


def report(probe_dir: str, harness_dir: str, out: str | None = None) -> None:
    """Paired differences of every cached probe vs the harness's zero3 run of its seed
    (a markdown table; with ``out``, also JSON with every run, probes and baselines)."""
    base = {}
    for r in _load_dir(harness_dir):
        if r["label"].startswith("zero3@"):
            seed = r["argv"][r["argv"].index("--seed") + 1]
            base[(seed, "--data-path" in r["argv"])] = r
    rows: dict[str, list] = {}
    used: dict[str, dict] = {}
    for r in _load_dir(probe_dir):
        seed = r["argv"][r["argv"].index("--seed") + 1]
        b = base.get((seed, "--data-path" in r["argv"]))
        if b is None:
            continue
        label = r["label"].split("@")[0] + (" (held-out)" if "--data-path" in r["argv"] else "")
        corpus = "held-out" if "--data-path" in r["argv"] else "built-in"
        used[f"{r['label']} {corpus}"], used[f"{b['label']} {corpus}"] = r, b
        tb, tr = cv.tail_mean(b, 20), cv.tail_mean(r, 20)
        vb, vr = cv.final_val(b), cv.final_val(r)
        rows.setdefault(label, []).append((int(seed), (tr - tb) / tb, (vr - vb) / vb,
                                           r["bytes_per_node_per_iter"]["inter_node"]))
    lines = ["| probe | seeds | per-seed | mean | 95% CI | val per-seed | val mean | cross-node B/it |",
             "|---|---|---|---|---|---|---|---|"]
    table = {}
    for label, rs in sorted(rows.items()):
        rs.sort()
        st, vs = cv.mean_ci([x[1] for x in rs]), cv.mean_ci([x[2] for x in rs])
        table[label] = {"seeds": [x[0] for x in rs], "diff_train_tail": [x[1] for x in rs],
                        "diff_train_tail_stats": st, "diff_val": [x[2] for x in rs], "diff_val_stats": vs,
                        "inter_node_bytes_per_node_per_iter": rs[0][3]}
        ci = "n/a" if st["ci95"] is None else f"[{cv._pct(st['ci95'][0])}, {cv._pct(st['ci95'][1])}]"
        lines.append(f"| {label} | {','.join(str(x[0]) for x in rs)} | {', '.join(cv._pct(x[1]) for x in rs)} "
                     f"| {cv._pct(st['mean'])} | {ci} | {', '.join(cv._pct(x[2]) for x in rs)} "
                     f"| {cv._pct(vs['mean'])} | {rs[0][3]:.0f} |")
    print("\n".join(lines))
    if out:
        tmp = out + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"metric": "paired relative difference vs zero3 of the same seed and corpus: "
                                 "last-20-iteration training loss; final validation loss",
                       "table": table, "table_markdown": "\n".join(lines), "runs": used}, f, indent=1)
        os.replace(tmp, out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--report", action="store_true", help="print the table of the cached probes and exit")
    p.add_argument("--out", default=None, help="with --report: also write the table and the runs as JSON")
    p.add_argument("--harness-cache", default=os.path.join(cv.REPO, "data_cache", "convergence_runs"),
                   help="convergence.py's --cache-dir (its zero3 runs are the baseline of --report)")
    p.add_argument("--config", help="a convergence.py configuration, e.g. qgz")
    p.add_argument("--seed", type=int)
    p.add_argument("--units", default="", help="regex of the unit names qgZ is kept for")
    p.add_argument("--sr", action="store_true", help="stochastic rounding")
    p.add_argument("--data-path", default=None)
    p.add_argument("--tokenizer-model", default=None)
    p.add_argument("--cache-dir", default=os.path.join(cv.REPO, "data_cache", "qgz_probe"))
    o = p.parse_args(argv)
    if o.report:
        report(o.cache_dir, o.harness_cache, o.out)
        return
    if o.config is None or o.seed is None:
        p.error("--config and --seed are required (or --report)")
    a = cv.parse(["--data-path", o.data_path, "--tokenizer-model", o.tokenizer_model] if o.data_path else [])
    run_argv = cv.model_argv(a, o.seed, "bf16") + cv.config_flags(o.config, a.world // 2)
    label = f"{o.config}{'+sr' if o.sr else ''}{'+only(' + o.units + ')' if o.units else ''}"
    key = hashlib.sha256(json.dumps([run_argv, o.units, o.sr]).encode()).hexdigest()[:16]
    out = os.path.join(o.cache_dir, f"{key}.json")
    if os.path.exists(out):
        print("cached", out)
        return
    os.makedirs(o.cache_dir, exist_ok=True)
    from megaq.testing.ranks import run_on_ranks

    metrics = os.path.join(o.cache_dir, f"{key}.metrics.jsonl")
    t0 = time.time()
    hpz = a.world // 2 if "--zero-hpz-partition-size" in run_argv else 1
    res = run_on_ranks(rank_main, a.world, ranks_per_node=a.world // 2, hpz_size=hpz,
                       args=(run_argv, metrics, o.units, o.sr), timeout=7200)[0]
    run = {"label": f"{label}@{o.seed}/bf16",
           "probe": {"units": o.units, "sr": o.sr, "config": o.config, "data": bool(o.data_path)},
           "argv": run_argv, "wall_s": time.time() - t0,
           "train": {int(k): v for k, v in res["losses"].items()},
           "val": {int(k): v for k, v in res["val"].items()},
           "bytes_per_node_per_iter": cv._bytes_per_iter(metrics)}
    with open(out + ".tmp", "w") as f:
        json.dump(run, f)
    os.replace(out + ".tmp", out)
    with open(out) as f:
        print(label, o.seed, f"last-{a.tail} loss {cv.tail_mean(json.load(f), a.tail):.4f}", round(run["wall_s"]))


if __name__ == "__main__":
    main()
