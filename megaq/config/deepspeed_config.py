"""--deepspeed-config FILE.json: a DeepSpeed ds_config read as megaq's flags.

A DeepSpeed user's run is described by a ds_config (JSON; DeepSpeed also accepts hjson,
megaq reads JSON only) plus the launch script's flags (Megatron-DeepSpeed passes both:
``--deepspeed --deepspeed_config ds.json --zero-stage 3 ...``). megaq reads the file as
command-line flags placed before the script's own:

* each key megaq honours becomes the flag that does the same (``zero_optimization.stage``
  is ``--zero-stage``, ``zero_quantized_gradients`` is ``--zero-quantized-gradients``,
  ``optimizer.params.lr`` is ``--lr``, ...; :data:`KEYS` and docs/TRAINING.md "Coming
  from DeepSpeed" list them);
* a key that changes nothing in megaq's training (``overlap_comm``,
  ``contiguous_gradients``, monitor sections, a disabled section) is noted;
* a key megaq cannot honour (offloading, fp16 loss scaling, another optimizer or
  scheduler, an unknown key, an HF Trainer ``"auto"`` value) is refused: every such key
  of the file in ONE line, exit 2, before any process group starts;
* a flag given on the command line too must agree with the file: the same value is
  fine (Megatron-DeepSpeed scripts repeat them), a different one is refused, all of
  them in one line, so that neither silently wins;
* a key the file leaves out keeps megaq's default (not DeepSpeed's): the mapping block
  names the defaults that differ from DeepSpeed's (gradient clipping, the persistence
  threshold).

The file is read as a hostile one: at most :data:`MAX_CONFIG_BYTES`, a regular file,
strict JSON (no NaN / Infinity, no key given twice), only the types each key takes;
nothing in it is executed. Any problem is one line naming the file and the fix. A
symbolic link the user names is followed: the path is the user's own choice, not a file
inside a directory megaq owns (those are opened without following links,
megaq.checkpoint.paths).

The batch sizes follow DeepSpeed's rule, train_batch_size = train_micro_batch_size_per_gpu
x gradient_accumulation_steps x data-parallel size; the data-parallel size is only known
with the world size, so :func:`batch_flags` completes and checks them then
(megaq.config.arguments.run_problems).

This module imports nothing of megaq beyond the standard library, so the parser can use
it before anything is built.
"""

from __future__ import annotations

import json
import math
import os
import stat
from dataclasses import dataclass, field

MAX_CONFIG_BYTES = 1 << 20  # a ds_config is a few hundred bytes; 1 MiB is generous
FILE_FLAGS = ("--deepspeed-config", "--deepspeed_config")  # one flag, both spellings
SWITCH = "--deepspeed"  # Megatron-DeepSpeed's switch that turns DeepSpeed on


class DeepSpeedConfigError(ValueError):
    """The file cannot be read as a ds_config; the message is one line naming it."""


def add_deepspeed_flags(parser) -> None:
    """--deepspeed-config / --deepspeed_config FILE and --deepspeed, as one --help group."""
    group = parser.add_argument_group("DeepSpeed config (docs/TRAINING.md 'Coming from "
                                      "DeepSpeed')")
    group.add_argument(*FILE_FLAGS, dest="deepspeed_config", metavar="FILE.json", help=(
        "read a DeepSpeed ds_config (JSON; hjson is not read) as megaq's flags: ZeRO stage "
        "and ZeRO++ keys, bucket sizes, bf16, gradient_clipping, the AdamW optimizer, the "
        "Warmup* schedulers, the batch sizes, steps_per_print. Rank 0 prints the mapping; "
        "every key megaq cannot honour is listed in one error line (exit 2); a flag also "
        "given on the command line must agree with the file"))
    group.add_argument(SWITCH, dest="deepspeed", action="store_true", help=(
        "Megatron-DeepSpeed's switch for its DeepSpeed engine: megaq's ZeRO engine is always "
        "on, so it only needs --deepspeed_config to read the file (noted)"))


def _names_file_flag(word: str) -> bool:
    """`word` is --deepspeed-config / --deepspeed_config or an abbreviation argparse takes
    for it (long enough not to be --deepspeed or --deepspeed-activation-checkpointing)."""
    return any(name.startswith(word) and len(word) >= len(name) - len("onfig")
               for name in FILE_FLAGS)


def config_path(argv: list[str]) -> str | None:
    """The ds_config named on the command line (the last one given), or None."""
    path = None
    for i, word in enumerate(argv):
        name, eq, value = word.partition("=")
        if word.startswith("--deepspeed") and _names_file_flag(name):
            if eq:
                path = value
            elif i + 1 < len(argv):
                path = argv[i + 1]
    return path


# ------------------------------------------------------------------ reading the file
def _no_duplicates(pairs):
    seen = {}
    for key, value in pairs:
        if key in seen:
            raise DeepSpeedConfigError(f"key {key!r} is given twice")
        seen[key] = value
    return seen


def _no_constant(name):
    raise DeepSpeedConfigError(f"{name} is not a JSON number; write a finite number")


def read_config(path: str) -> dict:
    """The ds_config at `path` as a dict, or DeepSpeedConfigError with one line."""
    where = f"--deepspeed-config {path}"
    try:
        # opened before it is checked (no swap in between); O_NONBLOCK: a FIFO named here
        # does not block the open, and is then refused as not a regular file
        with os.fdopen(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise DeepSpeedConfigError(f"{where}: not a regular file; pass the ds_config "
                                           f"JSON file")
            if st.st_size > MAX_CONFIG_BYTES:
                raise DeepSpeedConfigError(f"{where}: {st.st_size} bytes, more than a "
                                           f"ds_config's {MAX_CONFIG_BYTES} limit; pass the "
                                           f"ds_config JSON file")
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise DeepSpeedConfigError(f"{where}: {e.strerror or e}; check the path") from None
    if len(data) > MAX_CONFIG_BYTES:  # grew after the stat
        raise DeepSpeedConfigError(f"{where}: more than {MAX_CONFIG_BYTES} bytes; pass the "
                                   f"ds_config JSON file")
    try:
        cfg = json.loads(data.decode("utf-8"), object_pairs_hook=_no_duplicates,
                         parse_constant=_no_constant)
    except UnicodeDecodeError:
        raise DeepSpeedConfigError(f"{where}: not UTF-8 text; a ds_config is JSON") from None
    except json.JSONDecodeError as e:
        raise DeepSpeedConfigError(f"{where}: not valid JSON ({e.msg} at line {e.lineno} "
                                   f"column {e.colno}); megaq reads JSON ds_configs (convert "
                                   f"an hjson one)") from None
    except RecursionError:
        raise DeepSpeedConfigError(f"{where}: nested too deeply to be a ds_config") from None
    except DeepSpeedConfigError as e:
        raise DeepSpeedConfigError(f"{where}: {e}") from None
    if not isinstance(cfg, dict):
        raise DeepSpeedConfigError(f"{where}: the top level is a JSON {type(cfg).__name__}, "
                                   f"not an object of DeepSpeed keys")
    return cfg


# ------------------------------------------------------------------ the mapping
@dataclass
class Mapping:
    """What a ds_config says in megaq's terms."""

    flags: list = field(default_factory=list)    # [(megaq flag, value or None: a switch, key)]
    noted: list = field(default_factory=list)    # ["key: why it changes nothing"]
    refused: list = field(default_factory=list)  # ["key (value): why megaq cannot"]
    batch: dict = field(default_factory=dict)    # the batch keys given, by DeepSpeed name
    defaults: list = field(default_factory=list)  # ["megaq default that differs"]

    def tokens(self) -> list[str]:
        """The flags as command-line words."""
        words = []
        for name, value, _ in self.flags:
            words += [name] if value is None else [name, flag_word(value)]
        return words

    def block(self, path: str) -> str:
        """The mapping, printed once at start (rank 0; --dry-run too)."""
        lines = [f"------------------------ deepspeed config {path} ------------------------"]
        lines += [f"  {key} {'.' * max(1, 44 - len(key))} {name}"
                  + ("" if value is None else f" {flag_word(value)}")
                  for name, value, key in self.flags]
        lines += [f"  {line}" for line in (self.noted_line(), *self.defaults) if line]
        lines.append("-------------------- end of deepspeed config ---------------------")
        return "\n".join(lines)

    def noted_line(self) -> str | None:
        return (f"noted, no effect in megaq: {'; '.join(self.noted)}" if self.noted else None)

    def refusal(self, path: str) -> str | None:
        """The one line naming every key megaq cannot honour, or None."""
        if not self.refused:
            return None
        return (f"--deepspeed-config {path}: megaq cannot honour {len(self.refused)} key(s): "
                f"{'; '.join(self.refused)}; remove or change them (docs/TRAINING.md "
                f"'Coming from DeepSpeed')")


def flag_word(value) -> str:
    """A flag's value as a command-line word."""
    return repr(value) if isinstance(value, float) else str(value)


class _Reader:
    """Walks the config, recording each key into a Mapping (never stops at the first)."""

    def __init__(self):
        self.m = Mapping()

    # values of the types a key takes; a wrong one is refused, naming the type
    def typed(self, key: str, value, kind: str):
        ok = {"bool": isinstance(value, bool),
              "int": isinstance(value, int) and not isinstance(value, bool)
              or isinstance(value, float) and value.is_integer(),
              "number": isinstance(value, (int, float)) and not isinstance(value, bool),
              "str": isinstance(value, str),
              "dict": isinstance(value, dict)}[kind]
        if value == "auto":
            self.m.refused.append(f"{key} \"auto\" (a value HF Trainer fills in; write the "
                                  f"number)")
            return None
        if not ok:
            self.m.refused.append(f"{key} {json.dumps(value)[:40]} (must be {_A[kind]})")
            return None
        return int(value) if kind == "int" else value

    def flag(self, key, name, value=None):
        self.m.flags.append((name, value, key))

    def note(self, key, why):
        self.m.noted.append(f"{key} ({why})")

    def refuse(self, key, value, why):
        shown = "" if value is None else f" {json.dumps(value)[:40]}"
        self.m.refused.append(f"{key}{shown} ({why})")


_A = {"bool": "true or false", "int": "a whole number", "number": "a number",
      "str": "a string", "dict": "an object"}

_OFFLOAD = "megaq has no CPU / NVMe offloading: ZeRO shards the state over the DP ranks"
_ENGINE = "megaq's ZeRO engine decides it itself"

# zero_optimization keys that change nothing in megaq (key: why)
_ZERO_NOTES = {
    "overlap_comm": "megaq always overlaps its reductions and prefetched gathers with compute",
    "contiguous_gradients": "megaq's gradient buckets are flat contiguous buffers already",
    "reduce_scatter": "megaq's reduction gives the same values either way",
    "allgather_partitions": "megaq gathers each unit's weights in one all-gather",
    "allgather_bucket_size": "megaq gathers each unit's weights in one all-gather",
    "round_robin_gradients": "a setting of CPU offloading's gradient copies",
    "stage3_max_live_parameters": "megaq's live gathered weights are at most 1 + "
                                  "--zero-prefetch sites",
    "stage3_max_reuse_distance": "megaq releases each unit's gathered weights after use, "
                                 "and gathers them again for backward",
    "sub_group_size": "megaq steps its optimizer per partition",
    "stage3_gather_16bit_weights_on_model_save": "megaq's checkpoints are sharded; "
                                                 "--save-hf writes full weights",
    "gather_16bit_weights_on_model_save": "megaq's checkpoints are sharded; --save-hf writes "
                                          "full weights",
    "elastic_checkpoint": "megaq's torch_dist checkpoints load at any layout",
    "load_from_fp32_weights": "megaq's checkpoints hold the fp32 master weights",
    "ignore_unused_parameters": "megaq zeroes the gradients no parameter wrote",
    "memory_efficient_linear": _ENGINE,
    "legacy_stage1": _ENGINE,
    "use_multi_rank_bucket_allreduce": _ENGINE,
    "log_trace_cache_warnings": _ENGINE,
    "cpu_offload": _OFFLOAD,  # (false: refused below when true)
}

# top-level sections that mean nothing for training (key: why)
_TOP_NOTES = {
    "wall_clock_breakdown": "megaq's --timing-log-level 1 prints forward-backward / "
                            "optimizer times",
    "zero_allow_untested_optimizer": "megaq's optimizers are its own",
    "zero_force_ds_cpu_optimizer": _OFFLOAD,
    "prescale_gradients": "megaq divides the summed gradients by the DP size; dividing first "
                          "only guards fp16 against overflow",
    "gradient_predivide_factor": "megaq divides the summed gradients by the DP size; dividing "
                                 "first only guards fp16 against overflow",
    "dump_state": "a DeepSpeed debug print",
    "memory_breakdown": "a DeepSpeed debug print (megaq: --log-memory-to-tensorboard)",
    "tensorboard": "use --tensorboard-dir", "wandb": "use --wandb-project",
    "csv_monitor": "use --metrics-file", "comet": "use --tensorboard-dir or --wandb-project",
    "comms_logger": "use --log-comm-time", "flops_profiler": "use --log-throughput / --profile",
    "checkpoint": "megaq's checkpoints are its own (--save, --ckpt-format, --async-save)",
}

# top-level sections for features megaq lacks: refused when enabled
_TOP_FEATURES = {
    "amp": "NVIDIA apex AMP (use bf16)",
    "compression_training": "compression training",
    "curriculum_learning": "curriculum learning",
    "data_efficiency": "DeepSpeed data efficiency (curriculum, data routing)",
    "sparse_attention": "sparse attention",
    "elasticity": "elastic training",
    "autotuning": "DeepSpeed autotuning",
    "progressive_layer_drop": "progressive layer drop",
    "eigenvalue": "eigenvalue computation",
    "quantize_training": "quantization-aware training",
    "hybrid_engine": "the RLHF hybrid engine",
    "aio": "NVMe offloading",
    "nebula": "Nebula checkpointing",
    "moe": "mixture-of-experts layers",
    "pipeline": "DeepSpeed's pipeline engine (use --pipeline-model-parallel-size)",
    "sequence_parallel_size": "Ulysses sequence parallelism",
}


def _enabled(section) -> bool:
    return not isinstance(section, dict) or section.get("enabled", True) is not False


def map_config(cfg: dict) -> Mapping:
    """The megaq flags, notes and refusals of a ds_config (a dict from read_config)."""
    r = _Reader()
    for key, value in cfg.items():
        handler = _TOP.get(key)
        if handler is not None:
            handler(r, key, value)
        elif key in _TOP_WITH_CONFIG:
            _TOP_WITH_CONFIG[key](r, key, value, cfg)
        elif key in _TOP_NOTES:
            r.note(key, _TOP_NOTES[key])
        elif key in _TOP_FEATURES:
            if _enabled(value) and value not in (False, 0, 1, None):
                r.refuse(key, None, f"megaq has no {_TOP_FEATURES[key]}")
            else:
                r.note(key, "disabled")
        else:
            r.refuse(key, None, "not a DeepSpeed key megaq knows")
    lrs = [f for f in r.m.flags if f[0] == "--lr"]
    if len(lrs) == 2:  # the optimizer's and WarmupLR / WarmupDecayLR's warmup_max_lr
        optimizer_lr = next(f for f in lrs if f[2].startswith("optimizer"))
        r.m.flags.remove(optimizer_lr)
        r.note(optimizer_lr[2], "the scheduler's warmup_max_lr is the peak lr, as in DeepSpeed")
    if "gradient_clipping" not in cfg:
        r.m.defaults.append("not in the file: gradient_clipping, megaq's --clip-grad 1.0 "
                            "applies (DeepSpeed's default 0 does not clip; write "
                            "\"gradient_clipping\": 0 to match)")
    zero = cfg.get("zero_optimization")
    if not isinstance(zero, dict) or "stage" not in zero:
        r.m.defaults.append("not in the file: zero_optimization.stage, megaq's --zero-stage 3 "
                            "applies (DeepSpeed's default 0 replicates everything; the "
                            "training is the same, sharded)")
    elif "stage3_param_persistence_threshold" not in zero and zero.get("stage") == 3:
        r.m.defaults.append("not in the file: stage3_param_persistence_threshold, megaq's 0 "
                            "applies (DeepSpeed's 1e5 replicates small parameters; the "
                            "training is the same either way)")
    return r.m


_ZEROPP = {"zero_quantized_weights": "--zero-quantized-weights",
           "zero_quantized_gradients": "--zero-quantized-gradients",
           "zero_hpz_partition_size": "--zero-hpz-partition-size"}


def _zero(r: _Reader, key: str, zero) -> None:
    if r.typed(key, zero, "dict") is None:
        return
    for k, v in zero.items():
        name = f"{key}.{k}"
        if k == "stage":
            stage = r.typed(name, v, "int")
            if stage is not None:
                if stage in (0, 1, 2, 3):
                    r.flag(name, "--zero-stage", stage)
                else:
                    r.refuse(name, v, "DeepSpeed's stages are 0-3")
        elif k in _ZEROPP and zero.get("stage", 0) != 3:
            kind = "int" if k == "zero_hpz_partition_size" else "bool"
            v = r.typed(name, v, kind)
            if v is True or (kind == "int" and v not in (1, None)):
                r.note(name, "DeepSpeed applies ZeRO++ at stage 3 only, so it is off here too "
                             "(docs/ZERO.md says which parts megaq runs at stages 1-2)")
        elif k in ("zero_quantized_weights", "zero_quantized_gradients"):
            if r.typed(name, v, "bool"):
                r.flag(name, _ZEROPP[k])
        elif k == "zero_hpz_partition_size":
            size = r.typed(name, v, "int")
            if size is not None:
                r.flag(name, "--zero-hpz-partition-size", size)
        elif k == "zero_quantized_nontrainable_weights":
            if r.typed(name, v, "bool"):
                r.note(name, "megaq trains every weight: there are no frozen weights to "
                             "quantize")
        elif k == "reduce_bucket_size":
            n = r.typed(name, v, "int")
            if n is not None:
                r.flag(name, "--zero-reduce-bucket-size", n)
        elif k == "stage3_param_persistence_threshold":
            n = r.typed(name, v, "int")
            if n is not None:
                r.flag(name, "--zero-param-persistence-threshold", n)
        elif k == "stage3_prefetch_bucket_size":
            n = r.typed(name, v, "int")
            if n == 0:
                r.flag(name, "--zero-prefetch", 0)
            elif n is not None:
                r.note(name, "megaq prefetches whole sites, --zero-prefetch of them (default "
                             "1), not an element budget")
        elif k in ("offload_optimizer", "offload_param"):
            device = v.get("device", "none") if isinstance(v, dict) else v
            if device not in (None, "none"):
                r.refuse(name, device, _OFFLOAD)
            else:
                r.note(name, "device none: nothing offloaded")
        elif k == "zeropp_loco_param" and v is not None:
            r.refuse(name, None, "megaq has no LoCo compensation; its qgZ error feedback is "
                                 "--zero-gradient-error-feedback (the plain residual)")
        elif k == "cpu_offload" and v is True:
            r.refuse(name, v, _OFFLOAD)
        elif k in ("mics_shard_size", "mics_hierarchical_params_gather"):
            if v not in (-1, False, None):
                r.refuse(name, v, "megaq has no MiCS sharding (its hpZ, "
                                  "zero_hpz_partition_size, keeps a secondary in-node shard)")
        elif k in _ZERO_NOTES:
            r.note(name, _ZERO_NOTES[k])
        else:
            r.refuse(name, None, "not a zero_optimization key megaq knows")


def _precision(r: _Reader, key: str, section) -> None:
    if r.typed(key, section, "dict") is None:
        return
    if not r.typed(f"{key}.enabled", section.get("enabled", False), "bool"):
        return  # off (or refused: "auto", not a boolean)
    if key == "fp16":
        r.refuse(f"{key}.enabled", True, "megaq has no fp16 training with loss scaling; "
                                         "use \"bf16\": {\"enabled\": true}")
    else:
        r.flag(f"{key}.enabled", "--bf16")


def _number(flag_name, kind="number"):
    def handle(r: _Reader, key: str, value) -> None:
        v = r.typed(key, value, kind)
        if v is not None:
            r.flag(key, flag_name, v)
    return handle


def _batch(r: _Reader, key: str, value) -> None:
    v = r.typed(key, value, "int")
    if v is not None and v < 1:
        r.refuse(key, value, "must be >= 1")
    elif v is not None:
        r.m.batch[key] = v
        if key == "train_micro_batch_size_per_gpu":
            r.flag(key, "--micro-batch-size", v)
        elif key == "train_batch_size":
            r.flag(key, "--global-batch-size", v)


# DeepSpeed's optimizer types megaq runs: Adam is AdamW unless adam_w_mode is false
# Optimizer switches: (the value megaq's optimizer has, what it does)
_OPTIMIZER_SWITCHES = {
    "adam_w_mode": (True, "megaq's Adam decays weights decoupled (AdamW)"),
    "bias_correction": (True, "megaq's AdamW corrects the moments' bias"),
    "amsgrad": (False, "megaq's AdamW is without AMSGrad"),
    "nesterov": (False, "megaq's SGD is torch.optim.SGD with plain momentum"),
    "dampening": (0, "megaq's SGD is torch.optim.SGD with plain momentum, no dampening"),
}
_ADAM_PARAMS = {"lr": ("--lr", "number"), "eps": ("--adam-eps", "number"),
                "weight_decay": ("--weight-decay", "number")}


def _optimizer(r: _Reader, key: str, section) -> None:
    if r.typed(key, section, "dict") is None:
        return
    kind = section.get("type")
    params = section.get("params", {})
    for k in section:
        if k not in ("type", "params"):
            r.refuse(f"{key}.{k}", None, "not an optimizer key megaq knows")
    if r.typed(f"{key}.type", kind, "str") is None or r.typed(f"{key}.params", params,
                                                                "dict") is None:
        return
    lowered = kind.lower()
    if lowered not in ("adam", "adamw", "sgd"):
        r.refuse(f"{key}.type", kind, "megaq's optimizers are AdamW (Adam, AdamW) and SGD")
        return
    r.flag(f"{key}.type", "--optimizer", "sgd" if lowered == "sgd" else "adam")
    for k, v in params.items():
        name = f"{key}.params.{k}"
        if k in _ADAM_PARAMS or (k in ("momentum",) and lowered == "sgd"):
            flag_name, typ = _ADAM_PARAMS.get(k, ("--sgd-momentum", "number"))
            v = r.typed(name, v, typ)
            if v is not None:
                r.flag(name, flag_name, v)
        elif k == "betas" and lowered != "sgd":
            if isinstance(v, list) and len(v) == 2 and all(
                    isinstance(b, (int, float)) and not isinstance(b, bool) for b in v):
                r.flag(name, "--adam-beta1", v[0])
                r.flag(name, "--adam-beta2", v[1])
            else:
                r.refuse(name, v, "must be two numbers")
        elif k in _OPTIMIZER_SWITCHES:
            megaqs, why = _OPTIMIZER_SWITCHES[k]
            if v == megaqs or (k == "adam_w_mode" and params.get("weight_decay", 0) == 0):
                r.note(name, why)  # what megaq does anyway (without decay Adam is AdamW)
            else:
                r.refuse(name, v, why.replace("megaq's", "megaq's only", 1))
        elif k in ("torch_adam", "fused"):
            r.note(name, "megaq picks its optimizer kernel itself")
        else:
            r.refuse(name, None, f"not a {kind} parameter megaq knows")
    if lowered == "sgd" and "momentum" not in params:
        r.flag(f"{key}.params.momentum", "--sgd-momentum", 0)  # torch.optim.SGD's default


# DeepSpeed's schedulers megaq's schedule reproduces (linear warm-up from 0, then
# constant, linear to warmup_min_lr = 0, or cosine to cos_min_ratio x lr)
_SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")


def _scheduler(r: _Reader, key: str, section) -> None:
    if r.typed(key, section, "dict") is None:
        return
    kind, params = section.get("type"), section.get("params", {})
    if r.typed(f"{key}.type", kind, "str") is None or r.typed(f"{key}.params", params,
                                                                "dict") is None:
        return
    if kind not in _SCHEDULERS:
        r.refuse(f"{key}.type", kind, f"megaq's schedule is a linear warm-up then constant, "
                                      f"linear or cosine decay: {', '.join(_SCHEDULERS)}")
        return
    known = {"warmup_num_steps", "warmup_type", "last_batch_iteration"}
    known |= {"WarmupLR": {"warmup_min_lr", "warmup_max_lr"},
              "WarmupDecayLR": {"warmup_min_lr", "warmup_max_lr", "total_num_steps"},
              "WarmupCosineLR": {"total_num_steps", "warmup_min_ratio", "cos_min_ratio"}}[kind]
    for k in params:
        if k not in known:
            r.refuse(f"{key}.params.{k}", None, f"not a {kind} parameter megaq knows")
    p = f"{key}.params"
    if params.get("warmup_type", "log") != "linear":  # DeepSpeed's default warm-up is log
        r.refuse(f"{p}.warmup_type", params.get("warmup_type", "log (the default)"),
                 "megaq warms up linearly: write \"warmup_type\": \"linear\"")
    if params.get("last_batch_iteration", -1) != -1:
        r.refuse(f"{p}.last_batch_iteration", params["last_batch_iteration"],
                 "megaq's schedule resumes from its checkpoint")
    start = params.get("warmup_min_ratio" if kind == "WarmupCosineLR" else "warmup_min_lr", 0)
    if start != 0:
        r.refuse(f"{p}.{'warmup_min_ratio' if kind == 'WarmupCosineLR' else 'warmup_min_lr'}",
                 start, "megaq's warm-up (and linear decay) starts from / ends at 0")
    warmup = r.typed(f"{p}.warmup_num_steps", params.get("warmup_num_steps", 1000), "int")
    if warmup is not None:
        r.flag(f"{p}.warmup_num_steps", "--lr-warmup-iters", warmup)
    if kind in ("WarmupLR", "WarmupDecayLR"):
        peak = r.typed(f"{p}.warmup_max_lr", params.get("warmup_max_lr", 0.001), "number")
        if peak is not None:
            r.flag(f"{p}.warmup_max_lr", "--lr", peak)
    if kind == "WarmupLR":
        r.flag(f"{key}.type", "--lr-decay-style", "constant")
        return
    total = params.get("total_num_steps")
    if total is None:
        r.refuse(f"{p}.total_num_steps", None, f"{kind} needs it (the end of the decay)")
    elif r.typed(f"{p}.total_num_steps", total, "int") is not None:
        r.flag(f"{p}.total_num_steps", "--lr-decay-iters", int(total))
    r.flag(f"{key}.type", "--lr-decay-style", "linear" if kind == "WarmupDecayLR" else "cosine")
    if kind == "WarmupCosineLR":
        ratio = r.typed(f"{p}.cos_min_ratio", params.get("cos_min_ratio", 0.0001), "number")
        if ratio is not None:
            r.m.batch["cos_min_ratio"] = ratio  # --min-lr = ratio x the optimizer's lr


def _communication_dtype(r: _Reader, key: str, value, cfg: dict) -> None:
    """megaq sends gradients in the training dtype (qgZ: int8 / int4): a value that asks
    for another is refused."""
    bf16 = any(isinstance(cfg.get(k), dict) and cfg[k].get("enabled") is True
               for k in ("bf16", "bfloat16"))
    same = ("bf16", "bfloat16") if bf16 else ("fp32", "float32")
    if value is None or value in same:
        r.note(key, "megaq reduces gradients in the training dtype, as this asks")
    else:
        r.refuse(key, value, f"megaq reduces gradients in the training dtype "
                             f"({same[0]} here), accumulating them in fp32")


def _data_types(r: _Reader, key: str, value, cfg: dict) -> None:
    if r.typed(key, value, "dict") is None:
        return
    for k, v in value.items():
        if k == "grad_accum_dtype" and v in (None, "fp32", "float32"):
            r.note(f"{key}.{k}", "megaq accumulates gradients in fp32")
        elif k == "grad_accum_dtype":
            r.refuse(f"{key}.{k}", v, "megaq accumulates gradients in fp32")
        else:
            r.refuse(f"{key}.{k}", None, "not a data_types key megaq knows")


def _steps_per_print(r: _Reader, key: str, value) -> None:
    v = r.typed(key, value, "int")
    if v is not None:
        r.flag(key, "--log-interval", v)


_TOP = {
    "zero_optimization": _zero,
    "bf16": _precision, "bfloat16": _precision, "fp16": _precision,
    "gradient_clipping": _number("--clip-grad"),
    "optimizer": _optimizer,
    "scheduler": _scheduler,
    "train_batch_size": _batch,
    "train_micro_batch_size_per_gpu": _batch,
    "gradient_accumulation_steps": _batch,
    "steps_per_print": _steps_per_print,
}

_TOP_WITH_CONFIG = {  # handlers that read another key of the file too
    "communication_data_type": _communication_dtype,
    "data_types": _data_types,
}

# The table of docs/TRAINING.md "Coming from DeepSpeed": ds_config key -> megaq.
KEYS = (
    ("zero_optimization.stage", "--zero-stage (0-3)"),
    ("zero_optimization.zero_quantized_weights", "--zero-quantized-weights (int8 qwZ); "
     "like all three ZeRO++ keys, at stage 3 only (DeepSpeed ignores them below it: noted)"),
    ("zero_optimization.zero_hpz_partition_size", "--zero-hpz-partition-size"),
    ("zero_optimization.zero_quantized_gradients", "--zero-quantized-gradients (qgZ)"),
    ("zero_optimization without stage", "megaq's --zero-stage 3 (DeepSpeed's default is 0: "
     "the same training, replicated; named in the mapping block)"),
    ("zero_optimization.reduce_bucket_size", "--zero-reduce-bucket-size (elements)"),
    ("zero_optimization.stage3_param_persistence_threshold",
     "--zero-param-persistence-threshold (elements)"),
    ("zero_optimization.stage3_prefetch_bucket_size",
     "0: --zero-prefetch 0; otherwise noted (megaq prefetches whole sites)"),
    ("zero_optimization.overlap_comm, contiguous_gradients, reduce_scatter, "
     "allgather_*, stage3_max_live_parameters, stage3_max_reuse_distance, sub_group_size",
     "noted: megaq's engine does it its own way"),
    ("zero_optimization.offload_optimizer / offload_param (device other than none)",
     "refused: no offloading"),
    ("bf16.enabled", "--bf16"), ("fp16.enabled: true", "refused (as --fp16)"),
    ("gradient_clipping", "--clip-grad"),
    ("optimizer Adam / AdamW: lr, betas, eps, weight_decay",
     "--optimizer adam, --lr, --adam-beta1/2, --adam-eps, --weight-decay"),
    ("optimizer SGD: lr, momentum, weight_decay", "--optimizer sgd, --lr, --sgd-momentum, "
     "--weight-decay"),
    ("scheduler WarmupLR (linear, from 0)", "--lr warmup_max_lr, --lr-warmup-iters, "
     "--lr-decay-style constant"),
    ("scheduler WarmupDecayLR (linear, from 0)", "--lr warmup_max_lr, --lr-warmup-iters, "
     "--lr-decay-style linear, --lr-decay-iters total_num_steps"),
    ("scheduler WarmupCosineLR (linear, warmup_min_ratio 0)", "--lr-warmup-iters, "
     "--lr-decay-style cosine, --lr-decay-iters total_num_steps, --min-lr cos_min_ratio x lr"),
    ("train_micro_batch_size_per_gpu", "--micro-batch-size"),
    ("train_batch_size", "--global-batch-size"),
    ("gradient_accumulation_steps", "checked (or --global-batch-size = micro x accumulation "
     "x DP)"),
    ("steps_per_print", "--log-interval"),
    ("communication_data_type, data_types.grad_accum_dtype",
     "noted when it is what megaq does (the training dtype; fp32), else refused"),
    ("wall_clock_breakdown, monitors (tensorboard, wandb, csv_monitor), checkpoint",
     "noted"),
)


def keys_table_markdown() -> str:
    rows = ["| ds_config key | megaq |", "|---|---|"]
    rows += [f"| `{k}` | {v} |" for k, v in KEYS]
    return "\n".join(rows)


# ------------------------------------------------------------------ batch sizes
def batch_flags(mapping: Mapping, flags, dp: int, given: set) -> str | None:
    """Complete the flags the file implies once the data-parallel size is known, and
    check DeepSpeed's batch rule; returns the one problem line, or None. Writes
    --global-batch-size / --micro-batch-size into `flags` where the file derives them
    and the command line left them unset, and --min-lr for WarmupCosineLR (`given`: the
    destinations the command line set)."""
    b = mapping.batch
    if "cos_min_ratio" in b:
        min_lr = b["cos_min_ratio"] * flags.lr
        if "min_lr" in given and not math.isclose(flags.min_lr, min_lr):
            return (f"--deepspeed-config: scheduler.params.cos_min_ratio {b['cos_min_ratio']} "
                    f"means --min-lr {min_lr!r}, and the command line gives --min-lr "
                    f"{flags.min_lr!r}; drop the flag or change the file")
        flags.min_lr = min_lr
    total, micro, accum = (b.get(k) for k in ("train_batch_size",
                                              "train_micro_batch_size_per_gpu",
                                              "gradient_accumulation_steps"))
    if micro is None and "micro_batch_size" in given:  # the command line's counts as the file's
        micro = flags.micro_batch_size
    if total is None and micro is not None and accum is not None:
        if "global_batch_size" not in given:
            flags.global_batch_size = micro * accum * dp
        total = flags.global_batch_size
    if total is not None and micro is None:  # DeepSpeed derives the micro-batch
        accum = accum or 1
        if total % (accum * dp) == 0:
            micro = flags.micro_batch_size = total // (accum * dp)
    if total is None or micro is None:
        return None if micro is not None else (
            "--deepspeed-config: the micro-batch size is not set; give "
            "train_micro_batch_size_per_gpu (or train_batch_size) in the file, or "
            "--micro-batch-size")
    accum = accum if accum is not None else (total // (micro * dp) if total % (micro * dp)
                                             == 0 else None)
    if accum is None or total != micro * accum * dp:
        return (f"--deepspeed-config: batch sizes disagree: train_batch_size {total} != "
                f"train_micro_batch_size_per_gpu {micro} x gradient_accumulation_steps "
                f"{b.get('gradient_accumulation_steps', '(derived)')} x data-parallel size {dp}"
                f" (DeepSpeed's rule); fix the file or the layout")
    return None
