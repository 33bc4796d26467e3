"""Megatron's training / validation log lines, and optional TensorBoard scalars.

Users grep these lines (and Megatron log parsers read them), so the field names and
their order are Megatron-LM's:

 iteration        5/     100 | consumed samples:           40 | elapsed time per iteration (ms): 812.3 |
 throughput per GPU (TFLOP/s/GPU): 0.1 | learning rate: 3.000000E-04 | global batch size:     8 |
 lm loss: 9.876543E+00 | loss scale: 1.0 | grad norm: 1.234 | number of skipped iterations:   0 |
 number of nan iterations:   0 |

(one line), and ``validation loss at iteration 100 | lm loss value: 7.1E+00 | lm loss PPL: 1.2E+03 |``.
"""

from __future__ import annotations

import math
import sys
import warnings


def training_log_line(*, iteration: int, train_iters: int, consumed_samples: int,
                      elapsed_ms: float, tflops_per_gpu: float, lr: float,
                      global_batch_size: int, lm_loss: float | None, loss_scale: float,
                      grad_norm: float | None, skipped: int, nan: int) -> str:
    parts = [
        f" iteration {iteration:8d}/{train_iters:8d}",
        f" consumed samples: {consumed_samples:12d}",
        f" elapsed time per iteration (ms): {elapsed_ms:.1f}",
        f" throughput per GPU (TFLOP/s/GPU): {tflops_per_gpu:.3f}",
        f" learning rate: {lr:.6E}",
        f" global batch size: {global_batch_size:5d}",
    ]
    if lm_loss is not None:
        parts.append(f" lm loss: {lm_loss:.6E}")
    parts.append(f" loss scale: {loss_scale:.1f}")
    if grad_norm is not None:
        parts.append(f" grad norm: {grad_norm:.3f}")
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


def print_rank0(msg: str, rank: int = 0) -> None:
    if rank == 0:
        print(msg, flush=True)


class TensorBoard:
    """SummaryWriter when --tensorboard-dir is given and tensorboard imports; else no-op
    (with one warning, so a missing package never stops a run)."""

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

    def scalars(self, values: dict, step: int) -> None:
        if self.writer is None:
            return
        for k, v in values.items():
            if isinstance(v, (int, float)) and v is not None and math.isfinite(v):
                self.writer.add_scalar(k, v, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
