"""Host time of one quantization-kernel call: the Python from the op's entry to the launch.

Per op, microseconds per call of the host side only, two ways:
  jit     every call through Triton's JIT launch (kernels.quant.CACHED_LAUNCH = False)
  cached  the cached launcher (kernels/launch.py), the default

On a GPU the launches are real: N calls are issued back to back and the host clock is
read before the GPU is waited for (the kernels are small enough that the launch queue
never fills). Without a GPU there is nothing to launch: each kernel is replaced by a
stand-in whose JIT launch returns at once (`jit`: the wrapper's own cost, the JIT's
binding excluded) or whose compiled launcher returns at once (`cached`: wrapper, cache
key and lookup; the C launcher excluded). Prints a table; --out writes JSON.

    python tools/bench/bench_launch_host.py                         # CPU stand-ins (or the GPU)
    python tools/bench/bench_launch_host.py --out $OUT/launch_host.json
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))  # repo root

K_NODES, M_RANKS = 2, 4


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--elements", type=int, default=None, help="elements per op (default 16M on a GPU, 256K on CPU)")
    p.add_argument("--block", type=int, default=4096)
    p.add_argument("--calls", type=int, default=200, help="calls per timing (default 200; best of 5)")
    p.add_argument("--out", default=None, help="write results as JSON here")
    return p.parse_args(argv)


class _StubCompiled:
    """A compiled kernel whose launcher does nothing (CPU: the cached path's Python only)."""

    function, packed_metadata = None, None

    @staticmethod
    def run(*args):
        return None


class _StubJIT:
    """A JIT kernel whose launch does nothing and returns _StubCompiled."""

    def __init__(self, kernel):
        self.params = kernel.params if hasattr(kernel, "params") else _params_of(kernel)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: _StubCompiled


def _params_of(kernel):
    import inspect
    from types import SimpleNamespace

    import triton.language as tl

    fn = getattr(kernel, "fn", kernel)
    return [SimpleNamespace(name=n, is_constexpr=p.annotation is tl.constexpr)
            for n, p in inspect.signature(fn).parameters.items()]


def main(argv=None):
    args = parse_args(argv)
    import torch

    gpu = torch.cuda.is_available()
    if not gpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from megaq.kernels import launch, quant, reference

    device = "cuda" if gpu else "cpu"
    block, k, m = args.block, K_NODES, M_RANKS
    n = args.elements or ((16 << 20) if gpu else 64 * block)
    if n % (block * k * m):
        sys.exit(f"error: --elements {n} is not a multiple of block * {k * m} = {block * k * m}; pick a multiple")
    if not gpu:  # stand-ins: nothing can launch on this machine
        for name in ("_QUANTIZE", "_DEQUANT_REDUCE", "_INT4_HOP", "_INT4_WORDS"):
            stub = _StubJIT(getattr(quant, name).kernel)
            setattr(quant, name, launch.CachedLauncher(stub, get_device=lambda: 0, get_stream=lambda d: 0))
    x = torch.randn(n, device=device, dtype=torch.bfloat16)
    S = n // (k * m)
    recv = reference.reorder_quantize(x.cpu(), k, m, 4, block).to(device)
    q8 = reference.quantize(x.cpu(), 8, block).to(device)
    fin = reference.quantize(x.cpu().view(k, n // k), 4, block).to(device)
    ops = {
        "quantize8": lambda: quant.quantize(x, 8, block),
        "dequantize8": lambda: quant.dequantize(q8, n, 8, block, torch.bfloat16),
        "reorder_quantize4": lambda: quant.reorder_quantize(x, k, m, 4, block),
        "dequant_reduce_quantize4": lambda: quant.dequant_reduce_quantize(recv, k, S, 4, 4, block),
        "dequant_reduce4": lambda: quant.dequant_reduce(fin, n // k, 4, block, 0.125),
    }
    rows = []
    for op, fn in ops.items():
        for mode in ("jit", "cached"):
            quant.CACHED_LAUNCH = mode == "cached"
            try:
                us = _host_us(torch, fn, args.calls, gpu)
            finally:
                quant.CACHED_LAUNCH = True
            rows.append({"op": op, "launch": mode, "host_us": us})
    print(f"host microseconds per call ({'GPU, real launches' if gpu else 'CPU, launches stubbed'}, "
          f"{n} elements, block {block})")
    print(f"{'op':<26}{'jit':>10}{'cached':>10}")
    for op in ops:
        us = {r["launch"]: r["host_us"] for r in rows if r["op"] == op}
        print(f"{op:<26}{us['jit']:>10.1f}{us['cached']:>10.1f}")
    if args.out:
        meta = {"device": torch.cuda.get_device_name() if gpu else "cpu (launches stubbed)",
                "torch": torch.__version__, "triton": __import__("triton").__version__, "elements": n,
                "block": block, "calls": args.calls}
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "results": rows}, f, indent=1)
        print(f"wrote {args.out}")


def _host_us(torch, fn, calls, gpu):
    """Best of 5: host microseconds per call over `calls` back-to-back calls."""
    for _ in range(3):
        fn()
    if gpu:
        torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
        if gpu:
            torch.cuda.synchronize()
    return best


if __name__ == "__main__":
    main()
