#!/usr/bin/env python
"""Predict a megaq run's step time, throughput and memory on a cluster before launching it.

    python tools/plan.py --num-layers 32 --hidden-size 4096 --num-attention-heads 32 \\
        --seq-length 4096 --swiglu ... --micro-batch-size 1 --global-batch-size 1024 --bf16 \\
        --gpu H100-SXM --num-nodes 16 --inter-node-bandwidth 400 [--search] [--json]

Takes pretrain_gpt.py's own model / layout / batch / ZeRO / FP8 flags and the hardware
flags; --help lists them. The code is megaq.plan_cli (the model: megaq.planner).
"""

import sys

import _checkout

if __name__ == "__main__":
    _checkout.use_checkout()
    from megaq.plan_cli import plan_main

    sys.exit(plan_main())
