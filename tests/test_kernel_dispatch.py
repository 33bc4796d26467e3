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


def test_building_and_parsing_import_no_compiler():
    """The ops inductor must not fuse into are registered when blocks are compiled, not
    at import: registering imports torch._inductor (about 2 s of CPU in every process).
    A process that parses the CLI's flags and builds a model, FP8 GEMMs included (every
    rank of an eager run, --help), leaves it unimported; so do the CLI's error handling
    (megaq.pretrain.cli's imports) and megaq-generate's parser (tools/generate.py --help)
    the checkpoint formats' torch.distributed.checkpoint."""
    import subprocess
    import sys
    probe = ("import sys\n"
             "from megaq.config.arguments import parse_config\n"
             "from megaq.model import GPTConfig, GPTModel\n"
             "from megaq.parallel import fp8  # noqa: F401  (the FP8 GEMMs and their transpose)\n"
             "GPTModel(GPTConfig.llama(num_layers=1, hidden_size=16, num_attention_heads=2,\n"
             "                         vocab_size=64, seq_length=8))\n"
             "print('torch._inductor' in sys.modules)\n"
             "import megaq.pretrain, megaq.training, megaq.interop.errors  # noqa: F401,E401\n"
             "import megaq.cli.generate  # noqa: F401\n"
             "print('torch.distributed.checkpoint' in sys.modules)\n")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=repo + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["False", "False"], r.stdout + r.stderr[-2000:]


def test_compile_blocks_registers_every_op(monkeypatch):
    """compile_blocks registers the ops (torch.ops.megaq.*) before a block is traced: a
    trace would otherwise record their references, which inductor may fuse into."""
    from megaq import parallelize
    from megaq.model import GPTConfig, GPTModel

    calls = []

    def spy():
        calls.append(len(calls))
        dispatch.register_compiled_ops()

    monkeypatch.setattr(parallelize, "register_compiled_ops", spy)
    model = GPTModel(GPTConfig.llama(num_layers=1, hidden_size=16, num_attention_heads=2,
                                     vocab_size=64, seq_length=8))
    parallelize.compile_blocks(model, backend="eager")
    assert calls and dispatch._COMPILED_OPS
    assert all(op.op is not None for op in dispatch._COMPILED_OPS)
    assert all(hasattr(torch.ops.megaq, n)
               for n in ("swiglu_backward", "swiglu_backward_fp8", "transpose_1byte"))


def test_an_op_traced_before_registration_records_its_reference(monkeypatch):
    """A trace of a CompiledOp that nothing registered (torch.compile of megaq code
    outside compile_blocks) records the reference: the same values, no graph break."""
    op = dispatch.CompiledOp("test_unregistered", lambda x: x.t().contiguous() + 0,
                             lambda x: x.t().contiguous())
    dispatch._COMPILED_OPS.remove(op)  # a probe, not one of megaq's ops
    x = torch.arange(6.0).reshape(2, 3)
    fn = torch.compile(lambda t: op(t), backend="eager", fullgraph=True)
    assert torch.equal(fn(x), x.t().contiguous()) and op.op is None
