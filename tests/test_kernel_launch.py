"""The cached launch path (kernels/launch.py): one compiled kernel per specialization,
never another's, and results bit-identical to the torch reference through it.

On CPU the kernels run under the Triton interpreter, whose kernels have no compiled
form, so FakeJIT stands in for the JIT: it launches the real (interpreted) kernel and
returns a FakeCompiled that records the specialization it was "compiled" for. Its
launcher, the one the cache calls on every later call, first checks that the call's
arguments have exactly that specialization and constexprs (so a cache that hands out a
kernel for another dtype, alignment, block or int class fails here), then launches the
kernel with the arguments as the JIT's launcher would receive them (all parameters in
order, constexprs included). On a GPU (TRITON_INTERPRET=0) a test also drives
the real compiled launchers, and one checks that inductor launches the FP8 transpose
(a triton_op) from its own code.
"""

import inspect
import os
from types import SimpleNamespace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from megaq.kernels import launch, reference as ref  # noqa: E402
from megaq.kernels.tuning import Tuning  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
STREAM, FUNCTION, METADATA = object(), object(), object()


def _truth_spec(args):
    """The JIT's specialization of runtime arguments, written out independently of
    kernels/launch.py: pointer dtype and 16-byte alignment; int: the constant 1,
    16-divisible, width; float: fp32; tensor descriptor: dtype and block shape."""
    out = []
    for a in args:
        if type(a).__name__ == "TensorDescriptor":  # host-side: dtype and block shape
            out.append(("desc", str(a.base.dtype), tuple(a.block_shape)))
        elif isinstance(a, torch.Tensor):
            out.append(("ptr", str(a.dtype), a.data_ptr() % 16 == 0))
        elif isinstance(a, int):
            width = "i32" if -2**31 <= a < 2**31 else ("u64" if a >= 2**63 else "i64")
            out.append(("int", "constexpr 1" if a == 1 else width, a % 16 == 0))
        else:
            out.append(("fp32",))
    return out


def _params(kernel):
    fn = getattr(kernel, "fn", kernel)
    return [SimpleNamespace(name=n, is_constexpr=p.annotation is tl.constexpr)
            for n, p in inspect.signature(fn).parameters.items()]


class FakeCompiled:
    def __init__(self, jit, spec, kwargs, n_runtime):
        self.jit, self.spec, self.kwargs, self.n_runtime = jit, spec, dict(kwargs), n_runtime
        self.function, self.packed_metadata = FUNCTION, METADATA

    def run(self, g0, g1, g2, stream, function, metadata, launch_metadata, enter_hook, exit_hook, *all_args):
        assert (stream, function, metadata) == (STREAM, FUNCTION, METADATA)
        assert enter_hook is None and exit_hook is None
        names = [p.name for p in self.jit.params]
        assert len(all_args) == len(names), "the launcher takes every parameter, constexprs included"
        runtime, consts = all_args[:self.n_runtime], dict(zip(names[self.n_runtime:], all_args[self.n_runtime:]))
        assert _truth_spec(runtime) == self.spec, "cached kernel launched for another specialization"
        assert all(self.kwargs[k] == v and type(self.kwargs[k]) is type(v) for k, v in consts.items())
        self.jit.fast_runs += 1
        self.jit.inner[(g0, g1, g2)](*runtime, **self.kwargs)


class FakeJIT:
    """A JIT stand-in around a runnable kernel (interpreted on CPU)."""

    def __init__(self, inner):
        self.inner, self.params = inner, _params(inner)
        self.compiles, self.fast_runs = 0, 0

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.compiles += 1
            self.inner[grid](*args, **kwargs)
            return FakeCompiled(self, _truth_spec(args), kwargs, len(args))
        return run


def _fake_launcher(kernel):
    return launch.CachedLauncher(FakeJIT(kernel), get_device=lambda: 0, get_stream=lambda d: STREAM)


@triton.jit
def _axpb_kernel(x_ptr, out_ptr, n, a, BLOCK: tl.constexpr, SHIFT: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n, other=0).to(tl.float32)
    tl.store(out_ptr + i, x * a + SHIFT, mask=i < n)


def _axpb(launcher, x, a, block, shift=1, **opts):
    """out = x * a + shift in fp32; a is a power of two, so the product is exact and the
    result does not depend on whether the compiler fuses it into an fma."""
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    launcher((triton.cdiv(x.numel(), block),), x, out, x.numel(), a, BLOCK=block, SHIFT=shift, **opts)
    assert torch.equal(out, x.float() * a + shift)


def test_one_compiled_kernel_per_specialization():
    fl = _fake_launcher(_axpb_kernel)
    buf = torch.randn(200, device=DEV)
    calls = [  # (x, block, shift, options): each line a new specialization unless marked
        (buf[:64], 32, 1, {}),
        (buf[:64], 32, 1, {}),  # same: cached
        (buf[:64].bfloat16(), 32, 1, {}),  # dtype
        (buf[1:65], 32, 1, {}),  # pointer not 16-byte aligned
        (buf[:64], 64, 1, {}),  # block (constexpr)
        (buf[:64], 32, 2, {}),  # another constexpr
        (buf[:64], 32, 1.0, {}),  # a constexpr of another type, equal to 1
        (buf[:64], 32, 1, {"num_warps": 2}),  # launch option
        (buf[:1], 32, 1, {}),  # n == 1
        (buf[:17], 32, 1, {}),  # n: neither 1 nor 16-divisible
        (buf[:48], 32, 1, {}),  # n 16-divisible (the JIT would share 64's kernel; the key is finer)
    ]
    runs = 0
    for x, block, shift, opts in calls:
        for a in (2.0, -0.5):  # a scalar: keyed by value (finer than the JIT), so a new entry
            for _ in range(2):  # the second launch comes from the cache
                _axpb(fl, x, a, block, shift, **opts)
                runs += 1
    new = 2 * (len(calls) - 1)  # the second line repeats the first
    assert fl.kernel.compiles == new == fl.compiles
    assert fl.kernel.fast_runs == runs - new


def test_wrong_specialization_is_caught(monkeypatch):
    """The check above can fail: a cache key blind to dtype hands the fp32 kernel to a
    bf16 call, and the fake launcher refuses it."""
    fl = _fake_launcher(_axpb_kernel)
    x = torch.randn(64, device=DEV)
    _axpb(fl, x, 2.0, 32)
    monkeypatch.setattr(launch, "tensor_key", lambda t: "blind")
    fl._entries = {}
    _axpb(fl, x, 2.0, 32)  # compiles fp32 under the blind key
    with pytest.raises(AssertionError, match="another specialization"):
        _axpb(fl, x.bfloat16(), 2.0, 32)


def test_fallbacks_launch_through_the_jit():
    fl = _fake_launcher(_axpb_kernel)
    x = torch.randn(64, device=DEV)
    out = torch.empty(64, device=DEV)
    jit = launch.Launch((2,), (64, 2.0), dict(BLOCK=32, SHIFT=1), cached=False)  # Tuning(cached_launch=False)
    for _ in range(2):
        fl.launch(jit, x, out)
        assert torch.equal(out, x * 2 + 1)
    assert fl.kernel.compiles == 2 and fl.compiles == 0  # every call through the JIT
    fl = _fake_launcher(_axpb_kernel)
    fl._hooks_active = lambda: True  # a profiler's launch hook: the JIT builds its metadata
    _axpb(fl, x, 2.0, 32)
    _axpb(fl, x, 2.0, 32)
    assert fl.kernel.compiles == 2 and fl.kernel.fast_runs == 0


@pytest.fixture()
def quant_fake(monkeypatch, quant_kernels):
    """kernels.quant with every launcher driving FakeJIT (the real kernels inside)."""
    quant = quant_kernels
    fakes = {}
    for name in ("QUANTIZE", "DEQUANT_REDUCE", "INT4_HOP", "INT4_WORDS", "QUANTIZE8_TMA"):
        fakes[name] = _fake_launcher(getattr(quant.kt, name).kernel)
        monkeypatch.setattr(quant.kt, name, fakes[name])
    return quant, fakes


@pytest.mark.parametrize("words,block,dtypes", [
    (None, 96, (torch.float32, torch.bfloat16)),  # int4 word kernels (W = 12 padded to 16)
    (False, 64, (torch.bfloat16,)),  # the byte kernel
])
def test_quant_ops_bit_identical_through_cache(quant_fake, words, block, dtypes, faithful_interpreter):
    tq, fakes = quant_fake
    tuning = Tuning(words=words is not False)
    k, m, S = 2, 2, 2 * block
    for dtype in dtypes:
        g = torch.Generator().manual_seed(block)
        x = (torch.randn(k * m * S, generator=g) * 3).to(dtype).to(DEV)
        for _ in range(2):  # the second round launches from the cache
            for bits in (8, 4):
                a = tq.quantize(x, bits, block, tuning=tuning)
                assert torch.equal(a.cpu(), ref.quantize(x.cpu(), bits, block)), (block, dtype, bits)
                d = tq.dequantize(a, x.numel(), bits, block, dtype, tuning=tuning)
                assert torch.equal(d.cpu(), ref.dequantize(a.cpu(), x.numel(), bits, block, dtype))
            for code in ("linear", "square"):  # the int4 gradient codes
                r = tq.reorder_quantize(x, k, m, 4, block, code=code, tuning=tuning)
                assert torch.equal(r.cpu(), ref.reorder_quantize(x.cpu(), k, m, 4, block, code=code))
                h = tq.dequant_reduce_quantize(r, k, S, 4, 4, block, code=code, tuning=tuning)
                assert torch.equal(h.cpu(), ref.dequant_reduce_quantize(r.cpu(), k, S, 4, 4, block, code=code))
                f = tq.dequant_reduce(h, S, 4, block, 0.125, code=code, tuning=tuning)
                assert torch.equal(f.cpu(), ref.dequant_reduce(h.cpu(), S, 4, block, 0.125, code=code))
    used = [f for f in fakes.values() if f.compiles]
    assert used and all(f.kernel.fast_runs >= f.compiles for f in used)


def test_plans_launch_per_call_what_the_arguments_need(quant_fake):
    """The ops work out a launch once per shape, dtype and options (kernels/quant.py's
    plans) and launch it with each call's tensors: a call whose tensors differ from the
    plan's first call in alignment, contiguity or placement in a larger buffer still gets
    the kernel compiled for its own tensors (the fake launcher checks) and the
    reference's bytes; a bad argument raises on every call, not only the first."""
    tq, fakes = quant_fake
    block, n = 64, 4 * 64
    g = torch.Generator().manual_seed(9)
    buf = (torch.randn(n + 1, generator=g) * 3).to(DEV)
    for _ in range(2):
        for x in (buf[:n], buf[1:], buf[:n].view(4, block).t().contiguous().t()):  # aligned, 4 bytes off, strided
            x = x.reshape(4, block) if x.dim() == 1 else x
            a = tq.quantize(x, 8, block)
            assert torch.equal(a.cpu(), ref.quantize(x.cpu(), 8, block))
            for p in (a, torch.cat([a.new_zeros(1), a.reshape(-1)])[1:].view_as(a)):  # payload 1 byte off
                assert torch.equal(tq.dequantize(p, block, 8, block).cpu(), ref.dequantize(p.cpu(), block, 8, block))
            q4 = tq.quantize(x, 4, block)
            for p in (q4, torch.cat([q4.new_zeros(2), q4.reshape(-1)])[2:].view_as(q4)):  # int4 words need 4-byte
                assert torch.equal(tq.dequantize(p, block, 4, block).cpu(), ref.dequantize(p.cpu(), block, 4, block))
    assert fakes["DEQUANT_REDUCE"].compiles >= 1 and fakes["INT4_WORDS"].compiles >= 1  # both dequantize paths
    assert fakes["QUANTIZE"].compiles == 4  # int8 and int4, each aligned and 4 bytes off
    for _ in range(2):
        with pytest.raises(ValueError, match="multiple of the block size"):
            tq.quantize(buf[:n - 2], 8, block)
        with pytest.raises(ValueError, match="expected torch.uint8"):
            tq.dequantize(buf[:n], n, 8, block)


def test_descriptor_arguments_keyed_by_dtype_and_block_shape(quant_fake, monkeypatch):
    """Host-side tensor descriptors (the int8 quantize's bulk-copy path, Tuning.tma): the
    bytes are the reference's and repeats come from the cache; the launcher keys a
    descriptor by its dtype and block shape, whether it comes among a plan's leading
    arguments or among a plain call's scalars: a key blind to them hands a bf16 call the
    fp32 kernel, and the fake launcher refuses it."""
    tq, fakes = quant_fake
    bulk = Tuning(tma=True, nb=1)
    fake = fakes["QUANTIZE8_TMA"]
    g = torch.Generator().manual_seed(5)
    base = torch.randn(4096, generator=g) * 3
    cases = [(1024, torch.float32, 128), (2048, torch.float32, 128), (2048, torch.bfloat16, 128),
             (2048, torch.bfloat16, 256)]  # a length, a dtype, a block
    for _ in range(2):
        for n, dtype, block in cases:
            x = base[:n].to(dtype).to(DEV)
            assert torch.equal(tq.quantize(x, 8, block, tuning=bulk).cpu(), ref.quantize(x.cpu(), 8, block)), \
                (n, dtype, block)
    assert fake.compiles == fake.kernel.compiles == len(cases)  # one plan each, through the JIT once
    assert fake.kernel.fast_runs == len(cases)  # the second round from the cache

    plan = tq._quantize_plan(base.shape, base.dtype, 8, 128, "linear", False, bulk).bulk
    out = torch.empty(ref.packed_len(base.numel(), 8, 128), dtype=torch.uint8, device=DEV)

    def descriptors(x):
        shape, box = [x.numel() // 64, 64], [plan.kwargs["ROWS"], 64]
        return launch.TensorDescriptor(x, shape, [64, 1], box), launch.TensorDescriptor(out, shape, [64, 1], box)

    calls = {"plan": lambda x: fake.launch(plan, out, *descriptors(x)),
             "plain": lambda x: fake(plan.grid, out, *descriptors(x), *plan.scalars, **plan.kwargs)}
    monkeypatch.setattr(launch, "descriptor_key", lambda d: "blind")
    for call in calls.values():
        fake._entries = {}
        call(base.to(DEV))  # fp32 compiled under the blind key
        with pytest.raises(AssertionError, match="another specialization"):
            call(base.bfloat16().to(DEV))


@pytest.mark.skipif(INTERPRETED or DEV != "cuda", reason="compiled Triton launchers need a GPU")
def test_real_cached_launches_match_the_jit():
    from megaq.kernels import quant

    block, k, m = 4096, 2, 4
    x = torch.randn(k * m * 4 * block, device="cuda", dtype=torch.bfloat16)
    S = x.numel() // (k * m)
    outs = {}
    tunings = {cached: (Tuning(cached_launch=cached), Tuning(cached_launch=cached, tma=True)) for cached in (False, True)}
    for cached in (False, True, True):  # the JIT, the first cached call, a cache hit
        plain, tma = tunings[cached]  # tma: tensor-descriptor arguments
        r = quant.reorder_quantize(x, k, m, 4, block, tuning=plain)
        outs.setdefault(cached, []).append((quant.quantize(x, 8, block, tuning=plain),
                                            quant.quantize(x, 8, block, tuning=tma), r,
                                            quant.dequant_reduce_quantize(r, k, S, 4, 4, block, tuning=plain),
                                            quant.dequantize(r, k * S, 4, block, torch.bfloat16, tuning=plain)))
    for got in outs[True]:
        assert all(torch.equal(a, b) for a, b in zip(outs[False][0], got))
    assert quant.kt.INT4_HOP.compiles >= 1 and quant.kt.QUANTIZE.compiles >= 1 and quant.kt.QUANTIZE8_TMA.compiles >= 1
    assert torch.equal(outs[False][0][0], outs[False][0][1])


@pytest.mark.skipif(DEV == "cuda", reason="CPU only: swaps Triton's active driver (the GPU test above is real)")
def test_cached_launch_passes_what_the_jit_passes():
    """This machine's Triton, its CUDA backend compiling for sm_90 on the CPU, with a
    stand-in driver whose launcher records its arguments (tools/bench/host_driver.py):
    for every call the cached launch hands the compiled-kernel launcher exactly what
    Triton's JIT launch hands it for the same call (the same compiled function, metadata,
    grid, stream and arguments, constexprs included), hooks aside (none set: None)."""
    pytest.importorskip("triton.backends.nvidia.driver")
    from host_driver import host_driver  # tools/bench (pyproject.toml: pytest's pythonpath)
    from triton.runtime.jit import JITFunction

    kernel = JITFunction(getattr(_axpb_kernel, "fn", _axpb_kernel))  # compiled mode, whatever TRITON_INTERPRET says
    buf = torch.randn(100)
    OPTS = dict(enable_fp_fusion=False)  # a launch option besides the constexprs (Triton 3.9 warns when unset)
    out = torch.empty(100)
    with host_driver() as calls:
        cl = launch.CachedLauncher(kernel)
        functions, plans = set(), {}
        for x, block in ((buf[:64], 32), (buf[:64], 64), (buf[1:65], 32), (buf[:64].half(), 32), (buf[:64], 32)):
            kernel[(2,)](x, out, x.numel(), 2.0, BLOCK=block, SHIFT=1, **OPTS)
            jit = calls[-1]
            plan = plans.setdefault(block, launch.Launch((2,), (x.numel(), 2.0), dict(BLOCK=block, SHIFT=1, **OPTS)))
            for hit in (False, True):  # a miss (through the JIT), then a hit (cached), once per new specialization
                cl((2,), x, out, x.numel(), 2.0, BLOCK=block, SHIFT=1, **OPTS)
                plain = calls[-1]
                cl.launch(plan, x, out)
                for got in (plain, calls[-1]):  # a plain call's launch, and a plan's
                    assert len(got) == len(jit) and all(a is b or a == b
                                                        for a, b in zip(got[:6] + got[9:], jit[:6] + jit[9:]))
                    assert not hit or got[6:9] == (None, None, None)
            assert all(not getattr(h, "calls", h) for h in jit[7:9])  # the JIT's hooks: none set
            functions.add(jit[4])
    assert len(functions) == 4 and cl.compiles == 8  # block, alignment and dtype each compile their own
    # (8 entries: plain calls and plans key them apart, each kernel compiled once by the JIT)


_HOPPER_BUILD = """
import sys
import torch
from host_driver import host_driver
from triton.runtime.jit import JITFunction
from megaq.kernels import fused_adamw, fused_adamw_triton as A, fused_rope_triton as R
from megaq.kernels import fused_swiglu_triton as S

A.wrap_triton = R.wrap_triton = S.wrap_triton = lambda k: k  # launched as themselves (the driver records)
with host_driver() as calls:
    n = 3 * 2048 + 5
    p, m, v = (torch.zeros(n) for _ in range(3))
    A.adamw_step(p, torch.zeros(n, dtype=torch.bfloat16), m, v, None, torch.ones(()),
                 fused_adamw.step_scalars(1e-3, 0.1, (0.9, 0.95), 1e-8, 1),
                 fused_adamw.Segments([(0, 100), (100, n)], torch.zeros(2)))
    for cvt, groups, per_group in ((False, 2, 3), (True, 2, 3), (True, 4, 1)):
        R.uses_hw_cast = lambda t, cvt=cvt: cvt
        dq = torch.zeros(16, 2, groups * per_group, 128, dtype=torch.bfloat16)
        dk, dv = (torch.zeros(16, 2, groups, 128, dtype=torch.bfloat16) for _ in range(2))
        tables = torch.zeros(16, 1, 1, 128)
        R.qkv_rope_backward_fp8(dq, dk, dv, tables, tables, torch.ones(()), torch.float8_e5m2)
    for cvt in (False, True):
        S.swiglu_backward_fp8_at(torch.zeros(70, 40, dtype=torch.bfloat16),
                                 torch.zeros(70, 80, dtype=torch.bfloat16), torch.ones(()),
                                 torch.float8_e5m2, (S.BM_FP8, S.BF_FP8, S.WARPS_FP8), cvt)
print("launched", len(calls))
"""


@pytest.mark.skipif(DEV == "cuda", reason="CPU only: swaps Triton's active driver (a GPU compiles them for real)")
def test_kernels_the_interpreter_tests_also_compile_for_hopper():
    """The interpreter checks what a kernel computes, not that it compiles: Triton's CUDA
    backend builds these for sm_90 (PTX, then ptxas's cubin) through their own wrappers,
    on the CPU with the stand-in driver (tools/bench/host_driver.py), launching nothing:
    the AdamW step's per-range amax loop (a range read from memory, atomics), the QKV
    layer's fused RoPE FP8 backward (branches on the head slot; both FP8 conversions; a
    group of one query head, where Triton makes that count a constant) and fc1's fused
    SwiGLU FP8 backward, which shares its cast. In a process of
    its own: under TRITON_INTERPRET=1 Triton's library functions (tl.max) are
    interpreter-only."""
    pytest.importorskip("triton.backends.nvidia.driver")
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([repo, os.path.join(repo, "tools", "bench"),
                                         env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", _HOPPER_BUILD], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0 and "launched 6" in out.stdout, out.stderr[-3000:]


@pytest.mark.skipif(INTERPRETED or DEV != "cuda", reason="needs a GPU and compiled Triton (TRITON_INTERPRET=0)")
def test_fp8_transpose_is_launched_from_inductors_code(monkeypatch):
    """On the GPU, inductor launches the transpose kernel from its own generated code
    (the op is a triton_op), not through the op's Python and Triton's launcher on every
    call, the host time that made small FP8 models' steps slow; and it still copies every
    byte."""
    from torch._inductor.utils import run_and_get_code

    from megaq.kernels.transpose import transpose

    monkeypatch.setenv("MEGAQ_KERNELS", "auto")
    a = torch.randn(3000, 1030, device="cuda")
    fn = torch.compile(lambda t: transpose((t * 2).to(torch.float8_e5m2)))
    y, code = run_and_get_code(fn, a)
    code = "\n".join(code)
    assert torch.equal(y.view(torch.uint8), (a * 2).to(torch.float8_e5m2).t().contiguous().view(torch.uint8))
    # the kernel's source in inductor's code, and no call of the op (its name may still
    # appear in inductor's comments on the source nodes)
    assert "def _transpose" in code and "ops.megaq.transpose_1byte" not in code
