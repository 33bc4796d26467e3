"""Interleaved 1F1B (Megatron's virtual pipeline schedule).

Each rank holds ``vp`` model chunks; micro-batches go through chunk 0 of every stage,
then chunk 1 of every stage, and so on, so the pipeline fills ``vp`` times faster and the
bubble shrinks from (p-1)/(m+p-1) to (p-1)/(v*m+p-1), at the price of ``vp`` times more
p2p messages. Forward k on a rank runs chunk ``(k mod (p*vp)) // p``: groups of ``p``
micro-batches per chunk, which is why the number of micro-batches must be a multiple of
``p`` (Megatron's rule, checked in split.check_num_microbatches).

The bookkeeping below follows Megatron-LM's forward_backward_pipelining_with_interleaving
step for step (same warm-up count, same "who sends what" decisions), because the peer
ranks' batched p2p calls must pair up exactly; see the module docstring of schedules.py
for the loss convention.
"""

from __future__ import annotations


import torch

from megaq.parallel.pipeline.p2p import StepTimer
from megaq.parallel.pipeline.split import PipelineConfigError
from megaq.parallel.pipeline.schedules import _setup


def forward_backward_pipelining_with_interleaving(
        model_chunks, microbatches, num_microbatches: int, topo, *, tensor_shape,
        dtype: torch.dtype = torch.float32, forward_only: bool = False,
        timer: StepTimer | None = None, token_loss_scale=None) -> list[torch.Tensor]:
    if topo is None or topo.layout.pp < 2:
        raise PipelineConfigError("the interleaved schedule needs --pipeline-model-parallel-size "
                                  "> 1; use forward_backward_no_pipelining for PP=1")
    runner, p2p, pp_rank, pp = _setup(model_chunks, microbatches, num_microbatches, topo,
                                      tensor_shape, dtype, forward_only, timer, False,
                                      token_loss_scale)
    vp, m = len(model_chunks), num_microbatches
    total = m * vp
    first_rank, last_rank = pp_rank == 0, pp_rank == pp - 1
    inputs = [[] for _ in range(vp)]     # per chunk: inputs awaiting backward, oldest first
    outputs = [[] for _ in range(vp)]
    out_grads = [[] for _ in range(vp)]  # per chunk: received output grads, oldest first

    all_warmup = False
    if forward_only:
        warmup = total
    elif m == pp:
        warmup, all_warmup = total, True
    else:
        warmup = min((pp - pp_rank - 1) * 2 + (vp - 1) * pp, total)
    remaining = total - warmup

    def chunk_id(k: int, forward: bool) -> int:
        c = (k % (pp * vp)) // pp
        return c if forward else vp - c - 1

    def forward_step(k: int):
        c = chunk_id(k, True)
        if runner.is_first(c) and len(inputs[c]) == len(outputs[c]):
            inputs[c].append(None)
        out = runner.forward(c, inputs[c][-1])
        outputs[c].append(out)
        if forward_only:
            inputs[c].pop()
            outputs[c].pop()
        return None if runner.is_last(c) else out

    def backward_step(k: int):
        c = chunk_id(k, False)
        if runner.is_last(c) and not out_grads[c]:
            out_grads[c].append(None)
        grad = runner.backward(c, inputs[c].pop(0), outputs[c].pop(0), out_grads[c].pop(0))
        return None if runner.is_first(c) else grad

    # Warm-up: forwards only.
    inputs[0].append(None if first_rank else p2p.recv_forward())
    for k in range(warmup):
        out = forward_step(k)
        next_c = chunk_id(k + 1, True)
        recv_prev = not (first_rank and next_c == 0) and k != total - 1
        if k == warmup - 1 and not forward_only and not all_warmup:
            inp, og = p2p.communicate(send_next=out, recv_prev=recv_prev, recv_next=not last_rank)
            out_grads[vp - 1].append(og)
        else:
            inp, _ = p2p.communicate(send_next=out, recv_prev=recv_prev)
        inputs[next_c].append(inp)

    # Steady state: one forward, one backward, one exchange in both directions.
    for k in range(remaining):
        fk, bk = k + warmup, k
        out = forward_step(fk)
        in_grad = backward_step(bk)
        recv_prev = True
        if first_rank:  # the first stage runs pp-1 forwards ahead of the last
            next_fc = chunk_id(fk - (pp - 1), True)
            recv_prev = next_fc != vp - 1
            next_fc += 1
        else:
            next_fc = chunk_id(fk + 1, True)
        recv_next = True
        if last_rank:  # the last stage runs pp-1 backwards ahead of the first
            next_bc = chunk_id(bk - (pp - 1), False)
            recv_next = next_bc != 0
            next_bc -= 1
        else:
            next_bc = chunk_id(bk + 1, False)
        if k == remaining - 1:
            recv_prev = False
        inp, og = p2p.communicate(send_next=out, send_prev=in_grad,
                                  recv_prev=recv_prev, recv_next=recv_next)
        if recv_prev:
            inputs[next_fc].append(inp)
        if recv_next:
            out_grads[next_bc].append(og)

    # Cool-down: drain the backwards.
    if not forward_only:
        if all_warmup:
            out_grads[vp - 1].append(None if last_rank else p2p.recv_backward())
        for k in range(remaining, total):
            in_grad = backward_step(k)
            next_bc = chunk_id(k + 1, False)
            recv_next = not (last_rank and next_bc == vp - 1) and k != total - 1
            _, og = p2p.communicate(send_prev=in_grad, recv_next=recv_next)
            if recv_next:
                out_grads[next_bc].append(og)
    return runner.losses
