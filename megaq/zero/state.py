"""Full (un-sharded) optimizer state in and out of the engine, for checkpoints.

``full_state(engine)`` returns, for this TP/PP rank, ``{"step": int, "params":
{name: {"param": weights, <state name>: buffer, ...}}}`` with full fp32 CPU tensors
(gathered over DP; a collective every DP rank must join). The state names are the
optimizer's ``STATE_NAMES`` (megaq.zero.optimizer): AdamW's ``exp_avg`` and
``exp_avg_sq`` (the keys every megaq checkpoint so far holds), SGD's
``momentum_buffer``. Names are the chunk's ``named_parameters()`` names, prefixed
``chunk{i}.`` when a rank holds several model chunks (virtual pipeline).
``load_full_state(engine, sd)`` takes the same dict, whatever DP size wrote it, and
keeps only this rank's shard; an entry holding only "param" (a weights-only state,
megaq.checkpoint.engine_weights_only) starts the optimizer state fresh (zeros, step 0
as the dict says). Another optimizer's state is refused (OptimizerStateMismatch).
"""

from __future__ import annotations

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
