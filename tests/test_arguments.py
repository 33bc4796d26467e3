"""Flag parsing and validation: Megatron names, derived values, one-line refusals, and
the parser generated from the configuration classes."""

import io
import os
import subprocess
import sys

import pytest
import torch

import dataclasses

from megaq.config.arguments import ArgumentsError, build_parser, parse_config
from megaq.config.flags import dest, flag_fields
from megaq.config.megatron_flags import IMPLEMENTED, MEGATRON_FLAGS
from megaq.config.run import FLAG_CLASSES
from megaq.lr_schedule import LRSchedule

BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--micro-batch-size", "2", "--train-iters", "10",
        "--lr", "1e-3", "--mock-data"]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse(extra, world=8, rpn=None):
    return parse_config(BASE + extra, world_size=world, ranks_per_node=rpn)


def test_derived_values():
    c = parse(["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
               "--global-batch-size", "16"])
    assert c.parallel.dp == 2 and c.training.data_parallel_size == 2
    assert c.training.num_micro_batches == 16 // (2 * 2)
    assert c.model.kv_channels == 16 and c.model.ffn_hidden_size == 256
    assert c.model.max_position_embeddings == 32 and c.optimizer.lr_decay_iters == 10
    assert c.model.num_query_groups == 4 and c.model.vocab_size is None  # set by the tokenizer
    c = parse([], world=4)
    assert c.training.global_batch_size == 2 * 4 and c.training.num_micro_batches == 1  # mb x DP
    c = parse(["--swiglu", "--hidden-size", "96", "--num-attention-heads", "4"], world=1)
    assert c.model.ffn_hidden_size == 256  # Megatron: int(4h * 2/3 / 64) * 64
    c = parse(["--lr-warmup-fraction", "0.25", "--lr-decay-iters", "8"], world=1)
    assert c.optimizer.lr_warmup_iters == 2
    # flags spelled the other way round, or counting only together with another
    c = parse(["--disable-bias-linear", "--num-query-groups", "2"], world=1)
    assert c.model.add_bias_linear is False and c.model.num_query_groups == 4  # no GQA flag
    c = parse(["--group-query-attention", "--num-query-groups", "2", "--bf16",
               "--sequence-parallel"], world=1)
    assert c.model.num_query_groups == 2 and c.model.params_dtype == torch.bfloat16
    assert c.model.sequence_parallel is False  # TP=1
    c = parse(["--tensor-model-parallel-size", "2", "--sequence-parallel"], world=2)
    assert c.model.sequence_parallel
    # one class holds each: the model's sequence_parallel and seed, the run's length
    assert not hasattr(c.parallel, "sequence_parallel") and not hasattr(c.training, "seed")
    assert c.zero.block_size == c.zero.__class__().block_size  # one default: the engine's


def test_configuration_is_frozen_and_serialisable():
    c = parse(["--zero-quantized-gradients"], world=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.training.train_iters = 5
    d = c.resolved(c.data, 1024).to_dict()
    assert d["model"]["vocab_size"] == 1024 and d["model"]["params_dtype"] == "torch.float32"
    assert d["zero"]["quantized_gradients"] is True and d["parallel"]["layout"]["world_size"] == 1
    # plain values only: a checkpoint holding it loads with weights_only=True
    buf = io.BytesIO()
    torch.save(d, buf)
    buf.seek(0)
    assert torch.load(buf, weights_only=True) == d


@pytest.mark.parametrize("extra,world,needle", [
    (["--global-batch-size", "12"], 8, "--global-batch-size 12 is not a multiple of --micro-batch-size"),
    (["--fp16", "--bf16"], 1, "--fp16 and --bf16 are both set"),
    (["--fp16"], 1, "--fp16 is not supported"),
    (["--tensor-model-parallel-size", "3"], 8, "not divisible by TP x PP"),
    (["--tensor-model-parallel-size", "8"], 8, "--num-attention-heads 4 is not divisible"),
    (["--pipeline-model-parallel-size", "8"], 8, "--num-layers 4 is not divisible by --pipeline"),
    (["--gpus-per-node", "3"], 8, "not a multiple of the ranks per node"),
    (["--zero-hpz-partition-size", "3", "--gpus-per-node", "4"], 8, "--zero-hpz-partition-size 3"),
    (["--zero-stage", "0", "--zero-quantized-weights"], 8, "need --zero-stage 1, 2 or 3"),
    (["--zero-stage", "0", "--zero-hpz-partition-size", "2"], 1, "use --zero-stage 3"),  # not a layout line
    (["--min-lr", "1"], 1, "--min-lr 1.0 is above --lr"),
    (["--save-interval", "5"], 1, "--save-interval needs --save"),
    (["--lr-warmup-iters", "20"], 1, "--lr-warmup-iters 20 exceeds --lr-decay-iters 10"),
    (["--group-query-attention"], 1, "--group-query-attention needs --num-query-groups"),
    (["--seq-length", "64", "--max-position-embeddings", "32"], 1, "exceeds --max-position-embeddings"),
    (["--num-layers-per-virtual-pipeline-stage", "1"], 1, "needs --pipeline-model-parallel-size > 1"),
    (["--split", "a,b"], 1, "--split 'a,b': not numbers"),
    (["--num-layers", "0"], 1, "--num-layers must be >= 1"),
    (["--micro-batch-size", "0"], 1, "--micro-batch-size must be >= 1"),
    (["--log-interval", "0"], 1, "--log-interval must be >= 1"),
    (["--lr-warmup-iters", "2", "--lr-warmup-fraction", "0.1"], 1, "are both set; pass only one"),
    (["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
      "--num-layers-per-virtual-pipeline-stage", "1", "--global-batch-size", "6"], 4,
     "interleaved schedule needs the number of micro-batches (3)"),
    (["--zero-stage", "4"], 1, "argument --zero-stage: invalid choice"),
    (["--zero-quantized-gradients-chunk", "0"], 1, "--zero-quantized-gradients-chunk 0 must be >= 1"),
    # FP8 weight gathers: FP8 GEMMs needed, tensorwise only, no int8 qwZ under FP8 GEMMs
    (["--zero-quantized-weights", "fp8"], 1, "the model has none: add --fp8-format"),
    (["--zero-quantized-weights", "fp8", "--fp8-format", "e4m3", "--fp8-recipe", "rowwise"], 1,
     "--fp8-recipe rowwise scales per row: use --fp8-recipe tensorwise"),
    (["--zero-quantized-weights", "--fp8-format", "hybrid"], 1,
     "use --zero-quantized-weights fp8 with FP8 GEMMs"),
    (["--zero-quantized-weights", "fp4"], 1, "argument --zero-quantized-weights: invalid choice"),
    # weight deltas keep hpZ's slices as the references, and replace qwZ's gather
    (["--zero-weight-deltas"], 1, "add --zero-hpz-partition-size N"),
    (["--zero-weight-deltas", "--zero-hpz-partition-size", "2", "--zero-quantized-weights"], 2,
     "drop --zero-quantized-weights"),
    (["--zero-weight-delta-bits", "2"], 1, "argument --zero-weight-delta-bits: invalid choice"),
    # the Hadamard transform is part of qgZ, and works on 64-element groups of a block
    (["--zero-hadamard-gradients"], 1, "add --zero-quantized-gradients"),
    (["--zero-hadamard-gradients", "--zero-quantized-gradients", "--zero-quantization-block-size", "96"], 1,
     "--zero-quantization-block-size 96 must be a multiple of 64"),
])
def test_refusals_name_the_flag(extra, world, needle):
    with pytest.raises(ArgumentsError) as e:
        parse(extra, world=world)
    msg = str(e.value)
    assert needle in msg and "\n" not in msg


def _float_flags():
    """Every flag of the configuration declared as a float."""
    return [f.metadata["flag"] for cls in FLAG_CLASSES for f in flag_fields(cls)
            if f.metadata["argparse"].get("type") is float]


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "1e400"])
def test_every_float_flag_refuses_non_finite_values(value):
    """One generic check (the parser's float type), for every float flag: inf, nan and
    numbers beyond float range (which parse as inf) are one line naming the flag."""
    flags = _float_flags()
    assert {"--lr", "--min-lr", "--weight-decay", "--clip-grad", "--adam-eps",
            "--distributed-timeout-minutes", "--hang-timeout-minutes"} <= set(flags)
    for flag in flags:
        with pytest.raises(ArgumentsError) as e:
            parse([f"{flag}={value}"], world=1)  # the = form: "-inf" is no option name
        msg = str(e.value)
        assert msg.startswith(f"argument {flag}: {value!r} is not a finite number"), msg
        assert "\n" not in msg


@pytest.mark.parametrize("flag,value", [("--lr", "inf"), ("--lr", "nan"),
                                        ("--weight-decay", "nan"), ("--clip-grad", "inf")])
def test_non_finite_settings_named_in_the_issue_are_refused(flag, value):
    with pytest.raises(ArgumentsError, match=f"argument {flag}: '{value}' is not a finite number"):
        parse([flag, value], world=1)


def test_finite_float_ranges_are_unchanged():
    """The per-flag ranges still apply after the finiteness check (and large finite
    values pass it)."""
    assert parse(["--lr", "1e30", "--min-lr", "0"], world=1).optimizer.lr == 1e30
    with pytest.raises(ArgumentsError, match="--lr and --min-lr must be >= 0"):
        parse(["--lr", "-1"], world=1)
    with pytest.raises(ArgumentsError, match="--clip-grad must be >= 0"):
        parse(["--clip-grad", "-1"], world=1)
    with pytest.raises(ArgumentsError, match="--hang-timeout-minutes must be > 0"):
        parse(["--hang-timeout-minutes", "0"], world=1)


def test_zero_flags_reach_the_engine_config():
    """Each --zero-* flag lands in the engine's ZeroConfig (built once, at parse time)."""
    from megaq.zero import ZeroConfig
    z = parse(["--zero-quantized-weights"], world=1).zero  # no value: int8 qwZ, as before
    assert z.quantized_weights and not z.fp8_weights
    z = parse(["--zero-quantized-weights", "fp8", "--fp8-format", "hybrid"], world=1).zero
    assert z.fp8_weights and not z.quantized_weights
    z = parse(["--zero-quantized-gradients"], world=1).zero
    assert isinstance(z, ZeroConfig) and z.grad_chunk == ZeroConfig().grad_chunk
    c = parse(["--zero-quantized-gradients", "--zero-quantized-gradients-chunk", "4096",
               "--zero-quantized-gradients-bits", "8", "--zero-quantization-block-size", "64",
               "--zero-gradient-error-feedback", "--zero-quantized-weights", "--bf16",
               "--adam-beta2", "0.95", "--weight-decay", "0.1"], world=1)
    z, o = c.zero, c.optimizer
    assert (z.grad_chunk, z.grad_bits_intra, z.grad_bits_inter, z.block_size) == (4096, 8, 8, 64)
    assert z.error_feedback and z.quantized_weights and z.gather_dtype == torch.bfloat16
    # the optimizer's values live in OptimizerConfig only; the engine takes it beside z
    assert (o.adam_beta1, o.adam_beta2, o.weight_decay, o.lr) == (0.9, 0.95, 0.1, 1e-3)
    assert not {"lr", "betas", "eps", "weight_decay", "optimizer", "sgd_momentum"} & set(
        dataclasses.asdict(z))
    z = parse(["--zero-hpz-partition-size", "2", "--zero-weight-deltas",
               "--zero-weight-delta-bits", "8"], world=2).zero
    assert z.weight_deltas and z.weight_delta_bits == 8 and z.hpz_partition_size == 2
    assert ZeroConfig().weight_delta_bits == 4 and not ZeroConfig().weight_deltas
    z = parse(["--zero-quantized-gradients", "--zero-hadamard-gradients",
               "--zero-quantized-gradients-intra-bits", "8"], world=1).zero
    assert z.grad_hadamard and (z.grad_bits_intra, z.grad_bits_inter) == (8, 4)
    assert not ZeroConfig().grad_hadamard


def test_every_flag_is_one_config_field():
    """The parser is generated from the configuration classes: every flag is exactly one
    field, no flag is declared twice, and every documented default is the field's (the
    hardware flags of the plan are fields of megaq.planner.run.HardwareFlags)."""
    from megaq.planner.run import HardwareFlags
    classes = FLAG_CLASSES + (HardwareFlags,)
    seen = {}
    for cls in classes:
        for f in flag_fields(cls):
            assert f.metadata["flag"] not in seen, f.metadata["flag"]
            seen[f.metadata["flag"]] = cls
    parser = build_parser()
    actions = {a.option_strings[0]: a for a in parser._actions if a.option_strings
               and a.option_strings[0] != "-h"}
    assert set(seen) <= set(actions)
    # the rest are Megatron-LM's flags that megaq accepts with a note or refuses
    # (megaq.config.megatron_flags), --dry-run (an action, not a setting) and the
    # ds_config reader's flags (a file of flags, megaq.config.deepspeed_config), nothing else
    from megaq.config.deepspeed_config import FILE_FLAGS, SWITCH
    compat = ({f.name for f in MEGATRON_FLAGS if f.kind != IMPLEMENTED} | {"--dry-run", SWITCH}
              | set(FILE_FLAGS))
    assert set(actions) - set(seen) <= compat, set(actions) - set(seen) - compat
    for cls in classes:
        for f in flag_fields(cls):
            a = actions[f.metadata["flag"]]
            assert a.dest == dest(f)
            if f.metadata["value"] is None and not a.required and a.const is None:
                assert a.default == f.default, f.name


def test_demo_corpus_resolves_to_a_data_path():
    """The data setup turns --demo-corpus into the built files: the resolved config is an
    ordinary --data-path run (it passes the one-source check) that names the tokenizer."""
    argv = [x for x in BASE if x != "--mock-data"] + ["--demo-corpus"]
    data = parse_config(argv, world_size=1).data
    assert data.demo_corpus == "" and data.data_path is None
    built = data.with_built_corpus("/c/corpus_text_document", "/c/tokenizer.model")
    assert built.demo_corpus is None and built.data_path == ("/c/corpus_text_document",)
    assert built.tokenizer_model == "/c/tokenizer.model"


def test_data_source_required():
    argv = [x for x in BASE if x != "--mock-data"]
    with pytest.raises(ArgumentsError, match="no training data: pass --data-path"):
        parse_config(argv, world_size=1)
    with pytest.raises(ArgumentsError, match="needs --tokenizer-model"):
        parse_config(argv + ["--data-path", "x"], world_size=1)


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
                 "--zero-quantized-gradients-chunk", "--log-comm-time", "--zero-weight-deltas",
                 "--zero-weight-delta-bits", "--zero-hadamard-gradients"):
        assert flag in text, flag


ONE_RANK = {"WORLD_SIZE": "1", "OMP_NUM_THREADS": "1"}
# The CLI launches of this file (name -> extra flags, environment): independent, so the
# module starts them side by side (each is mostly one single-threaded `import torch`: two
# cores halve the wait), and each test reads its own.
CLI_LAUNCHES = {
    "refusal": (BASE + ["--global-batch-size", "3"], ONE_RANK),
    "non_finite_lr": (BASE + ["--lr", "inf", "--vocab-size", "64"], ONE_RANK),
    # NCCL asked for on a node with fewer GPUs than ranks (here: none, the CPU box)
    "nccl_without_gpus": (BASE + ["--distributed-backend", "nccl", "--mock-data"],
                          {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29599",
                           "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}),
    "help": (["--help"], {}),
}


@pytest.fixture(scope="module")
def cli_runs():
    """name -> the finished `python pretrain_gpt.py ...` of CLI_LAUNCHES (the real entry
    point, as a user runs it)."""
    procs = {name: subprocess.Popen([sys.executable, os.path.join(REPO, "pretrain_gpt.py"), *argv],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    env={**os.environ, **env})
             for name, (argv, env) in CLI_LAUNCHES.items()}
    runs = {}
    try:
        for name, proc in procs.items():
            out, err = proc.communicate(timeout=120)
            runs[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    finally:  # none outlives a failed wait
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return runs


def test_cli_refusal_is_one_line_and_nonzero(cli_runs):
    # The real entry point, as a user runs it: exit status 2, one "error:" line on stderr.
    r = cli_runs["refusal"]
    assert r.returncode == 2
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert lines == [lines[0]] and lines[0].startswith("error: --global-batch-size 3")


def test_cli_non_finite_lr_is_one_line_before_any_step(cli_runs):
    r = cli_runs["non_finite_lr"]
    assert r.returncode == 2, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert lines == ["error: argument --lr: 'inf' is not a finite number: every float setting "
                     "must be finite (no inf or nan); give a finite value (see --help)"], r.stderr
    assert "iteration" not in r.stdout


def test_device_flag():
    assert parse(["--distributed-backend", "gloo", "--device", "cuda"]).parallel.device == "cuda"
    assert parse([]).parallel.device is None  # cuda with NCCL, else cpu
    with pytest.raises(ArgumentsError, match="--distributed-backend nccl needs --device cuda"):
        parse(["--distributed-backend", "nccl", "--device", "cpu"])


def test_more_ranks_than_gpus_is_one_line_not_a_cuda_error(cli_runs):
    # NCCL asked for on a node with fewer GPUs than ranks (here: none, the CPU box):
    # one line naming the fix, not CUDA's "invalid device ordinal" traceback.
    r = cli_runs["nccl_without_gpus"]
    assert r.returncode == 2, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "local rank 0 has no GPU" in lines[0], r.stderr
    assert "--distributed-backend gloo" in lines[0]


def test_gpu_of_local_rank_works_for_both_slurm_gpu_bindings(monkeypatch):
    """Every task sees the node's 8 GPUs: local rank r takes GPU r. The cluster binds one
    GPU per task (each task sees 1): local rank 5 takes that GPU, 0, instead of failing.
    torchrun starting 16 ranks on 8 GPUs is still refused."""
    import torch
    from megaq.parallel.launch import _gpu_of_local_rank
    from megaq.parallel.topology import LayoutError

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert [_gpu_of_local_rank(r) for r in range(8)] == list(range(8))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert [_gpu_of_local_rank(r) for r in range(8)] == [0] * 8
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "16")
    with pytest.raises(LayoutError, match="local rank 9 has no GPU"):
        _gpu_of_local_rank(9)


def test_help_keeps_working_from_the_command_line(cli_runs):
    r = cli_runs["help"]
    assert r.returncode == 0 and "--zero-quantized-gradients-chunk" in r.stdout
    assert "elements per quantization block (default: " in r.stdout


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


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_cuda_is_an_error_in_process():
    """Ranks set up in-process (not through the launch path, which refuses it first) must
    not train on the CPU quietly when --device cuda asked for a GPU."""
    from megaq import pretrain
    from megaq.parallel.topology import LayoutError

    with pytest.raises(LayoutError, match="--device cuda: this node shows no CUDA device"):
        pretrain._device(parse(["--distributed-backend", "gloo", "--device", "cuda"]).parallel)
    assert pretrain._device(parse([]).parallel).type == "cpu"


def test_run_problems_lists_every_class_error_and_refusal_at_once():
    """One pass finds a problem in each configuration class and every refused Megatron-LM
    flag (pretrain_gpt.py --dry-run prints them all); parse_config raises the first."""
    from megaq.config.arguments import run_problems
    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "8",
            "--seq-length", "16", "--micro-batch-size", "1", "--train-iters", "1",
            "--lr", "1e-3", "--min-lr", "1", "--mock-data", "--log-interval", "0",
            "--tensor-model-parallel-size", "3", "--save-interval", "5",
            "--num-experts", "8", "--context-parallel-size", "2"]
    config, _, problems, _ = run_problems(argv, world_size=3)
    assert config is None
    assert len(problems) == 5, problems
    assert problems[0].startswith("--min-lr 1.0 is above --lr 0.001")  # optimizer
    assert problems[1] == "--save-interval needs --save DIR (where to write checkpoints)"
    assert problems[2] == "--log-interval must be >= 1 (got 0)"  # logging
    assert problems[3].startswith("--context-parallel-size 2: megaq has no context parallelism")
    assert problems[4].startswith("--num-experts 8: megaq has no mixture-of-experts")
    with pytest.raises(ArgumentsError) as e:
        parse_config(argv, world_size=3)
    assert str(e.value) == problems[0]
    # the heads-vs-TP rule spans two classes: checked once the classes themselves are good
    fixed = argv[:argv.index("--save-interval")]
    fixed[fixed.index("--min-lr") + 1] = "0"
    fixed[fixed.index("--log-interval") + 1] = "1"
    _, _, problems, _ = run_problems(fixed, world_size=3)
    assert len(problems) == 1 and "3" in problems[0] and "8" in problems[0], problems


def test_dry_run_lists_argparse_problems_with_the_rest(tmp_path, monkeypatch, capsys):
    """pretrain_gpt.py --dry-run: an invalid choice, a bad int, an unknown flag and a
    missing required flag are listed with a refusal, a class error and a missing data
    file, one `error:` line each, exit 2, the other flags still checked; without
    --dry-run the same command line stops at argparse's first problem, one line."""
    from megaq.pretrain import dry_run
    monkeypatch.setenv("WORLD_SIZE", "1")
    argv = ["--num-layers", "2", "--hidden-size", "x", "--num-attention-heads", "2",
            "--seq-length", "8", "--micro-batch-size", "1", "--train-iters", "1",
            "--zero-stage", "7", "--no-such-flag", "--fp16", "--min-lr", "1",
            "--data-path", str(tmp_path / "none"), "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "64"]
    assert dry_run(["--dry-run"] + argv) == 2
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err.splitlines() == [
        "error: argument --hidden-size: invalid int value: 'x' (see --help)",
        "error: argument --zero-stage: invalid choice: 7 (choose from 0, 1, 2, 3) (see --help)",
        "error: unrecognized arguments: --no-such-flag (see --help)",
        "error: the following arguments are required: --lr (see --help)",
        "error: --fp16 is not supported (megaq has no loss scaling); use --bf16 or fp32 "
        "(neither)",
        # --lr checked as its default (1e-4): the class error is still found
        "error: --min-lr 1.0 is above --lr 0.0001; use a --min-lr <= --lr",
        f"error: --data-path {tmp_path / 'none'}: {tmp_path / 'none'}.bin / "
        f"{tmp_path / 'none'}.idx not found; check the prefix (tools/preprocess_data.py "
        f"writes them)"]
    # a flag whose value is missing is dropped and the rest parsed again
    assert build_parser().parse_all(BASE + ["--zero-stage", "5", "--lr"])[1] == [
        "argument --lr: expected one argument (see --help)",
        "argument --zero-stage: invalid choice: 5 (choose from 0, 1, 2, 3) (see --help)"]
    assert build_parser().parse_all(BASE)[1] == []
    # without --dry-run: no dry run, and the parser stops at the first problem
    assert dry_run(argv) is None
    with pytest.raises(ArgumentsError) as e:
        build_parser().parse_args(argv)
    assert str(e.value) == "argument --hidden-size: invalid int value: 'x' (see --help)"


def test_dry_run_file_checks_name_each_missing_or_damaged_file(tmp_path):
    """launch_file_problems (pretrain_gpt.py --dry-run's file checks): a data prefix
    without its files, a tokenizer model that does not exist, and a --load whose newest
    iteration lost bytes of a file the manifest lists: three lines, nothing read beyond
    sizes; the same checkpoint intact passes."""
    from megaq.checkpoint.integrity import write_manifest
    from megaq.checkpoint.paths import iteration_dir, write_tracker
    from megaq.pretrain import launch_file_problems
    ckpt = tmp_path / "ckpt"
    it = iteration_dir(str(ckpt), 5)
    os.makedirs(it)
    with open(os.path.join(it, "model.pt"), "wb") as f:
        f.write(b"x" * 100)
    write_manifest(it)
    write_tracker(str(ckpt), 5)
    argv = BASE[:-1] + ["--data-path", str(tmp_path / "none"), "--tokenizer-model",
                        str(tmp_path / "tok.model"), "--load", str(ckpt)]
    flags = build_parser().parse_args(argv)
    assert launch_file_problems(flags)[2:] == []  # the checkpoint is intact
    with open(os.path.join(it, "model.pt"), "wb") as f:
        f.write(b"x" * 99)
    problems = launch_file_problems(flags)
    assert len(problems) == 3, problems
    assert problems[0].startswith(f"--data-path {tmp_path / 'none'}: ") and "not found" in problems[0]
    assert "tok.model" in problems[1] and "not found" in problems[1]
    assert problems[2] == (f"{os.path.join(it, 'model.pt')} is damaged: 99 bytes, the manifest "
                           f"expects 100; restore the file or load an earlier iteration")
