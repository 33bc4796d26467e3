"""fc1's FP8 backward in one pass (megaq.kernels.fused_swiglu.swiglu_backward_fp8: SwiGLU's
backward writing E5M2 dY, its transpose and |dY|'s max) against the passes it replaces.

Per shape (the tokens of a micro-batch x the FFN width of a bench_train size):

  fused            the op training runs (the committed tiles: BM_FP8 x BF_FP8, WARPS_FP8, and
                   the GPU's FP8 conversion where it has one, sm_89 on, else integer rounding)
  unfused          the bf16 SwiGLU backward kernel, then the cast with its amax (compiled:
                   inductor's one kernel, as in a compiled block) and the transpose op:
                   the path of SwiGLU after the GEMM (bench_train's -nse variants)
  tiles BMxBF/W C  the fused kernel at other tile shapes, warp counts and conversions C (gpu:
                   the instruction, int: integer rounding) (--no-tiles: none)

  cold   per call, eager, each after a 256 MB write that flushes the L2 (do_bench median)
  graph  10 calls in one CUDA graph, replayed (bench_kernels.py's Timer, both columns)

Bytes are what the fused pass must move: dOut and y read (2 + 4 bytes per element of
dOut at 16 bits), dY's FP8 copy and its transpose written (2 + 2), 10 per element.
`bits`: the fused op's Q^T is its Q transposed byte for byte, and every code of its Q is
within one of the unfused path's (which rounds dY to bf16 twice, as autograd does, where
the kernel rounds once; tests/test_fused_kernels.py), for data whose scale saturates some
values; exit status 1 if a shape fails it.

    python tools/bench/bench_swiglu_fp8.py --out swiglu_fp8.json
"""

from __future__ import annotations

import argparse
import functools
import sys

import torch

import _checkout  # noqa: E402  (a link to tools/_checkout.py: the checkout's megaq first)

_checkout.use_checkout()

from bench_kernels import Timer, write_json  # noqa: E402  (the kernels' two timers)

# name -> (tokens of bench_train's micro-batch, FFN width): 1.3B 8 x 2048, 3B 4 x 2048
SHAPES = {"1.3B": (8 * 2048, 5440), "3B": (4 * 2048, 8192)}
TILES = [(64, 64, 4), (128, 64, 8), (128, 64, 4), (32, 128, 4), (64, 128, 4), (128, 128, 8), (256, 64, 8),
         (128, 32, 4)]
FP8 = torch.float8_e5m2  # dY's format in the hybrid recipe


def bench_shape(name, N, F, timer, tiles):
    from megaq.kernels import fused_swiglu_triton as K
    from megaq.kernels.fused_swiglu import swiglu_backward, swiglu_backward_fp8
    from megaq.kernels.transpose import transpose
    from megaq.parallel import fp8
    g = torch.Generator(device="cuda").manual_seed(0)
    y = torch.randn(N, 2 * F, device="cuda", generator=g).to(torch.bfloat16)
    do = (torch.randn(N, F, device="cuda", generator=g) * 1e-2).to(torch.bfloat16)
    scale = torch.tensor(torch.finfo(FP8).max / 0.05, device="cuda")  # |dY| > 0.05 saturates

    cast_amax = torch.compile(lambda dy: (fp8.cast(dy, scale, FP8), fp8.tensor_amax(dy)))

    def unfused():
        dy = swiglu_backward(do, y)
        q, amax = cast_amax(dy)
        return q, transpose(q), amax

    fused = lambda: swiglu_backward_fp8(do, y, scale, FP8)  # noqa: E731
    (q, qt, _), (rq, _, _) = fused(), unfused()
    codes = q.view(torch.uint8).int(), rq.view(torch.uint8).int()
    bits = (torch.equal(qt.view(torch.uint8), q.view(torch.uint8).t().contiguous())
            and bool(((codes[0] - codes[1]).abs() <= 1).all()))

    nbytes = 10 * N * F
    cases = [("fused", fused), ("unfused", unfused)]
    hw_committed = K.uses_hw_cast(y)
    committed = (K.BM_FP8, K.BF_FP8, K.WARPS_FP8, hw_committed)
    casts = [True, False] if hw_committed else [False]
    cases += [(f"tiles {bm}x{bf}/{w} {'gpu' if hw else 'int'}",
               functools.partial(K.swiglu_backward_fp8_at, do, y, scale, FP8, (bm, bf, w), hw))
              for hw in casts for bm, bf, w in tiles if (bm, bf, w, hw) != committed]
    rows = []
    for variant, fn in cases:
        cold, graph = timer.cold(fn), timer(fn)
        rows.append(dict(shape=name, tokens=N, ffn=F, variant=variant, bytes=nbytes, cold_ms=cold,
                         graph_ms=graph, cold_TBps=nbytes / cold / 1e9, graph_TBps=nbytes / graph / 1e9))
    base = next(r for r in rows if r["variant"] == "unfused")
    for r in rows:
        r["vs_unfused_cold"], r["vs_unfused_graph"] = base["cold_ms"] / r["cold_ms"], base["graph_ms"] / r["graph_ms"]
    return rows, bits


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--no-tiles", action="store_true", help="skip the tile-shape sweep")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", default=None, help="JSON results")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("error: bench_swiglu_fp8.py times the GPU kernels and needs CUDA; run it on a GPU machine",
              file=sys.stderr)
        sys.exit(2)
    timer = Timer("cuda", args.iters)
    rows, ok = [], True
    for name in args.shapes:
        shape_rows, bits = bench_shape(name, *SHAPES[name], timer, [] if args.no_tiles else TILES)
        rows += shape_rows
        ok &= bits
        print(f"{name}: Q^T is Q transposed and Q within one code of the unfused path: {bits}")
    print("| shape | variant | cold ms | graph ms | cold TB/s | graph TB/s | vs unfused (cold / graph) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['variant']} | {r['cold_ms']:.3f} | {r['graph_ms']:.3f} | {r['cold_TBps']:.2f} "
              f"| {r['graph_TBps']:.2f} | {r['vs_unfused_cold']:.2f}x / {r['vs_unfused_graph']:.2f}x |")
    if args.out:
        write_json(args.out, dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                                  command=" ".join(sys.argv), bits_equal=ok, results=rows))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
