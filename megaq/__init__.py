"""megaq: GPT pretraining with Megatron-style TP/PP and a ZeRO-3 engine speaking ZeRO++."""

import importlib.abc
import importlib.util
import os
import sys

__version__ = "0.1.0"


class _CheckoutKernels(importlib.abc.MetaPathFinder):
    """Serves `megaq.kernels` from the repository's top-level `kernels/` folder.

    An installed wheel carries `megaq/kernels/`; a checkout keeps the kernels at the
    top level (the layout the project promises) and its `megaq/` has no `kernels/`.
    Run from a checkout (no install, or with the checkout's `megaq/` shadowing an
    installed copy), this finder answers for that one name, so `megaq.kernels` is
    always the kernels beside the `megaq/` that was imported.
    """

    def __init__(self, folder: str):
        self.folder = folder

    def find_spec(self, name, path=None, target=None):
        if name != "megaq.kernels":
            return None
        return importlib.util.spec_from_file_location(
            name, os.path.join(self.folder, "__init__.py"),
            submodule_search_locations=[self.folder])


def _serve_checkout_kernels() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    if os.path.isdir(os.path.join(here, "kernels")):
        return  # an installed copy: megaq/kernels/ is a real subpackage
    checkout = os.path.dirname(here)
    folder = os.path.join(checkout, "kernels")
    # a checkout (its pyproject.toml beside megaq/), never some other `kernels` package
    # that happens to sit next to megaq/ in a site-packages folder
    if not (os.path.isfile(os.path.join(checkout, "pyproject.toml"))
            and os.path.isfile(os.path.join(folder, "__init__.py"))):
        return
    sys.meta_path.insert(0, _CheckoutKernels(folder))


_serve_checkout_kernels()
