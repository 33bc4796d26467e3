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

`report()` is what the command-line entry calls in its ``except`` clause.
"""

from __future__ import annotations

import contextlib
import os
import sys


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
    interpreter finalisation: other threads may be blocked in a collective)."""
    if line:
        print(line, file=sys.stderr, flush=True)
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)
