"""Sweep launch variants of the int4 dequantize / reduce kernels on one GPU, in one run.

For every size and variant it first checks the Triton result against kernels/reference.py
bit for bit (on the GPU, at that size), then times it (CUDA-graph replays, bench_kernels'
Timer); a copy of N bf16 elements is timed at each size for the "% of copy" figures.

    python tools/bench/sweep_kernels.py --sizes 65536 --block 512 --iters 5 \
        --variants bytes-4x1 words-4x1 wordsnm-2x2      # CPU smoke test (interpreter)
    python tools/bench/sweep_kernels.py --out docs/results/kernels_h200_sweep_hop.json \\
        --variants bytes-4x1 words-4x1 words-8x2 wordsnm-4x1 bytes-4x1

A variant is KIND-WARPSxNB: KIND `bytes` (the byte kernel, _dequant_reduce_kernel),
`words` (the 32-bit-word kernels: _int4_hop_kernel for the hop, _int4_words_kernel with
exponent-trick nibble -> float for float outputs) or `wordsnm` (the float-output word
kernel with int -> float conversion instructions); WARPS warps per program, NB blocks
per program. `default` times the production launch (kernels.tuning.DEFAULT_TUNING).
Each variant is a kernels.tuning.Tuning passed to every call. List a variant twice to
see the run-to-run spread.

Operations (k=2 nodes x m=4 ranks, as tools/bench/bench_kernels.py; effective GB/s = bytes read
+ written): dequant_reduce_quantize4 (int4 [m, N/m] -> int4 [k, N/(k m)]), dequantize4
(int4 [N] -> bf16 [N]), dequant_reduce4 (int4 [k, N/k] -> fp32 [N/k], scaled sum).
"""

import argparse
import functools
import os
import sys

from bench_kernels import BENCH_BLOCK, K_NODES, M_RANKS, Timer, _fmt_size, write_json  # noqa: E402

DEFAULT_SIZES = [16 << 20, 64 << 20, 256 << 20, 1 << 30]
DEFAULT_VARIANTS = ["default"]


def parse_variant(v, Tuning, default):
    """(name, the Tuning it stands for; `default`: the production one)."""
    if v == "default":
        return v, default
    kind, _, shape = v.partition("-")
    try:
        warps, nb = (int(t) for t in shape.lower().split("x"))
    except ValueError:
        raise SystemExit(f"error: variant {v!r} is not default or KIND-WARPSxNB, e.g. words-4x1") from None
    if kind not in ("bytes", "words", "wordsnm"):
        raise SystemExit(f"error: variant {v!r}: kind must be bytes, words or wordsnm")
    return v, Tuning(words=kind != "bytes", magic=kind == "words", warps=warps, nb=nb)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=DEFAULT_SIZES)
    p.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS)
    p.add_argument("--block", type=int, default=BENCH_BLOCK)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a smoke test, Triton interpreted
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before megaq.kernels.quant is imported
    from megaq.kernels import quant, reference
    from megaq.kernels.format import packed_len
    from megaq.kernels.tuning import DEFAULT_TUNING, Tuning

    block = args.block
    variants = [parse_variant(v, Tuning, DEFAULT_TUNING) for v in args.variants]
    k, m = K_NODES, M_RANKS
    timer = Timer(device, args.iters)
    rows = []
    meta = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (Triton interpreter)", "torch": torch.__version__,
            "triton": __import__("triton").__version__, "block": block, "k_nodes": k, "m_ranks": m,
            "iters": args.iters, "command": "python tools/bench/sweep_kernels.py " + " ".join(argv or sys.argv[1:])}
    for n in args.sizes:
        torch.manual_seed(n % 1000003)
        x = torch.randn(n, device=device, dtype=torch.bfloat16)
        dst = torch.empty_like(x)
        ms = timer(lambda: dst.copy_(x), graph=False)
        rows.append({"op": "copy_bf16", "variant": "torch", "elements": n, "bytes": 4 * n, "ms": ms,
                     "GBps": 4 * n / ms / 1e6})
        dst = None
        S, L = n // (k * m), n // k
        recv = quant.reorder_quantize(x, k, m, 4, block)
        packed = quant.quantize(x, 4, block)
        fin = quant.quantize(x.view(k, L), 4, block)
        cases = {  # op: (bytes, the call's kernel and arguments, reference result)
            "dequant_reduce_quantize4": (recv.numel() + k * packed_len(S, 4, block),
                                         (quant.dequant_reduce_quantize, recv, k, S, 4, 4, block),
                                         reference.dequant_reduce_quantize(recv, k, S, 4, 4, block)),
            "dequantize4": (packed.numel() + 2 * n, (quant.dequantize, packed, n, 4, block, torch.bfloat16),
                            reference.dequantize(packed, n, 4, block, torch.bfloat16)),
            "dequant_reduce4": (fin.numel() + 4 * L, (quant.dequant_reduce, fin, L, 4, block, 0.125),
                                reference.dequant_reduce(fin, L, 4, block, 0.125)),
        }
        for name, tuning in variants:
            for op, (nbytes, call, want) in cases.items():
                fn = functools.partial(*call, tuning=tuning)
                same = bool(torch.equal(fn(), want))
                row = {"op": op, "variant": name, "elements": n, "bytes": nbytes, "identical": same}
                if same:  # a variant that is not bit-identical is never timed
                    row["ms"] = timer(fn)
                    row["GBps"] = nbytes / row["ms"] / 1e6
                rows.append(row)
                print(f"# {_fmt_size(n)} {op} {name}: identical={same} "
                      f"{row.get('GBps', float('nan')):.0f} GB/s", file=sys.stderr, flush=True)
        x = recv = packed = fin = cases = None  # free before the next size
        if device == "cuda":
            torch.cuda.empty_cache()
        if args.out:
            write_json(args.out, {"meta": meta, "results": rows, "partial": True})
    print_table(rows, args.sizes)
    if args.out:
        write_json(args.out, {"meta": meta, "results": rows})


def print_table(rows, sizes):
    copy = {r["elements"]: r["GBps"] for r in rows if r["op"] == "copy_bf16"}
    print("effective GB/s (bytes read + written); X = not bit-identical to the reference")
    print(f"{'op':<26}{'variant':<14}" + "".join(f"{_fmt_size(n):>9}" for n in sizes) + "   % of copy")
    print(f"{'copy_bf16':<26}{'torch':<14}" + "".join(f"{copy.get(n, 0):>9.0f}" for n in sizes))
    for op in dict.fromkeys(r["op"] for r in rows if r["op"] != "copy_bf16"):
        seen = {}
        for r in rows:
            if r["op"] == op:
                seen.setdefault(r["variant"], []).append(r)
        for name, rs in seen.items():
            by_n = {}
            for r in rs:  # a variant listed twice: both timings, first then second
                by_n.setdefault(r["elements"], []).append(r)
            for rep in range(max(len(v) for v in by_n.values())):
                cells, pct = "", ""
                for n in sizes:
                    r = by_n.get(n, [])[rep] if rep < len(by_n.get(n, [])) else None
                    cells += f"{'-':>9}" if r is None else (f"{'X':>9}" if not r["identical"] else f"{r['GBps']:>9.0f}")
                    if r is not None and r.get("GBps") and n in copy:
                        pct += f" {100 * r['GBps'] / copy[n]:.0f}"
                print(f"{op:<26}{name:<14}{cells}  {pct}")


if __name__ == "__main__":
    main()
