"""Which peer is gone: a roll call over the job's rendezvous store after a collective fails.

When one rank's process ends (kill -9, a crash, its node lost), the backend fails the
collective on the others ("Connection closed by peer [addr]:port", or a timeout when a
peer is silent): the error names a socket address at best, never a rank. The ranks
ask the one party every rank still talks to, the rendezvous store of the launch
(``MASTER_ADDR:MASTER_PORT``: torchrun's agent, or rank 0 when there is no agent):

* At start (:func:`start`, command-line launches) each rank writes its host name
  there (one store write, no collective) and keeps a second connection to it with a
  thread blocked on one key, the roll call. The thread needs no CPU and does not
  depend on the main thread, which may be computing or blocked in a collective.
* The first rank whose collective fails calls the roll (:func:`roll_call`): every
  rank's thread answers at once; a rank that is leaving on purpose (it printed its own
  error, or the launcher stopped it) has already marked itself so (:func:`mark_left`).
  Whoever has neither answered nor left after :data:`ROLL_CALL_SECONDS` is lost. The
  first verdict is stored and every later caller reads it, so all survivors name the
  same ranks.
* When the store itself does not answer, the process hosting it is the one gone:
  rank 0 without torchrun, or the first node's launcher.

Why not the backend's error text: gloo names a socket address, which maps to a host at
best (ranks of one node share it), and a survivor may fail on a peer that is alive but
was itself leaving. Why not heartbeats: a dead rank is then found only a period later,
and a busy rank can miss one. The roll call costs nothing until a collective fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

ROLL_CALL_SECONDS = 2.0  # how long a live rank has to answer (its thread answers in ms)
STORE_TIMEOUT_SECONDS = 5.0  # a store operation that takes longer: the store is gone
_WAIT_SECONDS = 24 * 3600.0  # the answering thread's wait, renewed until the job ends


@dataclass
class Verdict:
    """What the roll call found. `lost`: ranks that neither answered nor left; `left`:
    {rank: exit code} of ranks that left on purpose; `hosts` / `nodes`: where the lost
    ranks ran; `store_error`: the store did not answer (then nothing else is known)."""

    lost: list[int] = field(default_factory=list)
    left: dict[int, int] = field(default_factory=dict)
    hosts: dict[int, str] = field(default_factory=dict)
    nodes: dict[int, int] = field(default_factory=dict)
    store_error: str | None = None
    store_address: str = ""


class PeerWatch:
    def __init__(self, rank: int, world_size: int, node_of, host: str, port: int):
        import torch.distributed as dist

        self.rank, self.world_size, self.node_of = rank, world_size, node_of
        self.address = f"{host}:{port}"
        # torchrun's agent hosts the store (it outlives every rank); without one, rank 0 does
        self.agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        run = os.environ.get("TORCHELASTIC_RUN_ID", "")
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.prefix = f"megaq/peers/{run}/{restart}"
        timeout = timedelta(seconds=STORE_TIMEOUT_SECONDS)

        def client():
            return dist.TCPStore(host, port, is_master=False, timeout=timeout,
                                 wait_for_workers=False)

        self._ask = client()      # the main thread's: host record, roll call, leaving mark
        self._listen = client()   # the answering thread's, blocked in wait()
        self._ask.set(self._key("host", rank), socket.gethostname())
        self._left = False
        self._store_gone = False  # a roll call found the store gone: no more store calls
        self._lock = threading.RLock()  # mark_left may run in a signal handler of its own thread
        threading.Thread(target=self._answer, name="megaq-peer-watch", daemon=True).start()

    def _key(self, *parts) -> str:
        return "/".join((self.prefix, *map(str, parts)))

    def _status(self, store, value: str) -> None:
        """Record this rank's status once (the first of "here" / "left:CODE" wins) and
        count it, so that the caller of the roll sees when every rank has one."""
        if store.compare_set(self._key("status", self.rank), "", value).decode() == value:
            store.add(self._key("answered"), 1)

    def _answer(self) -> None:
        with contextlib.suppress(Exception):  # the store gone: nobody calls the roll any more
            while True:
                try:
                    self._listen.wait([self._key("rollcall")], timedelta(seconds=_WAIT_SECONDS))
                    break
                except Exception as e:  # noqa: BLE001 - a timeout: wait again; else give up
                    if "timeout" not in str(e).lower() and "timed out" not in str(e).lower():
                        return
            self._status(self._listen, "here")

    def mark_left(self, code: int) -> None:
        """This rank is leaving on purpose (exit `code`): a roll call does not count it lost."""
        with self._lock:
            if self._left or self._store_gone:
                return
            self._left = True
        with contextlib.suppress(Exception):
            self._status(self._ask, f"left:{int(code)}")

    def roll_call(self, seconds: float = ROLL_CALL_SECONDS) -> Verdict:
        """Call the roll (or read the verdict a peer stored); see the module's docstring."""
        s, verdict_key = self._ask, self._key("lost")
        try:
            if not s.check([verdict_key]):
                s.set(self._key("rollcall"), "1")
                deadline = time.monotonic() + seconds
                while time.monotonic() < deadline and not s.check([verdict_key]):
                    if int(s.add(self._key("answered"), 0)) >= self.world_size:
                        break  # every rank answered or left: nobody is lost
                    time.sleep(0.02)
                if not s.check([verdict_key]):
                    missing = [r for r in range(self.world_size)
                               if not s.check([self._key("status", r)])]
                    if missing:
                        s.compare_set(verdict_key, "", json.dumps(missing))
            lost = json.loads(s.get(verdict_key)) if s.check([verdict_key]) else []
            left = {}
            for r in range(self.world_size):
                k = self._key("status", r)
                if r not in lost and s.check([k]):
                    value = s.get(k).decode()
                    if value.startswith("left:"):
                        left[r] = int(value[5:])
            hosts = {r: s.get(self._key("host", r)).decode() for r in lost
                     if s.check([self._key("host", r)])}
            s.add(self._key("done"), 1)  # this rank has its verdict (see linger)
        except Exception as e:  # noqa: BLE001 - the store's host is gone
            self._store_gone = True
            verdict = Verdict(store_error=f"{type(e).__name__}: {e}".splitlines()[0],
                              store_address=self.address)
            if not self.agent_store:  # rank 0 hosted it: rank 0 is the one gone
                verdict.lost, verdict.nodes = [0], {0: self.node_of(0)}
                verdict.hosts = {0: self.address.rsplit(":", 1)[0]}
            return verdict
        return Verdict(lost=lost, left=left, hosts=hosts,
                       nodes={r: self.node_of(r) for r in lost}, store_address=self.address)

    def linger(self, verdict: Verdict, seconds: float = ROLL_CALL_SECONDS + 2.0) -> None:
        """Rank 0 hosting the store (no torchrun agent): stay until every other survivor
        has its verdict (or `seconds` pass), so that the store outlives their roll call."""
        if self.agent_store or self.rank != 0 or verdict.store_error:
            return
        expect = self.world_size - len(verdict.lost) - len(verdict.left)
        deadline = time.monotonic() + seconds
        with contextlib.suppress(Exception):
            while (time.monotonic() < deadline
                   and int(self._ask.add(self._key("done"), 0)) < expect):
                time.sleep(0.02)


_watch: PeerWatch | None = None


def start(rank: int, world_size: int, node_of) -> PeerWatch | None:
    """Start this process's watch (ranks started by a launcher, MASTER_ADDR/PORT set;
    every rank calls it). Without a store to reach it does nothing: a lost rank is
    then reported without its number."""
    global _watch
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if world_size < 2 or not host or not port:
        return None
    with contextlib.suppress(Exception):
        _watch = PeerWatch(rank, world_size, node_of, host, int(port))
    return _watch


def current() -> PeerWatch | None:
    return _watch


def mark_left(code: int) -> None:
    """This rank leaves on purpose, with exit `code` (see PeerWatch.mark_left)."""
    if _watch is not None:
        _watch.mark_left(code)


def roll_call() -> Verdict | None:
    """The verdict (see PeerWatch.roll_call), None when no watch runs in this process."""
    return _watch.roll_call() if _watch is not None else None


def linger(verdict: Verdict | None) -> None:
    """See PeerWatch.linger (a no-op without a watch)."""
    if _watch is not None and verdict is not None:
        _watch.linger(verdict)
