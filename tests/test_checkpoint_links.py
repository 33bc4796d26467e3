"""Nothing follows a link out of a checkpoint directory megaq owns, and the job lock
works where the filesystem has no flock.

The job lock, the tracker (and its temporary) and the stale-save sweep meet symbolic
links planted in the directory: each link's target must stay untouched, a linked lock
or tracker is refused in one line naming it, and the sweep reports only what it really
removed. The flock fallback is tested by making fcntl.flock fail as such filesystems
make it fail (ENOLCK).
"""

import errno
import json
import os
import socket

import pytest

from megaq import pretrain
from megaq.checkpoint import guard, paths
from megaq.checkpoint.errors import CheckpointError
from megaq.testing.ranks import run_cli_on_ranks

PRECIOUS = b"someone else's file\n"


@pytest.fixture(autouse=True)
def _release_locks():
    yield
    guard.unlock_all()


def _outside(tmp_path, name="outside.txt"):
    target = tmp_path / name
    target.write_bytes(PRECIOUS)
    return target


def tiny_argv(iters, *extra):
    return ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
            "--seq-length", "8", "--micro-batch-size", "1", "--lr", "1e-3", "--mock-data",
            "--vocab-size", "64", "--eval-iters", "0", "--log-interval", "1",
            "--train-iters", str(iters), *extra]


def error_lines(r):
    return [x for x in r["stderr"].splitlines() if "error:" in x]


# ------------------------------------------------------------------------ the lock
def test_symlinked_lock_is_refused_and_its_target_untouched(tmp_path):
    root = tmp_path / "ck"
    root.mkdir()
    target = _outside(tmp_path)
    os.symlink(target, root / guard.LOCK_NAME)
    with pytest.raises(paths.LinkRefused) as e:
        guard.lock_directory(str(root))
    msg = str(e.value)
    assert f"{root / guard.LOCK_NAME} is a symbolic link (to {target})" in msg
    assert "replace the link with a regular file, or remove it" in msg and "\n" not in msg
    assert target.read_bytes() == PRECIOUS


def test_symlinked_lock_stops_the_run_in_one_line(tmp_path):
    root = tmp_path / "ck"
    root.mkdir()
    target = _outside(tmp_path)
    os.symlink(target, root / guard.LOCK_NAME)
    r = run_cli_on_ranks(pretrain.cli, tiny_argv(2, "--save", str(root), "--save-interval", "1"), 2)
    lines = error_lines(r)
    assert 2 in r["codes"] and 0 not in r["codes"], r
    assert len(lines) == 1 and "is a symbolic link" in lines[0], r["stderr"]
    assert "Traceback" not in r["stderr"] and "iteration" not in r["stdout"]
    assert target.read_bytes() == PRECIOUS
    assert sorted(os.listdir(root)) == [guard.LOCK_NAME]  # nothing saved, the link left alone


# --------------------------------------------------------------------- the tracker
def test_symlinked_tracker_is_refused_on_load_and_save(tmp_path):
    root = tmp_path / "ck"
    root.mkdir()
    target = _outside(tmp_path)
    target.write_bytes(b"7\n")
    os.symlink(target, root / paths.TRACKER_FILE)
    with pytest.raises(CheckpointError, match="is a symbolic link") as e:
        paths.read_tracker(str(root))
    assert str(root / paths.TRACKER_FILE) in str(e.value)
    with pytest.raises(paths.LinkRefused):
        paths.read_tracker_text(str(root))  # what a --save claim checks before writing
    assert paths.latest_iteration(str(root)) is None  # the disk-full line does not follow it
    assert target.read_bytes() == b"7\n"


def test_tracker_writes_never_go_through_a_link(tmp_path):
    root = tmp_path / "ck"
    root.mkdir()
    target = _outside(tmp_path)
    other = _outside(tmp_path, "other.txt")
    # a link planted at the temporary's name, and one at the tracker's own name
    os.symlink(target, root / f"{paths.TRACKER_FILE}.tmp-{os.getpid()}")
    os.symlink(other, root / paths.TRACKER_FILE)
    paths.write_tracker(str(root), 3)
    assert target.read_bytes() == PRECIOUS and other.read_bytes() == PRECIOUS
    assert not os.path.islink(root / paths.TRACKER_FILE) and paths.read_tracker(str(root)) == 3


# ----------------------------------------------------------------------- the sweep
def test_sweep_removes_links_themselves_and_reports_only_what_is_gone(tmp_path, monkeypatch):
    root = tmp_path / "ck"
    root.mkdir()
    outside_dir = tmp_path / "outside_dir"
    outside_dir.mkdir()
    (outside_dir / "keep.bin").write_bytes(PRECIOUS)
    target = _outside(tmp_path)
    os.symlink(outside_dir, root / ".iter_0000005.tmp")        # a linked "temporary"
    real = root / ".iter_0000006.tmp"                          # a real one, linking out inside
    real.mkdir()
    os.symlink(target, real / "model.pt")
    (real / "half_written.pt").write_bytes(b"x")
    removed = guard.remove_stale_temporaries(str(root))
    assert removed == [".iter_0000005.tmp", ".iter_0000006.tmp"]
    assert not os.path.lexists(root / ".iter_0000005.tmp") and not real.exists()
    assert (outside_dir / "keep.bin").read_bytes() == PRECIOUS and target.read_bytes() == PRECIOUS

    # one that cannot be removed is not reported as removed
    os.symlink(outside_dir, root / ".iter_0000007.tmp")

    def refuse(path, *a, **kw):
        raise PermissionError(errno.EPERM, "Operation not permitted", path)
    monkeypatch.setattr(guard.os, "unlink", refuse)
    assert guard.remove_stale_temporaries(str(root)) == []
    assert os.path.islink(root / ".iter_0000007.tmp") and (outside_dir / "keep.bin").exists()


# ------------------------------------------------------------ no flock: a lock file
def _no_flock(monkeypatch):
    def flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")
    monkeypatch.setattr(guard.fcntl, "flock", flock)


def test_without_flock_the_lock_is_an_exclusive_file_with_a_note(tmp_path, monkeypatch):
    _no_flock(monkeypatch)
    root = str(tmp_path / "ck")
    note = guard.lock_directory(root)
    path = os.path.join(root, guard.EXCLUSIVE_LOCK_NAME)
    assert note and "filesystem without flock" in note and path in note
    assert "a job that crashes leaves it behind" in note and "until you remove it" in note
    record = json.load(open(path))
    assert record["pid"] == os.getpid() and record["host"] == socket.gethostname()

    # a live job (this process, seen from another job) holds it: refused, naming the file
    guard._held.clear()
    with pytest.raises(guard.CheckpointLockError) as e:
        guard.lock_directory(root)
    msg = str(e.value)
    assert f"{root} is claimed by another job (pid {os.getpid()}" in msg
    assert f"if it crashed, remove {path} and run again" in msg

    # on another host nothing can tell whether it runs: refused too
    with open(path, "w") as f:
        json.dump({"pid": 1, "host": "elsewhere", "start_time": "then"}, f)
    with pytest.raises(guard.CheckpointLockError, match="on host elsewhere"):
        guard.lock_directory(root)

    # on this host, a lock whose process is gone is taken over
    with open(path, "w") as f:
        json.dump({"pid": _dead_pid(), "host": socket.gethostname(), "start_time": "then"}, f)
    note = guard.lock_directory(root)
    assert "took over the stale lock" in note and json.load(open(path))["pid"] == os.getpid()
    guard.unlock_all()  # the end of the job removes it
    assert not os.path.exists(path)


def test_without_flock_a_linked_lock_file_is_refused(tmp_path, monkeypatch):
    _no_flock(monkeypatch)
    root = tmp_path / "ck"
    root.mkdir()
    target = _outside(tmp_path)
    os.symlink(target, root / guard.EXCLUSIVE_LOCK_NAME)
    with pytest.raises(paths.LinkRefused, match="is a symbolic link"):
        guard.lock_directory(str(root))
    assert target.read_bytes() == PRECIOUS


def _dead_pid() -> int:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid
