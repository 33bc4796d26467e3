"""Host time of one quantization-kernel call: the Python from the op's entry to the launch.

Per op, microseconds per call of the host side only, two ways:
  jit     every call through Triton's JIT launch (tuning=Tuning(cached_launch=False))
  cached  the cached launcher (kernels/launch.py) with the ops' memoised plans, the default
and with --deepspeed (GPU) a third column: DeepSpeed's quantizer op (C++, pybind) on the
same shapes, as tools/bench/bench_kernels.py calls it.

On a GPU the launches are real: N calls are issued back to back and the host clock is
read before the GPU is waited for (the kernels are small enough that the launch queue
never fills). Without a GPU (TRITON_INTERPRET must be unset) Triton's CUDA backend
compiles the kernels for sm_90 on the CPU and tools/bench/host_driver.py stands in for
the device: both columns then run Triton's real Python launch path, and only the
compiled kernel's C launcher (which would launch) is a no-op, the same in both.
Prints a table; --out writes JSON.

    python tools/bench/bench_launch_host.py                         # CPU (or the GPU)
    python tools/bench/bench_launch_host.py --out $OUT/launch_host.json
    python tools/bench/bench_launch_host.py --deepspeed --out $OUT/launch_host.json  # GPU
"""

import argparse
import contextlib
import functools
import json
import os
import sys
import time

import _checkout  # noqa: E402  (a link to tools/_checkout.py: the checkout's megaq first)

_checkout.use_checkout()

K_NODES, M_RANKS = 2, 4


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--elements", type=int, default=None, help="elements per op (default 16M on a GPU, 256K on CPU)")
    p.add_argument("--block", type=int, default=4096)
    p.add_argument("--calls", type=int, default=200, help="back-to-back calls per timing (default 200)")
    p.add_argument("--rounds", type=int, default=7, help="timings per op and launch, interleaved; the best counts")
    p.add_argument("--deepspeed", action="store_true", help="also time DeepSpeed's quantizer op (GPU only)")
    p.add_argument("--out", default=None, help="write results as JSON here")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    import torch

    gpu = torch.cuda.is_available()
    if os.environ.get("TRITON_INTERPRET", "0") != "0":
        sys.exit("error: TRITON_INTERPRET is set: the interpreter has no launch path to time; unset it")
    from megaq.kernels import quant, reference
    from megaq.kernels.tuning import Tuning

    if args.deepspeed and not gpu:
        sys.exit("error: --deepspeed needs a CUDA device (DeepSpeed's kernels are CUDA only); drop it on CPU")
    device = "cuda" if gpu else "cpu"
    block, k, m = args.block, K_NODES, M_RANKS
    n = args.elements or ((16 << 20) if gpu else 64 * block)
    if n % (block * k * m):
        sys.exit(f"error: --elements {n} is not a multiple of block * {k * m} = {block * k * m}; pick a multiple")
    if gpu:
        device_ctx = contextlib.nullcontext()
    else:
        from host_driver import host_driver

        device_ctx = host_driver()
    x = torch.randn(n, device=device, dtype=torch.bfloat16)
    S = n // (k * m)
    recv = reference.reorder_quantize(x, k, m, 4, block)  # the torch reference runs on any device
    q8 = reference.quantize(x, 8, block)
    fin = reference.quantize(x.view(k, n // k), 4, block)
    ops = {  # op: the kernel and its arguments
        "quantize8": (quant.quantize, x, 8, block),
        "dequantize8": (quant.dequantize, q8, n, 8, block, torch.bfloat16),
        "reorder_quantize4": (quant.reorder_quantize, x, k, m, 4, block),
        "dequant_reduce_quantize4": (quant.dequant_reduce_quantize, recv, k, S, 4, 4, block),
        "dequant_reduce4": (quant.dequant_reduce, fin, n // k, 4, block, 0.125),
        "quantize8_bulk": (quant.quantize, x, 8, block),  # with Tuning(tma=True): bulk tensor copies
    }
    settings = {"quantize8_bulk": {"tma": True}}
    calls = {(op, mode): functools.partial(*call, tuning=Tuning(cached_launch=mode == "cached", **settings.get(op, {})))
             for op, call in ops.items() for mode in ("jit", "cached")}
    ds_ops = {}
    if args.deepspeed:
        from bench_kernels import load_deepspeed

        ds_ops = load_deepspeed().cases(torch, x, block, k, m, [])
        ds_ops["quantize8_bulk"] = ds_ops["quantize8"]
    modes = ("jit", "cached", "deepspeed") if ds_ops else ("jit", "cached")
    rows = []
    with device_ctx:
        for op in ops:
            best = {mode: float("inf") for mode in modes if mode != "deepspeed" or op in ds_ops}
            for _ in range(args.rounds):  # interleaved, best of: a loaded machine hits all alike
                for mode in best:
                    fn = ds_ops[op] if mode == "deepspeed" else calls[op, mode]
                    best[mode] = min(best[mode], _host_us(torch, fn, args.calls, gpu))
            rows += [{"op": op, "launch": mode, "host_us": us} for mode, us in best.items()]
    print(f"host microseconds per call ({'GPU, real launches' if gpu else 'CPU, C launcher a no-op'}, "
          f"{n} elements, block {block})")
    print(f"{'op':<26}" + "".join(f"{mode:>11}" for mode in modes))
    for op in ops:
        us = {r["launch"]: r["host_us"] for r in rows if r["op"] == op}
        print(f"{op:<26}" + "".join(f"{us[mode]:>11.1f}" if mode in us else f"{'-':>11}" for mode in modes))
    if args.out:
        meta = {"device": torch.cuda.get_device_name() if gpu else "cpu (stand-in driver, C launcher a no-op)",
                "torch": torch.__version__, "triton": __import__("triton").__version__, "elements": n,
                "block": block, "calls": args.calls, "rounds": args.rounds}
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "results": rows}, f, indent=1)
        print(f"wrote {args.out}")


def _host_us(torch, fn, calls, gpu):
    """Host microseconds per call over `calls` back-to-back calls (after 3 warm-up calls)."""
    for _ in range(3):
        fn()
    if gpu:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    us = (time.perf_counter() - t0) / calls * 1e6
    if gpu:
        torch.cuda.synchronize()
    return us


if __name__ == "__main__":
    main()
