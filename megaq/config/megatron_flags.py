"""Megatron-LM's pretraining flags, every one classified (none is unknown).

A Megatron-LM launch script should parse unchanged. megaq.config.megatron_flag_list
records every flag of Megatron-LM's pretrain_gpt.py parser; each is one of:

- IMPLEMENTED: megaq has the flag and it does what Megatron's does (a field of a
  configuration class defines it, megaq.config.run.FLAG_CLASSES; this table only lists
  the ones a dense GPT / Llama script uses, the docs table adds the rest);
- ALIAS: Megatron's spelling of a megaq flag (--fp8-param-gather is
  --zero-quantized-weights fp8); it sets that flag's value (a switch that stands for
  several megaq flags, Megatron-DeepSpeed's --checkpoint-activations, fills those the
  command line left unset);
- NOTE: the flag has no meaning for megaq (a fusion switch, a backend choice, an fp16
  loss-scaling knob, a logging extra, another model's setting); it is accepted, and rank
  0 prints one line at start naming every such flag given (--quiet-notes: none);
- REFUSED: the flag asks for a feature megaq lacks; using it (with a value other than
  the harmless ones in `allowed`) is one line naming the feature.

The flags a dense-GPT script uses are listed one by one (MEGATRON_FLAGS' first part),
then Megatron-DeepSpeed's own (its ZeRO and activation-checkpointing flags; its
--deepspeed / --deepspeed_config are megaq.config.deepspeed_config's);
the rest of the recorded parser is classified by family (_FAMILIES: MoE, RL, inference,
vision and BERT settings, ...). megaq.config.arguments.build_parser calls
`add_megatron_flags(parser)` after the configuration's flags: it adds every ALIAS, NOTE
and REFUSED flag the parser does not already define (so flags megaq later implements
simply take over); megaq.config.arguments.run_problems calls `megatron_flag_problems`
(every refusal, and the notes) before building the configuration.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, field

from megaq.config.megatron_flag_list import MEGATRON_ARGUMENTS
from megaq.data.tokenizer import inferred_type_note

IMPLEMENTED, ALIAS, NOTE, REFUSED = "implemented", "alias", "note", "refused"


@dataclass(frozen=True)
class MegatronFlag:
    name: str                  # "--use-flash-attn"
    kind: str                  # IMPLEMENTED / NOTE / REFUSED
    why: str = ""              # NOTE: why it means nothing here; REFUSED: the missing feature
    takes: str | None = None   # None: a switch; "str" / "int" / "float": one value; "+": several
    allowed: tuple = field(default_factory=tuple)  # REFUSED: values that ask for nothing
    # ALIAS: the megaq flag's destination it sets, and the value (None: True for a switch)
    target: str | None = None
    const: object = None
    # REFUSED: when given these flags (parsed args), the flag asks for nothing: noted instead
    harmless: object = None    # Callable[[argparse.Namespace], bool] | None
    # ALIAS switch standing for several megaq flags: ((destination, value), ...), each
    # filled after parsing where the command line left it unset (None)
    fills: tuple = ()

    @property
    def dest(self) -> str:
        return self.name[2:].replace("-", "_")


def _impl(*names):
    return [MegatronFlag(n, IMPLEMENTED) for n in names]


def _note(name, why, takes=None):
    return MegatronFlag(name, NOTE, why, takes)


def _refuse(name, feature, takes=None, allowed=(), harmless=None):
    return MegatronFlag(name, REFUSED, feature, takes, tuple(allowed), harmless=harmless)


def _alias(name, megaq_flag, target, const=None):
    """`name` sets megaq's `megaq_flag` (its destination `target`, to `const`)."""
    return MegatronFlag(name, ALIAS, f"as {megaq_flag}", target=target, const=const)


def _fill_alias(name, megaq_flags, fills):
    """The switch `name` stands for several megaq flags, ((dest, value), ...): each is
    filled after parsing unless the command line set it; a value may be a function of
    the parsed flags (one that reads a companion flag)."""
    return MegatronFlag(name, ALIAS, f"as {megaq_flags}", fills=tuple(fills))


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
          "--calculate-per-token-loss", "--profile", "--use-pytorch-profiler",
          "--profile-step-start", "--profile-step-end", "--profile-ranks")
    + [
        # ---- accepted with a note: nothing to do for megaq ------------------------------
        _note("--use-mcore-models", "megaq's model is megatron-core's GPT layout already"),
        _note("--use-legacy-models", "megaq has one model implementation (mcore's layout)"),
        _note("--transformer-impl", "megaq has its own layer implementation", "str"),
        _note("--use-flash-attn", "megaq uses PyTorch's fused attention whenever it can"),
        _note("--attention-backend", "megaq uses PyTorch's fused attention whenever it can",
              "str"),
        MegatronFlag("--use-distributed-optimizer", ALIAS, "as --zero-stage 1 (the optimizer "
                     "state sharded over DP, weights and gradients whole: ZeRO-1)",
                     target="zero_stage", const={True: 1}),
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
              "megaq accumulates gradients in fp32 always (a step that writes each "
              "gradient once at DP = 1 keeps it bf16, which is the same value); its DP "
              "reductions carry the training dtype (bf16 in bf16 runs), summed into the "
              "fp32 accumulator"),
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
        _note("--deterministic-mode", "megaq does not change PyTorch's determinism settings "
              "(call torch.use_deterministic_algorithms yourself)"),
        # ---- aliases: Megatron's spelling of a megaq flag ----------------------------------
        _alias("--fp8-param-gather", "--zero-quantized-weights fp8 (ZeRO-3's FP8 weight "
               "gathers; needs --fp8-format)", "zero_quantized_weights", "fp8"),
        _alias("--use-rotary-position-embeddings", "--position-embedding-type rope",
               "position_embedding_type", "rope"),
        _alias("--override-opt-param-scheduler", "--override-opt_param-scheduler",
               "override_opt_param_scheduler"),
        _alias("--use-checkpoint-opt-param-scheduler", "--use-checkpoint-opt_param-scheduler",
               "use_checkpoint_opt_param_scheduler"),
        # ---- noted: the DP engine's own knobs ------------------------------------------------
        _note("--grad-reduce-in-bf16", "megaq's DP reductions carry the training dtype "
              "already (bf16 in bf16 runs; --zero-quantized-gradients cuts their bytes further, "
              "to int8/int4), accumulated in fp32"),
        _note("--ddp-bucket-size", "megaq's ZeRO engine sizes its reduce and gather buckets "
              "itself", "str"),
        _note("--use-torch-fsdp2", "megaq's ZeRO-3 engine (--zero-stage 3, the default) "
              "shards weights, gradients and optimizer state as FSDP does"),
        _note("--use-megatron-fsdp", "megaq's ZeRO-3 engine (--zero-stage 3, the default) "
              "shards weights, gradients and optimizer state as FSDP does"),
        _note("--use-precision-aware-optimizer", "megaq keeps fp32 main weights, gradients "
              "and Adam moments (only fp32 is accepted for --main-*-dtype / --exp-avg*-dtype)"),
        _note("--no-query-key-layer-scaling", "megaq never scales QK by the layer number "
              "(the default; it only matters for fp16)"),
        MegatronFlag("--data-parallel-sharding-strategy", ALIAS,
                     "as --zero-stage: no_shard is 0, optim 1, optim_grads 2, "
                     "optim_grads_params 3", "str", target="zero_stage",
                     const={"no_shard": 0, "optim": 1, "optim_grads": 2,
                            "optim_grads_params": 3}),
        _refuse("--main-grads-dtype", "gradients accumulated in other than fp32", "str",
                allowed=("fp32",)),
        _refuse("--main-params-dtype", "main weights in other than fp32", "str",
                allowed=("fp32",)),
        _refuse("--exp-avg-dtype", "Adam moments in other than fp32", "str", allowed=("fp32",)),
        _refuse("--exp-avg-sq-dtype", "Adam moments in other than fp32", "str",
                allowed=("fp32",)),
        _refuse("--no-position-embedding", "GPT without position embeddings (with "
                "--position-embedding-type rope, where it changes nothing, it is accepted)",
                harmless=lambda args: getattr(args, "position_embedding_type", None) == "rope"),
        _refuse("--non-persistent-save-interval", "non-persistent (local, in-memory) "
                "checkpoints: use --save-interval (--async-save hides the write)", "int"),
        _refuse("--rerun-mode", "rerun state machine (re-running a step to tell a transient "
                "fault from a bug; megaq checks for and skips non-finite steps)", "str",
                allowed=("disabled",)),
        # ---- Megatron-DeepSpeed's own flags (its ZeRO and activation checkpointing; its
        # --deepspeed / --deepspeed_config: megaq.config.deepspeed_config) ---------------
        MegatronFlag("--zero-stage", IMPLEMENTED, "Megatron-DeepSpeed's ZeRO stage; megaq's "
                     "engine runs it (Megatron-DeepSpeed only writes it into the ds_config)"),
        MegatronFlag("--zero-reduce-bucket-size", IMPLEMENTED, "Megatron-DeepSpeed's, in "
                     "elements: the gradient elements whose reduction may be in flight"),
        MegatronFlag("--checkpoint-num-layers", ALIAS, "as --recompute-num-layers with "
                     "--checkpoint-activations (layers per recomputed group; alone it asks "
                     "for nothing, as in Megatron-DeepSpeed)", "int"),
        _fill_alias("--checkpoint-activations", "--recompute-granularity full "
                    "--recompute-method uniform --recompute-num-layers N (N: --checkpoint-num-"
                    "layers, default 1; Megatron-DeepSpeed's "
                    "meaning: every layer recomputed in backward from its kept input; "
                    "Megatron-LM's own parser refuses this old spelling)",
                    (("recompute_granularity", "full"), ("recompute_method", "uniform"),
                     ("recompute_num_layers",
                      lambda args: getattr(args, "checkpoint_num_layers", None) or 1))),
        _note("--deepspeed-activation-checkpointing", "megaq recomputes with its own "
              "activation checkpointing (--checkpoint-activations / --recompute-granularity)"),
        _note("--zero-contigious-gradients", "megaq's gradient buckets are flat contiguous "
              "buffers already (DeepSpeed's contiguous_gradients)"),
        _note("--zero-reduce-scatter", "megaq's ZeRO engine reduce-scatters its gradients "
              "already"),
        _note("--zero-allgather-bucket-size", "megaq gathers each unit's weights in one "
              "all-gather (DeepSpeed's stage 1/2 allgather_bucket_size)", "int"),
        _note("--synchronize-each-layer", "megaq's recompute needs no device synchronisation "
              "per layer"),
        _note("--contigious-checkpointing", "megaq keeps the recomputed layers' inputs as "
              "ordinary tensors (no pre-allocated checkpoint buffer)"),
        _note("--profile-backward", "megaq's --profile covers backward"),
        _note("--cpu-torch-adam", "a setting of --cpu-optimizer, which megaq refuses"),
        _note("--local_rank", "megaq takes its local rank from the launcher's environment "
              "(LOCAL_RANK), as the deepspeed launcher also sets it", "int"),
        _refuse("--partition-activations", "partitioning of the recomputed layers' kept inputs "
                "over the TP ranks (--sequence-parallel keeps each TP rank's share of the "
                "layer inputs; with --tensor-model-parallel-size 1 it is accepted)",
                harmless=lambda args: getattr(args, "tensor_model_parallel_size", 1) == 1),
        _refuse("--checkpoint-in-cpu", "CPU offloading of activation checkpoints"),
        _refuse("--cpu-optimizer", "CPU offloading (the optimizer step on the CPU; ZeRO "
                "shards the optimizer state over the DP ranks instead)"),
        _refuse("--remote-device", "CPU / NVMe offloading of ZeRO-3 parameters", "str",
                allowed=("none",)),
        _refuse("--use-pin-memory", "CPU offloading of ZeRO-3 parameters"),
        # ---- refused: features megaq lacks ----------------------------------------------
        _refuse("--context-parallel-size", "context parallelism (--context-parallel-size > 1)",
                "int", allowed=("1",)),
        _refuse("--expert-model-parallel-size", "expert parallelism (mixture of experts)",
                "int", allowed=("1",)),
        _refuse("--num-experts", "mixture-of-experts layers (--num-experts)", "int"),
        _refuse("--moe-router-topk", "mixture-of-experts routing", "int"),
        _refuse("--fp16", "fp16 training with loss scaling (use --bf16)"),
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

_MOE = "mixture-of-experts layers"
_RL = "reinforcement-learning (RL / GRPO) training loop"
_INFER = "Megatron's inference engine setting; pretrain_gpt.py never runs that engine"
_OTHER_MODEL = ("a setting of Megatron's BERT / T5 / retrieval / vision models, which "
                "pretrain_gpt.py ignores in Megatron-LM too")
_DP = "megaq's ZeRO engine schedules, buckets and places its own collectives"
_CKPT = "megaq's torch_dist checkpoints are written and resharded by its own code"
_TELEMETRY = "NVIDIA's telemetry / cluster services are not used by megaq"

# The rest of Megatron-LM's parser (megaq.config.megatron_flag_list), by family: the
# first pattern matching a flag classifies it. In a refused family a switch that turns
# something off (--no-*, --disable-*) asks for nothing and is noted.
_FAMILIES: tuple[tuple[str, str, str], ...] = (
    # features megaq lacks
    (r"--(moe-|num-experts|expert-|overlap-moe-|ep-overlap-)", REFUSED, _MOE),
    (r"--(rl-|no-rl-|grpo-|perform-rl-step|langrl-|no-langrl-|refit-method)", REFUSED, _RL),
    (r"--(mamba-|hybrid-|is-hybrid-model|disable-mamba-)", REFUSED, "Mamba / hybrid layers"),
    (r"--(linear-(attention|conv|key|num|value))", REFUSED, "linear-attention layers"),
    (r"--(experimental-attention-variant|dsa-|softmax-type|window-|attention-output-gate"
     r"|qk-l2-norm|qk-clip|log-max-attention-logit)", REFUSED, "attention variant of this kind "
     "(sparse, windowed, gated, clipped or with another softmax)"),
    (r"--(multi-latent-attention|q-lora-rank|kv-lora-rank|qk-head-dim|qk-pos-emb-head-dim"
     r"|v-head-dim|cache-mla-latents|mscale|rotary-scaling-factor|rope-type)", REFUSED,
     "multi-latent attention (DeepSeek) or YaRN RoPE"),
    (r"--(mtp-)", REFUSED, "multi-token prediction"),
    (r"--(fp4-)", REFUSED, "FP4 training"),
    (r"--(fp8-margin|fp8-quantizer-factory|first-last-layers-bf16|num-layers-at-"
     r"|no-fp8-wgrad|disable-fp8-wgrad|te-precision-config-file|reuse-grad-buf-for-mxfp8"
     r"|keep-fp8-transpose-cache)", REFUSED,
     "FP8 setting of this kind (megaq's FP8 is --fp8-format / --fp8-recipe)"),
    (r"--(heterogeneous-|spec$|yaml-cfg|batch-invariant-mode|use-kitchen-attention"
     r"|kitchen-attention-backend|quick-geglu|openai-gelu|glu-linear-offset"
     r"|activation-func-clamp-value|use-fused-weighted-squared-relu|mrope-section"
     r"|rotary-interleaved|no-rope-freq|apply-residual-connection-post-layernorm"
     r"|fp32-residual-connection|embedding-init-method-std|decoupled-|head-lr-mult"
     r"|no-weight-decay-cond-type|apply-wd-to-qk-layernorm)", REFUSED,
     "model or optimizer variant of this kind (megaq's GPT / Llama layers, one learning "
     "rate, no decay on biases and norms)"),
    (r"--(optimizer-cpu-offload|optimizer-offload-fraction|overlap-cpu-optimizer"
     r"|use-torch-optimizer-for-cpu-offload|cpu-offloading-num-layers"
     r"|fine-grained-activation-offloading|offload-modules|min-offloaded-tensor-size"
     r"|no-pin-cpu-)", REFUSED, "CPU offloading"),
    (r"--(inprocess-restart$|enable-ft-package|enable-experimental|sft$|skip-train"
     r"|fim-|iterations-to-skip|full-validation|multiple-validation-sets"
     r"|per-split-data-args-path|data-args-path|per-dataset-sequences-path"
     r"|mid-level-dataset-surplus|phase-transition-iterations)", REFUSED,
     "training-loop feature of this kind (in-process restart, fault-tolerance package, SFT, "
     "fill-in-the-middle data, skipped iterations, multiple validation sets, data-args "
     "files)"),
    (r"--(ckpt-convert-|ckpt-step|load-main-params-from-ckpt|use-mp-args-from-checkpoint"
     r"|exit-on-missing-checkpoint|save-retain-interval|persistent-save-interval"
     r"|non-persistent-)", REFUSED,
     "checkpoint feature of this kind (convert with tools/convert_checkpoint.py; megaq "
     "loads the latest checkpoint of --load, saves every --save-interval)"),
    (r"--(num-distributed-optimizer-instances|hierarchical-context-parallel-sizes"
     r"|hybrid-context-parallel|cp-comm-type|max-seqlen-per-dp-cp-rank"
     r"|pipeline-model-parallel-layout|microbatch-group-size-per-virtual-pipeline-stage"
     r"|num-virtual-stages-per-pipeline-rank|decoder-num-layers|encoder-num-layers"
     r"|pipeline-model-parallel-comm-backend|use-ring-exchange-p2p|replication"
     r"|outer-dp-sharding-strategy|enable-full-sharding-in-hsdp)", REFUSED,
     "parallel layout of this kind (megaq: TP x PP (even stages, --num-layers-per-virtual-"
     "pipeline-stage) x ZeRO DP with hpZ)"),
    (r"--(tiktoken-|tokenizer-special-tokens|tokenizer-metadata|tokenizer-hf-"
     r"|tokenizer-sentencepiece-legacy|trust-remote-code|legacy-tokenizer"
     r"|allow-ambiguous-pad-tokens|sft-tokenizer-prompt-format)", REFUSED,
     "tokenizer option of this kind (megaq's types are --tokenizer-type's choices)"),
    # accepted: nothing to do for megaq
    (r"--(inference-|no-inference-|enable-chunked-prefill|disable-chunked-prefill"
     r"|flash-decode|decode-only-cuda-graphs|mlp-chunks-for-prefill|nccl-all-reduce-for"
     r"|use-legacy-static-engine)", NOTE, _INFER),
    (r"--(dino-|img-|patch-dim|num-channels|num-classes|vision-|swin-|classes-fraction"
     r"|data-per-class-fraction|mask-|iter-per-epoch|bert-|biencoder-|ict-|retriever-"
     r"|titles-data-path|evidence-data-path|block-data-path|query-in-block-prob"
     r"|use-one-sent-docs|indexer-|embedding-path|output-bert-embeddings|short-seq-prob"
     r"|encoder-seq-length|decoder-seq-length|relative-attention-|sample-rate"
     r"|no-data-sharding)", NOTE, _OTHER_MODEL),
    (r"--(inprocess-|ft-|calc-ft-timeouts)", NOTE,
     "a setting of in-process restart / the fault-tolerance package, which megaq refuses "
     "(it resumes through the launcher: scripts/pretrain_slurm.sbatch requeues)"),
    (r"--(muon-)", NOTE, "a setting of --optimizer muon, which megaq's --optimizer choices "
     "refuse"),
    (r"--(lr-wsd-)", NOTE, "a setting of --lr-decay-style WSD, which megaq's --lr-decay-style "
     "choices refuse"),
    (r"--(one-logger-|no-one-logger|app-tag-|straggler-|disable-straggler-on-startup"
     r"|log-straggler|run-workload-inspector-server|log-energy|config-logger-dir"
     r"|error-injection-|result-rejected-tracker-filename|check-for-spiky-loss"
     r"|check-for-large-grads|check-weight-hash-across-dp-replicas-interval|adlr-autoresume)", NOTE,
     _TELEMETRY + " (megaq checks for and skips non-finite steps itself)"),
    (r"--(ddp-|no-align-|overlap-param-gather-with-optimizer-step|torch-fsdp2-|fsdp-"
     r"|suggested-communication-unit-size|no-gradient-reduce-div-fusion"
     r"|create-all-gather-group|disable-symmetric-registration|use-nccl-ub"
     r"|nccl-communicator-config-path|use-sharp|sharp-enabled-group"
     r"|high-priority-stream-groups|disable-gloo-process-groups|no-strict-fsdp"
     r"|disable-strict-fsdp|no-overlap-p2p-communication|overlap-p2p-communication-warmup"
     r"|no-scatter-gather-tensors-in-pipeline|defer-embedding-wgrad-compute"
     r"|wgrad-deferral-limit|delay-wgrad-compute|distributed-timeout-seconds-after-init"
     r"|tp-comm-|no-tp-comm-|disable-tp-comm-|disable-async-tensor-model-parallel"
     r"|train-sync-interval|lazy-mpu-init|fake-process-group|local-rank|symmetric-ar-type)",
     NOTE, _DP),
    (r"--(cuda-graph-|enable-cuda-graph|external-cuda-graph|te-rng-tracker"
     r"|use-te-activation-func|disable-jit-fuser|cross-entropy-fusion-impl"
     r"|disable-bf16-reduced-precision-matmul|init-model-with-meta-device|onnx-safe"
     r"|no-clone-scatter-output|disable-clone-scatter-output|fp16-lm-cross-entropy"
     r"|no-initialization|no-check-for-nan-in-loss-and-grad|no-barrier-with-level-1-timing"
     r"|manual-gc-eval|no-manual-gc-eval|disable-manual-gc-eval|fp8-interval"
     r"|record-memory-history|memory-snapshot-path|save-dgrads-interval"
     r"|save-wgrads-interval|dump-param-to-param-group-map|log-device-memory-used"
     r"|log-memory-interval|logging-level|test-mode|exit-signal$"
     r"|exit-signal-handler-for-dataloader|max-tokens-to-oom)", NOTE,
     "megaq picks its kernels, memory handling and debug output itself"),
    (r"--(dist-ckpt-|distrib-optim-fully-reshardable|auto-detect-ckpt-format"
     r"|ckpt-assume-constant-structure|use-persistent-ckpt-worker|no-ckpt-fully-parallel-save"
     r"|disable-ckpt-fully-parallel-save|no-use-tokenizer-model-from-checkpoint"
     r"|disable-use-tokenizer-model-from-checkpoint|object-storage-cache-path|disable-msc"
     r"|dataloader-defer-npy-index-mmap|dataloader-fast-cache-load)", NOTE, _CKPT
     + "; its datasets memory-map their files"),
    (r"--(wandb-entity|log-loss-scale|no-log-loss-scale|disable-log-loss-scale"
     r"|moe-per-layer-logging)", NOTE, _TB),
    (r"--(batch-size|model-parallel-size|warmup"
     r"|decrease-batch-size-if-needed|padded-vocab-size)$", REFUSED,
     "old Megatron spelling of this kind (Megatron-LM itself refuses it): use "
     "--micro-batch-size, --tensor-model-parallel-size, --lr-warmup-iters, "
     "--global-batch-size, --vocab-size"),
    (r"--(distribute-saved-activations|recompute-modules|moe-layer-recompute)", REFUSED,
     "recomputation option of this kind (megaq: --recompute-granularity / -method / "
     "-num-layers)"),
)


# Flags Megatron-LM's main branch added since core_v0.16.1 (megatron_flag_list's second
# recording): the same families, extended, and a few flags one by one.
_FAMILIES += (
    (r"--(overlap-dispatch-)", REFUSED, _MOE),
    (r"--(gdp-)", REFUSED, "linear-attention layers (gated delta product)"),
    (r"--(yarn-|no-yarn-)", REFUSED, "YaRN RoPE"),
    (r"--(no-dsa-|disable-dsa-)", REFUSED, "attention variant of this kind (sparse)"),
    (r"--(enable-mhc-|mhc-|use-mup$|mup-|output-logit-dtype)", REFUSED,
     "model variant of this kind (hyper-connections, muP scaling, logits in another dtype)"),
    (r"--(fp8-output-proj)", REFUSED,
     "FP8 setting of this kind (megaq's FP8 is --fp8-format / --fp8-recipe)"),
    (r"--(activation-offload-fraction|cpu-offloading-|delay-offload-|delta-offload-"
     r"|fine-grained-offloading-)", REFUSED, "CPU offloading"),
    (r"--(logits-load-|logits-save-|freeze-all-layers|start-eval-at-iter|eval-global-batch-size"
     r"|eval-micro-batch-size|validation-set-names|step-batch-size-schedule"
     r"|dataloader-inter-document-masking)", REFUSED,
     "training-loop feature of this kind (saved logits or distillation from them, frozen "
     "layers, an evaluation batch size or start of its own, named validation sets, a "
     "batch-size schedule, attention cut at document boundaries)"),
    (r"--(override-ckpt-iteration)", REFUSED,
     "checkpoint feature of this kind (megaq resumes at the checkpoint's own iteration)"),
    (r"--(tensor-parallel-num-weight-shards|gtp-)", REFUSED,
     "parallel layout of this kind (weights sharded beyond TP: generalized TP)"),
    (r"--(chat-template|null-tokenizer-|no-tokenizer-sentencepiece-"
     r"|disable-tokenizer-sentencepiece-)", REFUSED,
     "tokenizer option of this kind (megaq's types are --tokenizer-type's choices)"),
    (r"--(lion-)", NOTE, "a setting of --optimizer lion, which megaq's --optimizer choices "
     "refuse"),
    (r"--(num-speculative-tokens|use-same-sampling-seed-across-dp-ranks)", NOTE, _INFER),
    (r"--(fault-injector-|otel-|gpu-sniff-test-interval)", NOTE,
     _TELEMETRY + " (megaq checks for and skips non-finite steps itself)"),
    (r"--(disable-align-|high-priority-a2a-comm-stream|no-use-layer-wise-param-layout"
     r"|megatron-fsdp-)", NOTE, _DP),
    (r"--(flight-recorder-|no-flight-recorder-|disable-flight-recorder-|nvtx-ranges"
     r"|pytorch-profiler-collect-|record-shapes|save-activations-interval"
     r"|save-params-interval|save-tokens-per-expert-interval|fused-residual-rmsnorm"
     r"|mla-down-proj-fusion|use-transformer-engine-op-fuser|optimizer-cuda-graph"
     r"|mlp-chunks-for-training|flash-attention-version|use-grouped-gemm-for-"
     r"|batch-invariant-backend)", NOTE,
     "megaq picks its kernels, memory handling and debug output itself"),
    (r"--(async-ckpt-|async-strategy|ckpt-drop-redundant-extra-state"
     r"|ckpt-fully-parallel-load-|ckpt-fully-parallel-save-|ckpt-pg-tensors-cache-"
     r"|no-ckpt-load-validate-|disable-ckpt-load-validate-|enable-msc)", NOTE, _CKPT),
)
MEGATRON_FLAGS += (
    _refuse("--no-pad-vocab-size", "unpadded vocabulary switch: pass "
            "--make-vocab-size-divisible-by 1 for no padding"),
    _refuse("--disable-pad-vocab-size", "unpadded vocabulary switch: pass "
            "--make-vocab-size-divisible-by 1 for no padding"),
    _note("--exit-signal-handler-for-training", "megaq stops cleanly on SIGTERM / SIGINT "
          "(--exit-signal-handler also saves first)"),
    _note("--verify-integrity", "megaq's checkpoints always carry a SHA-256 manifest, checked "
          "at load (--no-verify-checkpoint skips the check)"),
    _note("--use-gigatoken", "megaq's tokenizers are its own (--tokenizer-type)"),
    _note("--no-save-tokenizer-assets", "megaq's checkpoints keep a copy of the tokenizer's "
          "files"),
    _note("--disable-save-tokenizer-assets", "megaq's checkpoints keep a copy of the "
          "tokenizer's files"),
)


def _family(name: str) -> MegatronFlag | None:
    """`name`'s classification by family (None: no family matches)."""
    for pattern, kind, why in _FAMILIES:
        if re.match(pattern, name):
            takes = _TAKES[MEGATRON_ARGUMENTS.get(name, "-")]
            if kind == REFUSED and takes is None and re.match(r"--(no|disable)-", name):
                return _note(name, f"it turns off part of a feature megaq does not have ({why})")
            return MegatronFlag(name, kind, why, takes)
    return None


_TAKES = {"-": None, "1": "str", "?": "?", "+": "+"}
_EXPLICIT = {f.name for f in MEGATRON_FLAGS}
MEGATRON_FLAGS = MEGATRON_FLAGS + tuple(
    f for f in map(_family, sorted(set(MEGATRON_ARGUMENTS) - _EXPLICIT)) if f is not None)

BY_NAME = {f.name: f for f in MEGATRON_FLAGS}
assert len(BY_NAME) == len(MEGATRON_FLAGS), "a flag is classified twice"

_printed: set[str] = set()


def _help(f: MegatronFlag) -> str:
    if f.kind == ALIAS:
        return f"Megatron's spelling, {f.why}"
    if f.kind == NOTE:
        return f"accepted, no effect: {f.why}"
    return f"refused: megaq has no {f.why}"


def add_megatron_flags(parser: argparse.ArgumentParser) -> list[MegatronFlag]:
    """Add every ALIAS, NOTE and REFUSED flag the parser does not define yet; returns those
    added. A NOTE / REFUSED flag's default is None, so `megatron_flag_problems` sees exactly
    what was given (values are kept as text: they are compared, never used); an ALIAS of a
    switch or a fixed value writes the megaq flag's destination itself."""
    group = parser.add_argument_group("Megatron-LM flags accepted for compatibility "
                                      "(see megaq/config/megatron_flags.py, docs/TRAINING.md)")
    have = set(parser._option_string_actions)  # noqa: SLF001 - argparse has no public lookup
    added = []
    for f in MEGATRON_FLAGS:
        if f.kind == IMPLEMENTED or f.name in have:
            continue
        if f.kind == ALIAS and _switch_alias(f):
            group.add_argument(f.name, dest=f.dest, action=_SetAlias, target=f.target,
                               const=True if f.const is None else f.const, default=None,
                               help=_help(f))
        elif f.takes is None:
            group.add_argument(f.name, dest=f.dest, action="store_true", default=None,
                               help=_help(f))
        else:
            group.add_argument(f.name, dest=f.dest, default=None, help=_help(f),
                               nargs={"+": "+", "?": "?"}.get(f.takes),
                               type=int if f.kind == ALIAS and f.takes == "int" else None)
        added.append(f)
    return added


class _SetAlias(argparse.Action):
    """An alias switch: sets megaq's flag (`target`) to `const`, and records that it was
    given (its own destination True) for the note."""

    def __init__(self, option_strings, dest, target, const, **kw):
        super().__init__(option_strings, dest, nargs=0, const=const, **kw)
        self.target = target

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.target, self.const)
        setattr(namespace, self.dest, True)


def _switch_alias(f: MegatronFlag) -> bool:
    """An alias switch that sets its megaq flag as it is parsed (not a value alias or a
    fill alias, which megatron_flag_problems applies after parsing)."""
    return f.takes is None and not f.fills and not isinstance(f.const, dict)


def _given(args, f: MegatronFlag):
    return getattr(args, f.dest, None)


def _shown(f: MegatronFlag, v) -> str:
    return f.name if f.takes is None or v is True else \
        f"{f.name} {' '.join(v) if isinstance(v, list) else v}"


def megatron_flag_problems(args) -> tuple[list[str], list[str]]:
    """(refusals, notes) of the Megatron-LM flags given: one line per refused use (every
    one, not just the first), and one per flag accepted without effect or inferred. A
    value alias (--data-parallel-sharding-strategy) writes its megaq flag's value into
    `args` here, before the configuration is built from them."""
    refusals, noted, aliased = [], [], []
    # a value alias's target given already: by megaq's own flag (its parser default is
    # None, so given means given) or by an earlier alias; two different values conflict
    set_by = {}
    for f in MEGATRON_FLAGS:
        v = _given(args, f)
        if v is None or v is False:
            continue
        if f.kind == ALIAS and _switch_alias(f):
            aliased.append(f"{f.name} {f.why}")
        elif f.kind == ALIAS and f.fills:
            for dest, value in f.fills:
                if getattr(args, dest, None) is None:
                    setattr(args, dest, value(args) if callable(value) else value)
            aliased.append(f"{f.name} {f.why}")
        elif f.kind == ALIAS and not isinstance(f.const, dict):  # read by a fill alias
            aliased.append(f"{_shown(f, v)} {f.why}")
        elif f.kind == ALIAS:
            target = "--" + f.target.replace("_", "-")
            have = getattr(args, f.target, None)
            if v in f.const and have is not None and have != f.const[v]:
                refusals.append(f"{_shown(f, v)} means {target} {f.const[v]}, but "
                                f"{set_by.get(f.target, f'{target} {have}')} is given too: "
                                f"keep one")
            elif v in f.const:
                setattr(args, f.target, f.const[v])
                set_by[f.target] = _shown(f, v)
                aliased.append(f"{_shown(f, v)} as {target} {f.const[v]}")
            else:
                refusals.append(f"{_shown(f, v)}: megaq has no such value; it takes "
                                f"{' or '.join(f.const)} ({f.why})")
        elif f.kind == REFUSED:
            if f.allowed and str(v) in f.allowed:
                continue  # the value megaq runs anyway (--context-parallel-size 1)
            if f.harmless and f.harmless(args):
                noted.append(f.name)
            else:
                refusals.append(f"{_shown(f, v)}: megaq has no {f.why}; drop the flag")
        elif f.kind == NOTE:
            noted.append(f.name)
    inferred = inferred_type_note(*(getattr(args, k, None) for k in (  # what megaq infers
        "tokenizer_type", "tokenizer_model", "vocab_file", "merge_file")))
    notes = [summary_note(noted)] if noted else []
    if aliased:
        notes.append(f"note: Megatron-LM spellings read as megaq's flags: {'; '.join(aliased)}")
    return refusals, notes + ([inferred] if inferred else [])


def summary_note(names: list[str]) -> str:
    """The one line naming every Megatron-LM flag accepted without effect."""
    return (f"note: {len(names)} Megatron-LM flag(s) accepted without effect: "
            f"{', '.join(names)} (why: --help or docs/TRAINING.md; --quiet-notes hides this)")


def check_megatron_flags(args, error=ValueError) -> list[str]:
    """Raise error(line) for the first refused flag used; return the note lines."""
    refusals, notes = megatron_flag_problems(args)
    if refusals:
        raise error(refusals[0])
    return notes


def print_megatron_notes(args, error=ValueError, print_fn=print) -> list[str]:
    """check_megatron_flags, then print_notes (call it on rank 0)."""
    return print_notes(check_megatron_flags(args, error),
                       quiet=getattr(args, "quiet_notes", False), print_fn=print_fn)


def print_notes(notes: list[str], quiet: bool = False, print_fn=print) -> list[str]:
    """Print each note not printed before in this process (none with --quiet-notes);
    returns the notes printed now."""
    if quiet:
        return []
    fresh = [n for n in notes if n not in _printed]
    for n in fresh:
        _printed.add(n)
        print_fn(n)
    return fresh


def flags_table_markdown(defined: set[str]) -> str:
    """The table for docs/TRAINING.md: every classified flag, then every other flag of
    Megatron-LM's recorded parser that megaq defines itself, as flag | status | what megaq
    does. `defined`: the flags megaq's configuration classes define (an implemented flag
    not among them is listed as not accepted yet)."""
    rows = ["| Megatron-LM flag | status | what megaq does |", "|---|---|---|"]
    for f in MEGATRON_FLAGS:
        if f.kind == IMPLEMENTED:
            status, what = (("implemented", f.why or "what Megatron-LM does (its configuration "
                                            "field)")
                            if f.name in defined else ("not accepted yet", "planned"))
        elif f.kind == ALIAS:
            status, what = "alias", f"the same {f.why}"
        elif f.kind == NOTE:
            status, what = "noted", f"accepts it, no effect: {f.why}"
        else:
            status, what = "refused", f"stops with one line: megaq has no {f.why}" + (
                f" (accepted: {', '.join(f.allowed)})" if f.allowed else "")
        rows.append(f"| `{f.name}` | {status} | {what} |")
    for name in sorted(set(MEGATRON_ARGUMENTS) & defined - set(BY_NAME)):
        rows.append(f"| `{name}` | implemented | what Megatron-LM does (its configuration "
                    f"field) |")
    return "\n".join(rows)


if __name__ == "__main__":  # prints the table of docs/TRAINING.md
    from megaq.config.flags import flag_fields
    from megaq.config.run import FLAG_CLASSES
    print(flags_table_markdown({f.metadata["flag"] for cls in FLAG_CLASSES
                                for f in flag_fields(cls)}))
