"""Starting a rank from a launcher's environment (torchrun, srun, or one plain process).
Local gloo ranks for tests and tools: megaq.testing.ranks.

Two reliability guarantees start here:

* **The process-group timeout** (``--distributed-timeout-minutes``, default 10) is
  given to the world group here, and passed to ``build_topology``, which gives it to
  every group it creates and keeps it on the Topology (``topo.timeout``) for groups
  made later: a collective waiting that long for a peer fails instead of hanging.
* **Ranks never outlive their launcher** (:func:`die_with_parent`): a rank started by
  torchrun or srun asks the kernel for SIGKILL when its parent dies
  (``PR_SET_PDEATHSIG``; a parent-pid watch thread where that is unavailable), so a
  killed launcher leaves no rank training and writing checkpoints.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from megaq.parallel.topology import LayoutError


DEFAULT_TIMEOUT_MINUTES = 10.0  # Megatron's --distributed-timeout-minutes default

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def group_timeout(minutes: float) -> timedelta:
    """--distributed-timeout-minutes as the timeout torch's process groups take."""
    return timedelta(seconds=float(minutes) * 60.0)


def die_with_parent(sig: int = signal.SIGKILL) -> str:
    """Have this process killed with `sig` when its parent (the launcher) dies.

    Linux: prctl(PR_SET_PDEATHSIG), then a re-check of the parent pid (the parent may
    have died before the call). Elsewhere: a daemon thread polling the parent pid once a
    second. Returns which mechanism is in place (for logs and tests)."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0:
                if os.getppid() != parent:  # orphaned before the request took effect
                    os.kill(os.getpid(), sig)
                return "prctl"
        except (OSError, AttributeError):
            pass

    def watch():
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os.kill(os.getpid(), sig)
                return
    threading.Thread(target=watch, name="megaq-parent-watch", daemon=True).start()
    return "thread"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env_from_slurm() -> None:
    """srun without torchrun (one task per GPU): RANK / WORLD_SIZE / LOCAL_RANK from
    slurm's SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID, unless a launcher set them."""
    env = os.environ
    if "RANK" not in env and "SLURM_PROCID" in env:
        env.setdefault("RANK", env["SLURM_PROCID"])
        env.setdefault("WORLD_SIZE", env["SLURM_NTASKS"])
        env.setdefault("LOCAL_RANK", env.get("SLURM_LOCALID", "0"))


def _gpu_of_local_rank(local_rank: int) -> int:
    """The CUDA device of this local rank: ``local_rank % visible GPUs``.

    Both slurm GPU bindings work: every task sees all the node's GPUs (local rank r
    takes GPU r), or the cluster binds one GPU per task (``--gpus-per-task=1``,
    ``--gpu-bind``: each task sees only its own, as device 0). A node with no GPU, or
    torchrun starting more ranks than the node shows GPUs (``LOCAL_WORLD_SIZE``, set by
    torchrun only), is a launch mistake said in one line, not CUDA's "invalid device
    ordinal" or NCCL's duplicate-GPU error."""
    count = torch.cuda.device_count()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 0))
    if count == 0 or local_world > count:
        raise LayoutError(f"local rank {local_rank} has no GPU: this node shows {count} CUDA "
                          f"device(s); start at most {count} rank(s) per node (torchrun "
                          f"--nproc-per-node), or pass --distributed-backend gloo to train on "
                          f"the CPU")
    return local_rank % count


def init_from_env(backend: str | None = None,
                  timeout_minutes: float = DEFAULT_TIMEOUT_MINUTES,
                  device: str | None = None) -> tuple[int, int]:
    """Initialise torch.distributed from torchrun/slurm variables (or as one rank).

    Returns (rank, world_size). Sets the CUDA device from the local rank: one GPU per
    rank with NCCL (local rank modulo the visible GPUs, :func:`_gpu_of_local_rank`); with gloo and ``device="cuda"`` the local ranks take the node's GPUs
    round-robin (gloo stages through host memory, so ranks may share one). A rank started
    by a launcher (torchrun, srun) dies with it (:func:`die_with_parent`); every process
    group gets `timeout_minutes`.
    """
    env = os.environ
    if "RANK" in env or "SLURM_PROCID" in env or "LOCAL_RANK" in env:
        die_with_parent()  # not for a plain `python pretrain_gpt.py` (nohup keeps working)
    rank_env_from_slurm()
    # One process without a launcher: rank 0 of 1, its group's store in the process (no
    # port: one picked free can be taken by another process before the store binds it),
    # and nothing written to the environment, which child processes would inherit
    alone = "RANK" not in env
    rank, world = (0, 1) if alone else (int(env["RANK"]), int(env["WORLD_SIZE"]))
    if backend is None:  # --device cpu on a GPU host: CPU ranks, so gloo
        backend = "nccl" if torch.cuda.is_available() and device != "cpu" else "gloo"
    local_rank = int(env.get("LOCAL_RANK", 0))
    if backend == "nccl":
        torch.cuda.set_device(_gpu_of_local_rank(local_rank))
    elif device == "cuda":
        require_cuda()
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    if not dist.is_initialized():
        store = {"store": dist.HashStore()} if alone else {}
        dist.init_process_group(backend, rank=rank, world_size=world,
                                timeout=group_timeout(timeout_minutes), **store)
    return rank, world


def require_cuda() -> None:
    """--device cuda: raise LayoutError when this node shows no CUDA device (command-line
    launches here, ranks set up in-process in megaq.pretrain._device)."""
    if not torch.cuda.is_available():
        raise LayoutError("--device cuda: this node shows no CUDA device; leave --device out to train on the CPU")


__all__ = ["require_cuda", "init_from_env", "die_with_parent", "group_timeout", "rank_env_from_slurm",
           "free_port"]
