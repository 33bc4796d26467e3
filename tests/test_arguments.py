"""Flag parsing and validation: Megatron names, derived values, one-line refusals."""

import subprocess
import sys
import os

import pytest

from megaq.arguments import ArgumentsError, build_parser, parse_args
from megaq.lr_schedule import LRSchedule

BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--micro-batch-size", "2", "--train-iters", "10",
        "--lr", "1e-3", "--mock-data"]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse(extra, world=8, rpn=None):
    return parse_args(BASE + extra, world_size=world, ranks_per_node=rpn)


def test_derived_values():
    a = parse(["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
               "--global-batch-size", "16"])
    assert a.data_parallel_size == 2
    assert a.num_micro_batches == 16 // (2 * 2)
    assert a.kv_channels == 16 and a.ffn_hidden_size == 256
    assert a.max_position_embeddings == 32 and a.lr_decay_iters == 10
    a = parse([], world=4)
    assert a.global_batch_size == 2 * 4 and a.num_micro_batches == 1  # default: mb x DP
    a = parse(["--swiglu", "--hidden-size", "96", "--num-attention-heads", "4"], world=1)
    assert a.ffn_hidden_size == 256  # Megatron: int(4h * 2/3 / 64) * 64
    a = parse(["--lr-warmup-fraction", "0.25", "--lr-decay-iters", "8"], world=1)
    assert a.lr_warmup_iters == 2


@pytest.mark.parametrize("extra,world,needle", [
    (["--global-batch-size", "12"], 8, "--global-batch-size 12 is not a multiple of --micro-batch-size"),
    (["--fp16", "--bf16"], 1, "--fp16 and --bf16 are both set"),
    (["--fp16"], 1, "--fp16 is not supported"),
    (["--tensor-model-parallel-size", "3"], 8, "not divisible by TP x PP"),
    (["--tensor-model-parallel-size", "8"], 8, "--num-attention-heads 4 is not divisible"),
    (["--pipeline-model-parallel-size", "8"], 8, "--num-layers 4 is not divisible by --pipeline"),
    (["--gpus-per-node", "3"], 8, "not a multiple of the ranks per node"),
    (["--zero-hpz-partition-size", "3", "--gpus-per-node", "4"], 8, "--zero-hpz-partition-size 3"),
    (["--zero-stage", "0", "--zero-quantized-weights"], 8, "need --zero-stage 3"),
    (["--min-lr", "1"], 1, "--min-lr 1.0 is above --lr"),
    (["--save-interval", "5"], 1, "--save-interval needs --save"),
    (["--lr-warmup-iters", "20"], 1, "--lr-warmup-iters 20 exceeds --lr-decay-iters 10"),
    (["--group-query-attention"], 1, "--group-query-attention needs --num-query-groups"),
    (["--seq-length", "64", "--max-position-embeddings", "32"], 1, "exceeds --max-position-embeddings"),
    (["--num-layers-per-virtual-pipeline-stage", "1"], 1, "needs --pipeline-model-parallel-size > 1"),
    (["--split", "a,b"], 1, "--split 'a,b' does not parse"),
    (["--zero-stage", "2"], 1, "argument --zero-stage: invalid choice"),
    (["--zero-quantized-gradients-chunk", "0"], 1, "--zero-quantized-gradients-chunk 0 must be >= 1"),
])
def test_refusals_name_the_flag(extra, world, needle):
    with pytest.raises(ArgumentsError) as e:
        parse(extra, world=world)
    msg = str(e.value)
    assert needle in msg and "\n" not in msg


def test_qgz_chunk_reaches_the_zeropp_config():
    """The flag travels args -> ZeroConfig (pretrain_gpt.zero_config), which qgZ reads."""
    import pretrain_gpt
    from megaq.zero.config import DEFAULT_BLOCK_SIZE, DEFAULT_GRAD_CHUNK
    a = parse(["--zero-quantized-gradients"], world=1)
    assert pretrain_gpt.zero_config(a).grad_chunk == DEFAULT_GRAD_CHUNK
    assert pretrain_gpt.zero_config(a).block_size == DEFAULT_BLOCK_SIZE == 2048  # training's block
    a = parse(["--zero-quantized-gradients", "--zero-quantized-gradients-chunk", "4096"], world=1)
    assert pretrain_gpt.zero_config(a).grad_chunk == 4096


def test_data_source_required():
    argv = [x for x in BASE if x != "--mock-data"]
    with pytest.raises(ArgumentsError, match="no training data: pass --data-path"):
        parse_args(argv, world_size=1)
    with pytest.raises(ArgumentsError, match="needs --tokenizer-model"):
        parse_args(argv + ["--data-path", "x"], world_size=1)


def test_help_lists_megatron_and_zeropp_flags():
    text = build_parser().format_help()
    for flag in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                 "--num-layers-per-virtual-pipeline-stage", "--sequence-parallel",
                 "--group-query-attention", "--position-embedding-type", "--swiglu",
                 "--untie-embeddings-and-output-weights", "--lr-decay-style", "--min-lr",
                 "--recompute-activations", "--tensorboard-dir", "--make-vocab-size-divisible-by",
                 "--zero-stage", "--zero-quantized-weights", "--zero-hpz-partition-size",
                 "--zero-quantized-gradients", "--gpus-per-node", "--metrics-file",
                 "--data-cache-path", "--demo-corpus", "--save-interval", "--load",
                 "--zero-quantized-gradients-chunk", "--log-comm-time"):
        assert flag in text, flag


def test_cli_refusal_is_one_line_and_nonzero():
    # The real entry point, as a user runs it: exit status 2, one "error:" line on stderr.
    r = subprocess.run([sys.executable, os.path.join(REPO, "pretrain_gpt.py")] + BASE
                       + ["--global-batch-size", "3"], capture_output=True, text=True,
                       env={**os.environ, "WORLD_SIZE": "1", "OMP_NUM_THREADS": "1"}, timeout=120)
    assert r.returncode == 2
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert lines == [lines[0]] and lines[0].startswith("error: --global-batch-size 3")


def test_lr_schedule_values():
    s = LRSchedule(max_lr=1.0, min_lr=0.1, warmup_steps=4, decay_steps=14, decay_style="cosine")
    assert [s.lr_at(k) for k in (1, 2, 4)] == [0.25, 0.5, 1.0]
    assert s.lr_at(9) == pytest.approx(0.1 + 0.9 * 0.5)          # half-way: cos(pi/2)
    assert s.lr_at(14) == pytest.approx(0.1) and s.lr_at(20) == 0.1
    lin = LRSchedule(max_lr=1.0, min_lr=0.0, warmup_steps=0, decay_steps=10, decay_style="linear")
    assert [lin.lr_at(k) for k in (0, 5, 10, 11)] == [1.0, 0.5, 0.0, 0.0]
    const = LRSchedule(max_lr=0.3, min_lr=0.0, warmup_steps=2, decay_steps=10, decay_style="constant")
    assert [const.lr_at(k) for k in (1, 2, 7, 50)] == [0.15, 0.3, 0.3, 0.3]
    # get_lr is the lr of the next update; state round-trips the position
    s.step(); s.step()
    assert s.get_lr() == s.lr_at(3)
    t = LRSchedule(max_lr=1.0, min_lr=0.1, warmup_steps=4, decay_steps=14, decay_style="cosine")
    t.load_state_dict(s.state_dict())
    assert t.get_lr() == s.get_lr()
