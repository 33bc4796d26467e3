"""Megatron-LM's GPT pretraining flags that a dense GPT / Llama run uses, classified.

A Megatron-LM launch script should parse unchanged. Each flag is one of:

- IMPLEMENTED: megaq has the flag and it does what Megatron's does (a field of a
  configuration class defines it, megaq.config.run.FLAG_CLASSES; this table only lists it,
  so docs and tests can see the whole set);
- NOTE: the flag has no meaning for megaq (a fusion switch, a backend choice, an fp16
  loss-scaling knob, a logging extra); it is accepted, and a one-line note saying why
  is printed once;
- REFUSED: the flag asks for a feature megaq lacks; using it (with a value other than
  the harmless ones in `allowed`) stops with one line naming the feature.

megaq.config.arguments.build_parser calls `add_megatron_flags(parser)` after the configuration's
flags: it adds every NOTE and REFUSED flag the parser does not already define (so flags
megaq later implements simply take over); megaq.config.arguments.parse_config then calls
`check_megatron_flags` (a refusal is one ArgumentsError line) and, on rank 0,
`print_megatron_notes`.
`check_megatron_flags(args, error)` raises `error(one line)` for a refused use and
returns the notes; `print_megatron_notes(args)` prints each note once per process.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from megaq.data.tokenizer import inferred_type_note

IMPLEMENTED, NOTE, REFUSED = "implemented", "note", "refused"


@dataclass(frozen=True)
class MegatronFlag:
    name: str                  # "--use-flash-attn"
    kind: str                  # IMPLEMENTED / NOTE / REFUSED
    why: str = ""              # NOTE: why it means nothing here; REFUSED: the missing feature
    takes: str | None = None   # None: a switch; "str" / "int" / "float": one value; "+": several
    allowed: tuple = field(default_factory=tuple)  # REFUSED: values that ask for nothing

    @property
    def dest(self) -> str:
        return self.name[2:].replace("-", "_")


def _impl(*names):
    return [MegatronFlag(n, IMPLEMENTED) for n in names]


def _note(name, why, takes=None):
    return MegatronFlag(name, NOTE, why, takes)


def _refuse(name, feature, takes=None, allowed=()):
    return MegatronFlag(name, REFUSED, feature, takes, tuple(allowed))


_FUSION = "megaq picks its fused kernels itself"
_FP16 = "megaq trains in bf16 or fp32: there is no fp16 loss scaling"
_TB = "megaq's TensorBoard writer logs its fixed set of scalars"

MEGATRON_FLAGS: tuple[MegatronFlag, ...] = tuple(
    # ---- implemented (configuration fields; some are still to come: see the tests) ----
    _impl("--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads",
          "--kv-channels", "--group-query-attention", "--num-query-groups",
          "--max-position-embeddings", "--position-embedding-type", "--rotary-base",
          "--normalization", "--norm-epsilon", "--swiglu", "--disable-bias-linear",
          "--untie-embeddings-and-output-weights", "--attention-dropout", "--hidden-dropout",
          "--init-method-std", "--make-vocab-size-divisible-by", "--seq-length",
          "--tensor-model-parallel-size", "--pipeline-model-parallel-size",
          "--num-layers-per-virtual-pipeline-stage", "--sequence-parallel",
          "--use-tp-pp-dp-mapping", "--distributed-backend", "--distributed-timeout-minutes",
          "--micro-batch-size", "--global-batch-size", "--train-iters", "--train-samples",
          "--lr", "--min-lr", "--lr-decay-style", "--lr-decay-iters", "--lr-decay-samples",
          "--lr-warmup-iters", "--lr-warmup-samples", "--lr-warmup-fraction",
          "--weight-decay", "--adam-beta1", "--adam-beta2", "--adam-eps", "--clip-grad",
          "--optimizer", "--sgd-momentum", "--seed", "--bf16", "--recompute-activations",
          "--recompute-granularity", "--recompute-method", "--recompute-num-layers",
          "--data-path", "--train-data-path", "--valid-data-path", "--test-data-path",
          "--split", "--data-cache-path", "--mock-data", "--tokenizer-type",
          "--tokenizer-model", "--vocab-file", "--merge-file", "--vocab-size",
          "--eod-mask-loss", "--save", "--save-interval", "--load", "--no-load-rng",
          "--ckpt-format", "--async-save",
          "--no-load-optim", "--no-save-optim", "--finetune", "--pretrained-checkpoint",
          "--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler",
          "--exit-interval", "--exit-duration-in-mins", "--exit-signal-handler",
          "--fp8-format", "--fp8-recipe", "--fp8-amax-history-len", "--fp8-amax-compute-algo",
          "--log-interval", "--eval-interval", "--eval-iters", "--tensorboard-dir",
          "--log-throughput", "--log-memory-to-tensorboard", "--log-params-norm",
          "--timing-log-level", "--wandb-project", "--wandb-exp-name", "--wandb-save-dir",
          "--qk-layernorm", "--use-rope-scaling", "--rope-scaling-factor",
          "--calculate-per-token-loss")
    + [
        # ---- accepted with a note: nothing to do for megaq ------------------------------
        _note("--use-mcore-models", "megaq's model is megatron-core's GPT layout already"),
        _note("--use-legacy-models", "megaq has one model implementation (mcore's layout)"),
        _note("--transformer-impl", "megaq has its own layer implementation", "str"),
        _note("--use-flash-attn", "megaq uses PyTorch's fused attention whenever it can"),
        _note("--attention-backend", "megaq uses PyTorch's fused attention whenever it can",
              "str"),
        _note("--use-distributed-optimizer",
              "megaq's ZeRO-3 engine always shards the optimizer state over DP"),
        _note("--overlap-grad-reduce", "megaq's ZeRO engine schedules its gradient reduction"),
        _note("--overlap-param-gather", "megaq's ZeRO engine prefetches its weight gathers"),
        _note("--tp-comm-overlap", "megaq's TP collectives are not split into overlap chunks"),
        _note("--no-masked-softmax-fusion", _FUSION),
        _note("--no-bias-gelu-fusion", _FUSION),
        _note("--no-bias-swiglu-fusion", _FUSION),
        _note("--no-bias-dropout-fusion", _FUSION),
        _note("--no-rope-fusion", _FUSION),
        _note("--no-persist-layer-norm", _FUSION),
        _note("--no-gradient-accumulation-fusion", _FUSION),
        _note("--cross-entropy-loss-fusion", _FUSION),
        _note("--no-async-tensor-model-parallel-allreduce", _FUSION),
        _note("--attention-softmax-in-fp32",
              "megaq's fused attention computes the softmax in fp32"),
        _note("--apply-query-key-layer-scaling", "it only changes fp16 numerics; " + _FP16),
        _note("--accumulate-allreduce-grads-in-fp32",
              "megaq accumulates and reduces gradients in fp32 already"),
        _note("--loss-scale", _FP16, "float"),
        _note("--initial-loss-scale", _FP16, "float"),
        _note("--min-loss-scale", _FP16, "float"),
        _note("--loss-scale-window", _FP16, "float"),
        _note("--hysteresis", _FP16, "int"),
        _note("--use-cpu-initialization", "megaq chooses where it initialises the weights"),
        _note("--check-for-nan-in-loss-and-grad", "megaq always checks and skips non-finite "
              "steps"),
        _note("--manual-gc", "megaq leaves Python's garbage collector on"),
        _note("--manual-gc-interval", "megaq leaves Python's garbage collector on", "int"),
        _note("--empty-unused-memory-level", "megaq does not empty the CUDA cache per step",
              "int"),
        _note("--use-dist-ckpt", "megaq's --ckpt-format torch_dist (the default) is "
              "torch.distributed.checkpoint already"),
        _note("--ckpt-fully-parallel-save", "with --ckpt-format torch_dist every megaq rank "
              "writes its own shard"),
        _note("--ckpt-fully-parallel-load", "every megaq rank reads its own shard file"),
        _note("--no-save-rng", "megaq always saves the RNG streams (resume with --no-load-rng "
              "to ignore them)"),
        _note("--num-workers", "megaq's batch iterator reads memory-mapped data in the "
              "training process", "int"),
        _note("--dataloader-type", "megaq's batch iterator is Megatron's 'single' sampler",
              "str"),
        _note("--num-dataset-builder-threads", "rank 0 builds megaq's index caches", "int"),
        _note("--no-mmap-bin-files", "megaq always memory-maps .bin files"),
        _note("--no-create-attention-mask-in-dataloader",
              "megaq's causal mask is built by the attention kernel"),
        _note("--tensorboard-log-interval", _TB + " every --log-interval", "int"),
        _note("--tensorboard-queue-size", _TB, "int"),
        _note("--log-timers-to-tensorboard", _TB),
        _note("--log-validation-ppl-to-tensorboard", _TB),
        _note("--log-loss-scale-to-tensorboard", _TB),
        _note("--log-world-size-to-tensorboard", _TB),
        _note("--log-batch-size-to-tensorboard", _TB),
        _note("--log-learning-rate-to-tensorboard", _TB),
        _note("--log-num-zeros-in-grad", "megaq does not count zero gradients"),
        _note("--log-progress", "megaq's metrics file (--metrics-file) records progress"),
        _note("--timing-log-option", "megaq prints the timers (--timing-log-level) in Megatron's "
              "default form, (min, max) over the ranks", "str"),
        _note("--profile", "use --log-comm-time or torch.profiler around megaq.pretrain.main"),
        _note("--profile-step-start", "see --profile", "int"),
        _note("--profile-step-end", "see --profile", "int"),
        _note("--use-pytorch-profiler", "see --profile"),
        _note("--deterministic-mode", "megaq does not change PyTorch's determinism settings "
              "(call torch.use_deterministic_algorithms yourself)"),
        # ---- refused: features megaq lacks ----------------------------------------------
        _refuse("--context-parallel-size", "context parallelism (--context-parallel-size > 1)",
                "int", allowed=("1",)),
        _refuse("--expert-model-parallel-size", "expert parallelism (mixture of experts)",
                "int", allowed=("1",)),
        _refuse("--num-experts", "mixture-of-experts layers (--num-experts)", "int"),
        _refuse("--moe-router-topk", "mixture-of-experts routing", "int"),
        _refuse("--fp16", "fp16 training with loss scaling (use --bf16)"),
        _refuse("--fp8-param-gather", "flag of this name: its FP8 parameter gathers are "
                "--zero-quantized-weights fp8 (ZeRO-3, with --fp8-format)"),
        _refuse("--add-qkv-bias", "QKV bias without the other linear biases"),
        _refuse("--apply-layernorm-1p", "layer norm with zero-centred gamma (1p)"),
        _refuse("--squared-relu", "squared-ReLU MLPs"),
        _refuse("--rotary-percent", "partial rotary embeddings (--rotary-percent < 1)", "float",
                allowed=("1", "1.0")),
        _refuse("--rotary-seq-len-interpolation-factor", "RoPE position interpolation", "int"),
        _refuse("--rampup-batch-size", "batch-size ramp-up (a run's global batch is fixed: the "
                "data iterator, the schedules' micro-batch count and the LR schedule's step "
                "assume it; train at the final --global-batch-size)", "+"),
        _refuse("--decoder-first-pipeline-num-layers", "uneven pipeline stages", "int"),
        _refuse("--decoder-last-pipeline-num-layers", "uneven pipeline stages", "int"),
        _refuse("--account-for-embedding-in-pipeline-split", "uneven pipeline stages"),
        _refuse("--account-for-loss-in-pipeline-split", "uneven pipeline stages"),
        _refuse("--reset-position-ids", "position ids restarting at each document"),
        _refuse("--reset-attention-mask", "attention masks cut at document boundaries"),
        _refuse("--use-checkpoint-args", "taking the architecture from the checkpoint's args "
                "(pass the flags; tools/convert_checkpoint.py writes them to megaq_args.txt)"),
        _refuse("--vocab-extra-ids", "extra sentinel tokens (T5-style)", "int", allowed=("0",)),
        _refuse("--start-weight-decay", "weight-decay schedule", "float"),
        _refuse("--end-weight-decay", "weight-decay schedule", "float"),
        _refuse("--weight-decay-incr-style", "weight-decay schedule", "str",
                allowed=("constant",)),
        _refuse("--init-method-xavier-uniform", "Xavier-uniform initialisation"),
        _refuse("--data-parallel-random-init", "different initial weights per DP rank"),
        _refuse("--lr-warmup-init", "non-zero warm-up starting LR", "float",
                allowed=("0", "0.0")),
    ])

BY_NAME = {f.name: f for f in MEGATRON_FLAGS}
assert len(BY_NAME) == len(MEGATRON_FLAGS), "a flag is classified twice"

_TYPES = {"str": str, "int": str, "float": str, "+": str}  # values kept as given (compared as text)
_printed: set[str] = set()


def add_megatron_flags(parser: argparse.ArgumentParser) -> list[MegatronFlag]:
    """Add every NOTE and REFUSED flag the parser does not define yet; returns those added.
    Their default is None, so `check_megatron_flags` sees exactly what was given."""
    group = parser.add_argument_group("Megatron-LM flags accepted for compatibility "
                                      "(see megaq/config/megatron_flags.py)")
    have = set(parser._option_string_actions)  # noqa: SLF001 - argparse has no public lookup
    added = []
    for f in MEGATRON_FLAGS:
        if f.kind == IMPLEMENTED or f.name in have:
            continue
        help_text = (f"accepted, no effect: {f.why}" if f.kind == NOTE
                     else f"refused: megaq has no {f.why}")
        if f.takes is None:
            group.add_argument(f.name, dest=f.dest, action="store_true", default=None,
                               help=help_text)
        else:
            group.add_argument(f.name, dest=f.dest, default=None, help=help_text,
                               nargs="+" if f.takes == "+" else None, type=_TYPES[f.takes])
        added.append(f)
    return added


def _given(args, f: MegatronFlag):
    return getattr(args, f.dest, None)


def check_megatron_flags(args, error=ValueError) -> list[str]:
    """Raise error('<flag>: megaq has no <feature>; drop it') for the first refused flag
    used; return the note lines of the NOTE flags that were given."""
    for f in MEGATRON_FLAGS:
        if f.kind != REFUSED:
            continue
        v = _given(args, f)
        if v is None or v is False or (f.allowed and str(v) in f.allowed):
            continue
        shown = f.name if f.takes is None else f"{f.name} {' '.join(v) if isinstance(v, list) else v}"
        raise error(f"{shown}: megaq has no {f.why}; drop the flag")
    inferred = inferred_type_note(*(getattr(args, k, None) for k in (  # what megaq infers
        "tokenizer_type", "tokenizer_model", "vocab_file", "merge_file")))
    return [f"note: {f.name} is accepted and ignored: {f.why}"
            for f in MEGATRON_FLAGS if f.kind == NOTE and _given(args, f) not in (None, False)
            ] + ([inferred] if inferred else [])


def print_megatron_notes(args, error=ValueError, print_fn=print) -> list[str]:
    """check_megatron_flags, then print each note not printed before in this process
    (call it on rank 0); returns the notes printed now."""
    fresh = [n for n in check_megatron_flags(args, error) if n not in _printed]
    for n in fresh:
        _printed.add(n)
        print_fn(n)
    return fresh


def flags_table_markdown(defined: set[str]) -> str:
    """The table for docs/TRAINING.md: flag | megaq. `defined`: the flags megaq's parser
    defines itself (an implemented flag not among them is listed as not accepted yet)."""
    rows = ["| Megatron-LM flag | in megaq |", "|---|---|"]
    for f in MEGATRON_FLAGS:
        if f.kind == IMPLEMENTED:
            what = "implemented" if f.name in defined else "not accepted yet (planned)"
        elif f.kind == NOTE:
            what = f"accepted, no effect: {f.why}"
        else:
            what = f"refused: megaq has no {f.why}"
        rows.append(f"| `{f.name}` | {what} |")
    return "\n".join(rows)


if __name__ == "__main__":  # prints the table of docs/TRAINING.md
    from megaq.config.flags import flag_fields
    from megaq.config.run import FLAG_CLASSES
    print(flags_table_markdown({f.metadata["flag"] for cls in FLAG_CLASSES
                                for f in flag_fields(cls)}))
