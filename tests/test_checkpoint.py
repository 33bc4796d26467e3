"""Checkpoint layout and atomicity of --ckpt-format torch, on one process with a
minimal engine (the torch_dist format is in tests/test_dist_checkpoint.py).

The multi-rank behaviours (exact resume, DP reshard, a run killed mid-save) run the
real training loop in tests/test_checkpoint_resume.py.
"""

import os
import random
import shutil

import numpy as np
import pytest
import torch

from megaq.config.arguments import parse_config
from megaq.checkpoint import integrity
from megaq.checkpoint.errors import CheckpointError
from megaq.checkpoint.load import load_checkpoint
from megaq.checkpoint.save import save_checkpoint
from megaq.lr_schedule import LRSchedule
from megaq.parallel.topology import Layout, build_topology

ARGV = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--micro-batch-size", "1", "--train-iters", "10",
        "--lr", "1e-3", "--mock-data", "--ckpt-format", "torch"]


class DictEngine:
    """Stands in for the ZeRO engine: full_state() is a dict of tensors by name."""

    def __init__(self, value: float):
        self.state = {"step": 3, "params": {"w": {"param": torch.full((3, 2), value),
                                                  "exp_avg": torch.full((3, 2), value / 2),
                                                  "exp_avg_sq": torch.full((3, 2), value / 4)}}}
        self.loaded = None

    def full_state(self):
        return self.state

    def load_full_state(self, sd):
        self.loaded = sd

    def error_feedback_state(self):
        return {}  # no qgZ error feedback here (tests/test_checkpoint_resume.py has it)

    def params_finite(self):
        return all(bool(e["param"].isfinite().all()) for e in self.state["params"].values())

    def checkpoint_taken(self):
        """No weight-delta references to re-synchronise here."""


def run_config(argv=ARGV):
    config = parse_config(argv, world_size=1)
    return config.resolved(config.data, vocab_size=1024)  # as the tokenizer would


def setup(tmp_path, value=1.0):
    config = run_config()
    sched = LRSchedule.from_config(config.optimizer)
    return config, build_topology(Layout(1), 0), DictEngine(value), sched


def save(root, it, config, topo, engine, sched):
    return save_checkpoint(root, it, config=config, topo=topo, engine=engine,
                           lr_schedule=sched, consumed_samples=it * 4)


def load(root, config, topo, engine, sched):
    return load_checkpoint(root, config=config, topo=topo, engine=engine, lr_schedule=sched)


def test_layout_and_roundtrip(tmp_path):
    config, topo, engine, sched = setup(tmp_path)
    for _ in range(3):
        sched.step()
    random.seed(5); np.random.seed(5); torch.manual_seed(5)
    save(tmp_path, 3, config, topo, engine, sched)
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    assert (tmp_path / "iter_0000003" / "mp_rank_00_000" / "model_optim.pt").is_file()
    assert (tmp_path / "iter_0000003" / "rng" / "rank_00000.pt").is_file()
    expect = (random.random(), np.random.rand(), torch.rand(1).item())
    # every stream moves on, then the load rewinds all of them
    random.random(); np.random.rand(); torch.rand(1)
    fresh = DictEngine(0.0)
    sched2 = LRSchedule.from_config(config.optimizer)
    got = load(tmp_path, config, topo, fresh, sched2)
    assert got["iteration"] == 3 and got["consumed_samples"] == 12
    assert torch.equal(fresh.loaded["params"]["w"]["param"], engine.state["params"]["w"]["param"])
    assert sched2.num_steps == 3
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expect
    # files are plain tensors/containers: loadable without unpickling arbitrary objects
    torch.load(tmp_path / "iter_0000003" / "mp_rank_00_000" / "model_optim.pt", weights_only=True)


def test_no_checkpoint_means_fresh_start(tmp_path):
    config, topo, engine, sched = setup(tmp_path)
    assert load(tmp_path / "empty", config, topo, engine, sched) is None


class FailingEngine(DictEngine):
    """An engine whose error-feedback state cannot be produced: the save fails after the
    model and RNG files are written (as a crash between the files and the rename would)."""

    def error_feedback_state(self):
        raise KeyboardInterrupt("killed after the model file was written")


def test_crash_during_save_keeps_previous(tmp_path):
    config, topo, engine, sched = setup(tmp_path, value=1.0)
    save(tmp_path, 2, config, topo, engine, sched)
    with pytest.raises(KeyboardInterrupt):
        save(tmp_path, 4, config, topo, FailingEngine(9.0), sched)
    assert (tmp_path / ".iter_0000004.tmp" / "mp_rank_00_000" / "model_optim.pt").is_file()
    fresh = DictEngine(0.0)
    got = load(tmp_path, config, topo, fresh, LRSchedule.from_config(config.optimizer))
    assert got["iteration"] == 2
    assert torch.equal(fresh.loaded["params"]["w"]["param"], torch.full((3, 2), 1.0))
    # the next save cleans up the debris and completes
    save(tmp_path, 4, config, topo, DictEngine(9.0), sched)
    assert load(tmp_path, config, topo, fresh, LRSchedule.from_config(config.optimizer))["iteration"] == 4
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]


def test_refuses_other_architecture(tmp_path):
    config, topo, engine, sched = setup(tmp_path)
    save(tmp_path, 1, config, topo, engine, sched)
    other = run_config(ARGV[:1] + ["3"] + ARGV[2:] + ["--swiglu", "--disable-bias-linear"])
    with pytest.raises(CheckpointError) as e:
        load(tmp_path, other, topo, engine, sched)
    msg = str(e.value)
    assert "--num-layers 3 (checkpoint: 2)" in msg and "--swiglu True (checkpoint: False)" in msg
    assert "add_bias_linear False (checkpoint: True)" in msg and "\n" not in msg
    # the stored configuration is the run's, nested as RunConfig.to_dict() nests it
    sd = torch.load(tmp_path / "iter_0000001" / "mp_rank_00_000" / "model_optim.pt",
                    weights_only=True)
    assert sd["config"] == config.to_dict()


def test_reads_checkpoints_saved_before_the_typed_configuration(tmp_path):
    """Files written before RunConfig hold a flat "args" dict of flag values: they load,
    and an architecture change is still refused. Those saves predate the integrity
    manifest too: they are refused unless --no-verify-checkpoint is given."""
    config, topo, engine, sched = setup(tmp_path)
    save(tmp_path, 1, config, topo, engine, sched)
    path = tmp_path / "iter_0000001" / "mp_rank_00_000" / "model_optim.pt"
    os.remove(tmp_path / "iter_0000001" / integrity.MANIFEST_NAME)
    sd = torch.load(path, weights_only=True)
    del sd["config"]
    sd["args"] = {  # what megaq.config.arguments.args_to_dict wrote
        "num_layers": 2, "hidden_size": 32, "ffn_hidden_size": 128, "num_attention_heads": 4,
        "group_query_attention": False, "num_query_groups": 4, "kv_channels": 8,
        "seq_length": 16, "max_position_embeddings": 16,
        "position_embedding_type": "learned_absolute", "rotary_base": 10000,
        "normalization": "LayerNorm", "norm_epsilon": 1e-5, "swiglu": False,
        "untie_embeddings_and_output_weights": False, "disable_bias_linear": False,
        "vocab_size": 1024, "padded_vocab_size": 1024, "make_vocab_size_divisible_by": 128,
        "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
        "global_batch_size": 1, "train_iters": 10, "lr": 1e-3, "seed": 1234,
        "zero_quantized_gradients_bits": 4, "zero_quantization_block_size": None}
    torch.save(sd, path)
    with pytest.raises(CheckpointError, match="has no integrity manifest"):
        load(tmp_path, config, topo, DictEngine(0.0), sched)
    unverified = run_config(ARGV + ["--no-verify-checkpoint"])
    assert load(tmp_path, unverified, topo, DictEngine(0.0), sched)["saved_global_batch_size"] == 1
    with pytest.raises(CheckpointError, match="--hidden-size 64 \\(checkpoint: 32\\)"):
        load(tmp_path, run_config(ARGV[:2] + ["--hidden-size", "64"] + ARGV[4:]
                                  + ["--no-verify-checkpoint"]), topo, DictEngine(0.0), sched)


def test_refuses_other_tp_pp(tmp_path):
    config, topo, engine, sched = setup(tmp_path)
    save(tmp_path, 1, config, topo, engine, sched)
    d = tmp_path / "iter_0000001"
    shutil.copytree(d / "mp_rank_00_000", d / "mp_rank_00_001")  # as if saved with PP=2
    # Without the model chunks to reshard into, a TP/PP change is refused.
    with pytest.raises(CheckpointError, match="--pipeline-model-parallel-size 2"):
        load(tmp_path, config, topo, engine, sched)


def test_bad_tracker_and_missing_dir(tmp_path):
    config, topo, engine, sched = setup(tmp_path)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("banana\n")
    with pytest.raises(CheckpointError, match="not an iteration number"):
        load(tmp_path, config, topo, engine, sched)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("7\n")
    with pytest.raises(CheckpointError, match="iter_0000007 does not exist"):
        load(tmp_path, config, topo, engine, sched)


def test_no_load_optim_keeps_weights_resets_adam(tmp_path):
    config, topo, engine, sched = setup(tmp_path, value=2.0)
    save(tmp_path, 1, config, topo, engine, sched)
    fresh = DictEngine(0.0)
    load_checkpoint(tmp_path, config=config, topo=topo, engine=fresh, lr_schedule=sched,
                    load_optim=False)
    w = fresh.loaded["params"]["w"]
    assert fresh.loaded["step"] == 0 and torch.equal(w["param"], torch.full((3, 2), 2.0))
    assert set(w) == {"param"}  # weights only: the engine starts its optimizer state fresh
