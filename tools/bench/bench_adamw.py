"""megaq's one-pass AdamW step (megaq.kernels.fused_adamw.adamw_step: the update and the
write of the bf16 weights, Triton on CUDA) against torch's fused AdamW + the bf16 copy.

Per size (elements of one flat fp32 buffer), three variants, with the same two timers:

  megaq fp32 grad   adamw_step(p, g32, m, v, w16, coef, scalars): 30 bytes per element
  megaq bf16 grad   the same with the engine's 16-bit grad at DP = 1 (keep_16bit): 28
  torch fused+copy  torch.optim.AdamW([p], fused=True), then w16.copy_(p): 28 + 6 = 34.
                    Without the clip multiply (megaq's coef), which torch does in a pass
                    of its own: the baseline is, if anything, flattered

  cold   per call, eager, each after a 256 MB write that flushes the L2 (do_bench median)
  graph  --calls-per-graph calls in one CUDA graph, replayed in batches of 5 (CUDA
         events): the median batch / calls (bench_kernels.py's Timer, both columns)

"vs torch" is torch's time / this time (above 1: faster). `bits`: from the same state,
a step with g16.float() and one with g16 itself give the same param, moment and bf16
weight bits (a bf16 grad is read upcast exactly); exit status 1 if a size fails it.

    python tools/bench/bench_adamw.py --out adamw.json
"""

from __future__ import annotations

import argparse
import sys

import torch

import _checkout  # noqa: E402  (a link to tools/_checkout.py: the checkout's megaq first)

_checkout.use_checkout()

from bench_kernels import Timer, write_json  # noqa: E402  (the kernels' two timers)

# 1.3B's SwiGLU weight (2048 x 5440); a 50M buffer; 256M elements (1 GB per fp32 buffer)
SIZES = [2048 * 5440, 50_000_000, 256_000_000]
LR, WD, BETAS, EPS = 3e-4, 0.1, (0.9, 0.95), 1e-8
BYTES = {"megaq fp32 grad": 30, "megaq bf16 grad": 28, "torch fused+copy": 34}


def bench_size(n: int, timer: Timer):
    """{variant: (cold ms, graph ms)} and the bit check for one size."""
    from megaq.kernels import fused_adamw
    sc = fused_adamw.step_scalars(LR, WD, BETAS, EPS, step=1)
    param = torch.randn(n, device="cuda") * 0.02
    m = torch.randn(n, device="cuda") * 1e-4
    v = torch.rand(n, device="cuda") * 1e-6 + 1e-8  # positive, as a second moment is
    g16 = (torch.randn(n, device="cuda") * 1e-3).to(torch.bfloat16)
    g32 = g16.float()  # bf16-representable, for the bit check
    w16 = torch.empty(n, device="cuda", dtype=torch.bfloat16)
    coef = torch.tensor(0.5, device="cuda")  # the clip factor

    # bit check: the same step from the same state, fp32 grad vs bf16 grad
    states = [[t.clone() for t in (param, m, v, w16)] for _ in range(2)]
    for (sp, sm, sv, sw), grad in zip(states, (g32, g16)):
        fused_adamw.adamw_step(sp, grad, sm, sv, sw, coef, sc)
    bits = all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(*states))
    del states

    times = {}
    for name, grad in (("megaq fp32 grad", g32), ("megaq bf16 grad", g16)):
        def fn(grad=grad):
            fused_adamw.adamw_step(param, grad, m, v, w16, coef, sc)
        times[name] = (timer.cold(fn), timer(fn))

    tp = param.clone()
    tp.grad = g32.clone()

    def torch_step(capturable):  # the graph needs capturable=True (its step on the GPU)
        opt = torch.optim.AdamW([tp], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                                fused=True, capturable=capturable)

        def fn():
            opt.step()
            w16.copy_(tp)  # the separate pass into the model's bf16 weights
        return fn
    times["torch fused+copy"] = (timer.cold(torch_step(False)), timer(torch_step(True)))
    return times, bits


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=SIZES, metavar="ELEMENTS")
    p.add_argument("--calls-per-graph", type=int, default=10)
    p.add_argument("--iters", type=int, default=20, help="graph replays (in batches of 5)")
    p.add_argument("--out", default=None, help="JSON results")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_adamw.py needs a CUDA GPU")

    torch.manual_seed(0)
    timer = Timer("cuda", a.iters, calls_per_graph=a.calls_per_graph)
    rows = []
    for n in a.sizes:
        times, bits = bench_size(n, timer)
        torch.cuda.empty_cache()  # this size's buffers are gone with bench_size's frame
        base = times["torch fused+copy"]
        for name, (cold, graph) in times.items():
            rows.append({"elements": n, "variant": name, "bytes_per_element": BYTES[name],
                         "cold_ms": cold, "cold_gb_per_s": BYTES[name] * n / cold / 1e6,
                         "graph_ms": graph, "graph_gb_per_s": BYTES[name] * n / graph / 1e6,
                         "cold_vs_torch": base[0] / cold, "graph_vs_torch": base[1] / graph,
                         "bits": bits})

    print("| elements | variant | cold ms | cold GB/s | cold vs torch | graph ms | graph GB/s "
          "| graph vs torch |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['elements']:,} | {r['variant']} | {r['cold_ms']:.3f} | "
              f"{r['cold_gb_per_s']:.0f} | {r['cold_vs_torch']:.2f} | {r['graph_ms']:.3f} | "
              f"{r['graph_gb_per_s']:.0f} | {r['graph_vs_torch']:.2f} |")
    print("bits (fp32 grad == bf16 grad): "
          + ", ".join(f"{r['elements']:,}: {r['bits']}" for r in rows[::3]))
    if a.out:
        report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                  "command": " ".join(["bench_adamw.py"] + (argv or sys.argv[1:])),
                  "timers": {"cold": "per call, eager, cold L2 (triton.testing.do_bench median)",
                             "graph": f"CUDA graph of {a.calls_per_graph} calls, median of "
                                      f"batches of 5 replays (CUDA events) / calls"},
                  "rows": rows}
        write_json(a.out, report)
    return 0 if all(r["bits"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
