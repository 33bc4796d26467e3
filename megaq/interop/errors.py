"""The interop error, apart from the converters: a CLI that only needs to catch it (every
`except` of megaq.pretrain.cli) imports no checkpoint format with it."""

from __future__ import annotations


class InteropError(RuntimeError):
    """A conversion that cannot be done as asked; the message names the reason and the fix."""
