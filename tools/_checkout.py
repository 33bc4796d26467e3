"""`python tools/<name>.py` (and tools/bench/, tools/cluster/) from a checkout, megaq installed or not.

Python puts only the script's folder on sys.path, so :func:`use_checkout` puts the
repository root first, once, and the checkout's megaq answers (as it does for `python
pretrain_gpt.py`, whose folder is the root). This file is the one place that knows the
checkout's layout and touches sys.path: tools/bench/_checkout.py and
tools/cluster/_checkout.py are links to it, so a benchmark or cluster tool finds it
beside itself, calls :func:`use_checkout` and names the root as :data:`ROOT`.
Installed, the `megaq-*` commands (pyproject.toml [project.scripts]) run the user
tools' code with no path to set.
"""

import importlib
import os
import sys

# realpath: reached through tools/bench/_checkout.py (a link), the root is still two up
ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))


def use_checkout() -> None:
    """Put the repository root first on sys.path (once), so `import megaq` is the checkout's."""
    if sys.path[:1] != [ROOT]:
        sys.path.insert(0, ROOT)


def run(command: str) -> None:
    """Exit with megaq.cli.<command>.cli()'s status."""
    use_checkout()
    sys.exit(importlib.import_module(f"megaq.cli.{command}").cli())
