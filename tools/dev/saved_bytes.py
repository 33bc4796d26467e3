"""What one transformer block keeps for backward, per token, on the CPU: megaq in bf16 and
with each FP8 recipe, and, where torchao is importable, bench_train's plain Llama block
with torchao's tensorwise FP8 (its `ao-tw` variant) and in plain bf16 (`ref`).

Counted by megaq.testing.saved_bytes (saved_tensors_hooks, each storage once, weights
left out), eager and compiled (inductor's partitioner on the GPU's FP8 GEMM path: that
module's docstring says where it differs from the GPU). The block has the --size's
real hidden size, heads and FFN (tools/bench/bench_train.py SIZES), measured at --tokens
and twice as many tokens: the difference is what grows with the tokens (B/token), the
rest what a block keeps whatever the tokens (copies of its weights, MiB/block). The GiB
column scales both to bench_train's step (layers x micro-batch x 2048 tokens): what a
GPU step keeps for backward at its peak, besides the weights, gradients and optimizer
state. Eager blocks run the fused kernels' torch references, which save fp32 temporaries
that the GPU's Triton kernels do not: the eager rows show what save_for_backward keeps,
the compiled rows what bench_train's -comp variants keep.

    python -m tools.dev.saved_bytes --size 1.3B
    python -m tools.dev.saved_bytes --size 125M --variants bf16 fp8dl --eager
"""

import argparse
import dataclasses
import sys

import torch

VARIANTS = ("bf16", "fp8tw", "fp8dl", "fp8rw", "ao-tw", "ref")
MEGAQ_FP8 = {"fp8tw": ("hybrid", "tensorwise"), "fp8dl": ("hybrid", "delayed"),
             "fp8rw": ("e4m3", "rowwise")}  # as bench_train's FP8_VARIANTS


def megaq_block(size: str, variant: str, tokens: int, compiled: bool, backend: str):
    from megaq.testing.saved_bytes import block_saved_bytes
    from tools.bench import bench_train

    fp8 = MEGAQ_FP8.get(variant)
    kw = dict(fp8_format=fp8[0], fp8_recipe=fp8[1]) if fp8 else {}
    config = dataclasses.replace(bench_train.megaq_config(size, **kw), seq_length=tokens)
    return block_saved_bytes(config, compiled=compiled, micro_batch=1, backend=backend)


def reference_block(size: str, variant: str, tokens: int, compiled: bool, backend: str):
    """bench_train's RefBlock (fp32 weights, bf16 autocast), torchao-converted for ao-tw."""
    from megaq.testing.saved_bytes import count_saved, resident_storages
    from tools.bench import bench_train

    torch._dynamo.reset()
    torch.manual_seed(0)
    _, h, nh, _ = bench_train.SIZES[size]
    block = bench_train.RefBlock(h, nh)
    if variant == "ao-tw":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(block, config=Float8LinearConfig.from_recipe_name("tensorwise"))
    d = h // nh
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.arange(tokens).float()[:, None] * inv
    emb = torch.cat([freqs, freqs], -1)[:, None, :]
    cos, sin = emb.cos(), emb.sin()
    x = (torch.randn(1, tokens, h) * 0.5).requires_grad_()
    resident = resident_storages(block) | {t.untyped_storage().data_ptr() for t in (cos, sin)}

    def fwd(x, cos, sin):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return block(x, cos, sin)

    # the GPU's autocast runs bf16 residual adds on an fp32 stream; here the same
    return count_saved(fwd, (x, cos, sin), resident, compiled, backend)


def measure(size: str, variant: str, tokens: int, compiled: bool, backend: str):
    run = reference_block if variant in ("ao-tw", "ref") else megaq_block
    return run(size, variant, tokens, compiled, backend)


def torchao_importable() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("torchao.float8") is not None
    except ImportError:  # no torchao package at all
        return False


def main(argv=None) -> int:
    from megaq.testing.saved_bytes import PARTITIONED
    from tools.bench import bench_train

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="1.3B", choices=list(bench_train.SIZES))
    p.add_argument("--tokens", type=int, default=32, help="tokens of the smaller measured forward")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--eager", action="store_true", help="eager blocks only")
    mode.add_argument("--compiled", action="store_true", help="compiled blocks only")
    p.add_argument("--backend", default=PARTITIONED, choices=[PARTITIONED, "inductor"],
                   help="compiled blocks' backend: inductor's partitioner alone (default) or "
                        "inductor itself (C++ code generation on the CPU: slower)")
    args = p.parse_args(argv)
    if args.tokens < 16 or args.tokens % 16:
        print(f"error: --tokens {args.tokens} must be a positive multiple of 16 (FP8 GEMM "
              f"operands); pass e.g. --tokens 64", file=sys.stderr)
        return 2
    variants = list(args.variants)
    if any(v in ("ao-tw", "ref") for v in variants) and not torchao_importable():
        print("note: torchao is not importable here: leaving out ao-tw and ref "
              "(pip install torchao==0.17.0 --no-deps, the bench's fp8 extra)", file=sys.stderr)
        variants = [v for v in variants if v not in ("ao-tw", "ref")]
    modes = [False] if args.eager else [True] if args.compiled else [False, True]
    layers, _, _, micro_batch = bench_train.SIZES[args.size]
    step_tokens = layers * micro_batch * bench_train.SEQ
    print(f"{args.size}: kept for backward by one block (GiB: {layers} blocks at "
          f"{micro_batch} x {bench_train.SEQ} tokens)")
    print(f"{'variant':8s} {'mode':9s} {'B/token':>9s} {'MiB/block':>10s} {'GiB':>7s}  "
          f"B/token by dtype")
    for compiled in modes:
        for variant in variants:
            small, large = (measure(args.size, variant, n, compiled, args.backend)
                            for n in (args.tokens, 2 * args.tokens))
            per_token = (large.total - small.total) / args.tokens
            fixed = small.total - per_token * args.tokens
            dtypes = ", ".join(f"{k} {(large.by_dtype.get(k, 0) - v) / args.tokens:.0f}"
                               for k, v in sorted(small.by_dtype.items()))
            gib = (per_token * step_tokens + fixed * layers) / 2**30
            print(f"{variant:8s} {'compiled' if compiled else 'eager':9s} {per_token:9.0f} "
                  f"{fixed / 2**20:10.1f} {gib:7.2f}  {dtypes}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
