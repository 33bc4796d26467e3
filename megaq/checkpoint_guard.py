"""Guards around a checkpoint directory: one job at a time, no stale temporaries, and
write errors (a full disk) that leave the previous checkpoint in place.

* **The job lock.** ``--save DIR`` is claimed by global rank 0 at start
  (:func:`claim_save_directory`): an exclusive ``flock`` on ``DIR/.megaq_job.lock``,
  held for the life of the process, and the file names the job (host, pid, start time,
  slurm job id). The kernel drops the lock when its holder dies however it dies, so
  a lock that can be taken is stale by definition: the new job takes it over and says
  whose it was. A lock that cannot be taken belongs to a live job (for example orphaned
  ranks of a killed launcher) and the second job refuses, with one line naming it.
  Shared filesystems must honour ``flock`` (NFSv4, Lustre with ``-o flock``, GPFS do).
* **Stale temporaries.** A save killed halfway leaves ``.iter_XXXXXXX.tmp`` behind. Every
  save and every start removes all of them (:func:`remove_stale_temporaries`): the lock
  guarantees no other job is writing one.
* **Write errors.** :func:`write_errors` wraps each phase of a save: an ``OSError`` on any
  rank (ENOSPC, EDQUOT, EFBIG, EIO, ...) becomes one agreed error line on every rank
  naming the directory, the bytes the save needs and the bytes free; the half-written
  temporary directory is deleted, and since the tracker was not touched the previous
  checkpoint stays ``latest``.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import json
import os
import shutil
import socket
import time

from megaq import failure

LOCK_NAME = ".megaq_job.lock"
TRACKER_FILE = "latest_checkpointed_iteration.txt"  # as megaq.checkpoint.TRACKER_FILE

_held: dict[str, int] = {}  # absolute directory -> fd holding its flock (this process)


class CheckpointLockError(RuntimeError):
    """The checkpoint directory belongs to another job that is still running."""


class _WriteFailed(RuntimeError):
    """One rank's write error, already worded for the user (see write_errors)."""


# ------------------------------------------------------------------------------ lock
def _owner_record() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(),
            "start_time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "job_id": os.environ.get("SLURM_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID")}


def _describe(owner: dict | None) -> str:
    if not owner:
        return "a job that left no record"
    job = f", job {owner['job_id']}" if owner.get("job_id") else ""
    return f"pid {owner.get('pid')} on host {owner.get('host')}, started {owner.get('start_time')}{job}"


def _read_owner(fd: int) -> dict | None:
    with contextlib.suppress(OSError, ValueError):
        os.lseek(fd, 0, os.SEEK_SET)
        data = os.read(fd, 65536)
        owner = json.loads(data.decode()) if data.strip() else None
        return owner if isinstance(owner, dict) else None
    return None


def lock_directory(root: str) -> str | None:
    """Take `root`'s job lock for this process (idempotent). Returns a note when a stale
    lock was taken over, None otherwise; CheckpointLockError when a live job holds it."""
    root = os.path.abspath(root)
    if root in _held:
        return None
    path = os.path.join(root, LOCK_NAME)
    try:
        os.makedirs(root, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:  # a file in the way, no permission, a read-only file system
        raise CheckpointLockError(f"--save {root}: cannot write there ({e.strerror}: {e.filename}); "
                                  f"pass a --save directory this job can create and write") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        owner = _read_owner(fd)
        os.close(fd)
        raise CheckpointLockError(
            f"{root} is in use by another running job ({_describe(owner)}); a second job must "
            f"not write there: stop that job (its ranks may have outlived their launcher) or "
            f"pass another --save directory") from None
    previous = _read_owner(fd)
    me = _owner_record()
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, (json.dumps(me) + "\n").encode())
    os.fsync(fd)
    _held[root] = fd
    if previous and (previous.get("pid"), previous.get("host")) != (me["pid"], me["host"]):
        return f" note: took over the stale checkpoint lock of {root} ({_describe(previous)}: no longer running)"
    return None


def unlock_directory(root: str) -> None:
    """Release this process's lock on `root` (the kernel also does so at exit)."""
    fd = _held.pop(os.path.abspath(root), None)
    if fd is not None:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def claim_save_directory(root: str, topo) -> None:
    """Collective at start: global rank 0 locks `root` and removes stale temporaries;
    every rank raises the same AgreedError when another job holds the lock."""
    group = topo.world if topo is not None else None
    rank = topo.rank if topo is not None else 0
    with failure.agreed(group, catch=(CheckpointLockError, OSError)):
        if rank == 0:
            note = lock_directory(root)
            if note:
                print(note, flush=True)
            removed = remove_stale_temporaries(root)
            if removed:
                print(f" note: removed {len(removed)} unfinished save(s) from {root}: "
                      f"{', '.join(removed)}", flush=True)


def remove_stale_temporaries(root: str) -> list[str]:
    """Delete every ``.iter_*.tmp`` / ``.iter_*.old`` directory under `root` (saves that
    were killed or failed); returns their names. Only the lock holder calls this."""
    removed = []
    for path in sorted(glob.glob(os.path.join(root, ".iter_*.tmp")) +
                       glob.glob(os.path.join(root, ".iter_*.old"))):
        shutil.rmtree(path, ignore_errors=True)
        removed.append(os.path.basename(path))
    return removed


# ---------------------------------------------------------------------- write errors
def _tensor_bytes(obj) -> int:
    import torch
    if torch.is_tensor(obj):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def _dir_bytes(path: str) -> int:
    total = 0
    for dirpath, _, names in os.walk(path):
        for n in names:
            with contextlib.suppress(OSError):
                total += os.path.getsize(os.path.join(dirpath, n))
    return total


def _latest(root: str) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        with open(os.path.join(root, TRACKER_FILE)) as f:
            return int(f.read().strip())
    return None


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024.0
    return f"{n} B"


def describe_write_error(e: OSError, root: str, state=None) -> str:
    """One line for a failed checkpoint write: what failed, the bytes the save needs
    (the size of the last complete checkpoint, else this rank's state), the bytes
    free, and what stays ``latest``."""
    latest = _latest(root)
    needed = 0
    if latest is not None:
        needed = _dir_bytes(os.path.join(root, f"iter_{latest:07d}"))
    needed = max(needed, _tensor_bytes(state))
    free = None
    with contextlib.suppress(OSError):
        free = shutil.disk_usage(root if os.path.isdir(root) else os.path.dirname(root) or ".").free
    what = e.strerror or type(e).__name__
    where = f" ({e.filename})" if e.filename else ""
    room = f"; {_human(free)} free there" if free is not None else ""
    keep = (f"the previous checkpoint (iteration {latest}) stays latest" if latest is not None
            else "no checkpoint was written")
    return (f"cannot write the checkpoint to {root}: {what}{where}; the save needs about "
            f"{_human(needed)} ({needed} bytes){room}; the unfinished save was deleted and "
            f"{keep}; free space (or raise the quota / file-size limit) or pass another --save")


@contextlib.contextmanager
def write_errors(root: str, tmp: str, state, group, cleanup):
    """A phase of a save, agreed over `group`: an OSError on any rank deletes the
    temporary directory (`cleanup()`, rank 0) and raises one AgreedError everywhere."""
    with failure.agreed(group, catch=(_WriteFailed,), on_failure=cleanup):
        try:
            yield
        except Exception as e:  # noqa: BLE001 - any failure must reach the peers waiting below
            os_error = _os_error_in(e)
            if os_error is not None:
                raise _WriteFailed(describe_write_error(os_error, root, state)) from None
            raise _WriteFailed(f"saving the checkpoint to {root} failed ({type(e).__name__}: "
                               f"{e}); the unfinished save was deleted") from e


def _os_error_in(e: BaseException | None) -> OSError | None:
    """The OSError behind `e`: torch.save reports a failed write as the RuntimeError of
    its zip writer's cleanup, with the OSError as its context."""
    seen = 0
    while e is not None and seen < 10:
        if isinstance(e, OSError):
            return e
        e, seen = e.__cause__ or e.__context__, seen + 1
    return None
