"""Crash- and race-safe file writes: write to a temporary name, rename at the end.

Several ranks (or several tools) may build the same cached file at once; each writes
its own temporary name and `os.replace`s it into place, so readers only ever see a
complete file. `FileLock` serialises builders on one machine (and on shared
filesystems that honour flock) so the work is done once.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import uuid

import numpy as np


def tmp_name(path: str) -> str:
    """A sibling temporary name, unique per process and call (same filesystem as path)."""
    d, base = os.path.split(os.path.abspath(path))
    return os.path.join(d, f".{base}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def remove_quietly(*paths: str) -> None:
    for p in paths:
        # NotADirectoryError: a file stands where its directory should be, so it was never
        # made; the caller's own error (not this one, about a temp name) is the one to show
        with contextlib.suppress(FileNotFoundError, IsADirectoryError, NotADirectoryError):
            os.remove(p)


def open_tmp(tmp: str, path: str, mode: str = "wb"):
    """open(tmp, mode); an OSError names `path`, the file the user asked for, not the
    temporary name they never gave (run_cli prints it as one `error:` line)."""
    try:
        return open(tmp, mode)
    except OSError as e:
        raise type(e)(e.errno, e.strerror, path) from None


@contextlib.contextmanager
def atomic_write(path: str, mode: str = "wb"):
    """Open a temp file for writing; on success rename it to `path`, on error delete it."""
    tmp = tmp_name(path)
    try:
        with open_tmp(tmp, path, mode) as f:
            yield f
        os.replace(tmp, path)
    except BaseException:
        remove_quietly(tmp)
        raise


class FileLock:
    """Exclusive advisory lock on `path` (created if missing); a context manager."""

    def __init__(self, path: str):
        self.path = path
        self._fd = None

    def __enter__(self):
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None
        return False


def cache_lock(cache_dir: str, name: str, flag: str = "--data-cache-path") -> FileLock:
    """The FileLock `cache_dir/name`, making the directory; a directory that cannot be
    made or written (a file in its place, no permission) is one DataError naming `flag`."""
    from megaq.data.errors import DataError

    path = os.path.join(cache_dir, name)
    try:
        os.makedirs(cache_dir, exist_ok=True)
        open(path, "a").close()
    except OSError as e:
        raise DataError(f"{cache_dir}: cannot write the data index cache ({e.strerror}); "
                        f"pass another {flag}") from None
    return FileLock(path)


class BadCache(Exception):
    """A cached index file that is unreadable or does not fit its dataset."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = path, reason


def load_cached_index(path: str, what: str, row_shape: tuple = ()) -> np.ndarray:
    """Memory-map a cached .npy index of integers, 1-D (or rows of `row_shape`); a
    truncated or foreign file is a BadCache, not a failure in the middle of training."""
    try:
        a = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError) as e:  # truncated, or not an .npy at all
        raise BadCache(path, f"unreadable ({' '.join(str(e).split())})") from None
    if a.dtype.kind not in "iu" or a.ndim != 1 + len(row_shape) or a.shape[1:] != row_shape:
        raise BadCache(path, f"{a.dtype} array of shape {a.shape} is not {what}")
    return a


def values_outside(name: str, a: np.ndarray, low: int, high: int) -> str | None:
    """Why `a` is not all in [low, high) (one min/max pass), or None when it is."""
    if a.size == 0:
        return f"{name} is empty"
    amin, amax = int(a.min()), int(a.max())
    if amin < low or amax >= high:
        return f"{name} holds values {amin}..{amax}, outside {low}..{high - 1}"
    return None
