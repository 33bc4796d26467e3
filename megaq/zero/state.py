"""Full (un-sharded) optimizer state in and out of the engine, for checkpoints.

``full_state(engine)`` returns, for this TP/PP rank, ``{"step": int, "params":
{name: {"param", "exp_avg", "exp_avg_sq"}}}`` with full fp32 CPU tensors (gathered
over DP; a collective every DP rank must join). Names are the chunk's
``named_parameters()`` names, prefixed ``chunk{i}.`` when a rank holds several
model chunks (virtual pipeline). ``load_full_state(engine, sd)`` takes the same
dict, whatever DP size wrote it, and keeps only this rank's shard.
"""

from __future__ import annotations

import torch

from megaq.parallel import comm

KEYS = ("param", "exp_avg", "exp_avg_sq")


def state_buffers(st, optim: bool = True) -> dict[str, torch.Tensor]:
    """A partition's flat fp32 shard buffers by checkpoint name: the master weights
    ("param") and, with `optim`, the optimizer's per-element state (one home for the
    names: checkpoint writers and readers iterate this dict)."""
    out = {"param": st.master}
    if optim:
        out.update(exp_avg=st.exp_avg, exp_avg_sq=st.exp_avg_sq)
    return out


def full_state(engine) -> dict:
    out: dict[str, dict[str, torch.Tensor]] = {}
    dp = engine.topo.dp
    for st in engine.optimizer.states:
        part = st.part
        fulls = {}
        for key, buf in state_buffers(st).items():
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
        raise ValueError("load_full_state expects {'step': int, 'params': {name: {param, exp_avg, "
                         "exp_avg_sq}}} as written by engine.full_state()")
    params = sd["params"]
    expected = [slot.name for st in engine.optimizer.states for slot in st.part.slots]
    missing = [n for n in expected if n not in params]
    if missing:
        raise ValueError(f"optimizer state lacks {len(missing)} parameters (e.g. {missing[:3]}); "
                         f"load a checkpoint of the same model and TP/PP layout")
    for st in engine.optimizer.states:
        part = st.part
        for key, buf in state_buffers(st).items():
            full = part.full_flat_from({s.name: params[s.name][key] for s in part.slots})
            buf.copy_(full[part.lo:part.hi].to(buf.device))
    finish_load(engine, int(sd["step"]))


def finish_load(engine, step: int) -> None:
    """After the shard buffers were overwritten: the gather-dtype shards follow the
    masters and the optimizer its step count."""
    for st in engine.optimizer.states:
        st.write_back()
    engine.optimizer.set_step(step)
