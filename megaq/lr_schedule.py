"""Learning-rate schedule: linear warm-up, then constant / linear / cosine decay to --min-lr.

Same curve as Megatron-LM's OptimizerParamScheduler:

    step <= warmup:          lr * step / warmup
    warmup < step <= decay:  min_lr + coeff * (lr - min_lr), ratio = (step - warmup) / (decay - warmup)
                             linear: coeff = 1 - ratio;  cosine: coeff = (1 + cos(pi * ratio)) / 2
    step > decay:            min_lr
    constant:                lr after warm-up

The schedule counts in one unit: optimizer updates ("iterations": --train-iters,
--lr-warmup-iters, --lr-decay-iters) or samples ("samples": --train-samples,
--lr-warmup-samples, --lr-decay-samples; each update advances it by the global batch
size, as Megatron's scheduler does). It keeps both counts, so a resume may switch unit
with --override-opt_param-scheduler. A skipped, non-finite iteration advances neither;
the lr used for the next update is ``get_lr()`` = ``lr_at(position + one step)``, so the
first warm-up update uses lr / warmup rather than Megatron's zero.

Resuming (``load_state_dict``) follows Megatron's rules: the checkpoint's settings
(lr, min lr, warm-up, decay, decay style, unit) must equal the flags', else one
:class:`ScheduleMismatchError` line names the differences, unless
--override-opt_param-scheduler (keep the flags' settings) or
--use-checkpoint-opt_param-scheduler (take the checkpoint's) was given. Every checkpoint
format calls ``load_state_dict``, so every format gets the check.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

UNITS = ("iterations", "samples")


class ScheduleMismatchError(ValueError):
    """A resumed run's LR-schedule flags differ from the checkpoint's; the message names
    the differences and the two flags that accept them."""


@dataclass
class LRSchedule:
    max_lr: float
    min_lr: float
    warmup_steps: int          # in `unit`s
    decay_steps: int           # in `unit`s
    decay_style: str           # constant | linear | cosine
    num_steps: int = 0         # optimizer updates applied so far
    unit: str = "iterations"   # "iterations" | "samples": what warmup/decay count
    samples_per_step: int = 1  # the global batch size: what one update adds to num_samples
    num_samples: int = 0       # samples of the updates applied so far
    # resume policy (Megatron's flags; not part of the saved state)
    override: bool = False        # --override-opt_param-scheduler
    use_checkpoint: bool = False  # --use-checkpoint-opt_param-scheduler

    # the settings a resume compares, with the flags that set them
    SETTINGS = (("max_lr", "--lr"), ("min_lr", "--min-lr"), ("unit", "unit"),
                ("warmup_steps", "warm-up"), ("decay_steps", "decay"),
                ("decay_style", "--lr-decay-style"))

    def __post_init__(self):
        if self.decay_style not in ("constant", "linear", "cosine"):
            raise ValueError(f"unknown lr decay style {self.decay_style!r}")
        if self.unit not in UNITS:
            raise ValueError(f"unknown lr schedule unit {self.unit!r}")
        if self.override and self.use_checkpoint:
            raise ValueError("override and use_checkpoint are exclusive")

    @classmethod
    def from_config(cls, optimizer, global_batch_size: int = 1,
                    unit: str = "iterations") -> "LRSchedule":
        """From a megaq.config.run.OptimizerConfig (which checked the values), the run's
        global batch size (what each update adds to the sample count) and the unit its
        length counts in (TrainingConfig: "samples" with --train-samples)."""
        samples = unit == "samples"
        return cls(max_lr=optimizer.lr, min_lr=optimizer.min_lr,
                   warmup_steps=optimizer.lr_warmup_samples if samples else optimizer.lr_warmup_iters,
                   decay_steps=optimizer.lr_decay_samples if samples else optimizer.lr_decay_iters,
                   decay_style=optimizer.lr_decay_style, unit=unit,
                   samples_per_step=global_batch_size,
                   override=optimizer.override_opt_param_scheduler,
                   use_checkpoint=optimizer.use_checkpoint_opt_param_scheduler)

    def lr_at(self, step: int) -> float:
        """The lr at position `step` (in the schedule's unit)."""
        if self.warmup_steps > 0 and step <= self.warmup_steps:
            return self.max_lr * step / self.warmup_steps
        if self.decay_style == "constant":
            return self.max_lr
        if step > self.decay_steps:
            return self.min_lr
        span = self.decay_steps - self.warmup_steps
        ratio = (step - self.warmup_steps) / span if span > 0 else 1.0
        if self.decay_style == "linear":
            coeff = 1.0 - ratio
        else:
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    @property
    def position(self) -> int:
        """Where the schedule stands, in its unit."""
        return self.num_samples if self.unit == "samples" else self.num_steps

    def get_lr(self) -> float:
        """The lr for the next optimizer update."""
        return self.lr_at(self.position + (self.samples_per_step if self.unit == "samples" else 1))

    def step(self) -> None:
        self.num_steps += 1
        self.num_samples += self.samples_per_step

    def state_dict(self) -> dict:
        sd = asdict(self)
        del sd["override"], sd["use_checkpoint"]  # this run's policy, not the schedule's state
        return sd

    def restore_position(self, sd: dict) -> None:
        """Take only the checkpoint's position (updates and samples so far); the settings
        stay the flags' (--no-load-optim: no optimizer state, of which Megatron counts the
        schedule's settings, is loaded)."""
        self.num_steps = int(sd["num_steps"])
        # files written before the sample count existed counted iterations only
        self.num_samples = int(sd.get("num_samples", self.num_steps * self.samples_per_step))

    def load_state_dict(self, sd: dict) -> None:
        """Resume: the position, and the settings as Megatron decides (module docstring).
        A state without settings (a converter's checkpoint of an imported model, like
        Megatron's release checkpoints) gives the position only."""
        if not any(k in sd for k, _ in self.SETTINGS):
            self.restore_position(sd)
            return
        saved = {"unit": "iterations", **{k: sd[k] for k, _ in self.SETTINGS if k in sd}}
        diffs = [f"{name} {getattr(self, k)} (checkpoint: {saved[k]})"
                 for k, name in self.SETTINGS if saved.get(k) != getattr(self, k)]
        if diffs and self.use_checkpoint:
            for k, _ in self.SETTINGS:
                setattr(self, k, saved[k])
        elif diffs and not self.override:
            raise ScheduleMismatchError(
                f"the LR schedule differs from the checkpoint's: {'; '.join(diffs)} (warm-up "
                f"and decay in the schedule's unit, {self.unit}; the decay defaults to the run's "
                f"length). Pass the checkpoint's values, or --override-opt_param-scheduler to "
                f"use these flags' schedule, or --use-checkpoint-opt_param-scheduler to keep the "
                f"checkpoint's")
        self.restore_position(sd)
