"""`python tools/<name>.py` from a checkout, megaq installed or not.

Python puts only the script's folder (tools/) on sys.path, so :func:`run` puts the
repository root first, once, and the checkout's megaq answers (as it does for `python
pretrain_gpt.py`, whose folder is the root); then it runs the command. This is the one
place a user tool touches sys.path: installed, the `megaq-*` commands (pyproject.toml
[project.scripts]) run the same code with no path to set.
"""

import importlib
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(command: str) -> None:
    """Exit with megaq.cli.<command>.cli()'s status."""
    if sys.path[:1] != [ROOT]:
        sys.path.insert(0, ROOT)
    sys.exit(importlib.import_module(f"megaq.cli.{command}").cli())
