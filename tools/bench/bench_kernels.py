"""Benchmark the quantization kernels: effective GB/s (bytes read + written).

For each size N (elements of the operation's full-precision side) it times the Triton
kernel, the plain-PyTorch reference (eager, and torch.compile'd), and a device-to-device
copy of N bf16 elements, all in the same run; with --deepspeed also DeepSpeed's CUDA
kernels (its QuantizerBuilder op, JIT-built on first use) on the same shapes. Prints a
table and writes JSON (--out).

Two timings per case (GPU):
  graph  CUDA-graph replays back to back (--calls-per-graph calls per graph): the
         kernels' throughput, with no host cost (`ms`, `GBps`)
  cold   one eager call at a time with the L2 flushed before it (triton.testing.do_bench,
         median): the call as a training step makes it, Python and launch included
         (`cold_ms`, `cold_GBps`); --cold-rounds rounds, each over every case of a size in
         turn (megaq's and DeepSpeed's interleaved), the median round counts; the ratio to
         DeepSpeed is paired round by round (its round i over ours), the median and the
         lowest of those ratios reported (`vs_deepspeed_cold`, `vs_deepspeed_cold_min`)
Impl `triton` uses the cached launcher (kernels/launch.py), `triton_jit` the same kernel
through Triton's JIT launch (`tuning=Tuning(cached_launch=False)`; cold timing only: in a
graph both are the same kernel). --sweep passes its launch shapes the same way, as a
kernels.tuning.Tuning to every call.

    python tools/bench/bench_kernels.py --out docs/results/kernels_h200.json          # GPU
    python tools/bench/bench_kernels.py --deepspeed --no-reference --sizes 16777216 67108864 \
        --out $OUT/kernels_vs_deepspeed.json                                         # GPU, vs DeepSpeed
    python tools/bench/bench_kernels.py --device cpu --sizes 65536 --block 1024     # smoke test

Operations (bf16 input/output, fp32 accumulation):
  quantize8 / quantize4        bf16 [N] -> packed int8 / int4
  dequantize8 / dequantize4    packed -> bf16 [N]
  reorder_quantize4            bf16 gradient [N], k=2 nodes x m=4 ranks -> int4 [m, ...]
  dequant_reduce_quantize4     int4 [m=4, N/m] received rows -> sum -> int4 [k=2, N/(m k)]
  dequant_reduce4              int4 [k=2, N/k] -> fp32 [N/k] (scaled sum)
  reorder_quantize4_had        reorder_quantize4 with the Hadamard transform fused in
                               (--zero-hadamard-gradients; same bytes)
  dequant_reduce4_had          dequant_reduce4 with the inverse transform fused in

DeepSpeed's counterparts (fp16 in/out: its kernels read and write __half; they read
the same input buffer as megaq's, its bf16 bits taken as fp16), groups of --block
elements, symmetric: quantize / dequantize (8 and 4 bits), swizzle_quant
(reorder_quantize4, k nodes x m ranks), quantized_reduction (the hop, m ranks per
node). GB/s use megaq's byte count for the operation; `vs DeepSpeed`
is DeepSpeed's time over megaq's (above 1: megaq is faster). With --sweep, DeepSpeed's
kernels for the swept ops are timed in the sweep's rounds too, so every shape gets a
paired ratio.
"""

import argparse
import functools
import json
import os
import re
import statistics
import sys
import tempfile
import time

import _checkout  # noqa: E402  (a link to tools/_checkout.py: the checkout's megaq first)

_checkout.use_checkout()

DEFAULT_SIZES = [16 << 20, 64 << 20, 256 << 20, 1 << 30]
# The quantization block of the kernel table (docs/KERNELS.md; training's own is
# ZeroConfig.block_size, 2048): chosen here and passed to every kernel call.
BENCH_BLOCK = 4096
K_NODES, M_RANKS = 2, 4


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--sizes", type=int, nargs="+", default=None, help="element counts (default 16M 64M 256M 1G)")
    p.add_argument("--block", type=int, default=BENCH_BLOCK,
                   help=f"quantization block (default {BENCH_BLOCK}, the kernel table's)")
    p.add_argument("--sweep", nargs="*", default=[], metavar="SHAPE",
                   help="also time the Triton kernels for these launch shapes, e.g. 4096x8x2 "
                        "(block size, warps per program, blocks per program). SHAPE: " + SHAPE_HELP
                        + "; e.g. 4096x4x2e or 4096x4x1t")
    p.add_argument("--sweep-size", type=int, nargs="+", default=None, help="elements for the sweep (default 256M)")
    p.add_argument("--ops", nargs="+", default=None, metavar="OP",
                   help="time only these operations (table and sweep), e.g. quantize8 quantize4")
    p.add_argument("--skip-table", action="store_true", help="only run the sweep")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--calls-per-graph", type=int, default=10,
                   help="kernel calls captured in one CUDA graph per replay (default 10; 1 adds the "
                        "graph launch to every call)")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile'd baselines")
    p.add_argument("--compile-ops", nargs="*", default=None,
                   help="only these ops get a torch.compile'd baseline (default: all), e.g. quantize8")
    p.add_argument("--no-reference", action="store_true",
                   help="skip the plain-torch baselines (eager and compiled)")
    p.add_argument("--deepspeed", action="store_true",
                   help="also time DeepSpeed's quantizer kernels (needs the deepspeed package, a CUDA "
                        "toolkit and ninja: `pip install .[bench-deepspeed]`; docs/KERNELS.md)")
    p.add_argument("--cold-reps", type=int, default=100,
                   help="do_bench's measuring time in ms for the cold per-call timing (default 100)")
    p.add_argument("--cold-rounds", type=int, default=3,
                   help="cold timings per case, in rounds over all cases of a size; the median counts "
                        "(default 3)")
    p.add_argument("--out", default=None, help="write results as JSON here")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before megaq.kernels.quant is imported
    from megaq.kernels import quant, reference
    from megaq.kernels.format import packed_len
    from megaq.kernels.tuning import Tuning

    block = args.block
    sizes = args.sizes or (DEFAULT_SIZES if device == "cuda" else [64 * block])
    use_compile = not args.no_compile and not args.no_reference and device == "cuda"
    if args.deepspeed and device != "cuda":
        sys.exit("error: --deepspeed needs a CUDA device (DeepSpeed's kernels are CUDA only); drop it on CPU")
    shapes = [parse_shape(c) for c in args.sweep]
    if args.deepspeed and len({sh[0] for sh in shapes}) > 1:
        sys.exit("error: --sweep shapes with --deepspeed must share one block size (DeepSpeed's group size)")
    ds = load_deepspeed() if args.deepspeed else None
    step = block * K_NODES * M_RANKS
    bad = [n for n in sizes if n % step]
    if bad:
        sys.exit(f"error: sizes {bad} are not multiples of block * {K_NODES * M_RANKS} = {step}; pick multiples")

    timer = Timer(device, args.iters, args.calls_per_graph, args.cold_reps, args.cold_rounds)
    compiled = {}

    def baseline(op, fn):
        if not use_compile or (args.compile_ops is not None and op not in args.compile_ops):
            return None
        if fn not in compiled:
            compiled[fn] = torch.compile(fn, dynamic=True)
        return compiled[fn]

    meta = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (Triton interpreter)",
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "block": block,
        "k_nodes": K_NODES,
        "m_ranks": M_RANKS,
        "iters": args.iters,
        "timing": f"ms: CUDA graph replays back to back, {args.calls_per_graph} calls per graph "
                  "(copy: eager back to back), median of batches; cold_ms: one eager call after an L2 "
                  f"flush, triton.testing.do_bench median over {args.cold_reps} ms, median of "
                  f"{args.cold_rounds} rounds taken in turn over the cases of a size",
        "deepspeed": ds.version if ds else None,
        "command": "python " + " ".join([os.path.relpath(__file__)] + (argv if argv is not None else sys.argv[1:])),
    }
    results = []
    for n in ([] if args.skip_table else sizes):
        try:
            results += bench_size(torch, quant, reference, packed_len, n, block, device, timer, baseline,
                                  Tuning(cached_launch=False), reference_baselines=not args.no_reference, ds=ds,
                                  only_ops=args.ops)
        except torch.OutOfMemoryError:
            print(f"# {n} elements: out of memory, skipped", file=sys.stderr)
        if device == "cuda":
            torch.cuda.empty_cache()
        if args.out:  # partial results survive a timeout
            write_json(args.out, {"meta": meta, "results": results, "block_sweep": [], "partial": True})
    sweep = []
    if args.sweep:
        for n in args.sweep_size or [256 << 20 if device == "cuda" else sizes[0]]:
            sweep += bench_tuning(torch, quant, packed_len, Tuning, n, shapes, device, timer, args.ops, ds)

    print_table(results, sizes)
    ratios = deepspeed_ratios(results)
    if ratios:
        print_ratios(ratios, sizes)
    for n in dict.fromkeys(r["elements"] for r in sweep):
        rows = [r for r in sweep if r["elements"] == n]
        print(f"\ntuning sweep at {_fmt_size(n)} elements: GB/s, graph replay | cold per call"
              + (" | DeepSpeed's time over this shape's per call, median (lowest) of the rounds"
                 if ds else ""))
        shapes = list(dict.fromkeys(r["shape"] for r in rows))
        by_key = {(r["op"], r["shape"]): r for r in rows}
        ops = list(dict.fromkeys(r["op"] for r in rows))
        print(f"{'block x warps x NB':<20}" + "".join(f"{op[:15]:>34}" for op in ops))
        for sh in shapes:
            line = f"{sh:<20}"
            for op in ops:
                c = by_key.get((op, sh))
                cell = "-" if c is None else f"{c['GBps']:.0f}"
                if c is not None and "cold_ms" in c:
                    cell += f" | {c['cold_GBps']:.0f}"
                    if "vs_deepspeed_cold" in c:
                        cell += f" | {c['vs_deepspeed_cold']:.3f}x ({c['vs_deepspeed_cold_min']:.3f})"
                line += f"{cell:>34}"
            print(line)
    if args.out:
        write_json(args.out, {"meta": meta, "results": results, "vs_deepspeed": ratios, "block_sweep": sweep})


class Timer:
    """Milliseconds per call. On CUDA, CALLS_PER_GRAPH calls are captured in one CUDA
    graph and the graph is replayed back to back (median over several batches of
    replays), so Python, launch and graph-launch overhead stay out of the figure, as for
    kernels launched back to back from C++ (docs/PERFORMANCE.md compares 1 and 10 calls
    per graph); eager timing is the fallback when capture fails."""

    def __init__(self, device, iters, calls_per_graph=10, cold_reps=100, cold_rounds=3):
        self.device, self.iters, self.CALLS_PER_GRAPH = device, iters, calls_per_graph
        self.cold_reps, self.cold_rounds = cold_reps, cold_rounds

    def cold_in_rounds(self, timed):
        """Per-call timings of (row, fn) cases in `cold_rounds` rounds, each round over
        every case in turn, the median round kept in row["cold_ms"]: a slow spell of the
        host lands on all cases alike (megaq's and DeepSpeed's), not on whichever case it
        met."""
        for _ in range(self.cold_rounds):
            for row, fn in timed:
                row.setdefault("cold_ms_rounds", []).append(self.cold(fn))
        for row, _ in timed:
            rounds = row["cold_ms_rounds"]
            row["cold_ms"] = statistics.median_high(rounds)
            row["cold_GBps"] = row["bytes"] / row["cold_ms"] / 1e6

    def cold(self, fn):
        """Milliseconds of one eager call with the L2 flushed first (do_bench: a 256 MB
        write before each call, CUDA events around the call, median). Host time that
        outlasts the flush shows up in the figure. CPU: the host clock, as __call__."""
        if self.device != "cuda":
            return self(fn)
        from triton.testing import do_bench

        return do_bench(fn, warmup=10, rep=self.cold_reps, return_mode="median")

    def __call__(self, fn, graph=True):
        import torch

        if self.device != "cuda":
            fn()
            times = []
            for _ in range(max(1, self.iters // 5)):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
            return statistics.median_high(times)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        try:
            if not graph:
                raise RuntimeError("graph not wanted")
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(self.CALLS_PER_GRAPH):
                    fn()
            run, calls = graph.replay, self.CALLS_PER_GRAPH
        except Exception as exc:  # capture unsupported for this callable: time it eagerly
            if graph is not False:
                print(f"# graph capture failed ({type(exc).__name__}); timing eagerly", file=sys.stderr)
            graph, run, calls = None, fn, 1
        torch.cuda.synchronize()
        reps = 5
        times = []
        for _ in range(max(3, self.iters // reps)):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / (reps * calls))
        del graph
        return statistics.median_high(times)


def bench_size(torch, quant, reference, packed_len, n, block, device, timer, baseline, jit, reference_baselines=True,
               ds=None, only_ops=None):
    """The table's rows at n elements. `jit`: the Tuning of the triton_jit rows (every
    launch through Triton's JIT)."""
    k, m = K_NODES, M_RANKS
    x = torch.randn(n, device=device, dtype=torch.bfloat16)
    rows, cases = [], []

    def add(op, impl, nbytes, fn, graph=True, cold=True):
        if only_ops and op not in only_ops and op != "copy_bf16":
            return
        if fn is not None and (reference_baselines or impl not in ("eager", "compiled")):
            cases.append((op, impl, nbytes, fn, graph, cold))

    def add_triton(op, nbytes, kernel, *args, **kwargs):
        """kernel(*args, **kwargs) as megaq launches it (the production Tuning), and through
        Triton's JIT launch (per call only)."""
        add(op, "triton", nbytes, functools.partial(kernel, *args, **kwargs))
        add(op, "triton_jit", nbytes, functools.partial(kernel, *args, **kwargs, tuning=jit), graph=None)

    def time_case(op, impl, nbytes, fn, graph, cold):
        """The graph timing; the row, and whether it takes a cold (per-call) timing."""
        try:
            ms = timer(fn, graph) if graph is not None else None
        except Exception as exc:  # a torch.compile failure must not lose the other numbers
            if impl != "compiled":
                raise
            print(f"# {op} {impl} at {n}: {type(exc).__name__}: {str(exc)[:200]}", file=sys.stderr)
            return None
        cold = cold and device == "cuda"
        if ms is None and not cold:  # cold-only case off the GPU
            return None
        row = {"op": op, "impl": impl, "elements": n, "bytes": nbytes}
        if ms is not None:
            row.update(ms=ms, GBps=nbytes / ms / 1e6)
        rows.append(row)
        return (row, fn) if cold else None

    check_identical(torch, quant, reference, x, n, block, rows)
    dst = torch.empty_like(x)
    # eager, back to back: a D2D memcpy captured in a CUDA graph runs on the copy engines
    # (~2.6 TB/s on the H200), while the eager one runs as a kernel at full speed
    add("copy_bf16", "torch", 4 * n, lambda: dst.copy_(x), graph=False, cold=False)

    for bits in (8, 4):
        P = packed_len(n, bits, block)
        q_bytes = 2 * n + P
        add_triton(f"quantize{bits}", q_bytes, quant.quantize, x, bits, block)
        add(f"quantize{bits}", "eager", q_bytes, lambda bits=bits: reference.quantize(x, bits, block))
        comp = baseline(f"quantize{bits}", reference.quantize)
        add(f"quantize{bits}", "compiled", q_bytes, comp and (lambda bits=bits, comp=comp: comp(x, bits, block)))
        args = (quant.quantize(x, bits, block), n, bits, block, torch.bfloat16)
        add_triton(f"dequantize{bits}", q_bytes, quant.dequantize, *args)
        add(f"dequantize{bits}", "eager", q_bytes, lambda args=args: reference.dequantize(*args))
        comp = baseline(f"dequantize{bits}", reference.dequantize)
        add(f"dequantize{bits}", "compiled", q_bytes, comp and (lambda args=args, comp=comp: comp(*args)))

    # fused reorder + int4 quantize of a gradient split over k*m ranks
    S = n // (k * m)
    r_bytes = 2 * n + m * packed_len(k * S, 4, block)
    add_triton("reorder_quantize4", r_bytes, quant.reorder_quantize, x, k, m, 4, block)
    add("reorder_quantize4", "eager", r_bytes, lambda: reference.reorder_quantize(x, k, m, 4, block))
    comp = baseline("reorder_quantize4", reference.reorder_quantize)
    add("reorder_quantize4", "compiled", r_bytes, comp and (lambda comp=comp: comp(x, k, m, 4, block)))

    add_triton("reorder_quantize4_had", r_bytes, quant.reorder_quantize, x, k, m, 4, block, hadamard=True)
    add("reorder_quantize4_had", "eager", r_bytes,
        lambda: reference.reorder_quantize(x, k, m, 4, block, hadamard=True))

    # in-node hop: m received rows of k*S elements each -> k requantized chunks of S
    recv = quant.reorder_quantize(x, k, m, 4, block)
    drq_bytes = recv.numel() + k * packed_len(S, 4, block)
    add_triton("dequant_reduce_quantize4", drq_bytes, quant.dequant_reduce_quantize, recv, k, S, 4, 4, block)
    add("dequant_reduce_quantize4", "eager", drq_bytes,
        lambda: reference.dequant_reduce_quantize(recv, k, S, 4, 4, block))
    comp = baseline("dequant_reduce_quantize4", reference.dequant_reduce_quantize)
    add("dequant_reduce_quantize4", "compiled", drq_bytes, comp and (lambda comp=comp: comp(recv, k, S, 4, 4, block)))

    # final hop: k rows of n/k elements -> fp32 sum
    L = n // k
    fin = quant.quantize(x.view(k, L), 4, block)
    dr_bytes = fin.numel() + 4 * L
    add_triton("dequant_reduce4", dr_bytes, quant.dequant_reduce, fin, L, 4, block, 0.125)
    add("dequant_reduce4", "eager", dr_bytes, lambda: reference.dequant_reduce(fin, L, 4, block, 0.125))
    comp = baseline("dequant_reduce4", reference.dequant_reduce)
    add("dequant_reduce4", "compiled", dr_bytes, comp and (lambda comp=comp: comp(fin, L, 4, block, 0.125)))
    add_triton("dequant_reduce4_had", dr_bytes, quant.dequant_reduce, fin, L, 4, block, 0.125, hadamard=True)
    add("dequant_reduce4_had", "eager", dr_bytes,
        lambda: reference.dequant_reduce(fin, L, 4, block, 0.125, hadamard=True))

    if ds is not None:
        nbytes = {"quantize8": 2 * n + packed_len(n, 8, block), "quantize4": 2 * n + packed_len(n, 4, block),
                  "reorder_quantize4": r_bytes, "dequant_reduce_quantize4": drq_bytes}
        nbytes["dequantize8"], nbytes["dequantize4"] = nbytes["quantize8"], nbytes["quantize4"]
        for op, fn in ds.cases(torch, x, block, k, m, rows).items():
            add(op, "deepspeed", nbytes[op], fn)
    # the copy and the Triton kernels first, the (long-running) torch baselines after
    # them, so that no baseline's heat or clock state lands on a kernel's figure
    timed = [time_case(*case) for case in sorted(cases, key=lambda c: c[1] not in ("torch", "triton", "triton_jit",
                                                                                  "deepspeed"))]
    timer.cold_in_rounds([t for t in timed if t is not None])
    return rows


class DeepSpeedKernels:
    """DeepSpeed's quantizer op (csrc/quantization, JIT-built by its QuantizerBuilder),
    called as its ZeRO++ code calls it: quantize / dequantize for weights (qwZ),
    swizzle_quant -> quantized_reduction for gradients (qgZ)."""

    def __init__(self, module, version):
        self.op, self.version = module, version

    def cases(self, torch, x, block, k, m, rows):
        op, sym = self.op, self.op.Symmetric
        n = x.numel()
        groups = n // block
        # Its kernels read __half: they read the very buffer megaq's read, its bf16 bits taken
        # as fp16 (finite, below 4 in magnitude for a randn input; the kernels' work does not
        # depend on the values), so where an input lies in memory cannot enter the ratio.
        xh = x.view(torch.float16)
        cases = {}
        for bits in (8, 4):
            q, s = op.quantize(xh, groups, bits, sym)
            cases[f"quantize{bits}"] = lambda bits=bits: op.quantize(xh, groups, bits, sym)
            cases[f"dequantize{bits}"] = lambda q=q, s=s, bits=bits: op.dequantize(q, s, groups, bits, sym)
            # the op is called right: the round trip within one step (its step is absmax /
            # 2^(bits-1), and the largest value clips to 2^(bits-1) - 1 steps) plus fp16 rounding
            err = (op.dequantize(q, s, groups, bits, sym).float() - xh.float()).view(groups, block).abs().amax(1)
            ok = bool((err <= s.view(-1) * (1 + 2.0 ** -8) + xh.float().view(groups, block).abs().amax(1)
                       * 2.0 ** -10).all())
            rows.append({"op": f"check_deepspeed_round_trip{bits}", "impl": "-", "elements": n, "within_bound": ok})
        qs, ss = op.swizzle_quant(xh, groups, 4, sym, 1, k, m)
        cases["reorder_quantize4"] = lambda: op.swizzle_quant(xh, groups, 4, sym, 1, k, m)
        cases["dequant_reduce_quantize4"] = lambda: op.quantized_reduction(qs, ss, groups, groups // m, 4, sym, m)
        return cases


def load_deepspeed():
    """DeepSpeed's quantizer op, JIT-built (minutes the first time; cached afterwards)."""
    try:
        import deepspeed
        from deepspeed.ops.op_builder import QuantizerBuilder
    except ImportError as exc:
        sys.exit(f"error: --deepspeed needs the deepspeed package ({exc}); install it with "
                 "`pip install .[bench-deepspeed]` (offline: docs/KERNELS.md, 'DeepSpeed comparison')")
    t0 = time.perf_counter()
    module = QuantizerBuilder().load()
    print(f"# DeepSpeed {deepspeed.__version__} quantizer op loaded in {time.perf_counter() - t0:.0f} s",
          file=sys.stderr)
    return DeepSpeedKernels(module, deepspeed.__version__)


def deepspeed_ratios(results):
    """Per op and size: DeepSpeed's time over megaq's (cached launch), per call (the
    median of the ratios paired round by round, and their lowest: pair_with_deepspeed),
    in graph replay, and per call with the JIT launch."""
    by = {(r["op"], r["impl"], r["elements"]): r for r in results if "impl" in r}
    out = []
    for (op, impl, n), d in by.items():
        t, j = by.get((op, "triton", n)), by.get((op, "triton_jit", n))
        if impl != "deepspeed" or t is None:
            continue
        pair_with_deepspeed(t, d)
        row = {"op": op, "elements": n}
        if "vs_deepspeed_cold" in t:
            row["cold"], row["cold_min"] = t["vs_deepspeed_cold"], t["vs_deepspeed_cold_min"]
        if "ms" in d and "ms" in t:
            row["graph"] = d["ms"] / t["ms"]
        if j is not None:
            pair_with_deepspeed(j, d)
            if "vs_deepspeed_cold" in j:
                row["cold_jit"] = j["vs_deepspeed_cold"]
        out.append(row)
    return out


def check_identical(torch, quant, reference, x, n, block, rows):
    """Triton == reference bit for bit at this size (catches index overflow at 1G)."""
    k, m, S = K_NODES, M_RANKS, n // (K_NODES * M_RANKS)
    ok = True
    for bits in (8, 4):
        a, b = quant.quantize(x, bits, block), reference.quantize(x, bits, block)
        ok &= torch.equal(a, b)
        ok &= torch.equal(quant.dequantize(a, n, bits, block, torch.bfloat16),
                          reference.dequantize(a, n, bits, block, torch.bfloat16))
        del a, b
    r = quant.reorder_quantize(x, k, m, 4, block)
    ok &= torch.equal(r, reference.reorder_quantize(x, k, m, 4, block))
    h = quant.dequant_reduce_quantize(r, k, S, 4, 4, block)
    ok &= torch.equal(h, reference.dequant_reduce_quantize(r, k, S, 4, 4, block))
    ok &= torch.equal(quant.dequant_reduce(h, S, 4, block, 0.125), reference.dequant_reduce(h, S, 4, block, 0.125))
    if block % 64 == 0:  # the Hadamard variants (--zero-hadamard-gradients)
        ok &= torch.equal(quant.reorder_quantize(x, k, m, 4, block, hadamard=True),
                          reference.reorder_quantize(x, k, m, 4, block, hadamard=True))
        ok &= torch.equal(quant.dequant_reduce(h, S, 4, block, 0.125, hadamard=True),
                          reference.dequant_reduce(h, S, 4, block, 0.125, hadamard=True))
    rows.append({"op": "check_triton_equals_reference", "impl": "-", "elements": n, "identical": bool(ok)})
    print(f"# {n} elements: triton == reference bit for bit: {bool(ok)}", file=sys.stderr)


SHAPE = re.compile(r"(\d+)x(\d+)x(\d+)([ct]?)(e?)(?:r(\d+))?")
SHAPE_HELP = ("BLOCKxWARPSxNB[c|t][e][rNN]; quantize variants (without a letter: off, whatever the size): "
              "c = chunk tiles (kernels.tuning.Tuning.chunked), t = bulk tensor copies for the int8 quantize of one "
              "row (Tuning.tma), e = evict-first input loads (Tuning.evict), rNN = at most NN registers a "
              "thread (Tuning.regs, Triton's maxnreg; without it: no cap)")


def parse_shape(text):
    """'4096x4x1t' -> (4096, 4, 1, 't'): block, warps, blocks per program, variant letters."""
    hit = SHAPE.fullmatch(text.lower())
    if not hit:
        sys.exit(f"error: --sweep shape {text!r} is not {SHAPE_HELP.split(';')[0]}, e.g. 4096x4x2, 4096x4x1t or 4096x8x1er32")
    block, warps, nb, layout, evict, regs = hit.groups()
    return int(block), int(warps), int(nb), layout + evict + (f"r{regs}" if regs else "")


def bench_tuning(torch, quant, packed_len, Tuning, n, shapes, device, timer, only_ops=None, ds=None):
    """Triton GB/s per launch shape (block, warps per program, blocks per program, quantize
    variant letters: one Tuning, passed to every call), graph replay and (GPU) cold per
    call, the cold timings in rounds over all shapes in turn, as the table's; with `ds`,
    DeepSpeed's kernels for the same ops in the same rounds (shape "deepspeed"), so each
    shape's ratio to them is paired round by round (pair_with_deepspeed)."""
    x = torch.randn(n, device=device, dtype=torch.bfloat16)
    k, m = K_NODES, M_RANKS
    S = n // (k * m)
    rows, timed = [], []
    for block, warps, nb, flags in shapes:
        tuning = Tuning(warps=warps, nb=nb, chunked="c" in flags, evict="evict_first" if "e" in flags else "",
                        tma="t" in flags, regs=int(flags.split("r")[1]) if "r" in flags else None)
        recv = quant.reorder_quantize(x, k, m, 4, block, tuning=tuning)
        cases = [("reorder_quantize4", 2 * n + recv.numel(),
                  functools.partial(quant.reorder_quantize, x, k, m, 4, block, tuning=tuning)),
                 ("dequant_reduce_quantize4", recv.numel() + k * packed_len(S, 4, block),
                  functools.partial(quant.dequant_reduce_quantize, recv, k, S, 4, 4, block, tuning=tuning))]
        for bits in (8, 4):
            nbytes = 2 * n + packed_len(n, bits, block)
            packed = quant.quantize(x, bits, block, tuning=tuning)
            cases.append((f"quantize{bits}", nbytes, functools.partial(quant.quantize, x, bits, block, tuning=tuning)))
            cases.append((f"dequantize{bits}", nbytes, functools.partial(quant.dequantize, packed, n, bits, block,
                                                                         torch.bfloat16, tuning=tuning)))
        for op, nbytes, fn in cases:
            if only_ops and op not in only_ops:
                continue
            ms = timer(fn)
            rows.append({"op": op, "shape": f"{block}x{warps}x{nb}{flags}", "elements": n, "ms": ms,
                         "GBps": nbytes / ms / 1e6, "bytes": nbytes})
            timed.append((rows[-1], fn))
    if ds is not None:
        nbytes = {r["op"]: r["bytes"] for r in rows}
        for op, fn in ds.cases(torch, x, shapes[0][0], k, m, []).items():
            if op in nbytes:
                ms = timer(fn)
                rows.append({"op": op, "shape": "deepspeed", "elements": n, "ms": ms,
                             "GBps": nbytes[op] / ms / 1e6, "bytes": nbytes[op]})
                timed.append((rows[-1], fn))
    if device == "cuda":
        timer.cold_in_rounds(timed)
    ds_rows = {r["op"]: r for r in rows if r["shape"] == "deepspeed"}
    for r in rows:
        if r["shape"] != "deepspeed":
            pair_with_deepspeed(r, ds_rows.get(r["op"]))
    return rows


def pair_with_deepspeed(row, ds_row):
    """DeepSpeed's time over `row`'s per call, from the same rounds
    (Timer.cold_in_rounds): round i of DeepSpeed's case over round i of the row's, as
    `vs_deepspeed_cold_rounds`, their median `vs_deepspeed_cold` and their lowest
    `vs_deepspeed_cold_min`. The two cases were timed next to each other in every round,
    so a slow spell of the host or the GPU lands on both sides of one ratio."""
    if ds_row is None or "cold_ms_rounds" not in row or "cold_ms_rounds" not in ds_row:
        return
    ratios = [a / b for a, b in zip(ds_row["cold_ms_rounds"], row["cold_ms_rounds"])]
    row["vs_deepspeed_cold_rounds"] = ratios
    row["vs_deepspeed_cold"] = statistics.median_high(ratios)
    row["vs_deepspeed_cold_min"] = min(ratios)


def print_table(results, sizes):
    for key, title in (("GBps", "effective GB/s (bytes read + written), CUDA-graph replay"),
                       ("cold_GBps", "effective GB/s, one eager call after an L2 flush (do_bench median)")):
        rows = [r for r in results if key in r]
        if not rows:
            continue
        op_order = list(dict.fromkeys(r["op"] for r in rows))  # rows grouped by op
        ops = sorted(dict.fromkeys((r["op"], r["impl"]) for r in rows), key=lambda oi: op_order.index(oi[0]))
        by_key = {(r["op"], r["impl"], r["elements"]): r[key] for r in rows}
        head = f"{'op':<26}{'impl':<11}" + "".join(f"{_fmt_size(n):>10}" for n in sizes)
        print(title)
        print(head)
        print("-" * len(head))
        for op, impl in ops:
            cells = "".join(_fmt_rate(by_key[(op, impl, n)]) if (op, impl, n) in by_key else f"{'-':>10}"
                            for n in sizes)
            print(f"{op:<26}{impl:<11}{cells}")
        print()


def print_ratios(ratios, sizes):
    print("vs DeepSpeed: its time / megaq's (per call, median | lowest of the rounds | graph replay | "
          "per call with the JIT launch)")
    head = f"{'op':<26}" + "".join(f"{_fmt_size(n):>34}" for n in sizes)
    print(head)
    print("-" * len(head))
    by = {(r["op"], r["elements"]): r for r in ratios}
    for op in dict.fromkeys(r["op"] for r in ratios):
        cells = ""
        for n in sizes:
            r = by.get((op, n), {})
            cell = " | ".join(f"{r[k]:.3f}x" if k in r else "-" for k in ("cold", "cold_min", "graph", "cold_jit"))
            cells += f"{cell:>34}"
        print(f"{op:<26}{cells}")


def _fmt_rate(v):
    return f"{v:>10.0f}" if v >= 100 else f"{v:>10.3g}"


def _fmt_size(n):
    for unit, div in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div}{unit}"
    return str(n)


def write_json(path, data):
    path = os.path.abspath(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
