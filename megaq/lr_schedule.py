"""Learning-rate schedule: linear warm-up, then constant / linear / cosine decay to --min-lr.

Same curve as Megatron-LM's OptimizerParamScheduler:

    step <= warmup:          lr * step / warmup
    warmup < step <= decay:  min_lr + coeff * (lr - min_lr), ratio = (step - warmup) / (decay - warmup)
                             linear: coeff = 1 - ratio;  cosine: coeff = (1 + cos(pi * ratio)) / 2
    step > decay:            min_lr
    constant:                lr after warm-up

`step` counts optimizer updates taken so far (a skipped, non-finite iteration does not
advance it), so the lr used for update k+1 is ``get_lr()`` after k calls of ``step()``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass


@dataclass
class LRSchedule:
    max_lr: float
    min_lr: float
    warmup_steps: int
    decay_steps: int
    decay_style: str  # constant | linear | cosine
    num_steps: int = 0

    def __post_init__(self):
        if self.decay_style not in ("constant", "linear", "cosine"):
            raise ValueError(f"unknown lr decay style {self.decay_style!r}")

    @classmethod
    def from_config(cls, optimizer) -> "LRSchedule":
        """From a megaq.config.OptimizerConfig (which checked the values)."""
        return cls(max_lr=optimizer.lr, min_lr=optimizer.min_lr,
                   warmup_steps=optimizer.lr_warmup_iters, decay_steps=optimizer.lr_decay_iters,
                   decay_style=optimizer.lr_decay_style)

    def lr_at(self, step: int) -> float:
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

    def get_lr(self) -> float:
        """The lr for the next optimizer update: lr_at(num_steps + 1), so the first
        warm-up update uses lr / warmup rather than Megatron's zero."""
        return self.lr_at(self.num_steps + 1)

    def step(self) -> None:
        self.num_steps += 1

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, sd: dict) -> None:
        # The schedule's shape comes from the *current* flags (a user may extend a run);
        # only the position is restored, as Megatron does with --override-opt_param-scheduler.
        self.num_steps = int(sd["num_steps"])
