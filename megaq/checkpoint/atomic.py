"""A save is all or nothing: every rank writes into ``.iter_XXXXXXX.tmp``, rank 0 writes
the manifest (the last file: its presence marks a whole save), fsyncs, renames the
directory into place and only then points the tracker at it. A run killed at any
point leaves ``latest`` naming a complete previous checkpoint.

Each phase runs under megaq.checkpoint.guard.write_errors over the save's group: an
error on any rank (a full disk) removes the temporary directory and raises one agreed
error everywhere, and the previous checkpoint stays ``latest``.
"""

from __future__ import annotations

import os
import shutil

from megaq.checkpoint import guard, integrity
from megaq.checkpoint.paths import fsync_dir, iteration_dir, temporary_dir, write_tracker


class AtomicSave:
    """The temporary directory of one save of `iteration` under `root`, from its creation
    (:meth:`begin`) to its commit (:meth:`commit`); `group`: the ranks writing it."""

    def __init__(self, root: str, iteration: int, rank: int, group):
        self.root, self.iteration, self.rank, self.group = root, iteration, rank, group
        self.final = iteration_dir(root, iteration)
        self.tmp = temporary_dir(root, iteration)

    def remove_tmp(self) -> None:
        if self.rank == 0:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def phase(self, state=None):
        """A phase of the save, agreed over the group (`state`: what the save writes, for
        the bytes an out-of-space line says it needs)."""
        return guard.write_errors(self.root, self.tmp, state, self.group, self.remove_tmp)

    def begin(self, state=None) -> None:
        """Rank 0 creates the temporary directory, removing those of saves that were killed."""
        with self.phase(state):
            if self.rank == 0:
                os.makedirs(self.root, exist_ok=True)
                guard.remove_stale_temporaries(self.root)
                os.makedirs(self.tmp)

    def commit(self, state=None, known_hashes: dict | None = None) -> None:
        """Once every rank's files are in the temporary directory: rank 0 commits it."""
        with self.phase(state):
            if self.rank == 0:
                commit_directory(self.root, self.tmp, self.final, self.iteration, known_hashes)


def commit_directory(root: str, tmp: str, final: str, iteration: int,
                     known_hashes: dict | None = None) -> None:
    """Rank 0, once every file of a save is in `tmp`: write the manifest (the last
    file: its presence marks a whole save), fsync, rename `tmp` to `final`, point the
    tracker at `iteration`. `known_hashes`: files their writers hashed already."""
    integrity.write_manifest(tmp, known_hashes)
    for dirpath, _, _ in os.walk(tmp):
        fsync_dir(dirpath)
    if os.path.exists(final):  # re-saving an iteration (e.g. after a resume): replace it
        old = os.path.join(root, f".{os.path.basename(final)}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    fsync_dir(root)
    write_tracker(root, iteration)
