"""Starting ranks: from a launcher's environment, or N local processes on gloo.

`run_on_ranks` is the one helper every multi-rank test (and CPU benchmark) uses:
it forks N processes posing as `world_size / ranks_per_node` nodes, sets up any
TP x PP x DP layout, runs `fn(topo, *args)` on every rank and returns the results
in rank order (re-raising the first failure with the rank's traceback).
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import socket
import tempfile
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from megaq.parallel.topology import Layout, Topology, build_topology


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dumps(obj) -> bytes:
    # Serialise ourselves rather than let torch share tensor storage through fds,
    # which breaks when the child exits before the parent unpickles.
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _worker(rank, world_size, layout_kw, init_file, fn, args, queue):
    try:
        # Forked children share the parent's OpenMP pool state; one thread each avoids
        # oversubscribing CI's 2 cores and the classic fork-after-OpenMP hang.
        torch.set_num_threads(1)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=120))
        topo = build_topology(Layout(world_size=world_size, **layout_kw), rank)
        from megaq.parallel import comm
        comm.STATS.reset()
        result = fn(topo, *args)
        queue.put((rank, True, _dumps(result)))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - report anything to the parent
        queue.put((rank, False, traceback.format_exc()))


def run_on_ranks(fn, world_size: int, *, tp: int = 1, pp: int = 1,
                 ranks_per_node: int | None = None, hpz_size: int = 1, order: str = "tp-dp-pp",
                 args: tuple = (),
                 timeout: float = 300.0) -> list:
    """Run fn(topo, *args) on `world_size` gloo ranks; return per-rank results.

    fn and its results must be picklable only when the start method is not fork.
    """
    layout_kw = dict(tp=tp, pp=pp, ranks_per_node=ranks_per_node, hpz_size=hpz_size, order=order)
    Layout(world_size=world_size, **layout_kw)  # validate before forking
    # torch.optim, checkpointing and custom autograd Functions import torch._dynamo lazily
    # (seconds of CPU); importing it once here lets every forked rank inherit it.
    import torch._dynamo  # noqa: F401
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_worker,
                             args=(r, world_size, layout_kw, init_file, fn, args, queue))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        results: dict[int, object] = {}
        try:
            for _ in range(world_size):
                rank, ok, value = queue.get(timeout=timeout)
                if not ok:
                    raise RuntimeError(f"rank {rank} failed:\n{value}")
                results[rank] = torch.load(io.BytesIO(value), weights_only=False)
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
    return [results[r] for r in range(world_size)]


def rank_env_from_slurm() -> None:
    """srun without torchrun (one task per GPU): RANK / WORLD_SIZE / LOCAL_RANK from
    slurm's SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID, unless a launcher set them."""
    env = os.environ
    if "RANK" not in env and "SLURM_PROCID" in env:
        env.setdefault("RANK", env["SLURM_PROCID"])
        env.setdefault("WORLD_SIZE", env["SLURM_NTASKS"])
        env.setdefault("LOCAL_RANK", env.get("SLURM_LOCALID", "0"))


def init_from_env(backend: str | None = None) -> tuple[int, int]:
    """Initialise torch.distributed from torchrun/slurm variables (or as one rank).

    Returns (rank, world_size). Sets the CUDA device from the local rank.
    """
    env = os.environ
    rank_env_from_slurm()
    if "RANK" not in env:
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(_free_port()))
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(env.get("LOCAL_RANK", 0)))
    if not dist.is_initialized():
        dist.init_process_group(backend, rank=rank, world_size=world,
                                timeout=timedelta(minutes=30))
    return rank, world


__all__ = ["run_on_ranks", "init_from_env", "Topology"]
