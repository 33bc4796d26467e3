"""Where a step's time goes on the emulated two-node link: the main thread's CPU
(model compute + the ZeRO++ quantizers + the rest) against the link's busy time.

Runs the benchmark's model (tools/cluster/netns_zero_bench.py, same flags and configs)
once per config at one link rate, with ranks 0 and 2 (one per node) under cProfile on
the main thread's CPU clock (tools/cluster/profiled_pretrain.py). Per config it prints
and saves: the median step (wall), the link's busy share, and per profiled rank, per
iteration (every one after the first): the main thread's CPU in train_step, the part
of it in the torch reference quantizers (kernels/reference.py: what ZeRO++ runs on
CPU), the rest, and the whole process's CPU (gloo's transport threads included). With
R ranks on C cores, R x process CPU / C / step says how much of the machine's time the
ranks' own work fills; the remainder is the link and other processes' load.

    python tools/cluster/netns_step_profile.py --rate 250mbit --configs ZeRO-3,ZeRO++,deltas \
        --out docs/results/emulated_step_profile.json
"""

from __future__ import annotations

import argparse
import json
import os
import pstats
import sys
import tempfile

import emulate_cluster as emu  # noqa: E402
import netns_zero_bench as bench  # noqa: E402
from netns_link import rate_to_bits, why_unavailable  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
# the reference kernels' public entry points (they never call each other)
QUANTIZER_FUNCTIONS = ("quantize", "dequantize", "reorder_quantize",
                       "dequant_reduce_quantize", "dequant_reduce")


def breakdown(stats_path: str, step_cpu_s: list[float],
              step_process_cpu_s: list[float] | None = None) -> dict:
    """Main-thread CPU per iteration (ms) from one rank's profile of its training steps
    (profiled_pretrain.py: only inside train_step, warm-up excluded): the whole step, the
    reference quantizers inside it, and the rest (forward/backward compute, the
    optimizer, copies, Python)."""
    quant, waits = 0.0, 0
    for (path, _line, name), (_cc, ncalls, _tt, cum, _callers) in pstats.Stats(stats_path).stats.items():
        if name in QUANTIZER_FUNCTIONS and path.replace(os.sep, "/").endswith("kernels/reference.py"):
            quant += cum
        elif path == "~" and name.endswith("_distributed_c10d.wait>"):
            waits += ncalls   # each a point where this rank may wait for its peers
    step, per = sum(step_cpu_s), 1e3 / len(step_cpu_s)
    out = {"iterations": len(step_cpu_s), "train_step_cpu_ms": round(step * per, 1),
           "quantizer_cpu_ms": round(quant * per, 1), "rest_cpu_ms": round((step - quant) * per, 1),
           "quantizer_share": round(quant / step, 3) if step else None,
           "collective_waits": round(waits / len(step_cpu_s), 1)}
    if step_process_cpu_s:
        out["process_cpu_ms"] = round(sum(step_process_cpu_s) * per, 1)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", default="250mbit")
    ap.add_argument("--configs", default="ZeRO-3,ZeRO++,deltas")
    bench.add_workload_flags(ap)
    ap.add_argument("--iters", type=int, default=6, help="iterations (the first is not timed)")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--out", default=None, help="JSON results path")
    args = ap.parse_args(argv)
    configs = [c for c in args.configs.split(",") if c]
    bad = [c for c in configs if c not in bench.CONFIGS]
    if bad:
        ap.error(f"unknown config(s) {bad}: choose from {', '.join(bench.CONFIGS)}")
    if args.iters < 2:
        ap.error("--iters must be at least 2 (the first iteration is not timed)")
    rate_to_bits(args.rate)
    reason = why_unavailable()
    if reason:
        print(f"netns_step_profile: cannot build the emulated link: {reason}", file=sys.stderr)
        return 2
    emu.install_signal_cleanup()
    emu.sweep_stale()
    base = bench.workload_argv(args, args.iters)
    script = [os.path.join(HERE, "profiled_pretrain.py")] + base[1:]
    cores, ranks = os.cpu_count(), 2 * args.nproc_per_node
    results = []
    with tempfile.TemporaryDirectory(prefix="netns_step_profile_") as tmp:
        for config in configs:
            prefix = os.path.join(tmp, config)
            os.environ.update(MEGAQ_PROFILE_OUT=prefix,
                              MEGAQ_PROFILE_RANKS=f"0,{args.nproc_per_node}")
            metrics = prefix + ".jsonl"
            rec = emu.run_measured(script + bench.CONFIGS[config] + ["--metrics-file", metrics],
                                   rate=args.rate, nproc=args.nproc_per_node,
                                   metrics_file=metrics, timeout=args.timeout,
                                   log_dir=tempfile.mkdtemp(dir=tmp))
            per_rank = {}
            for r in (0, args.nproc_per_node):
                with open(f"{prefix}.r{r}.json") as f:
                    steps = json.load(f)
                per_rank[r] = breakdown(f"{prefix}.r{r}", steps["step_cpu_s"],
                                        steps["step_process_cpu_s"])
            cpu = sum(b["process_cpu_ms"] for b in per_rank.values()) / len(per_rank)
            row = {"config": config, "rate": args.rate, "step_ms": rec["step_ms"],
                   "step_ms_all": rec["step_ms_all"],
                   "link_busy_share": rec.get("link_busy_share"),
                   "ranks_cpu_fill": round(ranks * cpu / cores / rec["step_ms"], 3),
                   "per_rank": per_rank, "loadavg_1min_after": round(os.getloadavg()[0], 1)}
            results.append(row)
            q = [b["quantizer_cpu_ms"] for b in per_rank.values()]
            print(f"{config:<8} {args.rate}: step {rec['step_ms']:.0f} ms, link busy "
                  f"{rec.get('link_busy_share', float('nan')):.0%}; main-thread CPU per rank "
                  f"{[b['train_step_cpu_ms'] for b in per_rank.values()]} ms/iteration, of which "
                  f"quantizers {q}; process CPU (gloo's threads too) "
                  f"{[b['process_cpu_ms'] for b in per_rank.values()]} ms; collective waits "
                  f"{[b['collective_waits'] for b in per_rank.values()]}; "
                  f"{ranks} ranks x process CPU / {cores} cores = "
                  f"{row['ranks_cpu_fill']:.0%} of the step; load {row['loadavg_1min_after']}",
                  flush=True)
    if args.out:
        with open(args.out + ".tmp", "w") as f:
            json.dump({"command": "python tools/cluster/netns_step_profile.py "
                       + " ".join(argv if argv is not None else sys.argv[1:]),
                       "model_args": base, "cpus": cores, "results": results}, f, indent=1)
        os.replace(args.out + ".tmp", args.out)
        print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
