"""The checkpoint package's error: one line naming the reason and the fix (the CLI prints
it as ``error: ...`` and exits 2). The package's more specific errors subclass it:
integrity.IntegrityError (a file that does not match its manifest), paths.LinkRefused
(a symbolic link where megaq writes), guard.CheckpointLockError (another job's
directory)."""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used as asked; the message names the reason and the fix."""


class NonFiniteWeights(CheckpointError):
    """A save refused because the weights hold inf or nan. Every rank raises it together
    (it follows from an all-reduce), so rank 0 prints the one line (megaq.runtime.failure)."""

    agreed = True
