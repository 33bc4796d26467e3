"""The bf16 GEMMs of one bench_train.py training step, shape by shape: how close each runs
to the GPU's peak, and whether the other operand order would run faster.

For each linear layer of a bench_train.py size (qkv, proj, fc1, fc2 of every block, and
the logit layer), at its micro-batch x seq tokens, the three GEMMs of a step:

  fwd    y  = x @ W^T          (torch.nn.functional.linear)
  dgrad  dx = dy @ W
  wgrad  dW = dy^T @ x

each in the operand order autograd issues ("as issued") and with the operands swapped,
computing the transpose ("swapped": (W @ x^T), (W^T @ dy^T), (x^T @ dy)): cuBLAS picks a
kernel per layout, so the two can differ. Two timers (bench_kernels.py's Timer):

  cold   per call, eager, after a 256 MB write that flushes the L2 (do_bench median)
  graph  --calls-per-graph calls in one CUDA graph, replayed back to back / calls

The table gives TFLOP/s of the graph column and the step's GEMM total (blocks x layers +
the logit layer) in each order, to hold against bench_train.py's step time.

    python tools/bench/bench_gemm_shapes.py --size 1.3B --out gemm_shapes.json
"""

from __future__ import annotations

import argparse
import sys

import torch

import _checkout  # noqa: E402  (a link to tools/_checkout.py: the checkout's megaq first)

_checkout.use_checkout()

from bench_kernels import Timer, write_json  # noqa: E402  (the kernels' two timers)
from bench_train import SEQ, SIZES, VOCAB, ffn_size  # noqa: E402


def gemm_cases(size: str) -> tuple[int, dict]:
    """(tokens, {layer: (in_features, out_features, copies per step)}) of a size."""
    layers, h, _, micro_batch = SIZES[size]
    f = ffn_size(h)
    shapes = {"qkv": (h, 3 * h, layers), "proj": (h, h, layers), "fc1": (h, 2 * f, layers),
              "fc2": (f, h, layers), "head": (h, VOCAB, 1)}
    return micro_batch * SEQ, shapes


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="1.3B", choices=sorted(SIZES))
    p.add_argument("--calls-per-graph", type=int, default=10)
    p.add_argument("--iters", type=int, default=20, help="graph replays (in batches of 5)")
    p.add_argument("--peak-tflops", type=float, default=989.0,
                   help="dense bf16 peak for the %% column (H100 / H200 SXM: 989)")
    p.add_argument("--out", default=None, help="JSON results")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("error: bench_gemm_shapes.py needs a CUDA GPU")

    torch.manual_seed(0)
    timer = Timer("cuda", a.iters, calls_per_graph=a.calls_per_graph, cold_rounds=1)
    tokens, shapes = gemm_cases(a.size)
    rows = []
    for name, (k, n, copies) in shapes.items():
        x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16)
        cases = {("fwd", "as issued"): lambda x=x, w=w: x @ w.t(),
                 ("fwd", "swapped"): lambda x=x, w=w: w @ x.t(),
                 ("dgrad", "as issued"): lambda dy=dy, w=w: dy @ w,
                 ("dgrad", "swapped"): lambda dy=dy, w=w: w.t() @ dy.t(),
                 ("wgrad", "as issued"): lambda dy=dy, x=x: dy.t() @ x,
                 ("wgrad", "swapped"): lambda dy=dy, x=x: x.t() @ dy}
        flops = 2.0 * tokens * k * n
        for (gemm, order), fn in cases.items():
            cold, graph = timer.cold(fn), timer(fn)
            rows.append({"layer": name, "gemm": gemm, "order": order, "m": tokens, "k": k, "n": n,
                         "copies_per_step": copies, "cold_ms": cold, "graph_ms": graph,
                         "graph_tflops": flops / graph / 1e9,
                         "graph_pct_of_peak": 100 * flops / graph / 1e9 / a.peak_tflops})
        del x, w, dy, cases, fn  # the next layer's operands take their place
        torch.cuda.empty_cache()

    print(f"| layer | GEMM [m x k x n] | order | cold ms | graph ms | TFLOP/s | % of {a.peak_tflops:.0f} |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['layer']} | {r['gemm']} [{r['m']} x {r['k']} x {r['n']}] | {r['order']} | "
              f"{r['cold_ms']:.3f} | {r['graph_ms']:.3f} | {r['graph_tflops']:.0f} | "
              f"{r['graph_pct_of_peak']:.1f} |")
    totals = {}
    for order in ("as issued", "swapped"):
        totals[order] = sum(r["graph_ms"] * r["copies_per_step"] for r in rows if r["order"] == order)
    best = sum(min(r["graph_ms"] for r in rows if (r["layer"], r["gemm"]) == key)
               * shapes[key[0]][2] for key in {(r["layer"], r["gemm"]) for r in rows})
    flops_step = sum(2.0 * tokens * k * n * 3 * c for k, n, c in shapes.values())
    print(f"{a.size} step's GEMMs ({flops_step / 1e12:.1f} TFLOP), graph timer: as issued "
          f"{totals['as issued']:.1f} ms ({flops_step / totals['as issued'] / 1e9:.0f} TFLOP/s), "
          f"swapped {totals['swapped']:.1f} ms, the faster order of each {best:.1f} ms")
    if a.out:
        write_json(a.out, {
            "device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "command": " ".join(["bench_gemm_shapes.py"] + (argv or sys.argv[1:])),
            "timers": {"cold": "per call, eager, cold L2 (triton.testing.do_bench median)",
                       "graph": f"CUDA graph of {a.calls_per_graph} calls, median of batches "
                                f"of 5 replays (CUDA events) / calls"},
            "step_gemm_tflop": flops_step / 1e12, "step_gemm_ms": totals, "step_gemm_ms_faster_order": best,
            "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
