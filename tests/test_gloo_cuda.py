"""`--distributed-backend gloo --device cuda`: ranks share a GPU, collectives go through
host memory (megaq.parallel.comm stages them). What the emulated cluster's GPU mode
(tools/cluster/netns_zero_bench.py --device cuda) relies on: the same losses as one
process on the same GPU, with TP, PP (the p2p path) and ZeRO-3, and ZeRO++ trains.

Needs a CUDA device (skipped on the CPU box). On the GPU machine pass
TRITON_INTERPRET=0: tests/conftest.py sets 1 when it is unset."""

import json
import os
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)


def _argv(metrics, *extra):
    return ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
            "--global-batch-size", "8", "--lr", "1e-2", "--mock-data", "--vocab-size", "64",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--eval-iters", "0",
            "--log-interval", "1", "--train-iters", "5", "--seed", "7", "--zero-stage", "3",
            "--data-cache-path", os.path.join(os.path.dirname(metrics), "cache"),
            "--metrics-file", metrics, *extra]


def _losses(metrics):
    rows = [json.loads(line) for line in open(metrics)]
    return [r["lm_loss"] for r in rows if r.get("type") == "train"]


def _run(tmp_path, name, world, *extra):
    # torchrun, not a fork: a forked rank cannot use CUDA once this process has touched it
    metrics = str(tmp_path / f"{name}.jsonl")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        f"--nproc-per-node={world}", os.path.join(REPO, "pretrain_gpt.py"),
                        *_argv(metrics, "--distributed-backend", "gloo", "--device", "cuda",
                               *extra)],
                       capture_output=True, text=True, timeout=300, cwd=REPO,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "device cuda" in r.stdout
    return _losses(metrics)


def test_gloo_on_cuda_matches_one_process(tmp_path):
    one = _run(tmp_path, "one", 1)
    # 2 "nodes" x 4 ranks on one GPU: TP 2 x PP 2 x DP 2, ZeRO-3 + hpZ over gloo
    many = _run(tmp_path, "many", 8, "--tensor-model-parallel-size", "2",
                "--pipeline-model-parallel-size", "2", "--gpus-per-node", "4",
                "--zero-hpz-partition-size", "2")
    assert len(one) == len(many) == 5
    # fp32; only the summation order differs (DP and TP reductions)
    assert many == pytest.approx(one, rel=2e-5), (one, many)


def test_zeropp_and_weight_deltas_train_on_cuda_over_gloo(tmp_path):
    for name, flags in (("zeropp", ["--zero-quantized-weights", "--zero-quantized-gradients",
                                    "--zero-hpz-partition-size", "2"]),
                        ("deltas", ["--zero-weight-deltas", "--zero-quantized-gradients",
                                    "--zero-hpz-partition-size", "2"])):
        losses = _run(tmp_path, name, 4, "--gpus-per-node", "2", *flags)
        assert len(losses) == 5 and all(x == x for x in losses), losses
        assert losses[-1] < losses[0] - 0.05, (name, losses)
