"""Shared pytest setup: CPU-only, deterministic, Triton kernels in interpreter mode."""

import os

import pytest

# Must be set before triton is imported anywhere in the test session.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

# the data tests' session fixtures (tiny_corpus, tiny_tokenizer, tiny_dataset)
pytest_plugins = ["data_fixtures"]


try:  # after TRITON_INTERPRET is set
    import triton.language.core as _tl_core
except ImportError:  # no Triton: nothing to guard
    _tl_core = None

# Triton's interpreter (3.9) patches a jit function's `triton.language.core` to its own
# builtins at every nested call and restores only the kernel's own scope: a kernel that
# calls tl.max or tl.sum (jit functions of triton.language.standard, whose globals hold
# triton.language.core) leaves tl.core's functions patched. A later compile in
# compiled mode in the same process (tests/test_kernel_launch.py's sm_90 compile, when
# Triton's cache is cold) then fails with "'value' object has no attribute 'dtype'".
_TL_CORE = dict(vars(_tl_core)) if _tl_core is not None else {}


@pytest.fixture(autouse=True)
def _restore_triton_language_core():
    yield
    for name, value in _TL_CORE.items():
        if _tl_core.__dict__.get(name) is not value:
            setattr(_tl_core, name, value)
