"""megaq/config/megatron_flags.py: Megatron-LM's dense-GPT flags are classified, the
no-meaning ones are accepted with a note printed once, the refused ones stop with one
line naming the feature, and nothing clashes with megaq's own parser. A Megatron-LM
launch script's flag set parses through megaq's parser, prints its notes on rank 0
and trains; docs/TRAINING.md lists every flag."""

import math
import os
import subprocess
import sys

import pytest

from megaq.config import megatron_flags as mf
from megaq.config.arguments import ArgumentsError, build_parser, parse_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

def test_classification_against_megaq_parser():
    have = {f.name for f in mf.MEGATRON_FLAGS if f.kind == mf.IMPLEMENTED or f.name == "--fp16"}
    have = {n for n in build_parser()._option_string_actions
            if n not in mf.BY_NAME or n in have}  # megaq's own flags, not the compat ones
    implemented = {f.name for f in mf.MEGATRON_FLAGS if f.kind == mf.IMPLEMENTED}
    assert implemented <= have, implemented - have  # every "implemented" flag is megaq's
    others = {f.name for f in mf.MEGATRON_FLAGS if f.kind != mf.IMPLEMENTED}
    # megaq defines it: not a note/refusal (except --fp16, which megaq refuses itself)
    assert others & have <= {"--fp16"}, others & have
    assert all(f.why for f in mf.MEGATRON_FLAGS if f.kind != mf.IMPLEMENTED)


def test_notes_print_once_and_harmless_values_pass():
    p = build_parser()
    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3", "--mock-data",
            "--use-flash-attn", "--use-distributed-optimizer", "--use-mcore-models",
            "--transformer-impl", "transformer_engine", "--overlap-grad-reduce",
            "--overlap-param-gather", "--context-parallel-size", "1", "--rotary-percent", "1.0",
            "--no-masked-softmax-fusion", "--loss-scale", "4096"]
    args = p.parse_args(argv)
    printed = []
    notes = mf.print_megatron_notes(args, print_fn=printed.append)
    # one summary line naming the 7 no-meaning flags given (not the harmless values), and
    # one for the spelling read as megaq's flag
    assert notes == printed == [mf.summary_note([
        "--use-mcore-models", "--transformer-impl", "--use-flash-attn",
        "--overlap-grad-reduce", "--overlap-param-gather",
        "--no-masked-softmax-fusion", "--loss-scale"]),
        "note: Megatron-LM spellings read as megaq's flags: --use-distributed-optimizer as "
        "--zero-stage 1"]
    assert printed[0].startswith("note: 7 Megatron-LM flag(s) accepted without effect: ")
    assert mf.print_megatron_notes(args, print_fn=printed.append) == []  # once per process
    assert len(printed) == 2
    quiet = p.parse_args(argv + ["--quiet-notes"])
    monkey = []
    mf._printed.clear()
    assert mf.print_megatron_notes(quiet, print_fn=monkey.append) == [] and monkey == []


def test_every_recorded_megatron_flag_is_classified():
    """No flag of Megatron-LM's recorded parser (megaq.config.megatron_flag_list) is
    unknown to megaq's: each is megaq's own, an alias, noted or refused with its reason."""
    from megaq.config.megatron_flag_list import MEGATRON_ARGUMENTS
    parser = build_parser()
    have = set(parser._option_string_actions)
    assert len(MEGATRON_ARGUMENTS) > 600
    assert [n for n in MEGATRON_ARGUMENTS if n not in have] == []
    # the flags a Megatron-LM user reported as unknown, each with its status
    kinds = {n: mf.BY_NAME[n].kind for n in (
        "--grad-reduce-in-bf16", "--ddp-bucket-size", "--use-torch-fsdp2",
        "--data-parallel-sharding-strategy", "--use-precision-aware-optimizer",
        "--main-grads-dtype", "--use-rotary-position-embeddings", "--no-position-embedding",
        "--no-query-key-layer-scaling", "--non-persistent-save-interval", "--rerun-mode",
        "--fp8-param-gather")}
    assert kinds == {
        "--grad-reduce-in-bf16": "note", "--ddp-bucket-size": "note",
        "--use-torch-fsdp2": "note", "--data-parallel-sharding-strategy": "alias",
        "--use-precision-aware-optimizer": "note", "--main-grads-dtype": "refused",
        "--use-rotary-position-embeddings": "alias", "--no-position-embedding": "refused",
        "--no-query-key-layer-scaling": "note", "--non-persistent-save-interval": "refused",
        "--rerun-mode": "refused", "--fp8-param-gather": "alias"}
    # a switch that turns off part of a missing feature is noted, its switch refused
    assert mf.BY_NAME["--no-rl-use-sequence-packing"].kind == mf.NOTE
    assert mf.BY_NAME["--rl-use-sequence-packing"].kind == mf.REFUSED


BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3",
        "--mock-data"]


def test_aliases_set_megaq_flags():
    c = parse_config(BASE + ["--use-rotary-position-embeddings", "--no-position-embedding",
                             "--main-grads-dtype", "fp32", "--rerun-mode", "disabled",
                             "--override-opt-param-scheduler",
                             "--data-parallel-sharding-strategy", "no_shard"], world_size=1)
    assert c.model.position_embedding_type == "rope"
    assert c.optimizer.override_opt_param_scheduler and c.zero.stage == 0
    assert parse_config(BASE, world_size=1).zero.stage == 3
    flags = build_parser().parse_args(BASE + ["--fp8-param-gather"])
    assert flags.zero_quantized_weights == "fp8"  # as --zero-quantized-weights fp8
    assert mf.megatron_flag_problems(flags) == ([], [
        "note: Megatron-LM spellings read as megaq's flags: --fp8-param-gather as "
        "--zero-quantized-weights fp8 (ZeRO-3's FP8 weight gathers; needs --fp8-format)"])
    flags = build_parser().parse_args(BASE + ["--data-parallel-sharding-strategy", "no_shard"])
    assert mf.megatron_flag_problems(flags)[1] == [
        "note: Megatron-LM spellings read as megaq's flags: --data-parallel-sharding-strategy "
        "no_shard as --zero-stage 0"] and flags.zero_stage == 0
    with pytest.raises(ArgumentsError, match="--zero-quantized-weights fp8 gathers the weights "
                       "that FP8 GEMMs read"):  # its rule: FP8 GEMMs
        parse_config(BASE + ["--fp8-param-gather"], world_size=1)
    with pytest.raises(ArgumentsError, match=r"^--data-parallel-sharding-strategy full: megaq "
                       r"has no such value; it takes no_shard or optim or optim_grads or "
                       r"optim_grads_params"):
        parse_config(BASE + ["--data-parallel-sharding-strategy", "full"], world_size=1)
    with pytest.raises(ArgumentsError, match=r"^--no-position-embedding: megaq has no GPT "
                       r"without position embeddings"):
        parse_config(BASE + ["--no-position-embedding"], world_size=1)


@pytest.mark.parametrize("extra,line", [
    (["--context-parallel-size", "2"],
     "--context-parallel-size 2: megaq has no context parallelism (--context-parallel-size > 1); drop the flag"),
    (["--num-experts", "8"], "--num-experts 8: megaq has no mixture-of-experts layers (--num-experts); drop the flag"),
    (["--fp16"], "--fp16: megaq has no fp16 training with loss scaling (use --bf16); drop the flag"),
    (["--rampup-batch-size", "16", "16", "1000"],
     "--rampup-batch-size 16 16 1000: megaq has no batch-size ramp-up (a run's global batch is "
     "fixed: the data iterator, the schedules' micro-batch count and the LR schedule's step "
     "assume it; train at the final --global-batch-size); drop the flag"),
])
def test_refused_flags_name_the_feature(extra, line):
    p = build_parser()
    args = p.parse_args(["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
                         "--seq-length", "16", "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3",
                         "--mock-data", *extra])
    with pytest.raises(ValueError) as e:
        mf.check_megatron_flags(args)
    assert str(e.value) == line


def config_flags() -> set[str]:
    from megaq.config.flags import flag_fields
    from megaq.config.run import FLAG_CLASSES
    return {f.metadata["flag"] for cls in FLAG_CLASSES for f in flag_fields(cls)}


def test_markdown_table_lists_every_flag():
    table = mf.flags_table_markdown(config_flags())
    assert all(f"`{f.name}`" in table for f in mf.MEGATRON_FLAGS)
    assert "| `--swiglu` | implemented |" in table
    assert "not accepted yet" not in table  # every implemented flag is in megaq's parser


def megatron_launch_flags(tmp_path) -> list[str]:
    """The flag groups of a Megatron-LM GPT / Llama launch script (examples/gpt3 and the
    Llama recipes: model, training, parallelism, data, logging, checkpointing), with a
    tiny model, 2 iterations on 2 CPU ranks and mock data."""
    ckpt = str(tmp_path / "ckpt")
    return [
        # model
        "--use-mcore-models", "--transformer-impl", "transformer_engine",
        "--num-layers", "2", "--hidden-size", "32", "--ffn-hidden-size", "64",
        "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2",
        "--kv-channels", "8", "--seq-length", "16", "--max-position-embeddings", "16",
        "--position-embedding-type", "rope", "--rotary-base", "10000", "--rotary-percent", "1.0",
        "--normalization", "RMSNorm", "--norm-epsilon", "1e-5", "--swiglu",
        "--disable-bias-linear", "--untie-embeddings-and-output-weights",
        "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--init-method-std", "0.02",
        "--make-vocab-size-divisible-by", "128", "--attention-softmax-in-fp32",
        "--attention-backend", "auto", "--use-flash-attn", "--no-masked-softmax-fusion",
        "--no-bias-swiglu-fusion", "--no-rope-fusion", "--no-bias-dropout-fusion",
        "--apply-query-key-layer-scaling", "--no-persist-layer-norm", "--use-cpu-initialization",
        # training
        "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "2",
        "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
        "--adam-eps", "1e-8", "--clip-grad", "1.0", "--bf16", "--seed", "1234",
        "--lr", "3e-4", "--min-lr", "3e-5", "--lr-decay-style", "cosine",
        "--lr-warmup-fraction", "0.5", "--lr-decay-iters", "2", "--lr-warmup-init", "0.0",
        "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
        "--accumulate-allreduce-grads-in-fp32", "--no-gradient-accumulation-fusion",
        "--cross-entropy-loss-fusion", "--check-for-nan-in-loss-and-grad",
        "--recompute-granularity", "full", "--recompute-method", "uniform",
        "--recompute-num-layers", "1",
        "--manual-gc", "--manual-gc-interval", "50", "--optimizer", "adam",
        # parallelism
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "1",
        "--sequence-parallel", "--context-parallel-size", "1", "--expert-model-parallel-size", "1",
        "--tp-comm-overlap", "--no-async-tensor-model-parallel-allreduce",
        "--distributed-backend", "gloo",
        # data
        "--mock-data", "--vocab-size", "128", "--split", "949,50,1", "--num-workers", "2",
        "--dataloader-type", "single", "--no-create-attention-mask-in-dataloader",
        "--num-dataset-builder-threads", "1", "--data-cache-path", str(tmp_path / "cache"),
        "--eod-mask-loss",
        # logging and evaluation
        "--log-interval", "1", "--eval-interval", "2", "--eval-iters", "1",
        "--tensorboard-log-interval", "1", "--log-timers-to-tensorboard",
        "--log-validation-ppl-to-tensorboard", "--log-num-zeros-in-grad",
        "--timing-log-option", "minmax", "--log-progress", "--log-throughput",
        "--log-params-norm", "--log-memory-to-tensorboard", "--timing-log-level", "1",
        # checkpointing and exit
        "--save", ckpt, "--load", ckpt, "--save-interval", "2", "--ckpt-format", "torch_dist",
        "--async-save", "--exit-signal-handler", "--exit-duration-in-mins", "230",
    ]


def _train(topo, argv):
    from megaq.pretrain import main
    return main(argv, topo=topo).losses


def test_megatron_launch_flags_parse_note_once_and_train(tmp_path, capfd, monkeypatch):
    """Megatron-LM's launch flags, unchanged: parsed, each accepted-and-ignored flag noted
    once (by rank 0 only), 2 iterations trained at TP 2 with a checkpoint at the end."""
    from megaq.testing.ranks import run_on_ranks

    argv = megatron_launch_flags(tmp_path)
    given = {w for w in argv if w.startswith("--")}
    assert len(given) >= 90
    config = parse_config(argv, world_size=2)  # the flags megaq implements are applied
    assert (config.parallel.tp, config.model.swiglu, config.model.num_query_groups) == (2, True, 2)
    assert config.optimizer.lr_warmup_iters == 1 and config.training.bf16
    monkeypatch.setattr(mf, "_printed", set())  # the ranks' "printed once" starts empty
    capfd.readouterr()
    losses = run_on_ranks(_train, 2, tp=2, args=(argv,))[0]
    assert sorted(losses) == [1, 2] and all(math.isfinite(v) for v in losses.values()), losses
    assert abs(losses[1] - math.log(128)) < 0.5  # an untrained model on the 128-id vocab
    out = capfd.readouterr().out.splitlines()
    noted = [f for f in mf.MEGATRON_FLAGS if f.kind == mf.NOTE and f.name in given]
    assert len(noted) >= 30
    summary = [x for x in out if x.startswith("note: ") and "Megatron-LM flag(s) accepted "
               "without effect" in x]
    assert len(summary) == 1  # one line, from one rank, naming every such flag
    named = summary[0].split(": ", 2)[2].split(" (why:")[0].split(", ")
    assert sorted(named) == sorted(f.name for f in noted)
    assert open(tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read().strip() == "2"
    # the implemented logging flags: Megatron's line with throughput and params norm, and
    # its timer block; --eod-mask-loss on mock data says it masks nothing
    lines = [x for x in out if "] iteration " in x]
    assert len(lines) == 2 and all("throughput per GPU (TFLOP/s/GPU)" in x
                                   and "params norm:" in x for x in lines)
    assert out.count("(min, max) time across ranks (ms):") == 2
    assert sum(x.startswith(" note: --eod-mask-loss masks nothing here") for x in out) == 1


def test_refusal_is_one_line_through_the_parser_and_the_cli(tmp_path):
    base = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--micro-batch-size", "1", "--train-iters", "1",
            "--lr", "1e-3", "--mock-data"]
    with pytest.raises(ArgumentsError, match=r"^--num-experts 8: megaq has no mixture-of-experts"):
        parse_config(base + ["--num-experts", "8"], world_size=1)
    r = subprocess.run([sys.executable, os.path.join(REPO, "pretrain_gpt.py"), *base,
                        "--use-flash-attn", "--context-parallel-size", "2"],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path,
                       env={**os.environ, "WORLD_SIZE": "1", "OMP_NUM_THREADS": "1"})
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "error: --context-parallel-size 2: megaq has no context parallelism "
        "(--context-parallel-size > 1); drop the flag"]
    assert "note:" not in r.stdout  # a refused run prints no notes


def test_training_doc_lists_every_flag():
    text = open(os.path.join(REPO, "docs", "TRAINING.md")).read()
    # regenerate it with: python -m megaq.config.megatron_flags
    assert mf.flags_table_markdown(config_flags()) in text


def gpt3_example_flags(tmp_path) -> list[str]:
    """Megatron-LM's examples/gpt3/train_gpt3_175b_distributed.sh (core_v0.16.1), its flags
    unchanged but for the paths (here: files that do not exist) and the batch-size ramp-up
    of its older versions."""
    return [
        "--num-layers", "96", "--hidden-size", "12288", "--num-attention-heads", "96",
        "--seq-length", "2048", "--max-position-embeddings", "2048", "--attention-backend",
        "auto",
        "--micro-batch-size", "1", "--global-batch-size", "1536",
        "--rampup-batch-size", "16", "16", "5859375", "--train-iters", "500000",
        "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
        "--init-method-std", "0.006", "--clip-grad", "1.0", "--fp16", "--lr", "6.0e-5",
        "--lr-decay-style", "cosine", "--min-lr", "6.0e-6", "--lr-warmup-fraction", ".001",
        "--lr-decay-iters", "430000",
        "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "16",
        "--data-path", str(tmp_path / "data" / "corpus_text_document"),
        "--vocab-file", str(tmp_path / "gpt2-vocab.json"),
        "--merge-file", str(tmp_path / "gpt2-merges.txt"), "--split", "949,50,1",
        "--log-interval", "100", "--save-interval", "10000", "--eval-interval", "1000",
        "--save", str(tmp_path / "ckpt"), "--load", str(tmp_path / "ckpt"), "--eval-iters", "10",
        "--tensorboard-dir", str(tmp_path / "tb"),
    ]


def test_gpt3_example_dry_run_lists_every_problem_in_one_launch(tmp_path, gpt2_files):
    """One --dry-run of the GPT-3 example script names all it would stop at (refused
    --fp16 and --rampup-batch-size, the missing data and tokenizer files), one `error:`
    line each, exit 2, before any process group; the same flags with those fixed plan
    the run and exit 0 (the tokenizer type inferred from --vocab-file / --merge-file)."""
    import shutil

    import numpy as np

    from megaq.data.indexed import IndexedDatasetWriter

    env = {**os.environ, "WORLD_SIZE": "1", "OMP_NUM_THREADS": "1"}
    script = os.path.join(REPO, "pretrain_gpt.py")
    machine = ["--dry-run", "--num-nodes", "16", "--gpus-per-node", "8"]
    # three independent launches, each in a directory of its own, started side by side:
    # each is mostly one single-threaded `import torch`, so two cores halve the wait
    launches = {}  # name -> (directory, its flags, the process)
    for name in ("as_written", "fixed_quiet", "fixed"):
        d = tmp_path / name
        d.mkdir()
        argv = gpt3_example_flags(d)
        if name != "as_written":
            # fixed: bf16, no ramp-up, real files (a tiny GPT-2 BPE and one preprocessed
            # document)
            shutil.copy(gpt2_files[0], d / "gpt2-vocab.json")
            shutil.copy(gpt2_files[1], d / "gpt2-merges.txt")
            (d / "data").mkdir()
            w = IndexedDatasetWriter(str(d / "data" / "corpus_text_document"), np.uint16)
            w.add_document(np.arange(10, dtype=np.uint16))
            w.finish()
            w.commit()
            i = argv.index("--rampup-batch-size")
            argv = [a if a != "--fp16" else "--bf16" for a in argv[:i] + argv[i + 4:]]
            argv += ["--quiet-notes"] if name == "fixed_quiet" else []
        launches[name] = (d, subprocess.Popen(
            [sys.executable, script, *machine, *argv], stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, cwd=d, env=env))
    done = {}
    try:
        for name, (d, proc) in launches.items():
            out, err = proc.communicate(timeout=120)
            done[name] = (d, proc.returncode, out, err)
    finally:  # none outlives a failed wait
        for _, proc in launches.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    d, code, out, err = done["as_written"]
    assert code == 2, err
    prefix = d / "data" / "corpus_text_document"
    assert err.strip().splitlines() == [
        "error: --fp16 is not supported (megaq has no loss scaling); use --bf16 or fp32 "
        "(neither)",
        "error: --rampup-batch-size 16 16 5859375: megaq has no batch-size ramp-up (a run's "
        "global batch is fixed: the data iterator, the schedules' micro-batch count and the "
        "LR schedule's step assume it; train at the final --global-batch-size); drop the flag",
        f"error: --data-path {prefix}: {prefix}.bin / {prefix}.idx not found; check the prefix "
        f"(tools/preprocess_data.py writes them)",
        f"error: {d / 'gpt2-vocab.json'}: file not found; check --vocab-file"]
    assert out == ""  # no plan, no notes

    _, code, out, err = done["fixed_quiet"]
    assert code == 0, err
    assert err == "" and out.startswith("plan: ")  # the plan of this run
    # --quiet-notes: neither the flags' summary nor the tokenizer's inference
    assert "accepted without effect" not in out and "inferred" not in out
    _, code, out, err = done["fixed"]
    assert code == 0, err
    assert ("note: 1 Megatron-LM flag(s) accepted without effect: --attention-backend (why: "
            "--help or docs/TRAINING.md; --quiet-notes hides this)") in out.splitlines()
    assert "note: --tokenizer-type GPT2BPETokenizer inferred from --vocab-file" in out
