"""The engine's state in and out, for checkpoints: full (DP-gathered) or this rank's shard.

Full state (--ckpt-format torch):

``full_state(engine)`` returns, for this TP/PP rank, ``{"step": int, "params":
{name: {"param": weights, <state name>: buffer, ...}}}`` with full fp32 CPU tensors
(gathered over DP; a collective every DP rank must join). The state names are the
optimizer's ``STATE_NAMES`` (megaq.zero.optimizer): AdamW's ``exp_avg`` and
``exp_avg_sq`` (the keys every megaq checkpoint so far holds), SGD's
``momentum_buffer``. Names are the chunk's ``named_parameters()`` names, prefixed
``chunk{i}.`` when a rank holds several model chunks (virtual pipeline).
``load_full_state(engine, sd)`` takes the same dict, whatever DP size wrote it, and
keeps only this rank's shard; an entry holding only "param" (a weights-only state,
megaq.checkpoint.torch_format.engine_weights_only) starts the optimizer state fresh (zeros, step 0
as the dict says). Another optimizer's state is refused (OptimizerStateMismatch).

Sharded state (--ckpt-format torch_dist): ``sharded_state(engine, optim)`` is a
:class:`ShardedState`, this rank's part of every parameter as 1-D views into its shard
buffers (no copy, no collective), with the flat range of the parameter each covers and
the parameter's TP partition, which is what a writer needs to place the pieces in the
global tensors. A reader fills the views in place (or builds its own ShardedState of the
same parameters) and hands it to ``load_sharded_state(engine, sd)``; an optimizer state
the ShardedState does not carry starts from zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megaq.parallel import comm


class OptimizerStateMismatch(ValueError):
    """The state dict holds another optimizer's state than the engine's."""


def state_names(entry: dict) -> tuple[str, ...]:
    """The optimizer-state names of one parameter's entry (everything but "param")."""
    return tuple(sorted(k for k in entry if k != "param"))


def state_buffers(st, optim: bool = True) -> dict[str, torch.Tensor]:
    """A partition's flat fp32 shard buffers by checkpoint name: the master weights
    ("param") and, with `optim`, the optimizer's per-element state (AdamW's exp_avg /
    exp_avg_sq, SGD's momentum_buffer): checkpoint writers and readers iterate this."""
    bufs = st.buffers()
    return bufs if optim else {"param": bufs["param"]}


def full_state(engine) -> dict:
    out: dict[str, dict[str, torch.Tensor]] = {}
    dp = engine.topo.dp
    for st in engine.optimizer.states:
        part = st.part
        fulls = {}
        for key, buf in st.buffers().items():
            if part.sharded and dp.size > 1:
                full = torch.empty(part.padded_numel, dtype=torch.float32, device=buf.device)
                comm.all_gather(full, buf.contiguous(), dp, "dp_misc")
            else:
                full = buf.float()
            fulls[key] = full.cpu()
        for slot in part.slots:
            out[slot.name] = {k: f[slot.offset:slot.offset + slot.numel].view(slot.shape).clone()
                              for k, f in fulls.items()}
    return {"step": engine.optimizer.step_count, "params": out}


def load_full_state(engine, sd: dict) -> None:
    if not isinstance(sd, dict) or "params" not in sd or "step" not in sd:
        raise ValueError("load_full_state expects {'step': int, 'params': {name: {param, "
                         "<optimizer state>...}}} as written by engine.full_state()")
    params = sd["params"]
    opt = engine.optimizer
    expected = [slot.name for st in opt.states for slot in st.part.slots]
    missing = [n for n in expected if n not in params]
    if missing:
        raise ValueError(f"optimizer state lacks {len(missing)} parameters (e.g. {missing[:3]}); "
                         f"load a checkpoint of the same model and TP/PP layout")
    want = tuple(sorted(opt.STATE_NAMES))
    for name in expected:
        have = state_names(params[name])
        if have and have != want:
            raise OptimizerStateMismatch(
                f"the optimizer state holds {', '.join(have)} for {name}, but --optimizer "
                f"{opt.NAME} keeps {', '.join(want) or 'no state'}")
    for st in opt.states:
        part = st.part
        for key, buf in st.buffers().items():
            if key != "param" and not state_names(params[part.slots[0].name]):
                buf.zero_()  # a weights-only state: fresh optimizer state
                continue
            full = part.full_flat_from({s.name: params[s.name][key] for s in part.slots})
            buf.copy_(full[part.lo:part.hi].to(buf.device))
    finish_load(engine, int(sd["step"]))


def finish_load(engine, step: int) -> None:
    """After the shard buffers were overwritten: the gather-dtype shards follow the
    masters and the optimizer its step count."""
    for st in engine.optimizer.states:
        st.write_back()
    engine.optimizer.set_step(step)


# ---------------------------------------------------------------- sharded state
@dataclass
class ParamShard:
    """One parameter's part of this rank's shard."""

    name: str                          # as full_state keys it ("chunk{i}." with several chunks)
    shape: torch.Size                  # the parameter's (TP-local) shape
    start: int                         # [start, end): the elements of the row-major
    end: int                           # parameter this rank holds
    tensors: dict[str, torch.Tensor]   # "param" (fp32 master) and optimizer state: end - start
    replicated: bool                   # every DP rank holds all of it (not ZeRO-sharded)
    tp_dim: int | None                 # TP partition dimension (None: the same on every TP rank)
    tp_stride: int                     # and its stride (megaq.parallel.tensor_parallel.shard_of)
    shared_embedding: bool             # the copy of a tied embedding on another pipeline stage


@dataclass
class ShardedState:
    step: int
    keys: tuple[str, ...]              # what each ParamShard's tensors hold: "param" [+ the optimizer's]
    params: list[ParamShard]
    num_chunks: int                    # model chunks of this rank (the names' "chunk{i}.")


def sharded_state(engine, optim: bool = True) -> ShardedState:
    params = []
    for st in engine.optimizer.states:
        part = st.part
        buffers = state_buffers(st, optim)
        for slot in part.slots:
            a, b = max(slot.offset, part.lo), min(slot.offset + slot.numel, part.hi)
            if b <= a:
                continue  # the parameter lies wholly in other DP ranks' shards
            p = slot.param
            tp_split = getattr(p, "tensor_model_parallel", False)
            params.append(ParamShard(
                name=slot.name, shape=slot.shape, start=a - slot.offset, end=b - slot.offset,
                tensors={k: buf[a - part.lo:b - part.lo] for k, buf in buffers.items()},
                replicated=not part.sharded, tp_dim=p.partition_dim if tp_split else None,
                tp_stride=p.partition_stride if tp_split else 1,
                shared_embedding=getattr(p, "shared_embedding", False)))
    keys = ("param", *engine.optimizer.STATE_NAMES) if optim else ("param",)
    return ShardedState(engine.optimizer.step_count, keys, params, len(engine.chunks))


def load_sharded_state(engine, sd: ShardedState) -> None:
    """Take `sd` (views into this engine's buffers, filled in place, or tensors of the
    same parameters) as the engine's state; an optimizer state `sd` does not carry starts
    from zero, and the step is `sd.step`."""
    own = sharded_state(engine)
    if "param" not in sd.keys or not set(sd.keys) <= set(own.keys):
        raise OptimizerStateMismatch(f"the sharded state holds {', '.join(sd.keys)}, but this "
                                     f"engine keeps {', '.join(own.keys)}")
    if [(p.name, p.start, p.end) for p in own.params] != [(p.name, p.start, p.end) for p in sd.params]:
        raise ValueError("load_sharded_state expects this rank's shard of every parameter, "
                         "as engine.sharded_state() lists them")
    for st in engine.optimizer.states:  # an optimizer state not loaded: fresh (zeros)
        for key, buf in state_buffers(st).items():
            if key not in sd.keys:
                buf.zero_()
    for mine, given in zip(own.params, sd.params):
        for key in sd.keys:
            src, dst = given.tensors[key], mine.tensors[key]
            if src.data_ptr() != dst.data_ptr() or src.shape != dst.shape:
                dst.copy_(src)
    finish_load(engine, sd.step)
