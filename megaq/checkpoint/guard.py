"""Guards around a checkpoint directory: one job at a time, no stale temporaries, and
write errors (a full disk) that leave the previous checkpoint in place.

* **The job lock.** ``--save DIR`` is claimed by global rank 0 at start
  (:func:`claim_save_directory`): an exclusive ``flock`` on ``DIR/.megaq_job.lock``,
  held for the life of the process, and the file names the job (host, pid, start time,
  slurm job id). The kernel drops the lock when its holder dies however it dies, so
  a lock that can be taken is stale by definition: the new job takes it over and says
  whose it was. A lock that cannot be taken belongs to a live job (for example orphaned
  ranks of a killed launcher) and the second job refuses, with one line naming it.
  Shared filesystems should honour ``flock`` (NFSv4, Lustre with ``-o flock``, GPFS do).
  Where the filesystem refuses ``flock`` (ENOLCK, EOPNOTSUPP, EINVAL) the lock falls
  back to a file created exclusively, ``DIR/.megaq_job.lock.excl``, with a note: the job
  removes it when it ends, but a job that crashes leaves it behind, and the next job
  then refuses to start until it is removed (on the same host, a file whose process is
  gone is taken over).
* **No links followed.** Nothing megaq writes in DIR goes through a symbolic link: the
  lock, the tracker ``latest_checkpointed_iteration.txt`` (and its temporary,
  megaq.checkpoint.paths) and the save's temporary directory are opened with
  ``O_NOFOLLOW`` / ``O_EXCL`` and checked with ``lstat`` before anything is removed. A
  symlinked lock or tracker is refused in one line naming it (a job would otherwise
  write through it, outside DIR).
* **Stale temporaries.** A save killed halfway leaves ``.iter_XXXXXXX.tmp`` behind. Every
  save and every start removes all of them (:func:`remove_stale_temporaries`): the lock
  guarantees no other job is writing one. A link under such a name is removed itself
  (never what it points to), and only what is really gone is reported.
* **Write errors.** :func:`write_errors` wraps each phase of a save: an ``OSError`` on any
  rank (ENOSPC, EDQUOT, EFBIG, EIO, ...) becomes one agreed error line on every rank
  naming the directory, the bytes the save needs and the bytes free; the half-written
  temporary directory is deleted, and since the tracker was not touched the previous
  checkpoint stays ``latest``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import json
import os
import shutil
import socket
import stat
import time

from megaq.runtime import failure
from megaq.checkpoint.errors import CheckpointError
from megaq.checkpoint.paths import (LinkRefused, iteration_dir, latest_iteration, link_refusal,
                                    open_no_follow, read_tracker_text)

LOCK_NAME = ".megaq_job.lock"
EXCLUSIVE_LOCK_NAME = ".megaq_job.lock.excl"  # the lock where the filesystem has no flock

# absolute directory -> how this process holds its lock: ("flock", fd) or ("file", path)
_held: dict[str, tuple] = {}

# what fcntl.flock raises on a filesystem that does not support it
_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL}


class CheckpointLockError(CheckpointError):
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
    lock was taken over or the lock is a plain file (no flock there), None otherwise;
    CheckpointLockError when a live job holds it, LinkRefused when the lock is a link."""
    root = os.path.abspath(root)
    if root in _held:
        return None
    path = os.path.join(root, LOCK_NAME)
    try:
        os.makedirs(root, exist_ok=True)
        fd = open_no_follow(path, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK, "the job lock")
    except OSError as e:  # a file in the way, no permission, a read-only file system
        raise CheckpointLockError(f"--save {root}: cannot write there ({e.strerror}: {e.filename}); "
                                  f"pass a --save directory this job can create and write") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # a FIFO or device under the lock's name
        os.close(fd)
        raise CheckpointLockError(f"{path} is not a regular file; remove it and run again")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        owner = _read_owner(fd)
        os.close(fd)
        raise CheckpointLockError(
            f"{root} is in use by another running job ({_describe(owner)}); a second job must "
            f"not write there: stop that job (its ranks may have outlived their launcher) or "
            f"pass another --save directory") from None
    except OSError as e:
        os.close(fd)
        if e.errno not in _NO_FLOCK:
            raise
        return _lock_with_file(root)
    previous = _read_owner(fd)
    me = _owner_record()
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, (json.dumps(me) + "\n").encode())
    os.fsync(fd)
    _held[root] = ("flock", fd)
    if previous and (previous.get("pid"), previous.get("host")) != (me["pid"], me["host"]):
        return f" note: took over the stale checkpoint lock of {root} ({_describe(previous)}: no longer running)"
    return None


def _process_gone(owner: dict) -> bool:
    """True when `owner` (a lock record) names a process of this host that has ended."""
    if owner.get("host") != socket.gethostname() or not isinstance(owner.get("pid"), int):
        return False
    try:
        os.kill(owner["pid"], 0)
    except ProcessLookupError:
        return True
    except OSError:  # EPERM: it exists (another user's)
        return False
    return False


def _lock_with_file(root: str) -> str:
    """The job lock where the filesystem refuses flock: ``root/.megaq_job.lock.excl``,
    created with O_EXCL (exactly one creator wins) and removed when the job ends
    (unlock_all). A crashed job leaves it: on the same host a file whose process
    is gone is taken over, elsewhere the next job refuses until someone removes it."""
    path = os.path.join(root, EXCLUSIVE_LOCK_NAME)
    me = _owner_record()
    took_over = None
    for _ in range(2):
        try:
            fd = open_no_follow(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, "the job lock")
        except FileExistsError:
            if os.path.islink(path):
                raise LinkRefused(link_refusal(path, "the job lock")) from None
            try:
                owner_fd = open_no_follow(path, os.O_RDONLY, "the job lock")
            except FileNotFoundError:  # its owner just removed it
                continue
            owner = _read_owner(owner_fd)
            os.close(owner_fd)
            if owner and _process_gone(owner):
                os.unlink(path)
                took_over = owner
                continue
            raise CheckpointLockError(
                f"{root} is claimed by another job ({_describe(owner)}): its lock is the file "
                f"{path}, since this filesystem does not support flock; if that job is still "
                f"running, stop it or pass another --save; if it crashed, remove {path} and "
                f"run again") from None
        try:
            os.write(fd, (json.dumps(me) + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        _held[root] = ("file", path)
        note = (f" note: {root} is on a filesystem without flock: the job lock is the file "
                f"{path}, removed when this job ends; a job that crashes leaves it behind, and "
                f"the next job on this directory then refuses to start until you remove it "
                f"(on this host, a lock whose process is gone is taken over)")
        if took_over:
            note += f"; took over the stale lock of {_describe(took_over)}"
        return note
    raise CheckpointLockError(f"{path} keeps changing under this job: another job is claiming "
                              f"{root}; pass another --save directory")


def _unlock_directory(root: str) -> None:
    """Release this process's lock on `root` (the kernel also drops a flock at exit; a
    lock file is removed here, if it is still this process's)."""
    held = _held.pop(os.path.abspath(root), None)
    if held is None:
        return
    kind, handle = held
    if kind == "flock":
        with contextlib.suppress(OSError):
            fcntl.flock(handle, fcntl.LOCK_UN)
        os.close(handle)
        return
    with contextlib.suppress(OSError):
        fd = open_no_follow(handle, os.O_RDONLY, "the job lock")
        owner = _read_owner(fd)
        os.close(fd)
        if owner and (owner.get("pid"), owner.get("host")) == (os.getpid(), socket.gethostname()):
            os.unlink(handle)


def unlock_all() -> None:
    """Release every lock this process holds (the end of a run, however it ended)."""
    for root in list(_held):
        _unlock_directory(root)


def claim_save_directory(root: str, topo) -> None:
    """Collective at start: global rank 0 locks `root` and removes stale temporaries;
    every rank raises the same AgreedError when another job holds the lock."""
    with failure.agreed(topo.world, catch=(CheckpointLockError, LinkRefused, OSError)):
        if topo.rank == 0:
            note = lock_directory(root)
            if note:
                print(note, flush=True)
            read_tracker_text(root)  # a linked tracker: refused before anything is written
            removed = remove_stale_temporaries(root)
            if removed:
                print(f" note: removed {len(removed)} unfinished save(s) from {root}: "
                      f"{', '.join(removed)}", flush=True)


def remove_stale_temporaries(root: str) -> list[str]:
    """Delete every ``.iter_*.tmp`` / ``.iter_*.old`` under `root` (saves that were
    killed or failed); returns the names of those really gone. Only the lock holder
    calls this. A directory is removed with what it holds (links inside are unlinked,
    never followed); a link or stray file under such a name is unlinked itself, so
    what a link points to is never touched. One that cannot be removed is left (the
    save that needs its name then fails with a clear line) and not reported."""
    removed = []
    for path in sorted(glob.glob(os.path.join(root, ".iter_*.tmp")) +
                       glob.glob(os.path.join(root, ".iter_*.old"))):
        with contextlib.suppress(OSError):
            if stat.S_ISDIR(os.lstat(path).st_mode):
                shutil.rmtree(path)
            else:
                os.unlink(path)
        if not os.path.lexists(path):
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
    latest = latest_iteration(root)
    needed = 0
    if latest is not None:
        needed = _dir_bytes(iteration_dir(root, latest))
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
