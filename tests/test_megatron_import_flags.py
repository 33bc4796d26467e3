"""megaq/megatron_flags.py: Megatron-LM's dense-GPT flags are classified, the
no-meaning ones are accepted with a note printed once, the refused ones stop with one
line naming the feature, and nothing clashes with megaq's own parser."""

import pytest

from megaq import megatron_flags as mf
from megaq.arguments import build_parser

# Implemented flags that arrive with the typed configuration (issue 19, engineer B); until
# that lands they are missing from megaq's parser.
PENDING = {"--distributed-timeout-minutes", "--train-samples", "--lr-decay-samples",
           "--lr-warmup-samples", "--optimizer", "--recompute-granularity",
           "--train-data-path", "--valid-data-path", "--test-data-path", "--eod-mask-loss",
           "--no-save-optim", "--finetune", "--pretrained-checkpoint",
           "--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler",
           "--log-throughput", "--log-memory-to-tensorboard", "--log-params-norm",
           "--timing-log-level", "--wandb-project", "--wandb-exp-name", "--wandb-save-dir"}


def test_classification_against_megaq_parser():
    have = set(build_parser()._option_string_actions)
    implemented = {f.name for f in mf.MEGATRON_FLAGS if f.kind == mf.IMPLEMENTED}
    assert implemented - have <= PENDING, implemented - have - PENDING
    others = {f.name for f in mf.MEGATRON_FLAGS if f.kind != mf.IMPLEMENTED}
    # megaq defines it: not a note/refusal (except --fp16, which megaq refuses itself)
    assert others & have <= {"--fp16"}, others & have
    assert all(f.why for f in mf.MEGATRON_FLAGS if f.kind != mf.IMPLEMENTED)


def test_notes_print_once_and_harmless_values_pass():
    p = build_parser()
    mf.add_megatron_flags(p)
    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3", "--mock-data",
            "--use-flash-attn", "--use-distributed-optimizer", "--use-mcore-models",
            "--transformer-impl", "transformer_engine", "--overlap-grad-reduce",
            "--overlap-param-gather", "--context-parallel-size", "1", "--rotary-percent", "1.0",
            "--no-masked-softmax-fusion", "--loss-scale", "4096"]
    args = p.parse_args(argv)
    printed = []
    notes = mf.print_megatron_notes(args, print_fn=printed.append)
    assert notes == printed and len(printed) == 8  # the 8 no-meaning flags given
    assert ("note: --use-distributed-optimizer is accepted and ignored: megaq's ZeRO-3 engine "
            "always shards the optimizer state over DP") in printed
    assert mf.print_megatron_notes(args, print_fn=printed.append) == []  # once per process
    assert len(printed) == 8


@pytest.mark.parametrize("extra,line", [
    (["--context-parallel-size", "2"],
     "--context-parallel-size 2: megaq has no context parallelism (--context-parallel-size > 1); drop the flag"),
    (["--num-experts", "8"], "--num-experts 8: megaq has no mixture-of-experts layers (--num-experts); drop the flag"),
    (["--fp16"], "--fp16: megaq has no fp16 training with loss scaling (use --bf16); drop the flag"),
    (["--rampup-batch-size", "16", "16", "1000"], "--rampup-batch-size 16 16 1000: megaq has no batch-size ramp-up; drop the flag"),
])
def test_refused_flags_name_the_feature(extra, line):
    p = build_parser()
    mf.add_megatron_flags(p)
    args = p.parse_args(["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
                         "--seq-length", "16", "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3",
                         "--mock-data", *extra])
    with pytest.raises(ValueError) as e:
        mf.check_megatron_flags(args)
    assert str(e.value) == line


def test_markdown_table_lists_every_flag():
    table = mf.flags_table_markdown()
    assert all(f"`{f.name}`" in table for f in mf.MEGATRON_FLAGS)
