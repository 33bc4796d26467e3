"""--use-tp-pp-dp-mapping: same training numerics, DP groups spread over nodes.

TP=2 x PP=2 x DP=2 on 8 ranks posing as 2 nodes of 4, ZeRO-3. With Megatron's default
order each pipeline stage is one node, so ZeRO's collectives never leave a node; with
DP outermost every DP group spans both nodes. The losses must not care (fp32; only
the summation order inside gloo's reductions may differ, hence 1e-6 relative).
"""

import json
import os

from megaq import pretrain
from megaq.testing.ranks import run_on_ranks


def _argv(tmp, order_flag):
    return ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
            "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "4",
            "--train-iters", "3", "--lr", "5e-3", "--mock-data", "--vocab-size", "96",
            "--log-interval", "1", "--eval-iters", "0", "--attention-dropout", "0",
            "--hidden-dropout", "0", "--gpus-per-node", "4", "--zero-stage", "3",
            "--data-cache-path", os.path.join(tmp, "cache"), *order_flag]


def _train(topo, argv):
    state = pretrain.main(argv, topo=topo)
    return {"losses": state.losses, "dp_nodes": sorted(set(topo.dp.nodes))}


def _zero_inter_node_bytes(metrics_file):
    """Cross-node bytes of ZeRO's phases in the last logged iteration (metrics file)."""
    with open(metrics_file) as f:
        last = [json.loads(line) for line in f if line.strip()][-1]
    return sum(v["inter_node"] for k, v in last["comm"].items()
               if k.startswith(("weight_gather", "grad_reduce")))


def test_tp_pp_dp_mapping_spreads_dp_and_keeps_losses(tmp_path):
    m_default, m_spread = str(tmp_path / "default.jsonl"), str(tmp_path / "spread.jsonl")
    default = run_on_ranks(_train, 8, tp=2, pp=2, ranks_per_node=4,
                           args=(_argv(str(tmp_path), ["--metrics-file", m_default]),))
    spread = run_on_ranks(_train, 8, tp=2, pp=2, ranks_per_node=4, order="tp-pp-dp",
                          args=(_argv(str(tmp_path), ["--use-tp-pp-dp-mapping",
                                                      "--metrics-file", m_spread]),))
    assert all(len(r["dp_nodes"]) == 1 for r in default)
    assert _zero_inter_node_bytes(m_default) == 0
    assert all(r["dp_nodes"] == [0, 1] for r in spread)
    assert _zero_inter_node_bytes(m_spread) > 0
    # the last stage logs the losses; find a rank that has them in each run
    a = next(r["losses"] for r in default if r["losses"])
    b = next(r["losses"] for r in spread if r["losses"])
    assert sorted(a) == sorted(b) == [1, 2, 3]
    for it in a:
        assert abs(a[it] - b[it]) <= 1e-6 * abs(a[it]), (it, a[it], b[it])


def test_pp4_middle_stages_train(tmp_path):
    # Middle stages read no data: the batch iterator hands them None placeholders.
    argv = _argv(str(tmp_path), [])
    i = argv.index("--pipeline-model-parallel-size")
    argv[i + 1] = "4"
    argv[argv.index("--num-layers") + 1] = "4"
    argv[argv.index("--tensor-model-parallel-size") + 1] = "1"
    out = run_on_ranks(_train, 4, pp=4, ranks_per_node=4, args=(argv,))
    losses = out[-1]["losses"]
    assert sorted(losses) == [1, 2, 3] and all(0 < v < 20 for v in losses.values())
