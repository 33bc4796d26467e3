"""megaq's and DeepSpeed's int8 quantize, side by side under Nsight Compute.

Launches each kernel --calls times after an L2 flush (a 256 MB write, as the per-call
benchmark's), between cudaProfilerStart / Stop, for `ncu --profile-from-start off`:
what differs between two kernels that move the same bytes (docs/PERFORMANCE.md, "Per
call": the ncu reading at 32M elements). Needs a GPU and the deepspeed package (its
quantizer op is JIT-built, as for tools/bench/bench_kernels.py --deepspeed).

    DS_SKIP_CUDA_CHECK=1 TORCH_CUDA_ARCH_LIST=9.0 ncu --profile-from-start off \\
        --cache-control all --clock-control none --csv \\
        --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,\\
gpc__cycles_elapsed.max,smsp__cycles_active.avg,sm__warps_active.avg.pct_of_peak_sustained_active,\\
launch__registers_per_thread,launch__grid_size,launch__block_size \\
        python tools/bench/profile_quantize8.py --elements 33554432
"""

import argparse
import sys

import _checkout  # noqa: E402  (a link to tools/_checkout.py: the checkout's megaq first)

_checkout.use_checkout()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--elements", type=int, default=1 << 25, help="bf16 elements (default 32M)")
    p.add_argument("--block", type=int, default=4096, help="quantization block = DeepSpeed's group size")
    p.add_argument("--calls", type=int, default=2, help="profiled calls of each kernel (default 2)")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        sys.exit("error: profile_quantize8.py needs a CUDA GPU (it profiles compiled kernels); run it on one")
    if args.elements % args.block:
        sys.exit(f"error: --elements {args.elements} is not a multiple of --block {args.block}")
    import bench_kernels
    from megaq.kernels import quant

    op = bench_kernels.load_deepspeed().op
    x = torch.randn(args.elements, device="cuda", dtype=torch.bfloat16)
    xh, groups = x.view(torch.float16), args.elements // args.block  # as bench_kernels: the same buffer
    flush = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda")
    cases = (lambda: quant.quantize(x, 8, args.block), lambda: op.quantize(xh, groups, 8, op.Symmetric))
    for fn in cases * 3:  # compiled, JIT-built and planned before the profiled window
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for _ in range(args.calls):
        for fn in cases:
            flush.zero_()
            fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
