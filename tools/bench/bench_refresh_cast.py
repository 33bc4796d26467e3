"""The once-per-step E4M3 cast of the FP8 GEMMs' weights (megaq.parallel.fp8.cast_weight:
stage 0's E4M3-only weights, ZeRO-3's FP8 weight gathers), on one GPU.

For each size (elements of one fp32 master) it casts with the bf16 rounding fused into
the compiled kernel (one pass: read fp32, write E4M3) and in two passes (round to bf16,
then the compiled cast of the bf16 tensor, the GEMM's own path), and reports:

  fused_ok   the cast's own once-per-process check (fp8._RefreshCast): True when this
             torch's inductor keeps the rounding, so the fused pass is used
  bits       the fused cast equals the eager two-pass cast bit for bit
  ms         per call, eager, each launch after a 256 MB write that flushes the L2 (as
             the refresh sees its masters: not in cache); triton's do_bench median

    python tools/bench/bench_refresh_cast.py --out refresh_cast.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

import torch

import _checkout  # noqa: E402  (a link to tools/_checkout.py: the checkout's megaq first)

_checkout.use_checkout()

# 50M: a 7B model's largest weights; 1.3B's SwiGLU (2048 x 5440); 3B's attention (3072^2)
SIZES = [50_000_000, 2048 * 5440, 3072 * 3072]


def cold_ms(fn) -> float:
    """Per call with a cold L2, as bench_kernels.py's `cold` column: triton's do_bench
    (a 256 MB write before each call), median."""
    from triton.testing import do_bench
    return do_bench(fn, return_mode="median")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=SIZES, metavar="ELEMENTS")
    p.add_argument("--out", default=None, help="JSON results")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_refresh_cast.py needs a CUDA GPU")
    from megaq.parallel import fp8

    torch.manual_seed(0)
    rows = []
    for n in a.sizes:
        w = torch.randn(n, device="cuda") * 0.02
        scale = fp8.weight_scales(w.abs().amax().reshape(1), [])[0]
        out = torch.empty(n, device="cuda", dtype=fp8.E4M3)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fp8.cast_weight(out, w, scale, via=torch.bfloat16)
        bits = torch.equal(out.view(torch.uint8),
                           fp8.cast(w.to(torch.bfloat16), scale, fp8.E4M3).view(torch.uint8))
        fused = cold_ms(lambda: fp8.cast_weight(out, w, scale, via=torch.bfloat16))
        two = cold_ms(lambda: fp8._REFRESH_CAST.compiled(out, w.to(torch.bfloat16), scale, None))
        rows.append({"elements": n, "fused_ok": fp8._REFRESH_CAST.fused_ok, "bits": bits,
                     "fused_ms": fused, "two_pass_ms": two,
                     "fused_gb_per_s": 5 * n / fused / 1e6,
                     "megaq_warnings": [str(c.message) for c in caught
                                        if str(c.message).startswith("megaq")]})
    print("| elements | fused_ok | bits | one pass ms | two passes ms | one pass GB/s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['elements']:,} | {r['fused_ok']} | {r['bits']} | {r['fused_ms']:.3f} | "
              f"{r['two_pass_ms']:.3f} | {r['fused_gb_per_s']:.0f} |")
    if a.out:
        report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                  "command": " ".join(["bench_refresh_cast.py"] + (argv or sys.argv[1:])),
                  "timer": "per call, eager, cold L2 (triton.testing.do_bench median)", "rows": rows}
        with open(a.out + ".tmp", "w") as f:
            json.dump(report, f, indent=1)
        os.replace(a.out + ".tmp", a.out)
    return 0 if all(r["bits"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
