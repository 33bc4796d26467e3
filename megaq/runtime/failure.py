"""How a failure reaches the user, from whichever rank finds it.

Two kinds of failure, two ways of reporting:

* **A rank's own failure** (bad data it alone reads, a flag it alone rejects): that
  rank prints ``[rank N] error: <message>`` to stderr, flushed, the moment the error is
  caught, before anything else can happen. The other ranks may be blocked in a
  collective; once this rank exits, the launcher (torchrun) stops them. Printing
  first is what makes the line survive: torchrun's SIGTERM only comes after the exit.

* **A failure the ranks agree on** (:func:`agreed`): every rank runs the same block (for
  example a checkpoint load, where each rank reads its own files), then one small
  collective tells every rank whether any of them failed and why. Every rank then
  raises :class:`AgreedError` with the same message (the lowest failing rank's),
  rank 0 prints the one ``error:`` line, and the others wait for it at a barrier
  before they exit, so no SIGTERM can cut rank 0 off mid-print. An error class that
  every rank raises together because it follows from a collective result (class
  attribute ``agreed = True``: megaq.training.TrainingDiverged) is reported the same way.

* **A peer that vanished** (:func:`report_collective_failure`): a collective fails on
  the survivors (megaq.parallel.comm.CollectiveFailed). Every surviving rank prints one
  line naming the lost rank(s) with their node and host (a roll call over the job's
  store: megaq.runtime.peers), the phase and group of the collective and the last
  completed iteration, and exits with :data:`PEER_LOST_EXIT`. The backend's traceback
  goes to a per-rank log file whose path the line gives (:func:`log_path`), not to the
  terminal. When the peer left on purpose (it printed its own error line first), the
  survivors exit quietly with its exit code: the job shows one error line.
  The launcher stops the survivors with SIGTERM as soon as it notices the death, often
  before their own collectives fail; :func:`install_sigterm_grace` gives a rank
  :data:`SIGTERM_GRACE_SECONDS` to name the lost peer before it ends as SIGTERM would.

`report()` is what the command-line entry calls in its ``except`` clause.
"""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import sys
import tempfile
import threading
import traceback

PEER_LOST_EXIT = 1             # a survivor of a lost peer (not a user mistake: 2 is those)
SIGTERM_GRACE_SECONDS = 4.0    # > the roll call (megaq.runtime.peers.ROLL_CALL_SECONDS)
_reporting = threading.Event()  # this rank is reporting a lost peer: SIGTERM must wait


class AgreedError(RuntimeError):
    """Raised on every rank after a collective check found a failure on some rank.

    `origin_rank` found it; `kind` is the original exception's type name. Rank 0 prints
    the line for everyone (see :func:`report`)."""

    def __init__(self, message: str, origin_rank: int, kind: str, world_size: int):
        super().__init__(message)
        self.origin_rank, self.kind, self.world_size = origin_rank, kind, world_size


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text or type(e).__name__


def error_line(e: BaseException, rank: int, world_size: int) -> str:
    """The ``error:`` line for `e` as rank `rank` prints it (no rank prefix on one rank,
    nor for an agreed error, which rank 0 prints once for all)."""
    msg = _one_line(e)
    if isinstance(e, AgreedError):
        if e.world_size > 1 and e.origin_rank != 0:
            msg = f"{msg} (found on rank {e.origin_rank})"
        return f"error: {msg}"
    if is_agreed(e):
        return f"error: {msg}"
    prefix = f"[rank {rank}] " if world_size > 1 else ""
    return f"{prefix}error: {msg}"


def is_agreed(e: BaseException) -> bool:
    """An AgreedError, or an error class that every rank raises together because it
    follows from a collective result (class attribute ``agreed = True``, e.g.
    megaq.training.TrainingDiverged, decided on the all-reduced loss)."""
    return isinstance(e, AgreedError) or getattr(e, "agreed", False) is True


def report(e: BaseException, rank: int, world_size: int, group=None) -> None:
    """Print `e`'s one ``error:`` line to stderr, flushed, as the rules above say.

    For an :class:`AgreedError`, rank 0 prints, then all ranks meet at a barrier of
    `group` (a megaq.parallel.comm.Group, or the default group) so that the others
    exit only after rank 0's line is out."""
    agreed = is_agreed(e)
    if not agreed or rank == 0:
        print(error_line(e, rank, world_size), file=sys.stderr, flush=True)
    if agreed and world_size > 1:
        with contextlib.suppress(Exception):  # a dead peer: nothing left to wait for
            from megaq.parallel import comm
            comm.barrier(group)


def current_rank_and_world() -> tuple[int, int]:
    """(rank, world size) from torch.distributed when initialised, else the launcher's env."""
    with contextlib.suppress(Exception):
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def _gather(group, local) -> list:
    """Every member's small picklable `local`, in member order (one all_gather_object)."""
    import torch.distributed as dist
    if group is None or group.size == 1 or not dist.is_initialized():
        return [local]
    from megaq.parallel import comm
    return comm._gather_objects(group, local)  # the collective layer's object gather


@contextlib.contextmanager
def agreed(group, catch: tuple = (Exception,), on_failure=None):
    """Run the block on every member of `group`, then agree on its outcome.

    If the block raised one of `catch` on any rank, every rank raises
    :class:`AgreedError` with the lowest failing rank's message (after calling
    `on_failure()` if given, e.g. to delete a half-written directory). The block must
    not itself enter collectives that a failing rank would skip (a rank that failed
    halfway would leave its peers waiting there); file reads and writes are the use.
    Other exceptions (bugs, KeyboardInterrupt) propagate on the rank that raised them.
    On success the exchange doubles as a barrier."""
    failure = None
    try:
        yield
    except catch as e:  # noqa: PERF203 - one block
        # an inner block's agreed failure passes through naming the rank that found it
        failure = ((e.kind, _one_line(e), e.origin_rank) if isinstance(e, AgreedError)
                   else (type(e).__name__, _one_line(e), None))
    outcomes = _gather(group, failure)
    failed = [(i, f) for i, f in enumerate(outcomes) if f is not None]
    if not failed:
        return
    if on_failure is not None:
        with contextlib.suppress(Exception):
            on_failure()
    index, (kind, message, origin) = failed[0]
    if origin is None:
        origin = group.ranks[index] if group is not None else 0
    raise AgreedError(message, origin, kind, group.size if group is not None else 1)


def exit_now(code: int, line: str | None = None) -> None:
    """Print `line` (if any) to stderr, flush both streams and leave at once (no
    interpreter finalisation: other threads may be blocked in a collective). The peers
    learn that this rank left on purpose (megaq.runtime.peers.mark_left).

    Called from signal handlers (a second Ctrl-C): the handler may run while the main
    thread is inside a write to stderr (a write blocked on a full pipe runs the handler
    when the signal interrupts it), and stderr's buffered writer then refuses a second
    write with RuntimeError("reentrant call"), which ended the rank with exit code 1 and
    no line (seen under load, tests/test_reliability.py::test_second_ctrl_c_exits_at_once).
    So the line goes straight to file descriptor 2, past the buffer; a stderr without
    one (a test's capture) gets it through print."""
    if line:
        _stderr_line(line)
    with contextlib.suppress(Exception):
        from megaq.runtime import peers
        peers.mark_left(code)
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def _stderr_line(line: str) -> None:
    """`line` on stderr, written to its file descriptor (no lock a signal handler could
    meet held), after whatever the buffer held; print where stderr has no descriptor."""
    with contextlib.suppress(Exception):  # a reentrant flush fails: the line goes on anyway
        sys.stderr.flush()
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both
        print(line, file=sys.stderr, flush=True)
        return
    data = (line + "\n").encode(errors="replace")
    while data:
        try:
            data = data[os.write(fd, data):]
        except OSError:
            return


# ------------------------------------------------------------------- a lost peer
def install_sigterm_grace() -> None:
    """SIGTERM (the launcher stopping this rank, usually because a peer died) gives this
    rank SIGTERM_GRACE_SECONDS to find out and name the lost peer itself (its next
    collective fails within milliseconds of a death) before it ends as SIGTERM would.
    The rank marks itself as leaving at once, so that roll calls do not count it lost.
    A second SIGTERM ends it at once. Main thread only (a signal handler)."""
    with contextlib.suppress(ValueError):  # not the main thread (an embedding caller): skip
        signal.signal(signal.SIGTERM, _on_sigterm)


def _on_sigterm(signum, frame) -> None:  # noqa: ARG001 - signal API
    if _reporting.is_set():
        return  # this rank is naming a lost peer; it exits right after
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends it at once
    with contextlib.suppress(Exception):
        from megaq.runtime import peers
        peers.mark_left(128 + signal.SIGTERM)

    def end():
        if not _reporting.is_set():
            os.kill(os.getpid(), signal.SIGTERM)
    timer = threading.Timer(SIGTERM_GRACE_SECONDS, end)
    timer.daemon = True
    timer.start()


def log_path(rank: int, what: str) -> str:
    """A new per-rank log file for `what`, in $MEGAQ_LOG_DIR, else in a directory of this
    user's under the temporary directory (made private; never through a link)."""
    base = os.environ.get("MEGAQ_LOG_DIR") or os.path.join(tempfile.gettempdir(),
                                                            f"megaq-{os.getuid()}")
    os.makedirs(base, mode=0o700, exist_ok=True)
    st = os.lstat(base)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():  # someone else's, or a link
        base = tempfile.mkdtemp(prefix="megaq-")
    return os.path.join(base, f"{what}.rank{rank:05d}.pid{os.getpid()}.log")


def _write_log(path: str, line: str, e: BaseException) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(line + "\n\n" + "".join(traceback.format_exception(e)))


def _ranks_where(verdict) -> str:
    parts = []
    for r in verdict.lost:
        host = verdict.hosts.get(r)
        parts.append(f"{r} (node {verdict.nodes.get(r)}{f', host {host}' if host else ''})")
    return ("rank " if len(parts) == 1 else "ranks ") + ", ".join(parts)


def collective_failure_line(e, rank: int, verdict, log: str | None) -> str | None:
    """The line for CollectiveFailed `e` on `rank` given the roll call's `verdict`
    (None: no watch), or None when the peer left on purpose (nothing to add)."""
    where = f"in {e.phase} on {e.group.describe()}"
    where += (f" after iteration {e.iteration}" if e.iteration is not None
              else " outside the training loop")
    how = ("it stopped answering (no reply within the process-group timeout, nor to the roll "
           "call)" if e.timed_out else "its process ended (the connection to it closed)")
    if verdict is None:
        what = (f"lost a peer {where}: {how}; which rank is not known (no launcher store to ask: "
                f"start the job with torchrun or srun)")
    elif verdict.store_error and verdict.lost:  # rank 0 hosted the store (no torchrun agent)
        what = (f"lost {_ranks_where(verdict)} {where}: its process ended, and with it the job's "
                f"rendezvous store it hosted ({verdict.store_address}: {verdict.store_error})")
    elif verdict.store_error:
        what = (f"lost a peer {where}, and the job's rendezvous store at {verdict.store_address} "
                f"(torchrun's agent on the first node) does not answer either "
                f"({verdict.store_error}): that node or its launcher is gone")
    elif verdict.lost:
        what = f"lost {_ranks_where(verdict)} {where}: {how}"
    elif verdict.left:
        return None  # that rank printed its own error and left: the job has its one line
    else:
        what = (f"a collective failed {where}, yet every rank answered the roll call: "
                f"{str(e).split(': ', 1)[-1]}")
    tail = f"; this rank stops. The backend's traceback: {log}" if log else "; this rank stops"
    return f"[rank {rank}] error: {what}{tail}"


def report_collective_failure(e, rank: int) -> int:
    """For a CollectiveFailed (megaq.parallel.comm) on this rank: call the roll, print
    the one line (see :func:`collective_failure_line`), put the traceback in the log
    file, and return the exit code (PEER_LOST_EXIT; the leaving peer's own code when it
    left on purpose). SIGTERM waits until the caller exits."""
    _reporting.set()
    with contextlib.suppress(Exception):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from megaq.runtime import peers
    verdict = peers.roll_call()
    log = None
    with contextlib.suppress(OSError):
        log = log_path(rank, "collective_failure")
    line = collective_failure_line(e, rank, verdict, log)
    if line is None:  # the leaving peer's code; a rank the launcher stopped tells less
        sigterm = 128 + signal.SIGTERM
        return min(verdict.left.values(), key=lambda c: (c == sigterm, c))
    if log is not None:
        try:
            _write_log(log, line, e)
        except OSError:
            line = collective_failure_line(e, rank, verdict, None)
    print(line, file=sys.stderr, flush=True)
    peers.linger(verdict)  # rank 0 hosting the store keeps it up for the others' roll call
    return PEER_LOST_EXIT
