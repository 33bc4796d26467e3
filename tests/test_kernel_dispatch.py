"""The registry of kernels (megaq.kernels.ops.OPS) and the one rule that chooses
Triton or the torch reference (kernels/dispatch.py): every kernel has a reference with
its signature, every reference is registered, and MEGAQ_KERNELS, the device, fake
tensors and torch.compile's trace decide alike for every op."""

import inspect
import os

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from megaq.kernels import dispatch, fused_rmsnorm, ops, reference  # noqa: E402
from megaq.kernels.format import KERNEL_API  # noqa: E402
from megaq.kernels.tuning import DEFAULT_TUNING  # noqa: E402

KERNELS_DIR = os.path.dirname(ops.__file__)


def _params(fn):
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("op", ops.OPS, ids=lambda op: op.name)
def test_every_kernel_has_its_references_signature(op):
    """The Triton side takes the reference's parameters, names, kinds and defaults, plus
    at most one keyword-only `tuning` that defaults to the production launch."""
    pytest.importorskip("triton")
    triton_params = inspect.signature(op.triton_function()).parameters
    tuning = triton_params.get("tuning")
    if tuning is not None:
        assert tuning.kind is inspect.Parameter.KEYWORD_ONLY and tuning.default is DEFAULT_TUNING
    assert [p for p in _params(op.triton_function()) if p[0] != "tuning"] == _params(op.reference)


def test_every_reference_is_registered():
    """One registry: each `*_reference` function of the kernels package and each
    operation of kernels/reference.py belongs to exactly one Op."""
    registered = [op.reference for op in ops.OPS]
    assert len(set(registered)) == len(registered) and len({op.name for op in ops.OPS}) == len(ops.OPS)
    expected = {getattr(reference, name) for name in KERNEL_API if name != "packed_len"}
    for name in sorted(os.listdir(KERNELS_DIR)):
        if name.endswith(".py") and not name.endswith("_triton.py"):
            module = __import__(f"megaq.kernels.{name[:-3]}", fromlist=["_"])
            expected |= {f for n, f in vars(module).items()
                         if n.endswith("_reference") and inspect.isfunction(f) and f.__module__ == module.__name__}
    assert expected == set(registered)


@pytest.mark.parametrize("op", ops.OPS, ids=lambda op: op.name)
def test_one_rule_chooses_for_every_op(op, monkeypatch):
    """MEGAQ_KERNELS: `torch` takes the reference, `auto` Triton for CUDA tensors only,
    `triton` Triton for real tensors anywhere (the interpreter) but never for a trace's
    fake CPU tensor; a misspelling is refused, naming the variable."""
    pytest.importorskip("triton")
    cpu = torch.zeros(4)
    with FakeTensorMode():
        fake_cpu, fake_cuda = torch.empty(4), torch.empty(4, device="cuda")
    for choice, tensor, want_triton in (
            ("auto", cpu, False), ("torch", cpu, False), ("triton", cpu, True),
            ("auto", fake_cuda, True), ("torch", fake_cuda, False),
            ("triton", fake_cpu, False), ("triton", fake_cuda, True)):
        monkeypatch.setenv("MEGAQ_KERNELS", choice)
        want = op.triton_function() if want_triton else op.reference
        assert op.pick(tensor) is want, (choice, tensor.device)
    monkeypatch.delenv("MEGAQ_KERNELS")
    assert op.pick(cpu) is op.reference  # auto is the default
    monkeypatch.setenv("MEGAQ_KERNELS", "Tritn")
    with pytest.raises(ValueError, match="MEGAQ_KERNELS='tritn' is not one of auto, triton, torch"):
        op.pick(cpu)


@pytest.mark.parametrize("op", ops.OPS, ids=lambda op: op.name)
def test_under_compile_the_fused_ops_trace_their_reference(op, monkeypatch):
    """While torch.compile traces, an op whose reference inductor should fuse (the
    model's) records the reference even where Triton would run; the others (the FP8
    transpose, a triton_op inductor launches itself; the quantization ops) keep the rule."""
    pytest.importorskip("triton")
    monkeypatch.setenv("MEGAQ_KERNELS", "triton")
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    want = op.reference if op.under_compile == "reference" else op.triton_function()
    assert op.pick(torch.zeros(4)) is want
    monkeypatch.setenv("MEGAQ_KERNELS", "torch")
    assert op.pick(torch.zeros(4)) is op.reference


def test_a_compiled_model_op_is_one_graph_of_its_reference(monkeypatch):
    """For real: under torch.compile (fullgraph) with MEGAQ_KERNELS=triton on the CPU,
    RMSNorm traces its reference (the Triton op would break the graph) and computes
    the reference's values."""
    monkeypatch.setenv("MEGAQ_KERNELS", "triton")
    x, w = torch.randn(3, 8), torch.randn(8)
    fn = torch.compile(lambda a, b: fused_rmsnorm.rms_norm(a, b, 1e-5), backend="eager", fullgraph=True)
    assert torch.equal(fn(x, w), fused_rmsnorm.rms_norm_reference(x, w, 1e-5))


def test_op_refuses_an_unknown_trace_policy():
    with pytest.raises(ValueError, match="under_compile='never'"):
        dispatch.Op("x", fused_rmsnorm.rms_norm_reference, "fused_rmsnorm_triton.rms_norm", under_compile="never")
