"""RunConfig: one run's whole configuration, as frozen dataclasses, validated once.

    RunConfig
      model          megaq.model.GPTConfig          --num-layers, --hidden-size, --swiglu, ...
      parallel       megaq.parallel.ParallelConfig  --tensor-model-parallel-size, ... (+ Layout)
      zero           megaq.zero.ZeroConfig          --zero-stage, --zero-quantized-weights, ...
      data           megaq.data.DataConfig          --data-path, --split, --mock-data, ...
      training       TrainingConfig                 --micro-batch-size, --train-iters, --bf16, ...
      optimizer      OptimizerConfig                --lr, --lr-decay-style, --adam-beta1, ...
      checkpointing  CheckpointConfig               --save, --load, --save-interval, ...
      logging        LoggingConfig                  --log-interval, --eval-iters, --metrics-file, ...

Each class declares its flags as fields (megaq.config.flags: name, help, default live on the
field) and checks its own values in ``__post_init__``, next to what it guards; checks
that span two classes (heads vs TP, layers vs pipeline stages, micro-batches vs
interleaving) live in :meth:`RunConfig.__post_init__`, and call the helper of the layer
that owns the rule. :meth:`RunConfig.from_flags` is the one builder from parsed flags
(megaq.config.arguments.parse_config parses and calls it).

A run's vocabulary is only known once the tokenizer is loaded: the model's
``vocab_size`` is None until :meth:`RunConfig.resolved` fills it in with the data setup's
answer (``dataclasses.replace``; nothing is mutated).

Adding a flag: add a field made with ``flag(...)`` / ``switch(...)`` to the class it
configures (its --help section is the class's FLAG_GROUP), then use it where the class
is read. Library code takes these objects, never an argparse namespace.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from dataclasses import dataclass
from typing import ClassVar

import torch

from megaq import export_files
from megaq.data.config import DataConfig
from megaq.data.errors import DataError
from megaq.config.flags import flag, from_flags, set_derived, switch, to_dict
from megaq.model import ModelConfigError
from megaq.model.config import GPTConfig
from megaq.parallel.config import ParallelConfig
from megaq.parallel.pipeline.split import (check_num_microbatches, num_microbatches_per_step,
                                           virtual_pipeline_size)
from megaq.parallel.pipeline import PipelineConfigError
from megaq.parallel.topology import LayoutError, check_hpz_size, check_model_fits_tp
from megaq.zero import ZeroConfig, ZeroConfigError, check_fp8_weight_gathers
from megaq.zero.config import OPTIMIZER_NAMES


class ConfigError(ValueError):
    """A bad setting or combination; the message names the flag and the fix."""


# What building a RunConfig may raise for a bad flag (each class checks its own values).
CONFIG_ERRORS = (ConfigError, DataError, LayoutError, ModelConfigError, PipelineConfigError,
                 ZeroConfigError)


def _at_least(cfg, minimum, *names) -> None:
    for name in names:
        value = getattr(cfg, name)
        if value is not None and value < minimum:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= {minimum} (got {value})")


@dataclass(frozen=True)
class TrainingConfig:
    FLAG_GROUP: ClassVar[str] = "training"

    micro_batch_size: int = flag("--micro-batch-size", "samples per micro-batch per DP rank", 1,
                                 type=int, required=True)
    global_batch_size: int | None = flag(
        "--global-batch-size", "samples per step (default micro-batch x DP); must be a multiple "
        "of micro-batch x DP (the quotient is the gradient accumulation count)", type=int)
    train_iters: int | None = flag(
        "--train-iters", "optimizer steps to train for (in total, across resumes); this or "
        "--train-samples is required", type=int)
    train_samples: int | None = flag(
        "--train-samples", "samples to train for (in total, across resumes), instead of "
        "--train-iters: the run takes train-samples // global-batch-size steps and its LR "
        "schedule counts samples (--lr-warmup-samples, --lr-decay-samples)", type=int)
    bf16: bool = switch("--bf16", "bf16 weights/activations (fp32 master)")
    calculate_per_token_loss: bool = switch(
        "--calculate-per-token-loss", "the loss (and its gradient) is the mean over every "
        "loss token of the global batch, not the mean over micro-batches of each one's "
        "token mean (Megatron's; differs when loss masks count unequally)")
    fp16: bool = switch("--fp16", "not supported (no loss scaling): use --bf16")
    max_consecutive_skipped_iters: int = flag(
        "--max-consecutive-skipped-iters",
        "stop when this many iterations in a row had a non-finite loss or grad", 10, type=int)
    exit_interval: int | None = flag(
        "--exit-interval", "save (with --save) and exit when the iteration is a multiple of this",
        type=int)
    exit_duration_in_mins: float | None = flag(
        "--exit-duration-in-mins", "save and exit after this many minutes of training (job time "
        "limits)", type=float)
    exit_signal_handler: bool = switch(
        "--exit-signal-handler", "on SIGTERM / SIGUSR1 / SIGINT (any rank): finish the "
        "iteration, save, exit 0; a second Ctrl-C exits at once")
    hang_timeout_minutes: float | None = flag(
        "--hang-timeout-minutes", "abort a rank, printing its stacks and last collective, when "
        "no iteration completes for this long (default: 5 x the slowest iteration so far, at "
        "least 10 minutes; fractions allowed)", type=float)
    # ---- derived ----
    data_parallel_size: int = 1   # from the layout
    num_micro_batches: int = 0    # global batch / (micro batch x DP): gradient accumulation

    def __post_init__(self):
        if self.fp16 and self.bf16:
            raise ConfigError("--fp16 and --bf16 are both set; pass only one (--bf16 is the "
                              "supported one)")
        if self.fp16:
            raise ConfigError("--fp16 is not supported (megaq has no loss scaling); use --bf16 or "
                              "fp32 (neither)")
        _at_least(self, 1, "micro_batch_size", "max_consecutive_skipped_iters", "exit_interval")
        _at_least(self, 0, "train_iters", "train_samples")
        if self.train_iters is not None and self.train_samples is not None:
            raise ConfigError("--train-iters and --train-samples are both set; pass only one "
                              "(iteration-based or sample-based training, as in Megatron-LM)")
        if self.train_iters is None and self.train_samples is None:
            raise ConfigError("the run's length is not set; pass --train-iters N (optimizer "
                              "steps) or --train-samples N (samples)")
        if self.exit_duration_in_mins is not None and self.exit_duration_in_mins <= 0:
            raise ConfigError("--exit-duration-in-mins must be > 0")
        if self.hang_timeout_minutes is not None and not self.hang_timeout_minutes > 0:
            raise ConfigError(f"--hang-timeout-minutes must be > 0 minutes "
                              f"(got {self.hang_timeout_minutes})")
        gbs = self.global_batch_size or self.micro_batch_size * self.data_parallel_size
        set_derived(self, global_batch_size=gbs, num_micro_batches=num_microbatches_per_step(
            gbs, self.micro_batch_size, self.data_parallel_size))
        if self.train_samples is not None:
            # Megatron-LM without batch-size ramp-up: whole global batches only
            if self.train_samples and self.train_samples < gbs:
                raise ConfigError(f"--train-samples {self.train_samples} is less than one global "
                                  f"batch ({gbs}); pass at least {gbs} or a smaller "
                                  f"--global-batch-size")
            set_derived(self, train_iters=self.train_samples // gbs)

    @property
    def sample_based(self) -> bool:
        """--train-samples: the run's length and LR schedule count samples."""
        return self.train_samples is not None

    @property
    def schedule_unit(self) -> str:
        """What the LR schedule counts (megaq.lr_schedule.UNITS)."""
        return "samples" if self.sample_based else "iterations"

    @property
    def params_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.bf16 else torch.float32


@dataclass(frozen=True)
class OptimizerConfig:
    """The optimizer (AdamW or momentum SGD) and the learning-rate schedule
    (megaq.lr_schedule.LRSchedule.from_config). The ZeRO engine takes this object itself
    as its update rule (build_engine(..., optimizer=config.optimizer): the attribute names
    of megaq.zero.OptimizerSettings), so the values live here only."""

    FLAG_GROUP: ClassVar[str] = "optimizer and learning rate"

    optimizer: str = flag("--optimizer", "adam: AdamW (decoupled weight decay); sgd: SGD with "
                          "--sgd-momentum and L2 weight decay (torch.optim.SGD, as Megatron)",
                          "adam", choices=list(OPTIMIZER_NAMES))
    lr: float = flag("--lr", "peak learning rate", 1e-4, type=float, required=True)
    min_lr: float = flag("--min-lr", "learning rate at the end of the decay", 0.0, type=float)
    lr_decay_style: str = flag("--lr-decay-style", "decay after warm-up", "linear",
                               choices=["constant", "linear", "cosine"])
    lr_decay_iters: int | None = flag(
        "--lr-decay-iters", "steps from the start to the end of the decay (iteration-based runs; "
        "default --train-iters)", type=int)
    lr_decay_samples: int | None = flag(
        "--lr-decay-samples", "samples from the start to the end of the decay (sample-based "
        "runs, --train-samples; default --train-samples)", type=int)
    lr_warmup_iters: int = flag("--lr-warmup-iters", "linear warm-up steps from 0 to --lr", 0,
                                type=int)
    lr_warmup_samples: int = flag(
        "--lr-warmup-samples", "linear warm-up from 0 to --lr over this many samples "
        "(sample-based runs, --train-samples)", 0, type=int)
    lr_warmup_fraction: float | None = flag(
        "--lr-warmup-fraction", "warm-up as a fraction of the decay (--lr-decay-iters or "
        "--lr-decay-samples; instead of --lr-warmup-iters / --lr-warmup-samples)", type=float)
    weight_decay: float = flag("--weight-decay", "weight decay, not on biases and norms (AdamW: "
                               "decoupled; SGD: L2, added to the gradient)",
                               0.01, type=float)
    adam_beta1: float = flag("--adam-beta1", "AdamW beta1", 0.9, type=float)
    adam_beta2: float = flag("--adam-beta2", "AdamW beta2", 0.999, type=float)
    adam_eps: float = flag("--adam-eps", "AdamW epsilon", 1e-8, type=float)
    sgd_momentum: float = flag("--sgd-momentum", "momentum of --optimizer sgd", 0.9, type=float)
    clip_grad: float = flag("--clip-grad", "global grad-norm clip (0 = off)", 1.0, type=float)
    override_opt_param_scheduler: bool = switch(
        "--override-opt_param-scheduler", "on resume, take the LR schedule's settings (--lr, "
        "--min-lr, warm-up, decay) from these flags even where the checkpoint's differ "
        "(without it or --use-checkpoint-opt_param-scheduler a difference is refused)")
    use_checkpoint_opt_param_scheduler: bool = switch(
        "--use-checkpoint-opt_param-scheduler", "on resume, take the LR schedule's settings from "
        "the checkpoint, ignoring these flags' (--lr, --min-lr, warm-up, decay)")
    # (the run's length, the decay's default and the schedule's unit, is TrainingConfig's:
    # RunConfig.from_flags derives the decay from it, derive_schedule)

    def __post_init__(self):
        if self.lr < 0 or self.min_lr < 0:
            raise ConfigError("--lr and --min-lr must be >= 0")
        if self.min_lr > self.lr:
            raise ConfigError(f"--min-lr {self.min_lr} is above --lr {self.lr}; use a --min-lr "
                              f"<= --lr")
        if self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler:
            raise ConfigError("--override-opt_param-scheduler and "
                              "--use-checkpoint-opt_param-scheduler are both set; pass only one "
                              "(the flags' LR schedule, or the checkpoint's)")
        if self.clip_grad < 0:
            raise ConfigError("--clip-grad must be >= 0 (0 turns clipping off)")
        if not self.sgd_momentum >= 0:
            raise ConfigError(f"--sgd-momentum must be >= 0 (got {self.sgd_momentum})")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be in [0, 1) (got {getattr(self, name)})")
        if not self.adam_eps >= 0:
            raise ConfigError(f"--adam-eps must be >= 0 (got {self.adam_eps})")

    def derive_schedule(self, training: "TrainingConfig") -> None:
        """Megatron-LM's rules: a run is iteration-based (--train-iters, --lr-decay-iters,
        --lr-warmup-iters) or sample-based (--train-samples, --lr-decay-samples,
        --lr-warmup-samples), never a mix; the decay defaults to the run's length
        (training's; a rule across two classes: RunConfig.from_flags calls it once, after
        both are built)."""
        sample_based = training.sample_based
        unit = "samples" if sample_based else "iters"
        other = "iters" if sample_based else "samples"
        for kind in ("decay", "warmup"):
            value = getattr(self, f"lr_{kind}_{other}")
            if value is not None and value != 0:  # given (the warm-up's default is 0)
                run = ("sample-based (--train-samples)" if sample_based
                       else "iteration-based (--train-iters)")
                raise ConfigError(f"--lr-{kind}-{other} {value} mixes iteration- and sample-based "
                                  f"settings: this run is {run}; use --lr-{kind}-{unit} instead")
        decay_name, warmup_name = f"lr_decay_{unit}", f"lr_warmup_{unit}"
        decay = getattr(self, decay_name)
        if decay is None:
            decay = training.train_samples if sample_based else training.train_iters
        if decay is None:
            raise ConfigError(f"--lr-decay-{unit} is not set (it defaults to --train-{unit})")
        set_derived(self, **{decay_name: decay})
        if self.lr_warmup_fraction is not None:
            if getattr(self, warmup_name):
                raise ConfigError(f"--lr-warmup-{unit} and --lr-warmup-fraction are both set; "
                                  f"pass only one")
            if not 0 <= self.lr_warmup_fraction <= 1:
                raise ConfigError("--lr-warmup-fraction must be in [0, 1]")
            set_derived(self, **{warmup_name: int(self.lr_warmup_fraction * decay)})
        _at_least(self, 0, warmup_name, decay_name)
        warmup = getattr(self, warmup_name)
        if self.lr_decay_style != "constant" and warmup > decay:
            raise ConfigError(f"--lr-warmup-{unit} {warmup} exceeds --lr-decay-{unit} {decay}; "
                              f"shorten the warm-up or lengthen the decay")


@dataclass(frozen=True)
class CheckpointConfig:
    FLAG_GROUP: ClassVar[str] = "checkpointing"

    save: str | None = flag("--save", "checkpoint directory to write")
    save_interval: int | None = flag("--save-interval", "iterations between saves", type=int)
    load: str | None = flag("--load", "checkpoint directory to resume from (starts fresh if it "
                                      "holds none)")
    no_load_rng: bool = switch("--no-load-rng", "do not restore RNG streams")
    no_load_optim: bool = switch(
        "--no-load-optim", "load weights only (fresh AdamW moments); the iteration, consumed "
        "samples and the LR schedule's position still come from the checkpoint")
    no_save_optim: bool = switch(
        "--no-save-optim", "save without the AdamW moments (smaller checkpoints); such a "
        "checkpoint loads only with --no-load-optim or --finetune")
    finetune: bool = switch(
        "--finetune", "start a fine-tuning run from the weights in --load: iteration and "
        "consumed samples 0, fresh AdamW moments, LR schedule and RNG streams from the flags")
    pretrained_checkpoint: str | None = flag(
        "--pretrained-checkpoint", "when --load holds no checkpoint yet (or is not given), "
        "start from this checkpoint's weights as --finetune does; once the run has saved to "
        "--load, resumes load from there", metavar="DIR")
    save_hf: str | None = flag(
        "--save-hf", "at the end of training, also write the final model in Hugging Face "
        "transformers form to DIR (from the final --save checkpoint; docs/INTEROP.md)",
        metavar="DIR")
    ckpt_format: str = flag(
        "--ckpt-format", "checkpoint format to save: torch_dist (every rank writes its own "
        "shard through torch.distributed.checkpoint; loads reshard to any layout) or torch "
        "(one full file per TP x PP rank, written by DP rank 0). Loading reads either",
        "torch_dist", choices=["torch_dist", "torch"])
    async_save: bool = switch(
        "--async-save", "torch_dist: copy this rank's shard to CPU memory and write it in a "
        "background thread while training continues; the next save or the end of the run "
        "waits for it and makes it the latest")
    no_verify_checkpoint: bool = switch(
        "--no-verify-checkpoint", "load without checking files against the checkpoint's "
        "SHA-256 manifest (checkpoints without one, damaged files you accept)")

    def __post_init__(self):
        _at_least(self, 1, "save_interval")
        if self.save_interval and not self.save:
            raise ConfigError("--save-interval needs --save DIR (where to write checkpoints)")
        if self.finetune and not (self.load or self.pretrained_checkpoint):
            raise ConfigError("--finetune needs --load DIR (the checkpoint whose weights to start "
                              "from)")
        if self.async_save and self.ckpt_format != "torch_dist":
            raise ConfigError("--async-save needs --ckpt-format torch_dist (the torch format "
                              "saves synchronously)")
        if self.save_hf and not self.save:
            raise ConfigError("--save-hf needs --save DIR (the HF export is written from the "
                              "final checkpoint)")
        if self.save_hf:
            _check_save_hf(self.save_hf, {"--save": self.save, "--load": self.load,
                                          "--pretrained-checkpoint": self.pretrained_checkpoint})


def _check_save_hf(save_hf: str, checkpoints: dict) -> None:
    """The HF export replaces its directory: refuse one that would take a checkpoint with
    it (the same as, inside or around --save / --load / --pretrained-checkpoint) or that
    holds something other than an earlier export (an empty directory, or an earlier
    export: megaq.export_files.is_export, is replaced)."""
    target = os.path.realpath(save_hf)
    for flag_name, path in checkpoints.items():
        if not path:
            continue
        other = os.path.realpath(path)
        if os.path.commonpath([target, other]) in (target, other):
            raise ConfigError(f"--save-hf {save_hf} overlaps {flag_name} {path}: the export replaces "
                              f"its directory; give --save-hf a directory outside the checkpoints")
    if os.path.isdir(target) and os.listdir(target) and not export_files.is_export(target):
        raise ConfigError(f"--save-hf {save_hf} exists and is not a Hugging Face export written by "
                          f"megaq (it holds other files): the export would replace it; choose a new "
                          f"directory or remove this one")
    if os.path.exists(target) and not os.path.isdir(target):
        raise ConfigError(f"--save-hf {save_hf} is a file, not a directory: choose a directory path")


@dataclass(frozen=True)
class LoggingConfig:
    FLAG_GROUP: ClassVar[str] = "logging and evaluation"

    log_interval: int = flag("--log-interval", "iterations per log line / metrics line", 100,
                             type=int)
    eval_interval: int = flag("--eval-interval",
                              "iterations between evaluations on the validation split", 1000,
                              type=int)
    eval_iters: int = flag("--eval-iters",
                           "validation batches per evaluation (0 = no evaluation)", 100, type=int)
    tensorboard_dir: str | None = flag(
        "--tensorboard-dir", "write TensorBoard scalars here (needs tensorboard installed)")
    metrics_file: str | None = flag(
        "--metrics-file", "append one JSON object per logged iteration (and per evaluation)")
    log_comm_time: bool = switch(
        "--log-comm-time", "time every collective and log milliseconds per phase "
        "(weight_gather_fwd, grad_reduce, ...) per iteration; collectives then run synchronously "
        "with a device sync around each, so steps are slower (no overlap): use it to see where "
        "communication time goes, not to measure step time")
    log_throughput: bool = switch(
        "--log-throughput", "put 'throughput per GPU (TFLOP/s/GPU)' (Megatron's model FLOPs, "
        "recomputation not counted) and 'tokens per second per GPU' in the iteration line")
    log_params_norm: bool = switch(
        "--log-params-norm", "put 'params norm' (L2 norm of all fp32 master weights over every "
        "TP/PP/ZeRO shard, each counted once; one all-reduce, no weight gather) in the "
        "iteration line (and TensorBoard / wandb)")
    log_memory_to_tensorboard: bool = switch(
        "--log-memory-to-tensorboard", "log memory scalars (CUDA: Megatron's mem-reserved-bytes, "
        "mem-allocated-bytes, mem-max-allocated-bytes; CPU: mem-max-rss-bytes) and the ZeRO "
        "engine's bytes per kind; the metrics file gets each rank's peak (peak_memory_bytes)")
    timing_log_level: int = flag(
        "--timing-log-level", "0: no timers; 1: forward-backward, all-grads-sync, optimizer; "
        "2: also batch-generator, forward-compute, backward-compute, pipeline-p2p, "
        "optimizer-clip-main-grad, optimizer-inner-step. Printed after each iteration line as "
        "Megatron's '(min, max) time across ranks (ms)' (the device is synchronised at each "
        "timed phase's end)", 0, type=int, choices=[0, 1, 2])
    quiet_notes: bool = switch(
        "--quiet-notes", "do not print the start-up note naming the Megatron-LM flags given "
        "that change nothing in megaq (refusals are still errors)")
    profile: bool = switch(
        "--profile", "profile iterations --profile-step-start+1 .. --profile-step-end on "
        "--profile-ranks: with --use-pytorch-profiler under torch.profiler (a Chrome trace "
        "rank<r>.trace.json in --tensorboard-dir, else ./profile; the top kernels; the device's "
        "busy and idle time per iteration), else marked for Nsight Systems "
        "(nsys profile --capture-range=cudaProfilerApi)")
    use_pytorch_profiler: bool = switch("--use-pytorch-profiler",
                                        "--profile with torch.profiler (see --profile)")
    profile_step_start: int = flag("--profile-step-start",
                                   "--profile's window starts after this many iterations", 10,
                                   type=int)
    profile_step_end: int = flag("--profile-step-end",
                                 "--profile's window ends after this many iterations", 12,
                                 type=int)
    profile_ranks: tuple = flag("--profile-ranks", "the global ranks --profile profiles", (0,),
                                type=int, nargs="+")
    wandb_project: str | None = flag(
        "--wandb-project", "log the TensorBoard scalars to this Weights & Biases project too "
        "(needs `pip install wandb` and --wandb-exp-name; offline when the server is "
        "unreachable or WANDB_MODE=offline)")
    wandb_exp_name: str | None = flag("--wandb-exp-name", "the wandb run's name")
    wandb_save_dir: str | None = flag("--wandb-save-dir",
                                      "where wandb writes its files (default <--save>/wandb)")

    def __post_init__(self):
        if (self.wandb_exp_name or self.wandb_save_dir) and not self.wandb_project:
            raise ConfigError("--wandb-exp-name / --wandb-save-dir need --wandb-project NAME")
        if self.wandb_project:
            if not self.wandb_exp_name:
                raise ConfigError("--wandb-project needs --wandb-exp-name NAME (the run's name, "
                                  "as Megatron requires)")
            if importlib.util.find_spec("wandb") is None:
                raise ConfigError("--wandb-project: the wandb package is not installed; "
                                  "`pip install wandb`, or drop the --wandb-* flags")
        _at_least(self, 1, "log_interval")
        if self.eval_interval < 1:
            raise ConfigError("--eval-interval must be >= 1 (use --eval-iters 0 to turn "
                              "evaluation off)")
        _at_least(self, 0, "eval_iters")
        if self.profile and not 0 <= self.profile_step_start < self.profile_step_end:
            raise ConfigError(f"--profile-step-start {self.profile_step_start} and "
                              f"--profile-step-end {self.profile_step_end}: the window needs "
                              f"0 <= start < end")


def reduce_bucket_bytes(elements: int | None, dtype: torch.dtype) -> int:
    """ZeroConfig.reduce_bucket_size (bytes of gradient buckets in flight) from
    --zero-reduce-bucket-size (elements, DeepSpeed's unit): the buckets hold gradients in
    the training dtype. Not given: the field's default."""
    if elements is None:
        return ZeroConfig.reduce_bucket_size
    return elements * torch.empty((), dtype=dtype).element_size()


# The flag groups of --help, in order (megaq.config.arguments.build_parser).
FLAG_CLASSES = (GPTConfig, ParallelConfig, ZeroConfig, TrainingConfig, OptimizerConfig,
                DataConfig, CheckpointConfig, LoggingConfig)


@dataclass(frozen=True)
class RunConfig:
    model: GPTConfig
    parallel: ParallelConfig
    zero: ZeroConfig
    data: DataConfig
    training: TrainingConfig
    optimizer: OptimizerConfig
    checkpointing: CheckpointConfig
    logging: LoggingConfig

    def __post_init__(self):
        # Rules that span two classes, each checked by the helper of the layer owning it.
        m, p = self.model, self.parallel
        check_hpz_size(p.layout, self.zero.hpz_partition_size)  # hpZ's groups vs the nodes
        check_model_fits_tp(p.tp, m.num_attention_heads,
                            m.num_query_groups if m.group_query_attention else None)
        check_num_microbatches(self.training.num_micro_batches, p.pp, self.virtual_pipeline_size)
        if self.logging.wandb_project and not (self.logging.wandb_save_dir
                                               or self.checkpointing.save):
            raise ConfigError("--wandb-project needs --wandb-save-dir DIR (or --save, whose "
                              "wandb/ subdirectory is the default)")
        per_chunk = m.num_layers // p.pp // self.virtual_pipeline_size
        if m.recompute_num_layers is not None and m.recompute_num_layers > per_chunk:
            raise ConfigError(f"--recompute-num-layers {m.recompute_num_layers} exceeds the "
                              f"{per_chunk} layers per pipeline stage (model chunk); use 1.."
                              f"{per_chunk}")
        check_fp8_weight_gathers(m.fp8, self.zero)

    @classmethod
    def from_flags(cls, flags, world_size: int, ranks_per_node: int | None = None,
                   problems: list[str] | None = None) -> "RunConfig | None":
        """The run's configuration from parsed flags (an argparse namespace) and the
        launcher's world size and ranks per node. Without `problems` the first bad
        setting raises its error; with a list, every class is still built and checked
        and each error's line appended (what depends on a class that failed is built
        on its defaults, so no error is reported twice), and None returned if any."""
        def part(build, fallback=None):
            if problems is None:
                return build()
            try:
                return build()
            except CONFIG_ERRORS as e:
                problems.append(str(e))
                return fallback

        parallel = part(lambda: from_flags(ParallelConfig, flags, world_size=world_size,
                                           ranks_per_node=ranks_per_node))
        training = part(lambda: from_flags(TrainingConfig, flags, data_parallel_size=(
            parallel.dp if parallel else 1)))
        optimizer = part(lambda: from_flags(OptimizerConfig, flags))
        if optimizer and training:  # once: the decay defaults to the run's length
            part(lambda: optimizer.derive_schedule(training))
        dtype = training.params_dtype if training else torch.float32
        model = part(lambda: from_flags(GPTConfig, flags, vocab_size=None, params_dtype=dtype))
        zero = part(lambda: from_flags(  # the --zero-* flags (the optimizer's beside them)
            ZeroConfig, flags, fp8_weights=flags.zero_quantized_weights == "fp8",
            gather_dtype=dtype, reduce_bucket_size=reduce_bucket_bytes(
                flags.zero_reduce_bucket_size, dtype)))
        data = part(lambda: from_flags(DataConfig, flags))
        checkpointing = part(lambda: from_flags(CheckpointConfig, flags))
        logging = part(lambda: from_flags(LoggingConfig, flags))
        if problems:
            return None
        return part(lambda: cls(model=model, parallel=parallel, zero=zero, data=data,
                                training=training, optimizer=optimizer,
                                checkpointing=checkpointing, logging=logging))

    # ------------------------------------------------------------------ derived
    @property
    def virtual_pipeline_size(self) -> int:
        """Model chunks per pipeline stage (1 without interleaving)."""
        return virtual_pipeline_size(self.model.num_layers, self.parallel.pp,
                                     self.parallel.num_layers_per_virtual_pipeline_stage)

    @property
    def padded_vocab_size(self) -> int:
        return self.model.padded_vocab_size(self.parallel.tp)

    def resolved(self, data: DataConfig, vocab_size: int) -> "RunConfig":
        """This configuration once the data setup has resolved the data sources (e.g.
        --demo-corpus's files) and the tokenizer has given the vocabulary size."""
        return dataclasses.replace(
            self, data=data, model=dataclasses.replace(self.model, vocab_size=vocab_size))

    def to_dict(self) -> dict:
        """Plain nested dict (what a checkpoint stores)."""
        return {f.name: to_dict(getattr(self, f.name)) for f in dataclasses.fields(self)}
