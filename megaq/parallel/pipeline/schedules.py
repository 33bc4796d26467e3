"""Forward/backward schedules over micro-batches: no pipelining, 1F1B, interleaved 1F1B.

Loss convention (Megatron's): the loss of one micro-batch is the masked mean of its
per-token losses, ``sum(loss * mask) / sum(mask)`` (the denominator clamped to 1 so an
all-masked micro-batch gives 0, not NaN), and each micro-batch's backward starts from
``loss / num_microbatches``. The accumulated gradients are therefore those of the mean
over micro-batches of the per-micro-batch losses -- exactly what one process running
the same micro-batches one after another computes. (DP averaging is the engine's job.)

With ``token_loss_scale`` (Megatron's --calculate-per-token-loss) a micro-batch's loss
is instead ``sum(loss * mask) * token_loss_scale``: the trainer passes
``num_microbatches x DP / (loss tokens of the whole global batch)``, so the backward of
``loss / num_microbatches``, averaged over DP by the engine, is the gradient of the mean
over every loss token of the global batch, and the mean of the recorded losses over
micro-batches and DP ranks is that mean too.

All schedules share one signature and return the unscaled, detached per-micro-batch
losses (tensors, nothing is synchronised to the host) on the last pipeline stage and
an empty list elsewhere. ``microbatches`` is a list or iterator of dicts with ``tokens``
(needed on the first stage), ``labels`` and ``loss_mask`` (needed on the last stage) and
optionally ``position_ids`` (passed to every chunk of a rank that has micro-batches:
with RoPE and custom positions, give every stage its micro-batches); other ranks may
pass None.

Data-parallel engines act through autograd (module forward hooks, parameter grad hooks)
since backward is a plain ``torch.autograd.backward(output, grad)``: the schedules know
nothing about data parallelism.
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterable

import torch

from megaq.parallel.pipeline.p2p import PipelineP2P, StepTimer
from megaq.parallel.pipeline.split import PipelineConfigError, check_num_microbatches


def masked_mean_loss(per_token_loss: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """sum(loss * mask) / sum(mask) over a micro-batch, in fp32."""
    mask = loss_mask.to(torch.float32).reshape(per_token_loss.shape)
    return (per_token_loss.float() * mask).sum() / mask.sum().clamp(min=1.0)


class _Microbatches:
    """Micro-batch i on demand from a list or an iterator (read in order, kept for the step).

    Every chunk that runs micro-batch i on this rank sees the same dict (the first
    chunk reads tokens, the last labels/mask, any chunk position_ids).
    """

    def __init__(self, source: Iterable | None):
        self._it = None if source is None else iter(source)
        self._seen: list[dict] = []

    @property
    def available(self) -> bool:
        return self._it is not None

    def get(self, i: int) -> dict:
        if self._it is None:
            raise PipelineConfigError("this pipeline stage needs micro-batches (tokens on the "
                                      "first stage, labels and loss_mask on the last); got None")
        while len(self._seen) <= i:
            try:
                self._seen.append(next(self._it))
            except StopIteration:
                raise PipelineConfigError(f"micro-batch source ran out after {len(self._seen)} "
                                          f"micro-batches; the step needs {i + 1}") from None
        return self._seen[i]


class _Runner:
    """Forward and backward of one micro-batch on one chunk, shared by every schedule."""

    def __init__(self, chunks, microbatches, num_microbatches, pp_rank, pp_size,
                 forward_only, timer, token_loss_scale=None):
        self.chunks, self.m = list(chunks), num_microbatches
        self.token_loss_scale = token_loss_scale  # None: the masked mean per micro-batch
        self.first_stage, self.last_stage = pp_rank == 0, pp_rank == pp_size - 1
        self.forward_only, self.timer = forward_only, timer
        self.data = _Microbatches(microbatches)
        self.forwards_done = [0] * len(self.chunks)   # next micro-batch id per chunk
        self.backwards_done = [0] * len(self.chunks)
        self.losses: list[torch.Tensor] = []

    def is_first(self, chunk: int) -> bool:
        return self.first_stage and chunk == 0

    def is_last(self, chunk: int) -> bool:
        return self.last_stage and chunk == len(self.chunks) - 1

    def forward(self, chunk: int, input_tensor):
        """Returns the output to send on (hidden states) or the scaled loss (last chunk)."""
        t0 = time.perf_counter()
        mb_id = self.forwards_done[chunk]
        self.forwards_done[chunk] += 1
        model = self.chunks[chunk]
        needs_data = self.is_first(chunk) or self.is_last(chunk)
        # Stages that need no data may be handed None (the batch iterator's placeholder
        # for them); they only read the optional position ids.
        batch = (self.data.get(mb_id) if needs_data or self.data.available else None) or {}
        kwargs = {}
        if "position_ids" in batch:
            kwargs["position_ids"] = batch["position_ids"]
        if self.is_last(chunk):
            kwargs["labels"] = batch["labels"]
        with torch.no_grad() if self.forward_only else contextlib.nullcontext():
            if self.is_first(chunk):
                out = model(input_ids=batch["tokens"], **kwargs)
            else:
                out = model(hidden_states=input_tensor, **kwargs)
            if self.is_last(chunk):
                if self.token_loss_scale is None:
                    loss = masked_mean_loss(out, batch["loss_mask"])
                else:
                    mask = batch["loss_mask"].to(torch.float32).reshape(out.shape)
                    loss = (out.float() * mask).sum() * self.token_loss_scale
                self.losses.append(loss.detach())
                out = loss / self.m
        if self.timer is not None:
            self.timer.forward_done(t0)
        return out

    def backward(self, chunk: int, input_tensor, output_tensor, output_grad):
        """Backprop one micro-batch through one chunk; returns the grad of its input."""
        t0 = time.perf_counter()
        self.backwards_done[chunk] += 1
        torch.autograd.backward(output_tensor, grad_tensors=output_grad)
        grad = None if input_tensor is None else input_tensor.grad
        if self.timer is not None:
            self.timer.backward_done(t0)
        return grad


def _setup(model_chunks, microbatches, num_microbatches, topo, tensor_shape, dtype,
           forward_only, timer, one_chunk: bool, token_loss_scale=None):
    pp_size = 1 if topo is None else topo.layout.pp
    pp_rank = 0 if topo is None else topo.pp_rank
    vp = len(model_chunks)
    if one_chunk and vp != 1:
        raise PipelineConfigError(f"this schedule runs one model chunk per rank, got {vp}; "
                                  f"use the interleaved schedule for virtual pipeline stages")
    check_num_microbatches(num_microbatches, pp_size, vp)
    runner = _Runner(model_chunks, microbatches, num_microbatches, pp_rank, pp_size,
                     forward_only, timer, token_loss_scale)
    p2p = None
    if pp_size > 1:
        if tensor_shape is None:
            raise PipelineConfigError("pipeline schedules need tensor_shape ([s/tp, b, h] under "
                                      "sequence parallelism); see pipeline_tensor_shape()")
        device = next(model_chunks[0].parameters()).device
        p2p = PipelineP2P(topo.pp, tensor_shape, dtype, device, not forward_only, timer)
    return runner, p2p, pp_rank, pp_size


def forward_backward_no_pipelining(model_chunks, microbatches, num_microbatches: int, topo=None,
                                   *, tensor_shape=None, dtype: torch.dtype = torch.float32,
                                   forward_only: bool = False,
                                   timer: StepTimer | None = None,
                                   token_loss_scale=None) -> list[torch.Tensor]:
    """PP=1: forward then backward of each micro-batch in turn (gradient accumulation)."""
    if topo is not None and topo.layout.pp != 1:
        raise PipelineConfigError(f"forward_backward_no_pipelining needs PP=1 "
                                  f"(got {topo.layout.pp}); use get_forward_backward_func")
    runner, _, _, _ = _setup(model_chunks, microbatches, num_microbatches, None, tensor_shape,
                             dtype, forward_only, timer, True, token_loss_scale)
    for _ in range(num_microbatches):
        out = runner.forward(0, None)
        if not forward_only:
            runner.backward(0, None, out, None)
    return runner.losses


def forward_backward_pipelining_without_interleaving(
        model_chunks, microbatches, num_microbatches: int, topo, *, tensor_shape,
        dtype: torch.dtype = torch.float32, forward_only: bool = False,
        timer: StepTimer | None = None, token_loss_scale=None) -> list[torch.Tensor]:
    """1F1B: stage p runs pp-p-1 warm-up forwards, then alternates one forward / one
    backward, then drains the remaining backwards. Stage p holds at most pp-p micro-batches'
    activations (the first stage: pp), instead of all of them."""
    runner, p2p, pp_rank, pp_size = _setup(model_chunks, microbatches, num_microbatches, topo,
                                           tensor_shape, dtype, forward_only, timer, True,
                                           token_loss_scale)
    first, last = runner.is_first(0), runner.is_last(0)
    m = num_microbatches
    warmup = m if forward_only else min(pp_size - pp_rank - 1, m)
    remaining = m - warmup
    inputs, outputs = [], []  # activations awaiting backward, oldest first

    def recv_forward():
        return None if first else p2p.recv_forward()

    def send_forward(out):
        if not last:
            p2p.send_forward(out)

    for _ in range(warmup):
        inp = recv_forward()
        out = runner.forward(0, inp)
        send_forward(out)
        if not forward_only:
            inputs.append(inp)
            outputs.append(out)

    inp = recv_forward() if remaining > 0 else None
    for i in range(remaining):
        last_iteration = i == remaining - 1
        out = runner.forward(0, inp)
        if forward_only:
            send_forward(out)
            if not last_iteration:
                inp = recv_forward()
            continue
        out_grad = None if last else p2p.send_forward_recv_backward(out)
        inputs.append(inp)
        outputs.append(out)
        in_grad = runner.backward(0, inputs.pop(0), outputs.pop(0), out_grad)
        if last_iteration:
            if not first:
                p2p.send_backward(in_grad)
        elif first:
            inp = None
        else:
            inp = p2p.send_backward_recv_forward(in_grad)

    if not forward_only:
        for _ in range(warmup):
            out_grad = None if last else p2p.recv_backward()
            in_grad = runner.backward(0, inputs.pop(0), outputs.pop(0), out_grad)
            if not first:
                p2p.send_backward(in_grad)
    return runner.losses
