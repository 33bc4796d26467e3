"""Experiment, not part of megaq: would FMA make the fused int4 hop 3x DeepSpeed's?

The qgZ hop kernel (kernels/quant.py, _int4_words_kernel) is bound by instruction issue
and keeps bit-identity with the torch reference, which rules out fused multiply-adds.
This file holds a prototype of the same hop (int4 in, int4 out, m rows summed in fp32)
under a different, still exactly reproducible contract, and times it next to the real
kernel on one GPU:

* dequantize-and-add as one FFMA per element: exact when q * scale is exact, i.e. when
  every scale has at most 20 significant bits (scales rounded up to 20 bits: the
  quantization step grows by < 2^-19 relative);
* requantize with one FFMA, fma(x, inv, 1.5 * 2^23): round half to even of the exact
  product, and the nibble sits in the result's low bits (no float -> int conversion);
* one division per block (inv = 1 / scale) instead of two.

SASS for sm_90 (Triton 3.9 on the CPU box, 4 rows, block 4096, 4 warps): 741
instructions up to the final EXIT against 948 for the real kernel (1.28x fewer).
Measured: docs/PERFORMANCE.md ("FMA prototype of the int4 hop") and
docs/results/kernels_h200_int4_hop_fma_prototype.json.

    ln -sfn ../kernels megaq/kernels; export PYTHONPATH=$PWD   # on the GPU machine
    python tools/experiments/int4_hop_fma_prototype.py --out docs/results/kernels_h200_int4_hop_fma_prototype.json

Timing and sizes as tools/bench_kernels.py (its Timer: CUDA-graph replays, median;
k = 2 nodes x m = 4 ranks; bytes read + written); prints a table, writes JSON.
"""
import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl

from megaq.kernels import quant, reference
from megaq.kernels.format import TINY, packed_len
from megaq.kernels.quant import _load_tile, _nibble_scales, _store_tile, _word_nibbles, _word_program


@triton.jit
def _qb(x, inv):
    # fma(x, inv, 1.5*2^23): round half to even of the exact product; q in the low bits
    return (x * inv + 12582912.0).to(tl.int32, bitcast=True)


@triton.jit
def proto_kernel(in_ptr, out_ptr, in_row_words, in_payload_words, in_rows_per_out, in_blocks_per_out,
                 out_row_groups, out_row_words, out_payload_words,
                 NB: tl.constexpr, N_SUM: tl.constexpr, W: tl.constexpr, W_P2: tl.constexpr, TINY: tl.constexpr):
    # the real kernel's indexing and nibble decoding (kernels/quant.py); what differs is
    # below: products are accumulated with FMA and the requantization
    orow, ob, in_blk, in_w, in_f = _word_program(in_ptr, in_blocks_per_out, out_row_groups, NB)
    row = orow * in_rows_per_out * in_row_words
    q0, q1, q2, q3, q4, q5, q6, q7 = _word_nibbles(_load_tile(in_w + row + in_blk * W, NB, W_P2, W))
    s, s4, s8, s12, s16 = _nibble_scales(tl.load(in_f + row + in_payload_words + in_blk + tl.arange(0, NB))[:, None])
    a0 = q0 * s
    a1 = q1 * s4
    a2 = q2 * s8
    a3 = q3 * s12
    a4 = q4 * s16
    a5 = q5 * s8
    a6 = q6 * s12
    a7 = q7 * s16
    for r in tl.static_range(1, N_SUM):
        row = (orow * in_rows_per_out + r) * in_row_words
        q0, q1, q2, q3, q4, q5, q6, q7 = _word_nibbles(_load_tile(in_w + row + in_blk * W, NB, W_P2, W))
        s, s4, s8, s12, s16 = _nibble_scales(tl.load(in_f + row + in_payload_words + in_blk
                                                     + tl.arange(0, NB))[:, None])
        a0 = a0 + q0 * s
        a1 = a1 + q1 * s4
        a2 = a2 + q2 * s8
        a3 = a3 + q3 * s12
        a4 = a4 + q4 * s16
        a5 = a5 + q5 * s8
        a6 = a6 + q6 * s12
        a7 = a7 + q7 * s16
    amax = tl.maximum(tl.maximum(tl.maximum(tl.abs(a0), tl.abs(a1)), tl.maximum(tl.abs(a2), tl.abs(a3))),
                      tl.maximum(tl.maximum(tl.abs(a4), tl.abs(a5)), tl.maximum(tl.abs(a6), tl.abs(a7))))
    absmax = tl.max(amax, axis=1)
    is_zero = absmax < TINY
    # scale = absmax * fl(1/7) rounded UP to 20 significant bits (so q * scale is exact)
    sb = (absmax * 0.14285714924335479736).to(tl.int32, bitcast=True)
    sb = (sb + 15) & -16
    scale = tl.where(is_zero, 0.0, sb.to(tl.float32, bitcast=True))
    inv = tl.where(is_zero, 0.0, tl.math.div_rn(tl.full(absmax.shape, 1.0, tl.float32),
                                                tl.where(is_zero, 1.0, scale)))[:, None]
    word = (_qb(a0, inv) + _qb(a1, inv) * 16 + _qb(a2, inv) * 256 + _qb(a3, inv) * 4096
            + _qb(a4, inv) * 65536 + _qb(a5, inv) * 1048576 + _qb(a6, inv) * 16777216
            + _qb(a7, inv) * 268435456)
    # sum of bits_i * 16^i = sum q_i 16^i + 0x4B400000 * 0x11111111 (mod 2^32)
    word = (word + 1229490312) ^ -2004318072
    out_row = orow * out_row_words
    _store_tile(out_ptr.to(tl.pointer_type(tl.int32)) + out_row + ob * W, word, NB, W_P2, W)
    tl.store(out_ptr.to(tl.pointer_type(tl.float32)) + out_row + out_payload_words + ob + tl.arange(0, NB), scale)


DEEPSPEED = {16 << 20: 641, 64 << 20: 905, 256 << 20: 1009}  # GB/s, issue 6's figures


def main(argv=None):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from bench_kernels import DEFAULT_SIZES, K_NODES, M_RANKS, Timer, write_json

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=DEFAULT_SIZES, help="elements N")
    p.add_argument("--block", type=int, default=4096)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", default=None, help="JSON record")
    args = p.parse_args(argv)
    k, m, block, timer = K_NODES, M_RANKS, args.block, Timer("cuda", args.iters)
    rows = []
    for n in args.sizes:
        S = n // (k * m)
        x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        recv = quant.reorder_quantize(x, k, m, 4, block)
        out = torch.empty((k, packed_len(S, 4, block)), dtype=torch.uint8, device="cuda")
        nbytes = recv.numel() + out.numel()
        W = block // 8

        def run_proto():
            proto_kernel[(k * (S // block),)](
                recv, out, recv.shape[-1] // 4, k * S // 8, 0, S // block, S // block,
                out.shape[-1] // 4, S // 8, NB=1, N_SUM=m, W=W, W_P2=W, TINY=TINY, num_warps=4,
                enable_fp_fusion=True)

        run_proto()
        # the prototype's chunks are within half a step (plus the rounding of inv) of the
        # exact fp32 sum of the dequantized rows
        exact = reference._dequantize_fp32(recv, k * S, 4, block).sum(0).reshape(k, S)
        got = reference._dequantize_fp32(out, S, 4, block)
        scales = out[:, S // 2:].contiguous().view(torch.float32)
        err = ((got - exact).abs().reshape(k, S // block, block).amax(-1)
               / scales.clamp(min=1e-30)).max().item()
        del exact, got
        dst = torch.empty_like(x)
        copy_ms = timer(lambda: dst.copy_(x), graph=False)
        cur_ms = timer(lambda: quant.dequant_reduce_quantize(recv, k, S, 4, 4, block))
        proto_ms = timer(run_proto)
        r = {"elements": n, "copy_bf16_GBps": 4 * n / copy_ms / 1e6,
             "current_GBps": nbytes / cur_ms / 1e6, "prototype_GBps": nbytes / proto_ms / 1e6,
             "prototype_max_err_over_scale": err}
        r["prototype_over_current"] = r["prototype_GBps"] / r["current_GBps"]
        if n in DEEPSPEED:
            r["current_vs_deepspeed"] = r["current_GBps"] / DEEPSPEED[n]
            r["prototype_vs_deepspeed"] = r["prototype_GBps"] / DEEPSPEED[n]
        rows.append(r)
        del x, dst, recv, out
        torch.cuda.empty_cache()
    print("| N | copy GB/s | current GB/s | prototype GB/s | prototype / current | current / DS | prototype / DS | max err / step |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        ds = (f"{r['current_vs_deepspeed']:.2f}x | {r['prototype_vs_deepspeed']:.2f}x"
              if "current_vs_deepspeed" in r else "- | -")
        print(f"| {r['elements'] >> 20}M | {r['copy_bf16_GBps']:,.0f} | {r['current_GBps']:,.0f} | "
              f"{r['prototype_GBps']:,.0f} | {r['prototype_over_current']:.2f}x | {ds} | "
              f"{r['prototype_max_err_over_scale']:.7f} |")
    if args.out:
        write_json(args.out, {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                              "triton": triton.__version__, "block": block, "k": k, "m": m,
                              "rows": rows})


if __name__ == "__main__":
    main()
