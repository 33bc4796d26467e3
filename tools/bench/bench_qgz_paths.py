"""Time one rank's qgZ compute per unit for each gradient path (issue 22's opt-ins).

The fused default runs the in-node hop as one kernel (dequant_reduce_quantize); exact
own rows and error feedback run it unfused (dequantize / dequant_reduce, a sum, then
quantize, plus the residual update). This times the real code of
megaq.zero.zeropp.grads.QuantizedGradReducer for one rank of k=2 nodes x m=4 ranks
(grid position a=1, j=1), with groups of size 1 in place of the in-node and cross-node
groups: their all-to-all is a local device copy of the packed rows, so the figure is
the compute (and that copy), without any network.

Per path and size, two figures per call:
  eager_cold_ms   one eager call (Python and launches included) after a 512 MiB write
                  that evicts the L2 cache; CUDA events around the call; median.
  graph_ms        calls captured in one CUDA graph and replayed back to back
                  (tools/bench/bench_kernels.py's Timer; eager when capture fails).
Two operations: `unit` (start_reduce + finish: hop 1, hop 2 and the final reduce
of every chunk) and `hop2` (the in-node hop alone, chunk 0: fused kernel vs unfused).

    python tools/bench/bench_qgz_paths.py --out $OUT/qgz_paths_h200.json       # GPU
    python tools/bench/bench_qgz_paths.py --device cpu --sizes 65536 --block 512 --iters 3  # smoke
"""

import argparse
import json
import os
import sys
import time
from types import SimpleNamespace

import _checkout  # noqa: E402  (a link to tools/_checkout.py: the checkout's megaq first)

_checkout.use_checkout()

K_NODES, M_RANKS = 2, 4
PATHS = {  # name -> (error_feedback, grad_exact_own_rows)
    "fused (default)": (False, False),
    "exact own rows": (False, True),
    "error feedback": (True, False),
    "own rows + error feedback": (True, True),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--sizes", type=int, nargs="+", default=None,
                   help="elements of one unit's full flat gradient (default 16M 64M 256M)")
    p.add_argument("--block", type=int, default=None, help="quantization block (default: the engine's)")
    p.add_argument("--chunk", type=int, default=None, help="qgZ chunk, shard elements (default: the engine's)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default=None, help="write results as JSON here")
    return p.parse_args(argv)


def cold_eager_ms(torch, fn, iters, device):
    """Median ms of one eager call after evicting the L2 cache (512 MiB write)."""
    if device != "cuda":
        fn()
        times = []
        for _ in range(max(1, iters // 5)):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return sorted(times)[len(times) // 2]
    flush = torch.empty(512 << 20, dtype=torch.uint8, device=device)
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main(argv=None):
    args = parse_args(argv)
    import torch

    from bench_kernels import Timer
    from megaq.zero.config import DEFAULT_BLOCK_SIZE, DEFAULT_GRAD_CHUNK, ZeroConfig
    from megaq.zero.zeropp.grads import QuantizedGradReducer, chunk_bounds
    from megaq.zero.zeropp.rails import Rails

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    block = args.block or DEFAULT_BLOCK_SIZE
    chunk = args.chunk or DEFAULT_GRAD_CHUNK
    sizes = args.sizes or ([16 << 20, 64 << 20, 256 << 20] if device == "cuda" else [64 * block])
    n = K_NODES * M_RANKS
    bad = [N for N in sizes if N % (n * block)]
    if bad:
        sys.exit(f"error: sizes {bad} are not multiples of {n} ranks x block {block} = {n * block}; pick multiples")
    rails = Rails(k=K_NODES, m=M_RANKS, a=1, j=1)
    local = SimpleNamespace(size=1)  # comm.all_to_all over one member: a local copy
    timer = Timer(device, args.iters)
    rows = []
    for N in sizes:
        S = N // n
        grad = torch.randn(N, device=device, dtype=torch.bfloat16)
        out = torch.zeros(S, device=device, dtype=torch.float32)
        for name, (ef, own) in PATHS.items():
            cfg = ZeroConfig(quantized_gradients=True, error_feedback=ef, grad_exact_own_rows=own,
                             block_size=block, grad_chunk=chunk)
            red = QuantizedGradReducer(cfg, rails, local, local)
            bounds = chunk_bounds(S, block, chunk)

            def unit(red=red):
                red.start_reduce("unit", grad, out).finish()

            hop1 = red._issue_hop1("unit", 0, bounds[0], grad.reshape(n, S))
            hop1[1].wait()
            hop1 = (hop1[0], None, hop1[2])  # received: time the hop itself, no wait

            def hop2(red=red, hop1=hop1):
                red._issue_hop2("unit", 0, bounds[0], hop1)

            for op, fn in (("unit", unit), ("hop2", hop2)):
                rec = {"path": name, "op": op, "elements": N, "shard": S, "chunks": len(bounds),
                       "chunk0_elements": bounds[0][1] - bounds[0][0],
                       "eager_cold_ms": cold_eager_ms(torch, fn, args.iters, device),
                       "graph_ms": timer(fn)}
                rows.append(rec)
                print(f"{N:>11} {op:5s} {name:28s} eager(cold L2) {rec['eager_cold_ms']:8.3f} ms   "
                      f"graph {rec['graph_ms']:8.3f} ms", flush=True)
            del red
            if device == "cuda":
                torch.cuda.empty_cache()
    meta = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (torch reference)",
            "torch": torch.__version__, "block": block, "chunk": chunk, "k_nodes": K_NODES,
            "m_ranks": M_RANKS, "grid_position": "a=1, j=1", "iters": args.iters,
            "command": "python " + " ".join([os.path.relpath(__file__)] + (argv if argv is not None else sys.argv[1:]))}
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"meta": meta, "results": rows}, f, indent=1)
        os.replace(tmp, args.out)


if __name__ == "__main__":
    main()
