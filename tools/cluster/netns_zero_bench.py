"""ZeRO-3 vs ZeRO++ step time over an emulated two-node link, at several link rates.

The same small Llama-style model and batch run as five configurations (ZeRO-3, qwZ,
qwZ + hpZ, full ZeRO++ = qwZ + hpZ + qgZ, and weight deltas = hpZ + int4 weight
differences + qgZ). Each configuration is one launch on a
freshly built link (tools/cluster/emulate_cluster.py) whose rate is switched in place through
the rate schedule; `--repeats` passes go over the configurations in alternating order.
Per (config, rate): median step time over the timed iterations of all passes, bytes
over the link (veth counters) per iteration vs megaq's own inter-node accounting, the
share of the step the link is busy, and the speedup over ZeRO-3 at the same rate.
Writes a JSON record, a PNG (step time against link rate) and prints a markdown table.

    scripts/emulate_cluster.sh bench --rates 250mbit,1gbit,4gbit --repeats 2 \
        --out docs/results/emulated_cluster.json --plot docs/results/emulated_cluster.png
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import emulate_cluster as emu  # noqa: E402
from netns_link import rate_to_bits, why_unavailable  # noqa: E402

CONFIGS = {   # name -> ZeRO flags (DeepSpeed's names, as pretrain_gpt.py takes them)
    "ZeRO-3": [],
    "qwZ": ["--zero-quantized-weights"],
    "qwZ+hpZ": ["--zero-quantized-weights", "--zero-hpz-partition-size", "2"],
    "ZeRO++": ["--zero-quantized-weights", "--zero-hpz-partition-size", "2",
               "--zero-quantized-gradients"],
    "deltas": ["--zero-hpz-partition-size", "2", "--zero-weight-deltas",
               "--zero-quantized-gradients"],
}


def model_args(layers: int, hidden: int, seq: int, micro: int, nproc: int,
               iters: int, device: str = "cpu") -> list[str]:
    """A small Llama-style model (RMSNorm, SwiGLU, RoPE, untied embeddings) on mock data.

    gloo carries the collectives over the emulated link either way; `device="cuda"`
    keeps each rank's tensors on the host's GPU (ranks share it), so compute and the
    quantizers run at GPU speed and the link is what is left of the step."""
    dp = 2 * nproc
    return ["pretrain_gpt.py", "--mock-data", "--vocab-size", "4096",
            "--num-layers", str(layers), "--hidden-size", str(hidden),
            "--num-attention-heads", str(max(1, hidden // 64)),
            "--seq-length", str(seq), "--max-position-embeddings", str(seq),
            "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
            "--disable-bias-linear", "--untie-embeddings-and-output-weights",
            "--micro-batch-size", str(micro), "--global-batch-size", str(micro * dp),
            "--train-iters", str(iters), "--lr", "1e-4", "--log-interval", "1",
            "--eval-iters", "0", "--zero-stage", "3", "--seed", "1234",
            "--distributed-backend", "gloo", "--device", device]


def add_workload_flags(ap: argparse.ArgumentParser) -> None:
    """The model and ranks both emulated-cluster tools run (this benchmark and
    netns_step_profile.py); `workload_argv` turns them into pretrain_gpt.py's argv."""
    ap.add_argument("--nproc-per-node", type=int, default=2)
    ap.add_argument("--num-layers", type=int, default=2)
    ap.add_argument("--hidden-size", type=int, default=256)
    ap.add_argument("--seq-length", type=int, default=16,
                    help="tokens per sample (default 16: see docs/CLUSTER_EMULATION.md, \"The workload\"; "
                         "--seq-length 128 is the earlier setup)")
    ap.add_argument("--micro-batch-size", type=int, default=1)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="where the ranks compute (default cpu); cuda: all ranks share the "
                         "host's GPUs, gloo still carries every collective over the link")


def workload_argv(args, iters: int) -> list[str]:
    return model_args(args.num_layers, args.hidden_size, args.seq_length, args.micro_batch_size,
                      args.nproc_per_node, iters, args.device)


def one_config(config: str, rates: list[str], base: list[str], args, tmp: str) -> list[dict]:
    """One launch of `config`; the link's rate is switched in place between segments."""
    metrics = os.path.join(tmp, f"{config}.jsonl")
    argv = base + CONFIGS[config] + ["--metrics-file", metrics]
    load_before = os.getloadavg()[0]
    for attempt in (1, 2):   # one retry: a run can die of the shared machine's hiccups
        try:
            rec = emu.run_measured(argv, rate=rates, nproc=args.nproc_per_node,
                                   metrics_file=metrics, timeout=args.timeout,
                                   warmup=args.warmup, iters_per_rate=args.iters_per_rate,
                                   settle=args.settle, log_dir=tempfile.mkdtemp(dir=tmp))
            break
        except (RuntimeError, TimeoutError) as e:
            print(f"  {config}: attempt {attempt} failed: {str(e)[-3000:]}", flush=True)
            if attempt == 2:
                return [{"config": config, "rate": r, "error": str(e)[-4000:]} for r in rates]
    loads = [round(load_before, 1), round(os.getloadavg()[0], 1)]
    out = []
    for w in rec["segments"]:
        w = dict(w, config=config, loadavg_1min_before_after_run=loads,
                 run_wall_s=rec["wall_s"],
                 seconds_to_first_iteration=rec["seconds_to_first_iteration"],
                 run_link_over_accounted=rec["link_over_accounted"],
                 loopback_bytes_run=rec["loopback_bytes"], shaping_mtu=rec["shaping"]["mtu"])
        out.append(w)
    return out


def aggregate(runs: list[dict]) -> list[dict]:
    """One record per (config, rate): the median over every timed iteration of every
    pass, so one disturbed iteration or one disturbed pass does not set the result."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r["config"], r["rate"]), []).append(r)
    out = []
    for (config, rate), rs in groups.items():
        ok = [r for r in rs if "error" not in r]
        if not ok:
            out.append(rs[0])
            continue
        agg = {k: v for k, v in ok[0].items() if k not in ("repeat",)}
        steps = [t for r in ok for t in r["step_ms_all"]]
        agg.update(step_ms=round(statistics.median(steps), 1), step_ms_min=min(steps),
                   step_ms_all=steps, step_ms_per_pass=[r["step_ms"] for r in ok],
                   passes=len(ok),
                   loadavg_1min_per_pass=[r["loadavg_1min_before_after_run"] for r in ok])
        for k in ("steady_link_bytes_per_iteration", "steady_link_over_accounted"):
            vals = [r[k] for r in ok if r.get(k) is not None]
            if vals:
                agg[k] = round(statistics.mean(vals), 4) if "over" in k else statistics.mean(vals)
        busy = [r["link_busy_share"] * r["step_ms"] for r in ok if "link_busy_share" in r]
        if busy:
            agg["link_busy_share"] = round(statistics.mean(busy) / agg["step_ms"], 3)
        out.append(agg)
    return out


def table(records: list[dict]) -> str:
    def step_of(config):
        return {r["rate"]: r["step_ms"] for r in records if r["config"] == config and "step_ms" in r}
    base, zpp = step_of("ZeRO-3"), step_of("ZeRO++")
    nan = float("nan")
    # "link ms": the busier direction's bytes at the link's rate (busy share x step),
    # the step a purely link-bound machine would take
    rows = ["| link rate | config | step ms | speedup vs ZeRO-3 | vs ZeRO++ | link MB/iter | "
            "megaq inter-node MB/iter | link / megaq | link busy share | link ms |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        if "error" in r:
            rows.append(f"| {r['rate']} | {r['config']} | failed | | | | | | | |")
            continue
        sp, spp = base.get(r["rate"]), zpp.get(r["rate"])
        busy = r.get("link_busy_share", nan)
        rows.append(
            f"| {r['rate']} | {r['config']} | {r['step_ms']:.0f} | "
            f"{(sp / r['step_ms']) if sp else nan:.2f}x | "
            f"{(spp / r['step_ms']) if spp else nan:.2f}x | "
            f"{r.get('steady_link_bytes_per_iteration', nan) / 1e6:.2f} | "
            f"{r['steady_accounted_per_iteration'] / 1e6:.2f} | "
            f"{r.get('steady_link_over_accounted') or nan:.3f} | "
            f"{busy:.0%} | {busy * r['step_ms']:.0f} |")
    return "\n".join(rows)


def plot(records: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for config in CONFIGS:
        rs = sorted((r for r in records if r["config"] == config and "step_ms" in r),
                    key=lambda r: r["rate_bits"])
        if rs:
            x = [r["rate_bits"] / 1e6 for r in rs]
            y = [r["step_ms"] for r in rs]
            # bars: the spread of the timed iterations (the machine is shared and noisy)
            lo = [r["step_ms"] - min(r["step_ms_all"]) for r in rs]
            hi = [max(r["step_ms_all"]) - r["step_ms"] for r in rs]
            ax.errorbar(x, y, yerr=[lo, hi], marker="o", capsize=3, label=config)
    ax.set_xscale("log")
    ticks = sorted({r["rate_bits"] / 1e6 for r in records if "rate_bits" in r})
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("emulated inter-node link rate per direction (Mbit/s)")
    ax.set_ylabel("step time (ms): median, bars min..max")
    ax.set_title("2 emulated nodes x 2 ranks (gloo, CPU): ZeRO-3, ZeRO++, deltas")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = path + ".tmp.png"
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", default="250mbit,1gbit,4gbit")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    add_workload_flags(ap)
    ap.add_argument("--iters-per-rate", type=int, default=3)
    ap.add_argument("--settle", type=int, default=1,
                    help="iterations after each rate change left out of the timing")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2,
                    help="passes over the configs, alternating forward and reverse order, so "
                         "drifting load from other processes hits every config alike")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--out", default=None, help="JSON results path")
    ap.add_argument("--plot", default=None, help="PNG path")
    args = ap.parse_args(argv)
    reason = why_unavailable()
    if reason:
        print(f"netns_zero_bench: cannot build the emulated link: {reason}", file=sys.stderr)
        return 2
    configs = [c for c in args.configs.split(",") if c]
    bad = [c for c in configs if c not in CONFIGS]
    if bad:
        ap.error(f"unknown config(s) {bad}: choose from {', '.join(CONFIGS)}")
    rates = [r for r in args.rates.split(",") if r]
    for r in rates:
        rate_to_bits(r)   # fail early on a typo
    emu.install_signal_cleanup()
    emu.sweep_stale()
    iters = args.warmup + args.iters_per_rate * len(rates)
    base = workload_argv(args, iters)
    t0, nan = time.time(), float("nan")
    runs = []
    with tempfile.TemporaryDirectory(prefix="netns_zero_bench_") as tmp:
        for rep in range(args.repeats):
            for config in (configs if rep % 2 == 0 else configs[::-1]):
                try:
                    recs = one_config(config, rates, base, args, tmp)
                except (KeyboardInterrupt, emu._Terminated) as e:
                    print(f"netns_zero_bench: interrupted ({str(e) or 'SIGINT'}); namespaces "
                          f"removed", file=sys.stderr)
                    return 130
                for rec in recs:
                    rec["repeat"] = rep
                    runs.append(rec)
                    if "error" not in rec:
                        print(f"pass {rep + 1} {rec['rate']:>8} {config:<8} step "
                              f"{rec['step_ms']:8.1f} ms {rec['step_ms_all']}  link "
                              f"{rec.get('steady_link_bytes_per_iteration', nan) / 1e6:6.2f}"
                              f" MB/it  megaq {rec['steady_accounted_per_iteration'] / 1e6:6.2f} "
                              f"MB/it  busy {rec.get('link_busy_share', nan):.0%}  load "
                              f"{rec['loadavg_1min_before_after_run']}", flush=True)
    records = aggregate(runs)
    records.sort(key=lambda r: (rate_to_bits(r["rate"]), list(CONFIGS).index(r["config"])))
    print()
    print(table(records))
    result = {
        "what": "ZeRO-3 vs ZeRO++ vs weight deltas over an emulated 2-node link (network "
                "namespaces, tc tbf)",
        "command": "scripts/emulate_cluster.sh bench " + " ".join(argv if argv is not None
                                                                    else sys.argv[1:]),
        "model_args": base, "configs": {c: CONFIGS[c] for c in configs},
        "machine": {"host": platform.node(), "kernel": platform.release(),
                    "cpus": os.cpu_count(), "python": platform.python_version()},
        "bench_wall_s": round(time.time() - t0, 1),
        "records": records, "table_markdown": table(records), "per_pass_records": runs,
    }
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out + ".tmp", "w") as f:
            json.dump(result, f, indent=1)
        os.replace(args.out + ".tmp", args.out)
        print(f"results: {args.out}")
    if args.plot:
        plot(records, args.plot)
        print(f"plot: {args.plot}")
    print(f"benchmark wall time {result['bench_wall_s']:.0f} s")
    return 0 if all("error" not in r for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
