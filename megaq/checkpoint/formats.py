"""The one place a checkpoint format is chosen: by --ckpt-format for a save, by what a
directory holds for a load.

Each format module has the same parts: ``NAME``; ``save(root, iteration, ...)``;
``layout(ckpt_dir, files)`` (the saved TP and PP sizes); ``read_settings(ckpt_dir, files,
place)`` (the run's record, its file and the saved TP and PP sizes); ``read_ahead(...)``
(what a load reads before it compares settings); ``load(...)`` (the engine's state);
``read_whole_weights(ckpt_dir, files, model)`` (one process's whole model); and
``RESHARDS_ANY_LAYOUT`` (whether a TP / PP change loads without the model chunks).
"""

from __future__ import annotations

from megaq.checkpoint import dcp_format, torch_format
from megaq.checkpoint.integrity import Verifier
from megaq.checkpoint.paths import is_dist_checkpoint

FORMATS = {torch_format.NAME: torch_format, dcp_format.NAME: dcp_format}


def named(name: str):
    """The format module of --ckpt-format `name`."""
    return FORMATS[name]


def of_directory(ckpt_dir: str):
    """The format module that wrote the checkpoint directory `ckpt_dir`."""
    return dcp_format if is_dist_checkpoint(ckpt_dir) else torch_format


def checkpoint_layout(ckpt_dir: str, files: Verifier | None = None) -> tuple[int, int]:
    """(tp, pp) of a checkpoint directory of either format (its files verified by
    `files`; by default a Verifier that verifies)."""
    return of_directory(ckpt_dir).layout(ckpt_dir, files or Verifier(ckpt_dir))
