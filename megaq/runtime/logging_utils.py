"""Megatron's training / validation log lines, its start-up report (arguments,
parameter count, memory after the first iterations), its per-phase timers, and the
optional TensorBoard and Weights & Biases scalars.

Users grep these lines (and Megatron log parsers read them), so the field names and
their order are Megatron-LM's:

 [2026-12-01 07:19:53] iteration        5/     100 | consumed samples:           40 |
 elapsed time per iteration (ms): 812.3 | throughput per GPU (TFLOP/s/GPU): 0.1 |
 tokens per second per GPU: 1234.5 | learning rate: 3.000000E-04 | global batch size:     8 |
 lm loss: 9.876543E+00 | loss scale: 1.0 | grad norm: 1.234 | params norm: 12.345 |
 number of skipped iterations:   0 | number of nan iterations:   0 |

(one line; the two throughput fields only with --log-throughput, as Megatron's first
one; "params norm" only with --log-params-norm), and ``validation loss at iteration
100 | lm loss value: 7.1E+00 | lm loss PPL: 1.2E+03 |``. With --timing-log-level 1 or 2
the line is followed by Megatron's timer block (:class:`Timers`)::

 (min, max) time across ranks (ms):
     forward-backward ...............................: (812.03, 812.40)
     optimizer ......................................: (1.20, 1.31)
"""

from __future__ import annotations

import datetime
import math
import os
import resource
import socket
import sys
import time
import warnings

import torch


def timestamp(now: datetime.datetime | None = None) -> str:
    """Megatron's log-line prefix, e.g. '[2026-12-01 07:19:53]' (local time)."""
    return f"[{(now or datetime.datetime.now()).strftime('%Y-%m-%d %H:%M:%S')}]"


def training_log_line(*, iteration: int, train_iters: int, consumed_samples: int,
                      elapsed_ms: float, lr: float, global_batch_size: int,
                      lm_loss: float | None, loss_scale: float, grad_norm: float | None,
                      skipped: int, nan: int, tflops_per_gpu: float | None = None,
                      tokens_per_s_per_gpu: float | None = None,
                      params_norm: float | None = None,
                      now: datetime.datetime | None = None) -> str:
    """The iteration line; a None optional field (throughput: no --log-throughput; params
    norm: no --log-params-norm) is left out, as Megatron leaves it out."""
    parts = [
        f" {timestamp(now)} iteration {iteration:8d}/{train_iters:8d}",
        f" consumed samples: {consumed_samples:12d}",
        f" elapsed time per iteration (ms): {elapsed_ms:.1f}",
    ]
    if tflops_per_gpu is not None:
        parts.append(f" throughput per GPU (TFLOP/s/GPU): {tflops_per_gpu:.1f}")
    if tokens_per_s_per_gpu is not None:
        parts.append(f" tokens per second per GPU: {tokens_per_s_per_gpu:.1f}")
    parts += [f" learning rate: {lr:.6E}", f" global batch size: {global_batch_size:5d}"]
    if lm_loss is not None:
        parts.append(f" lm loss: {lm_loss:.6E}")
    parts.append(f" loss scale: {loss_scale:.1f}")
    if grad_norm is not None:
        parts.append(f" grad norm: {grad_norm:.3f}")
    if params_norm is not None:
        parts.append(f" params norm: {params_norm:.3f}")
    parts += [f" number of skipped iterations: {skipped:3d}",
              f" number of nan iterations: {nan:3d}"]
    return " |".join(parts) + " |"


def perplexity(loss: float) -> float:
    return math.exp(min(20.0, loss))  # Megatron clamps at e^20 too


def validation_log_line(iteration: int, loss: float, where: str = "") -> str:
    """`where` is Megatron's suffix for the end-of-training evaluation, e.g. "on validation set"."""
    at = f"iteration {iteration}" + (f" {where}" if where else "")
    return (f" validation loss at {at} | lm loss value: {loss:.6E} | "
            f"lm loss PPL: {perplexity(loss):.6E} |")


def arguments_block(values: dict, title: str = "arguments") -> str:
    """Megatron's start-up dump of its arguments (_print_args): one dotted line per
    name, sorted case-insensitively, between two rules."""
    entries = [f"  {name} {'.' * (48 - len(name))} {value}" for name, value in values.items()]
    return "\n".join([f"------------------------ {title} ------------------------",
                      *sorted(entries, key=str.lower),
                      f"-------------------- end of {title} ---------------------"])


def parameter_count_line(tp_rank: int, pp_rank: int, count: int) -> str:
    """Megatron's line for the parameters one (tensor, pipeline) rank holds."""
    return (f" > number of parameters on (tensor, pipeline) model parallel rank "
            f"({tp_rank}, {pp_rank}): {count}")


def memory_report_line(rank: int, iteration: int, device: torch.device) -> str | None:
    """Megatron's report_memory line after `iteration` iterations: this rank's CUDA
    allocator figures in MiB. None off CUDA (the CPU has no such allocator; the peak RSS
    goes to --log-memory-to-tensorboard's mem-max-rss-bytes instead)."""
    if device.type != "cuda":
        return None
    mb = float(2**20)
    return (f"[Rank {rank}] (after {iteration} iterations) memory (MB)"
            f" | allocated: {torch.cuda.memory_allocated(device) / mb:.2f}"
            f" | max allocated: {torch.cuda.max_memory_allocated(device) / mb:.2f}"
            f" | reserved: {torch.cuda.memory_reserved(device) / mb:.2f}"
            f" | max reserved: {torch.cuda.max_memory_reserved(device) / mb:.2f}")


# The tags Megatron-LM's training_log and evaluate_and_print_results write a second
# time as "<tag> vs samples", with the consumed samples as the step (iteration-time,
# throughput and the mem-* tags have no such twin there).
SAMPLES_TWINS = frozenset({
    "learning-rate", "batch-size", "lm loss", "loss-scale", "world-size", "grad-norm",
    "num-zeros", "params-norm", "lm loss validation", "lm loss validation ppl"})


class TensorBoard:
    """SummaryWriter when --tensorboard-dir is given and tensorboard imports; else no-op
    (with one warning, so a missing package never stops a run). Tags are Megatron's, so
    a Megatron dashboard reads a megaq run unchanged: a tag of :data:`SAMPLES_TWINS`
    is also written as "<tag> vs samples" against the consumed samples."""

    def __init__(self, log_dir: str | None, enabled: bool = True):
        self.writer = None
        if not log_dir or not enabled:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except Exception as e:  # noqa: BLE001 - tensorboard missing or broken
            print(f"WARNING: --tensorboard-dir {log_dir} ignored: tensorboard is not importable "
                  f"({type(e).__name__}: {e}); pip install tensorboard to get scalars",
                  file=sys.stderr, flush=True)
            return
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.writer = SummaryWriter(log_dir=log_dir, max_queue=100)

    def scalars(self, values: dict, step: int, samples: int | None = None) -> None:
        """`values` at `step` (the iteration); with `samples` (the consumed samples) the
        "vs samples" twins too."""
        if self.writer is None:
            return
        for k, v in values.items():
            if isinstance(v, (int, float)) and v is not None and math.isfinite(v):
                self.writer.add_scalar(k, v, step)
                if samples is not None and k in SAMPLES_TWINS:
                    self.writer.add_scalar(f"{k} vs samples", v, samples)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()


class Timers:
    """Megatron's per-phase timers (--timing-log-level): named phases timed in seconds on
    every rank, printed at each log line as ``(min, max) time across ranks (ms):`` with
    milliseconds per iteration (Megatron's default --timing-log-option minmax; a rank
    that never ran a phase is left out of its min and max).

    A phase is timed only when its level is at most the configured one, so level 0
    costs nothing; on CUDA the device is synchronised when a timed phase ends (so
    the time is the GPU's, as Megatron's timers do), a handful of times per step at
    level 1 and a few per micro-batch at level 2."""

    def __init__(self, level: int, device: torch.device | None = None):
        self.level = level
        self.sync = device is not None and device.type == "cuda"
        self.seconds: dict[str, float] = {}
        self._started: dict[str, float] = {}

    def on(self, level: int) -> bool:
        return 0 < level <= self.level

    def start(self, name: str, level: int = 1) -> None:
        if self.on(level):
            self._started[name] = time.perf_counter()

    def stop(self, name: str, level: int = 1) -> None:
        if not self.on(level) or name not in self._started:
            return
        if self.sync:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - self._started.pop(name)
        self.seconds[name] = self.seconds.get(name, 0.0) + elapsed

    def add(self, name: str, seconds: float, level: int) -> None:
        """Time measured elsewhere (e.g. the pipeline schedule's StepTimer)."""
        if self.on(level):
            self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def take(self) -> dict[str, float]:
        """This interval's seconds per phase, and start the next interval."""
        out, self.seconds = self.seconds, {}
        return out


def timers_block(per_rank: list[dict[str, float]], iterations: int) -> str | None:
    """Megatron's timer block from every rank's {phase: seconds} of an interval."""
    names = []
    for d in per_rank:
        names += [n for n in d if n not in names]
    if not names:
        return None
    lines = ["(min, max) time across ranks (ms):"]
    for name in names:
        ms = [d[name] * 1000.0 / max(1, iterations) for d in per_rank if d.get(name, 0.0) > 0]
        if ms:
            lines.append(f"    {(name + ' ').ljust(48, '.')}: ({min(ms):.2f}, {max(ms):.2f})")
    return "\n".join(lines)


def memory_stats(device: torch.device) -> dict[str, float]:
    """This rank's memory, under Megatron's TensorBoard names on CUDA
    (mem-reserved-bytes, mem-allocated-bytes, mem-max-allocated-bytes); on CPU the
    process's peak resident set size (mem-max-rss-bytes). "peak" is the number the
    metrics file records per rank."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        return {"mem-reserved-bytes": torch.cuda.memory_reserved(device),
                "mem-allocated-bytes": torch.cuda.memory_allocated(device),
                "mem-max-allocated-bytes": peak, "peak": peak}
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return {"mem-max-rss-bytes": rss, "peak": rss}


WANDB_HOST = ("api.wandb.ai", 443)


class WandB:
    """Weights & Biases run for --wandb-project: the scalars TensorBoard gets, logged
    with the iteration as the step (Megatron's _set_wandb_writer: run name
    --wandb-exp-name, files under --wandb-save-dir, config = the run's configuration).
    When WANDB_MODE is unset and the wandb server cannot be reached (an air-gapped
    cluster), the run is logged offline (``wandb sync DIR`` uploads it later)."""

    def __init__(self, project: str | None, name: str | None, save_dir: str | None,
                 config: dict | None = None, enabled: bool = True, log=print):
        self.run = None
        if not project or not enabled:
            return
        import wandb
        mode = os.environ.get("WANDB_MODE")
        if mode is None and not _reachable(WANDB_HOST):
            mode = "offline"
            log(f" note: {WANDB_HOST[0]} is not reachable: logging to wandb offline in "
                f"{save_dir} (upload later with `wandb sync`)")
        os.makedirs(save_dir, exist_ok=True)
        self.run = wandb.init(project=project, name=name, dir=save_dir, config=config or {},
                              mode=mode)

    def scalars(self, values: dict, step: int) -> None:
        if self.run is None:
            return
        finite = {k: v for k, v in values.items()
                  if isinstance(v, (int, float)) and math.isfinite(v)}
        if finite:
            self.run.log(finite, step=step)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


def _reachable(host_port: tuple[str, int], timeout: float = 3.0) -> bool:
    try:
        with socket.create_connection(host_port, timeout=timeout):
            return True
    except OSError:
        return False
