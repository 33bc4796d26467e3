"""--optimizer sgd: the sharded momentum SGD (megaq.zero.optimizer.ShardedSGD) trains
as one process with torch.optim.SGD (L2 weight decay off biases and norms, global
clipping), on ZeRO-3 DP 2 and TP 2 x DP 2; its named state (momentum_buffer) survives a
DP-resharding round trip; pretrain_gpt.py resumes SGD exactly from a checkpoint and
refuses an AdamW checkpoint's optimizer state (unless --no-load-optim)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import zero_harness as H  # noqa: E402

from megaq.runtime.failure import AgreedError  # noqa: E402
from megaq.testing.ranks import run_on_ranks  # noqa: E402
from megaq.zero import OptimizerSettings, ZeroConfig, ZeroConfigError  # noqa: E402

SGD = {"optimizer": "sgd", "sgd_momentum": 0.9, "lr": 0.3, "block_size": 8}
MODEL = {"untie_embeddings_and_output_weights": True}


def test_sgd_dp2_and_tp2_dp2_match_torch_sgd():
    ref = H.reference(MODEL, 2, 2, zero_kw=SGD)
    assert ref[2]["layers.0.mlp.linear_fc1.weight"].ne(
        H.reference(MODEL, 2, 2, steps=1, zero_kw=SGD)[2]["layers.0.mlp.linear_fc1.weight"]).any()
    dp2 = run_on_ranks(H.train_rank, 2, args=(MODEL, SGD, 2))
    H.check_against_reference(dp2, ref)
    for r in dp2:
        assert set(next(iter(r["state"]["params"].values()))) == {"param", "momentum_buffer"}
        mem = r["mem"][-1]  # momentum only: 4 bytes per parameter sharded, not Adam's 8
        assert mem["optimizer"] < 0.6 * 8 * r["numel"] / 2 + 4096
    tp2 = run_on_ranks(H.train_rank, 4, tp=2, args=(MODEL, SGD, 1))
    H.check_against_reference(tp2, H.reference(MODEL, 2, 1, zero_kw=SGD))


def test_sgd_state_round_trip_across_dp_sizes():
    """3 steps on DP 2, full state out, into DP 1 for 2 more: as 5 steps in one process
    (the momentum buffer carried by name)."""
    first = run_on_ranks(H.train_rank, 2, args=(MODEL, SGD, 1, 3))
    saved = first[0]["state"]
    assert saved["step"] == 3
    momentum = saved["params"]["layers.0.mlp.linear_fc1.weight"]["momentum_buffer"]
    assert momentum.abs().sum() > 0
    second = run_on_ranks(H.train_rank, 1, args=(MODEL, SGD, 2, H.STEPS, False, H.CLIP, 3,
                                                 saved))
    ref = H.reference(MODEL, 2, 1, zero_kw=SGD)
    H.check_against_reference(second, (ref[0][3:], ref[1][3:], ref[2]))


def test_adam_state_is_refused_by_sgd_engine():
    from megaq.parallel.topology import Layout, build_topology
    from megaq.zero import build_engine
    from megaq.zero.state import OptimizerStateMismatch

    def engine(**kw):
        torch.manual_seed(0)
        return build_engine([H.GPTModel(H.model_config())], build_topology(Layout(1), 0),
                            ZeroConfig(block_size=8), OptimizerSettings(**kw))
    adam_state = engine().full_state()
    with pytest.raises(OptimizerStateMismatch, match="holds exp_avg, exp_avg_sq for .*, but "
                       "--optimizer sgd keeps momentum_buffer"):
        engine(optimizer="sgd").load_full_state(adam_state)
    with pytest.raises(ZeroConfigError, match="optimizer 'lion'"):
        OptimizerSettings(optimizer="lion")


def _argv(tmp_path, iters, extra=()):
    return ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
            "--train-iters", str(iters), "--lr", "0.05", "--mock-data", "--vocab-size", "64",
            "--log-interval", "1", "--eval-iters", "0", "--hidden-dropout", "0",
            "--attention-dropout", "0", "--data-cache-path", str(tmp_path / "cache"), *extra]


@pytest.mark.slow  # three short pretrain runs
def test_pretrain_sgd_resumes_exactly_and_refuses_adam_state(tmp_path):
    from megaq.parallel.topology import Layout, build_topology
    from megaq.pretrain import main

    def run(iters, extra):
        return main(_argv(tmp_path, iters, extra), topo=build_topology(Layout(1), 0)).losses
    sgd = ["--optimizer", "sgd", "--sgd-momentum", "0.8"]
    whole = run(4, sgd)
    ck = str(tmp_path / "sgd")
    run(4, sgd + ["--save", ck, "--exit-interval", "2"])
    resumed = run(4, sgd + ["--load", ck])
    assert sorted(resumed) == [3, 4]
    assert [resumed[i] for i in (3, 4)] == [whole[i] for i in (3, 4)]  # bit for bit
    adam = str(tmp_path / "adam")
    run(4, ["--save", adam, "--exit-interval", "2"])
    with pytest.raises(AgreedError, match=r"holds --optimizer adam state, this run uses "
                       r"--optimizer sgd; pass --no-load-optim to load the weights only"):
        run(4, sgd + ["--load", adam])
    assert sorted(run(4, sgd + ["--load", adam, "--no-load-optim"])) == [3, 4]
