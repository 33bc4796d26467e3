"""Every RNG stream of a process as a checkpoint's rng/rank_*.pt holds it: python,
numpy, torch CPU, CUDA and the TP RNG tracker, as tensors and plain values (so that
megaq.checkpoint.safe_unpickle's tensor-only reader takes them back)."""

from __future__ import annotations

import random

import numpy as np
import torch

from megaq.parallel.tensor_parallel import get_rng_tracker


def rng_state() -> dict:
    """Every RNG stream of this process, as tensors and plain values."""
    version, internal, gauss = random.getstate()
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state = {
        "python": {"version": version, "internal": torch.tensor(internal, dtype=torch.int64),
                   "gauss": gauss},
        "numpy": {"kind": np_kind, "keys": torch.from_numpy(np_keys.astype(np.int64)),
                  "pos": int(np_pos), "has_gauss": int(np_has_gauss),
                  "cached_gaussian": float(np_gauss)},
        "torch_cpu": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }
    state["tp_tracker"] = get_rng_tracker().get_states()
    return state


def set_rng_state(state: dict) -> None:
    py = state["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["internal"].tolist()), py["gauss"]))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"],
                         n["has_gauss"], n["cached_gaussian"]))
    torch.set_rng_state(state["torch_cpu"])
    if torch.cuda.is_available() and state["cuda"]:
        torch.cuda.set_rng_state_all(state["cuda"])
    if state["tp_tracker"]:
        get_rng_tracker().set_states(state["tp_tracker"])
