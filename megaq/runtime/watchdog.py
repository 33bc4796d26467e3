"""A hang watchdog: a thread per rank that ends the process when training stops moving.

A rank that waits forever (a peer stopped or wedged, a deadlocked collective, a
stuck filesystem) is otherwise silent until the process-group timeout, and some
waits (a hung NFS read, a spinning kernel) are not collectives at all. The training
loop calls :func:`beat` after every iteration; when no beat comes within the bound,
the watchdog prints, to stderr, one ``error:`` line with the rank, the last completed
iteration, the last collective this rank entered (``comm.LAST_ENTERED``) and how
long ago, then a Python stack dump of every thread (``faulthandler``), and exits the
process with :data:`EXIT_CODE`. The launcher then ends the job.

The bound is ``--hang-timeout-minutes`` when given. Otherwise it adapts: ``FACTOR``
times the slowest interval between two beats so far (saves and evaluations
included, since they run between beats), never below ``FLOOR_MINUTES``; before
the first iteration completes (compilation, first collectives) it is the floor.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time

EXIT_CODE = 124          # as timeout(1): the process was ended for taking too long
FLOOR_MINUTES = 10.0     # default bound's floor (also Megatron's default process-group timeout)
FACTOR = 5.0             # default bound: this many times the slowest iteration so far


class Watchdog:
    def __init__(self, rank: int, timeout_minutes: float | None = None,
                 floor_minutes: float = FLOOR_MINUTES, factor: float = FACTOR):
        self.rank = rank
        self.fixed = None if timeout_minutes is None else float(timeout_minutes) * 60.0
        self.floor = float(floor_minutes) * 60.0
        self.factor = float(factor)
        self.iteration: int | None = None
        self.slowest = 0.0
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def bound_seconds(self) -> float:
        if self.fixed is not None:
            return self.fixed
        return max(self.floor, self.factor * self.slowest)

    def beat(self, iteration: int) -> None:
        now = time.monotonic()
        self.slowest = max(self.slowest, now - self._last)
        self._last = now
        self.iteration = iteration

    def start(self) -> "Watchdog":
        self._last = time.monotonic()
        self._thread = threading.Thread(target=self._watch, name="megaq-hang-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.is_set():
            bound = self.bound_seconds()
            self._stop.wait(min(1.0, max(0.05, bound / 20.0)))
            if self._stop.is_set():
                return
            waited = time.monotonic() - self._last
            if waited > bound:
                self._abort(waited, bound)

    def diagnosis(self, waited: float, bound: float) -> str:
        from megaq.parallel import comm
        what, when = comm.LAST_ENTERED[0], comm.LAST_ENTERED[1]
        last = (f"{what}, entered {time.time() - when:.1f} s ago" if what else "none yet")
        it = "none yet" if self.iteration is None else str(self.iteration)
        how = ("--hang-timeout-minutes" if self.fixed is not None else
               f"{self.factor:g} x the slowest iteration ({self.slowest:.1f} s), at least "
               f"{self.floor / 60:g} min; set --hang-timeout-minutes to change it")
        return (f"[rank {self.rank}] error: hang watchdog: no iteration completed for "
                f"{waited:.1f} s (bound {bound:.1f} s: {how}); last completed iteration: {it}; "
                f"last collective entered: {last}; a peer may be stopped, dead or stuck. "
                f"Stacks of every thread of rank {self.rank} (pid {os.getpid()}) follow; aborting")

    def _abort(self, waited: float, bound: float) -> None:
        err = sys.stderr if _has_fileno(sys.stderr) else sys.__stderr__
        try:
            print(self.diagnosis(waited, bound), file=err, flush=True)
            faulthandler.dump_traceback(file=err, all_threads=True)
            err.flush()
            from megaq.runtime import peers
            peers.mark_left(EXIT_CODE)  # the peers' roll call: this rank left on purpose
        finally:
            os._exit(EXIT_CODE)


def _has_fileno(f) -> bool:
    try:
        f.fileno()
        return True
    except Exception:  # noqa: BLE001 - captured / replaced streams
        return False


_current: Watchdog | None = None


def start(rank: int, timeout_minutes: float | None = None) -> Watchdog:
    """Start this process's watchdog (replacing a previous one)."""
    global _current
    stop()
    _current = Watchdog(rank, timeout_minutes).start()
    return _current


def beat(iteration: int) -> None:
    """An iteration completed (called by the training loop)."""
    if _current is not None:
        _current.beat(iteration)


def stop() -> None:
    global _current
    if _current is not None:
        _current.stop()
        _current = None
