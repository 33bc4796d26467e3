"""Time qgZ's int4 kernels in the linear and the square-law code, in the same run.

For each gradient-path operation (bf16 / fp32 side of N elements, block 2048 as the
engine uses, k=2 nodes x m=4 ranks as tools/bench/bench_kernels.py), code and size:

  eager_cold_ms  one eager call (Python and launch included) after a 512 MiB write that
                 evicts the L2 cache; CUDA events; median (bench_qgz_paths.cold_eager_ms)
  graph_ms       10 calls per CUDA graph replayed back to back (bench_kernels.Timer)
  GB/s           (bytes read + written) / graph_ms

Before timing, every operation's Triton output is compared with the torch reference
(kernels/reference.py) on the same device, bit for bit, at every size. Also one rank's
whole qgZ unit (QuantizedGradReducer, all-to-alls replaced by local copies, as
bench_qgz_paths.py) per code.

    python tools/bench/bench_qgz_code.py --out $OUT/qgz_code_h200.json          # GPU
    python tools/bench/bench_qgz_code.py --device cpu --sizes 65536 --block 512 --iters 2  # smoke
"""

import argparse
import json
import os
import sys
from types import SimpleNamespace

import _checkout  # noqa: E402  (a link to tools/_checkout.py: the checkout's megaq first)

_checkout.use_checkout()

K_NODES, M_RANKS = 2, 4
CODES = ("linear", "square")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--sizes", type=int, nargs="+", default=None, help="elements (default 16M 64M 256M)")
    p.add_argument("--block", type=int, default=None, help="quantization block (default: the engine's, 2048)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default=None, help="write results as JSON here")
    return p.parse_args(argv)


def cases(torch, kern, n, block, code, device):
    """(op, bytes moved, fn) for the int4 gradient operations at N = n elements."""
    from megaq.kernels.format import packed_len

    k, m = K_NODES, M_RANKS
    g = torch.Generator(device=device).manual_seed(n)
    x = (torch.randn(n, device=device, generator=g) * torch.exp(torch.randn(n, device=device, generator=g)))
    x = x.to(torch.bfloat16)
    res = torch.zeros(n, device=device)
    q = kern.quantize(x, 4, block, code)
    rows = kern.reorder_quantize(x, k, m, 4, block, code=code)  # [m, packed(n/m)]: the in-node rows
    S = n // (k * m)
    hop = kern.dequant_reduce_quantize(rows, k, S, 4, 4, block, code)  # [k, packed(S)]
    fin = torch.zeros(S, device=device)
    p4 = packed_len(n, 4, block)
    return [
        ("quantize4", 2 * n + p4, lambda: kern.quantize(x, 4, block, code)),
        ("dequantize4", p4 + 2 * n, lambda: kern.dequantize(q, n, 4, block, torch.bfloat16, code)),
        ("reorder_quantize4", 2 * n + p4, lambda: kern.reorder_quantize(x, k, m, 4, block, code=code)),
        ("reorder_quantize4+residual", 2 * n + 8 * n + p4,
         lambda: kern.reorder_quantize(x, k, m, 4, block, res, code)),
        ("dequant_reduce_quantize4", rows.numel() + hop.numel(),
         lambda: kern.dequant_reduce_quantize(rows, k, S, 4, 4, block, code)),
        ("dequant_reduce4", hop.numel() + 8 * S,
         lambda: kern.dequant_reduce(hop, S, 4, block, 1.0 / (k * m), fin, code)),
    ]


def check_identical(torch, quant, reference, n, block, code, device):
    """Every operation: Triton == the torch reference, bit for bit (fresh inputs and
    residuals, so both start from the same state)."""
    for (op, _, fa), (_, _, fb) in zip(cases(torch, quant, n, block, code, device),
                                       cases(torch, reference, n, block, code, device)):
        a, b = fa(), fb()
        if not torch.equal(a, b):
            raise SystemExit(f"error: {op} ({code}, N={n}): Triton differs from the reference "
                             f"in {(a != b).sum().item()} elements")


def main(argv=None):
    args = parse_args(argv)
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from bench_kernels import Timer
    from bench_qgz_paths import cold_eager_ms
    from megaq.kernels import quant, reference
    from megaq.zero.config import DEFAULT_BLOCK_SIZE, ZeroConfig
    from megaq.zero.zeropp.grads import QuantizedGradReducer
    from megaq.zero.zeropp.rails import Rails

    block = args.block or DEFAULT_BLOCK_SIZE
    sizes = args.sizes or ([16 << 20, 64 << 20, 256 << 20] if device == "cuda" else [16 * block])
    bad = [N for N in sizes if N % (K_NODES * M_RANKS * block)]
    if bad:
        sys.exit(f"error: sizes {bad} are not multiples of {K_NODES * M_RANKS} x block {block}; pick multiples")
    timer = Timer(device, args.iters)
    rows = []

    def record(op, code, N, nbytes, fn):
        rec = {"op": op, "code": code, "elements": N, "bytes": nbytes,
               "eager_cold_ms": cold_eager_ms(torch, fn, args.iters, device), "graph_ms": timer(fn)}
        rec["graph_GBps"] = nbytes / rec["graph_ms"] / 1e6 if nbytes else None
        rows.append(rec)
        rate = f"{rec['graph_GBps']:8.0f} GB/s" if nbytes else ""
        print(f"{N:>11} {op:28s} {code:6s} eager(cold L2) {rec['eager_cold_ms']:8.3f} ms  "
              f"graph {rec['graph_ms']:8.4f} ms {rate}", flush=True)

    for N in sizes:
        for code in CODES:
            check_identical(torch, quant, reference, N, block, code, device)
        for code in CODES:
            for op, nbytes, fn in cases(torch, quant, N, block, code, device):
                record(op, code, N, nbytes, fn)
            if device == "cuda":
                torch.cuda.empty_cache()
        n = K_NODES * M_RANKS
        grad = torch.randn(N, device=device, dtype=torch.bfloat16)
        out = torch.zeros(N // n, device=device)
        local = SimpleNamespace(size=1)  # all-to-all over one member: a local copy
        for code in CODES:
            cfg = ZeroConfig(quantized_gradients=True, block_size=block, grad_code=code)
            red = QuantizedGradReducer(cfg, Rails(k=K_NODES, m=M_RANKS, a=1, j=1), local, local)
            record("qgZ unit (one rank)", code, N, 0, lambda red=red: red.start_reduce("u", grad, out).finish())
    meta = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (Triton interpreter)",
            "torch": torch.__version__, "block": block, "k_nodes": K_NODES, "m_ranks": M_RANKS,
            "iters": args.iters, "bit_identical": "Triton == reference, every op, code and size",
            "command": "python " + " ".join([os.path.relpath(__file__)] + (argv if argv is not None else sys.argv[1:]))}
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out + ".tmp", "w") as f:
            json.dump({"meta": meta, "results": rows}, f, indent=1)
        os.replace(args.out + ".tmp", args.out)


if __name__ == "__main__":
    main()
