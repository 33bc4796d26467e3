"""Local ranks for tests and tools: N forked gloo processes posing as several nodes.

* :func:`run_on_ranks` is the one helper every multi-rank test (and CPU benchmark) uses:
  it forks N processes posing as `world_size / ranks_per_node` nodes, sets up any
  TP x PP x DP layout, runs `fn(topo, *args)` on every rank and returns the results in
  rank order (re-raising the first failure with the rank's traceback).
* :func:`run_cli_on_ranks` runs a whole command-line program on forked ranks as torchrun
  would (its environment, its agent's store, its failure policy): the reliability tests'
  launcher.

Nothing in the library imports this package (tests/test_import_layers.py: it is the top
layer).
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import importlib
import io
import multiprocessing as mp
import os
import queue as queue_mod
import signal
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist

from megaq.kernels.dispatch import register_compiled_ops
from megaq.parallel import comm
from megaq.parallel.launch import free_port, group_timeout
from megaq.parallel.topology import Layout, build_topology, check_hpz_size

RANK_GROUP_TIMEOUT = group_timeout(2.0)  # every group of a run_on_ranks job: a hung test fails


def _dumps(obj) -> bytes:
    # Serialise ourselves rather than let torch share tensor storage through fds,
    # which breaks when the child exits before the parent unpickles.
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _stacks_file(tmp: str, rank: int) -> str:
    return os.path.join(tmp, f"stacks.{rank}")


def forked_child() -> None:
    """First thing in a forked rank: never collect what the parent left behind.

    The parent's uncollected garbage comes along with the fork. A gloo process group in
    it (left in a reference cycle by an in-process run) has a C++ destructor that joins
    the group's worker threads: in the child those threads do not exist, so a
    collection that reaches it blocks for ever (seen as a rank stuck in "Garbage-collecting" while
    building its model). Freezing moves every inherited object out of the collector's
    reach; the child's own objects are collected as usual, and the parent collects its
    garbage itself, where its threads are. Every forked child that runs Python work
    calls this (here, and the tests' own forks)."""
    gc.freeze()


def _worker(rank, world_size, layout_kw, hpz_size, init_file, fn, args, queue):
    forked_child()
    # a rank that never reports has its Python stacks dumped here on SIGUSR1, so a hang
    # fails with where every silent rank stood (run_on_ranks), not a bare queue timeout
    stacks = open(_stacks_file(os.path.dirname(init_file), rank), "w")
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    try:
        # Forked children share the parent's OpenMP pool state; one thread each avoids
        # oversubscribing CI's 2 cores and the classic fork-after-OpenMP hang.
        torch.set_num_threads(1)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=world_size, timeout=RANK_GROUP_TIMEOUT)
        topo = build_topology(Layout(world_size=world_size, **layout_kw), rank, hpz_size,
                              timeout=RANK_GROUP_TIMEOUT)
        comm.STATS.reset()
        result = fn(topo, *args)
        queue.put((rank, True, _dumps(result)))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - report anything to the parent
        queue.put((rank, False, traceback.format_exc()))


def _import_before_fork() -> None:
    """What ranks import lazily at seconds of CPU each, imported once here and inherited
    by every forked rank: torch._dynamo (torch.optim, checkpointing and custom autograd
    Functions import it) and, with the ops compiled blocks trace, torch._inductor
    (megaq.kernels.dispatch.register_compiled_ops)."""
    importlib.import_module("torch._dynamo")
    register_compiled_ops()


def run_on_ranks(fn, world_size: int, *, tp: int = 1, pp: int = 1,
                 ranks_per_node: int | None = None, hpz_size: int = 1, order: str = "tp-dp-pp",
                 args: tuple = (),
                 timeout: float = 300.0) -> list:
    """Run fn(topo, *args) on `world_size` gloo ranks; return per-rank results.

    fn and its results must be picklable only when the start method is not fork.
    """
    layout_kw = dict(tp=tp, pp=pp, ranks_per_node=ranks_per_node, order=order)
    check_hpz_size(Layout(world_size=world_size, **layout_kw), hpz_size)  # validate before forking
    _import_before_fork()
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
        deadline = time.monotonic() + timeout
        failed = True
        try:
            for _ in range(world_size):
                try:
                    rank, ok, value = queue.get(timeout=max(deadline - time.monotonic(), 0.1))
                except queue_mod.Empty:
                    raise TimeoutError(_silent_ranks_report(procs, results, tmp, timeout)) from None
                if not ok:
                    raise RuntimeError(f"rank {rank} failed:\n{value}")
                # Not untrusted input, so not megaq.checkpoint.safe_unpickle's: these bytes come over a
                # pipe from a child this process forked a moment ago, running this
                # process's own code (fn's return value, any picklable object); no file and
                # no other user is in between. Every file megaq reads goes through
                # safe_unpickle (tests/test_safe_unpickle.py checks that no other code does).
                results[rank] = torch.load(io.BytesIO(value), weights_only=False)
            failed = False
        finally:
            # Ranks that reported are exiting: give them time. After a failed or silent
            # rank the others wait in a collective that never completes: end them now.
            for p in procs:
                p.join(timeout=0 if failed else 30)
                if p.is_alive():
                    p.kill()
                    p.join()
    return [results[r] for r in range(world_size)]


def _silent_ranks_report(procs, results: dict, tmp: str, timeout: float) -> str:
    """Which ranks reported nothing within the timeout, and the Python stacks of those
    still alive (faulthandler, armed in _worker), for the failure message."""
    silent = [r for r in range(len(procs)) if r not in results]
    alive = [r for r in silent if procs[r].is_alive()]
    for r in alive:
        with contextlib.suppress(ProcessLookupError):
            os.kill(procs[r].pid, signal.SIGUSR1)
    time.sleep(1.0)  # faulthandler writes from the signal handler; give it a moment
    lines = [f"rank(s) {silent} reported nothing within {timeout:.0f} s "
             f"(alive: {alive}; exit codes of the others: "
             f"{ {r: procs[r].exitcode for r in silent if r not in alive} })"]
    for r in alive:
        with contextlib.suppress(OSError), open(_stacks_file(tmp, r)) as f:
            lines.append(f"--- rank {r}'s stacks ---\n{f.read().rstrip()}")
    return "\n".join(lines)


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
    _import_before_fork()
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        pids = []
        for r in range(world_size):
            out, err = (os.path.join(tmp, f"{r}.{k}") for k in ("out", "err"))
            pid = os.fork()
            if pid == 0:  # the rank
                forked_child()
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
