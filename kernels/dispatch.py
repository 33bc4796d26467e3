"""The one place that chooses between a kernel's Triton implementation and its torch
reference.

Every op megaq calls is an :class:`Op` (the list: ``kernels.ops.OPS``): a torch
reference and a Triton implementation with the same signature (the Triton side may add
one keyword-only ``tuning``: how it launches, never what it computes). A call goes to
``op.pick(t)(...)``, `t` its leading tensor:

- ``MEGAQ_KERNELS`` (read on every call): ``torch`` always takes the reference;
  ``triton`` takes Triton for any real tensor (the CPU tests, under
  ``TRITON_INTERPRET=1``); ``auto`` (the default) takes Triton for CUDA tensors.
- While torch.compile traces a call, an op with ``under_compile="reference"`` (the fused
  model ops) records its reference, which inductor fuses into its own kernels (an opaque
  autograd.Function would only break the graph); one with ``"triton"`` (a
  ``torch.library.triton_op``, or ops that run outside compiled code) keeps its rule.
- Fake tensors (a trace's) never go to the interpreter: it runs on real data only.

A function that inductor must launch as one kernel and never fuse into (the SwiGLU
backward, the FP8 transpose) is a :class:`CompiledOp`: a ``torch.library.triton_op``
registered by :func:`register_compiled_ops` before anything compiles, called as the
function itself outside a trace.

The Triton side is named as ``"module.function"`` under megaq.kernels and imported on
its first use, so CPU-only runs never load Triton.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
from typing import Callable

import torch
from torch._subclasses.fake_tensor import is_fake

BACKENDS = ("auto", "triton", "torch")
UNDER_COMPILE = ("reference", "triton")


def backend() -> str:
    """MEGAQ_KERNELS, checked: "auto", "triton" or "torch"."""
    choice = os.environ.get("MEGAQ_KERNELS", "auto").lower()
    if choice not in BACKENDS:
        raise ValueError(f"MEGAQ_KERNELS={choice!r} is not one of {', '.join(BACKENDS)}")
    return choice


def use_triton(t: torch.Tensor, under_compile: str) -> bool:
    """Whether a call whose leading tensor is `t` runs the Triton implementation (the
    rule of the module docstring; `under_compile`: Op.under_compile)."""
    choice = backend()
    if choice == "torch":
        return False
    if under_compile == "reference" and torch.compiler.is_compiling():
        return False
    if choice == "triton":
        return t.is_cuda or not is_fake(t)
    return t.is_cuda


_MODULES: dict = {}  # "module" -> the imported megaq.kernels.module (imported once, kept)


@functools.lru_cache(maxsize=None)
def _split(qualified: str) -> tuple[str, str]:
    """"module.function" -> ("module", "function"), once per name (a call's host time
    matters: the qgZ hop of a 16M bucket runs for a few microseconds)."""
    module, _, name = qualified.rpartition(".")
    return module, name


@dataclasses.dataclass(frozen=True)
class Op:
    """One kernel: `reference` (a torch function) and `triton` ("module.function" under
    megaq.kernels, with the reference's signature), and what a torch.compile trace
    records (`under_compile`, see the module docstring)."""

    name: str
    reference: Callable
    triton: str
    under_compile: str

    def __post_init__(self):
        if self.under_compile not in UNDER_COMPILE:
            raise ValueError(f"Op {self.name}: under_compile={self.under_compile!r} is not one of "
                             f"{', '.join(UNDER_COMPILE)}")

    def triton_function(self) -> Callable:
        """The Triton implementation (its module imported on first use)."""
        module, name = _split(self.triton)
        mod = _MODULES.get(module)
        if mod is None:
            mod = _MODULES[module] = importlib.import_module(f"{__package__}.{module}")
        return getattr(mod, name)  # looked up per call: a reloaded or patched module is seen

    def pick(self, t: torch.Tensor) -> Callable:
        """The implementation for a call whose leading tensor is `t`."""
        return self.triton_function() if use_triton(t, self.under_compile) else self.reference


_COMPILED_OPS: list = []  # every CompiledOp, in definition order


class CompiledOp:
    """`fn` as one op inside a torch.compile trace: the ``torch.library.triton_op``
    ``megaq::<name>`` (inductor launches the Triton kernel inside it from its generated
    code and fuses nothing into it), registered by :func:`register_compiled_ops`.

    Registering a triton_op imports torch._inductor to find the kernels in `fn` (about
    2 s of CPU), so it waits until something compiles (megaq.parallelize.compile_blocks
    calls it): a process that never compiles (``--help``, an eager run, the ranks of a
    CPU test) does not pay it. Outside a trace a call runs `fn` itself, the op's body.
    A trace before registration records `reference` (the same values; inductor may fuse
    into it), since a trace cannot register the op itself."""

    def __init__(self, name: str, fn: Callable, reference: Callable):
        self.name, self.fn, self.reference, self.op = name, fn, reference, None
        _COMPILED_OPS.append(self)

    def register(self) -> None:
        if self.op is None:
            from torch.library import triton_op

            self.op = triton_op(f"megaq::{self.name}", mutates_args=())(self.fn)

    def __call__(self, *args):
        if torch.compiler.is_compiling():
            return self.op(*args) if self.op is not None else self.reference(*args)
        return self.fn(*args)


def register_compiled_ops() -> None:
    """Register every CompiledOp (once; call before torch.compile traces megaq code)."""
    importlib.import_module(f"{__package__}.ops")  # the registry imports every kernel module
    for op in _COMPILED_OPS:
        op.register()
