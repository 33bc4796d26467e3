"""Starting ranks: from a launcher's environment, or N local processes on gloo.

`run_on_ranks` is the one helper every multi-rank test (and CPU benchmark) uses:
it forks N processes posing as `world_size / ranks_per_node` nodes, sets up any
TP x PP x DP layout, runs `fn(topo, *args)` on every rank and returns the results
in rank order (re-raising the first failure with the rank's traceback).

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

import contextlib
import ctypes
import io
import multiprocessing as mp
import os
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from megaq.parallel.topology import Layout, LayoutError, Topology, build_topology, check_hpz_size


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


def _worker(rank, world_size, layout_kw, hpz_size, init_file, fn, args, queue):
    try:
        # Forked children share the parent's OpenMP pool state; one thread each avoids
        # oversubscribing CI's 2 cores and the classic fork-after-OpenMP hang.
        torch.set_num_threads(1)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=world_size, timeout=group_timeout(2.0))
        topo = build_topology(Layout(world_size=world_size, **layout_kw), rank, hpz_size,
                              timeout=group_timeout(2.0))
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
    layout_kw = dict(tp=tp, pp=pp, ranks_per_node=ranks_per_node, order=order)
    check_hpz_size(Layout(world_size=world_size, **layout_kw), hpz_size)  # validate before forking
    # torch.optim, checkpointing and custom autograd Functions import torch._dynamo lazily
    # (seconds of CPU); importing it once here lets every forked rank inherit it.
    import torch._dynamo  # noqa: F401
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_worker,
                             args=(r, world_size, layout_kw, hpz_size, init_file, fn, args, queue))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        results: dict[int, object] = {}
        try:
            for _ in range(world_size):
                rank, ok, value = queue.get(timeout=timeout)
                if not ok:
                    raise RuntimeError(f"rank {rank} failed:\n{value}")
                # Not untrusted input, so not megaq.checkpoint.safe_unpickle's: these bytes come over a
                # pipe from a child this process forked a moment ago, running this
                # process's own code (fn's return value, any picklable object); no file and
                # no other user is in between. Every file megaq reads goes through
                # safe_unpickle (tests/test_safe_unpickle.py checks that no other code does).
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


def run_cli_on_ranks(entry, argv: list[str], world_size: int, *, env: dict | None = None,
                     timeout: float = 300.0, grace: float = 5.0, before=None,
                     on_start=None) -> dict:
    """Run a whole command-line program on `world_size` forked ranks, as torchrun would.

    Each rank gets torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
    MASTER_PORT), a session of its own, stdout/stderr in files, and runs
    ``os._exit(entry(argv))``. As torchrun's agent does, the launcher hosts the job's
    rendezvous store (TORCHELASTIC_USE_AGENT_STORE), so it outlives any rank. The
    launcher's failure policy is torchrun's: when a rank
    exits non-zero, the others get SIGTERM, then SIGKILL after `grace` seconds. Forking
    from a process that already imported torch and megaq makes a run take about a
    second, so tests can repeat races many times. `before()` runs in each rank before
    the program (e.g. a resource limit); `on_start(pids, outdir)` runs in the launcher
    once all ranks are started (fault injection; rank r writes outdir/r.out, r.err).
    Returns {"codes": [...], "stdout": str,
    "stderr": str, "seconds": float}, the outputs concatenated in rank order."""
    import torch._dynamo  # noqa: F401 - imported once here, inherited by every rank
    port = _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        pids = []
        for r in range(world_size):
            out, err = (os.path.join(tmp, f"{r}.{k}") for k in ("out", "err"))
            pid = os.fork()
            if pid == 0:  # the rank
                code = 1
                try:
                    os.setsid()
                    for fd, path in ((1, out), (2, err)):
                        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                        os.dup2(f, fd)
                        os.close(f)
                    sys.stdout = open(1, "w", closefd=False)
                    sys.stderr = open(2, "w", closefd=False)
                    os.environ.update({"RANK": str(r), "WORLD_SIZE": str(world_size),
                                       "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": str(world_size),
                                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                       "TORCHELASTIC_USE_AGENT_STORE": "True",
                                       "TORCHELASTIC_RESTART_COUNT": "0",
                                       "GLOO_SOCKET_IFNAME": "lo", **(env or {})})
                    torch.set_num_threads(1)
                    if before is not None:
                        before()
                    code = entry(argv)
                except BaseException:  # noqa: BLE001 - a crash is reported as the traceback
                    traceback.print_exc()
                finally:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(code if isinstance(code, int) else 1)
            pids.append(pid)
        # the agent's store (after the forks: no child inherits its server); the ranks'
        # clients retry until it listens
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=True,
                              wait_for_workers=False)
        if on_start is not None:
            on_start(list(pids), tmp)
        t0 = time.monotonic()
        codes: dict[int, int] = {}
        killed_at = None
        while len(codes) < world_size:
            for r, pid in enumerate(pids):
                if r in codes:
                    continue
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[r] = os.waitstatus_to_exitcode(status)
                    if codes[r] != 0 and killed_at is None:  # torchrun's policy
                        killed_at = time.monotonic()
                        for q, other in enumerate(pids):
                            if q not in codes:
                                with contextlib.suppress(ProcessLookupError):
                                    os.kill(other, signal.SIGTERM)
            now = time.monotonic()
            if (killed_at is not None and now - killed_at > grace) or now - t0 > timeout:
                for q, other in enumerate(pids):
                    if q not in codes:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(other, signal.SIGKILL)
            time.sleep(0.02)
        seconds = time.monotonic() - t0
        del store

        def read(k):
            return "".join(open(os.path.join(tmp, f"{r}.{k}"), errors="replace").read()
                           for r in range(world_size))
        return {"codes": [codes[r] for r in range(world_size)], "stdout": read("out"),
                "stderr": read("err"), "seconds": seconds}


def _gpu_of_local_rank(local_rank: int) -> int:
    """The CUDA device of this local rank; a node started with more ranks than it has
    GPUs is a launch mistake, said in one line (not CUDA's "invalid device ordinal")."""
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise LayoutError(f"local rank {local_rank} has no GPU: this node shows {count} CUDA "
                          f"device(s); start at most {count} rank(s) per node (torchrun "
                          f"--nproc-per-node), or pass --distributed-backend gloo to train on "
                          f"the CPU")
    return local_rank


def init_from_env(backend: str | None = None,
                  timeout_minutes: float = DEFAULT_TIMEOUT_MINUTES,
                  device: str | None = None) -> tuple[int, int]:
    """Initialise torch.distributed from torchrun/slurm variables (or as one rank).

    Returns (rank, world_size). Sets the CUDA device from the local rank: one GPU per
    rank with NCCL; with gloo and ``device="cuda"`` the local ranks take the node's GPUs
    round-robin (gloo stages through host memory, so ranks may share one). A rank started
    by a launcher (torchrun, srun) dies with it (:func:`die_with_parent`); every process
    group gets `timeout_minutes`.
    """
    env = os.environ
    if "RANK" in env or "SLURM_PROCID" in env or "LOCAL_RANK" in env:
        die_with_parent()  # not for a plain `python pretrain_gpt.py` (nohup keeps working)
    rank_env_from_slurm()
    if "RANK" not in env:
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(_free_port()))
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    if backend is None:  # --device cpu on a GPU host: CPU ranks, so gloo
        backend = "nccl" if torch.cuda.is_available() and device != "cpu" else "gloo"
    local_rank = int(env.get("LOCAL_RANK", 0))
    if backend == "nccl":
        torch.cuda.set_device(_gpu_of_local_rank(local_rank))
    elif device == "cuda":
        require_cuda()
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    if not dist.is_initialized():
        dist.init_process_group(backend, rank=rank, world_size=world,
                                timeout=group_timeout(timeout_minutes))
    return rank, world


def require_cuda() -> None:
    """--device cuda: raise LayoutError when this node shows no CUDA device (command-line
    launches here, ranks set up in-process in megaq.pretrain._device)."""
    if not torch.cuda.is_available():
        raise LayoutError("--device cuda: this node shows no CUDA device; leave --device out to train on the CPU")


__all__ = ["run_on_ranks", "require_cuda", "run_cli_on_ranks", "init_from_env", "die_with_parent", "group_timeout",
           "Topology"]
