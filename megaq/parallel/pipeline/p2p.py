"""Activations forward and their gradients backward between neighbouring stages.

Every exchange of one schedule step is posted as a single ``comm.batch_p2p`` (phase
``pp``) and waited on at once, as Megatron does: sends and receives between two stages
are matched in posting order (NCCL and gloo have no tags here), so each call posts
"towards next" messages before "towards previous" ones, and receives "from previous"
before "from next". With PP=2 both neighbours are the same rank and this order keeps
activations and gradients from being swapped.

Neighbours wrap around (stage pp-1 -> stage 0) because the interleaved schedule sends
the last stage's output of chunk v to stage 0's chunk v+1; the schedules pass None
where no message exists.

Every tensor moved has the fixed ``shape`` (``[s/tp, b, h]`` under sequence parallelism,
``[s, b, h]`` otherwise, see :func:`pipeline_tensor_shape`) and ``dtype``; sends of
anything else are refused, since the receiver could not know.
"""

from __future__ import annotations

import time

import torch

from megaq.parallel import comm
from megaq.parallel.pipeline.split import PipelineConfigError


def pipeline_tensor_shape(seq_length: int, micro_batch_size: int, hidden_size: int,
                          tp_size: int = 1, sequence_parallel: bool = False) -> tuple[int, int, int]:
    """Shape of the hidden states passed between stages ([s, b, h], seq split under SP)."""
    if sequence_parallel:
        if seq_length % tp_size:
            raise PipelineConfigError(
                f"--seq-length {seq_length} is not divisible by --tensor-model-parallel-size "
                f"{tp_size}, which --sequence-parallel needs; pick a multiple of {tp_size}")
        seq_length //= tp_size
    return (seq_length, micro_batch_size, hidden_size)


class StepTimer:
    """Seconds spent waiting on p2p vs computing (forward, backward), per rank: the
    bubble benchmark's and --timing-log-level 2's numbers. sync=True synchronises the
    CUDA device before reading the clock, so the times are the GPU's, not launch times."""

    def __init__(self, sync: bool = False):
        self.p2p_s = 0.0
        self.forward_s = 0.0
        self.backward_s = 0.0
        self.forwards = 0
        self.backwards = 0
        self.sync = sync

    @property
    def compute_s(self) -> float:
        return self.forward_s + self.backward_s

    def elapsed(self, t0: float) -> float:
        if self.sync:
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    def forward_done(self, t0: float) -> None:
        self.forward_s += self.elapsed(t0)
        self.forwards += 1

    def backward_done(self, t0: float) -> None:
        self.backward_s += self.elapsed(t0)
        self.backwards += 1


class PipelineP2P:
    def __init__(self, group: comm.Group, shape, dtype: torch.dtype, device,
                 requires_grad: bool, timer: StepTimer | None = None):
        self.group, self.shape, self.dtype, self.device = group, tuple(shape), dtype, device
        self.requires_grad = requires_grad
        self.timer = timer
        n, me = group.size, group.rank
        self.prev, self.next = (me - 1) % n, (me + 1) % n

    def _check(self, t: torch.Tensor, what: str) -> torch.Tensor:
        if tuple(t.shape) != self.shape or t.dtype != self.dtype:
            raise PipelineConfigError(
                f"pipeline {what} has shape {tuple(t.shape)} / {t.dtype} but the schedule "
                f"expects {self.shape} / {self.dtype}; pass tensor_shape (seq/tp under sequence "
                f"parallelism) and dtype matching the model's hidden states")
        return t.detach().contiguous()

    def _empty(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=self.device)

    def communicate(self, send_next: torch.Tensor | None = None,
                    send_prev: torch.Tensor | None = None,
                    recv_prev: bool = False, recv_next: bool = False):
        """One batched exchange; returns (tensor from prev or None, tensor from next or None).

        A tensor received from prev is an activation: it becomes a leaf that requires grad
        (so backward can read its .grad) unless the schedule runs forward-only.
        """
        t0 = time.perf_counter()
        sends, recvs = [], []
        if send_next is not None:
            sends.append((self._check(send_next, "activation"), self.next))
        if send_prev is not None:
            sends.append((self._check(send_prev, "activation gradient"), self.prev))
        from_prev = self._empty() if recv_prev else None
        from_next = self._empty() if recv_next else None
        if from_prev is not None:
            recvs.append((from_prev, self.prev))
        if from_next is not None:
            recvs.append((from_next, self.next))
        if sends or recvs:
            comm.batch_p2p(sends, recvs, self.group, "pp").wait()
        if from_prev is not None and self.requires_grad:
            from_prev.requires_grad_(True)
        if self.timer is not None:
            self.timer.p2p_s += self.timer.elapsed(t0)
        return from_prev, from_next

    # Megatron's names, for readers who know its schedules.
    def recv_forward(self):
        return self.communicate(recv_prev=True)[0]

    def recv_backward(self):
        return self.communicate(recv_next=True)[1]

    def send_forward(self, t):
        self.communicate(send_next=t)

    def send_backward(self, t):
        self.communicate(send_prev=t)

    def send_forward_recv_backward(self, t, recv: bool = True):
        return self.communicate(send_next=t, recv_next=recv)[1]

    def send_backward_recv_forward(self, t, recv: bool = True):
        return self.communicate(send_prev=t, recv_prev=recv)[0]
