"""Shared pytest setup: CPU-only, deterministic, Triton kernels in interpreter mode; the
`slow` and `multirank` markers (scripts/test.sh --quick runs -m "not slow")."""

import os
import re
import signal
import subprocess
import types

import pytest

# Must be set before triton is imported anywhere in the test session.
os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ["TRITON_INTERPRET"] == "1":
    # The suite is a CPU suite, on a GPU host too: hide the GPUs before anything asks
    # CUDA (it reads the variable once). Seen, the H200 machine, 2026-12-02: otherwise
    # pretrain_gpt's ranks default to NCCL (4 ranks, 1 GPU: refused), and ranks forked
    # after a test touched CUDA cannot use it. TRITON_INTERPRET=0 is the GPU run
    # (compiled kernels; tests/test_kernels.py, test_kernel_launch.py, test_gloo_cuda.py).
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
else:
    # The GPU run. torch.cuda.is_available() (a module's list of devices to test, say)
    # would initialise the CUDA driver in this process, and ranks forked from it after
    # that fail at their first CUDA query (torch.optim asks whether a graph is being
    # captured): "CUDA error: initialization error" (seen on the H200, 2026-12-06,
    # tests/test_fp8_resident.py). Asking NVML instead leaves the driver untouched until
    # a test uses the GPU.
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
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


# Triton's interpreter stands in for the GPU only where it computes what the compiled
# kernels compute. Triton 3.6's (the one beside torch 2.11) does not: a loop over
# tensor bounds fails under NumPy 2 ("only 0-dimensional arrays can be converted"), and
# single elements of the int8 / int4 codes come out one step off (seen 2026-12-02, torch
# 2.11 with Triton 3.6 on the CPU: this fixture skips 39 tests there, and the rest of
# the suite passes). Compiled by that Triton on the H200 the same kernels match their
# references (tests/test_kernels.py; the fused ones: tools/bench/bench_train.py --check),
# and interpreted by 3.9 (CI) these tests pass.
FAITHFUL_INTERPRETER = (3, 9)


@pytest.fixture(scope="session")
def faithful_interpreter():
    """Skip a test that runs Triton kernels in an interpreter older than
    FAITHFUL_INTERPRETER, saying how to test those kernels instead (compiled kernels,
    TRITON_INTERPRET=0, are not held back)."""
    import triton

    version = tuple(int(p) for p in re.findall(r"\d+", triton.__version__)[:2])
    if os.environ.get("TRITON_INTERPRET") == "1" and version < FAITHFUL_INTERPRETER:
        pytest.skip(f"Triton {triton.__version__}'s interpreter does not reproduce the compiled "
                    f"kernels (needs {'.'.join(map(str, FAITHFUL_INTERPRETER))}+); on a GPU test "
                    "them compiled: TRITON_INTERPRET=0 python -m pytest tests/test_kernels.py")


@pytest.fixture(scope="module")
def quant_kernels():
    """megaq.kernels.quant with its kernels decorated as this run launches them: without a
    GPU, under the interpreter (kernels.quant_triton reloaded first, then quant, if an
    earlier import decorated them compiled)."""
    import importlib

    import torch
    from megaq.kernels import quant

    if not torch.cuda.is_available() and not quant.kt.INTERPRETED:
        importlib.reload(quant.kt)
        quant = importlib.reload(quant)
    return quant


@pytest.fixture(autouse=True)
def _restore_triton_language_core():
    yield
    for name, value in _TL_CORE.items():
        if _tl_core.__dict__.get(name) is not value:
            setattr(_tl_core, name, value)


_HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


@pytest.fixture(autouse=True)
def _restore_signal_handlers():
    """megaq's entry points install signal handlers in the process they run in (the
    SIGTERM grace of megaq.runtime.failure, the training loop's --exit-signal-handler). A
    test that runs one in-process must not hand them to later tests, whose forked ranks
    and pool workers inherit them (seen: a preprocess pool worker that caught SIGTERM and
    kept pool.terminate() waiting)."""
    saved = {s: signal.getsignal(s) for s in _HANDLED_SIGNALS}
    yield
    for s, handler in saved.items():
        if handler is not None and signal.getsignal(s) is not handler:
            signal.signal(s, handler)
    from megaq.runtime import failure
    failure._reporting.clear()  # set by an in-process report of a lost peer


# ---------------------------------------------------------------------------- markers
def pytest_configure(config):
    config.addinivalue_line("markers", "slow: takes more than about 5 s on an idle 2-core machine "
                            "(every multirank test, and the single-process ones marked so); "
                            "scripts/test.sh --quick leaves them out")
    config.addinivalue_line("markers", "multirank: starts other processes (forked gloo ranks, "
                            "torchrun, a tool or pip in a subprocess); set by this file")


TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


def _spawns(fn, seen: set) -> bool:
    """Does `fn` (or a helper it names that lives in tests/, through any depth) name the rank
    launchers, the subprocess module, sys.executable or a fork? Read from the code objects,
    so a new test that starts ranks is marked without anyone remembering to."""
    from megaq.testing import ranks

    launchers = (ranks.run_on_ranks, ranks.run_cli_on_ranks, subprocess)
    code = getattr(fn, "__code__", None)
    if code is None or code in seen:
        return False
    seen.add(code)
    stack, names = [code], set()
    while stack:
        c = stack.pop()
        names.update(c.co_names)
        stack.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
    # names (a function-local `from ... import run_on_ranks` leaves only the name)
    if names & {"run_on_ranks", "run_cli_on_ranks", "subprocess", "executable", "fork",
                "in_forked_children"}:
        return True
    scope = getattr(fn, "__globals__", {})
    for name in names:
        obj = scope.get(name)
        if any(obj is x for x in launchers):
            return True
        if isinstance(obj, types.FunctionType) and os.path.dirname(
                os.path.abspath(obj.__code__.co_filename)) == TESTS_DIR and _spawns(obj, seen):
            return True
    return False


def pytest_collection_modifyitems(config, items):
    """multirank: the test or one of its fixtures starts processes; slow: every multirank
    test (a forked job costs seconds of interpreter start-up and rendezvous on 2 cores)."""
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        fns = [getattr(item, "function", None)]
        for defs in (info.name2fixturedefs.values() if info else ()):
            fns.extend(d.func for d in defs if os.path.dirname(os.path.abspath(
                getattr(getattr(d.func, "__code__", None), "co_filename", ""))) == TESTS_DIR)
        seen: set = set()
        if any(_spawns(f, seen) for f in fns if f is not None):
            item.add_marker("multirank")
            item.add_marker("slow")
