"""Cached kernel launches: Triton's compiled kernel called without the JIT's per-call work.

`kernel[grid](*args, **kwargs)` costs tens of microseconds of Python per call: the JIT
binds the arguments, computes their specialization and a cache key, checks the globals
the kernel read, then launches. The qgZ hop of a 16M-element bucket runs for about
5 us, so that path, not the kernel, set the time of one call (docs/PERFORMANCE.md).

`CachedLauncher(kernel)(grid, *args, **kwargs)` launches exactly what
`kernel[grid](*args, **kwargs)` launches. The first call with a given specialization
goes through the JIT (which compiles the kernel if needed) and keeps the compiled kernel
it returns; later calls with the same specialization call that kernel's launcher
directly (`compiled.run(grid, stream, function, metadata, ..., *args)`, the call the JIT
itself ends with in Triton 3.x).

`launcher.launch(plan, *tensors)` does the same for a `Launch` (grid, scalars and
keyword arguments fixed, built once by the caller per distinct call): its key is the
plan object with the device and the tensors' dtypes and alignment, so a call spends
nothing on the fixed part (kernels/quant.py's ops launch this way). A plan made with
`cached=False` launches through the JIT every call (Tuning.cached_launch: the
benchmarks' comparison).

The cache key is at least as fine as the JIT's specialization (which looks at a
tensor's dtype and 16-byte alignment, at whether an int is 1 or a multiple of 16 and at
its width), so the cached kernel is the one the JIT would pick:
- keyword arguments (constexprs and launch options such as num_warps), with their types;
- the leading tensor arguments: dtype, and whether the address is 16-byte aligned;
- the other (scalar) arguments: their values and types, whole (cheaper to hash than
  to classify; a call site sees few distinct shapes, and MAX_ENTRIES bounds the rest),
  except host-side tensor descriptors (Triton's TensorDescriptor, for bulk tensor
  copies): their dtype, block shape and padding, what the JIT specializes on (the
  launcher builds the copy descriptor from the object at every call);
- the current device.
A tensor among the scalars, launch hooks set by a profiler, pre-run hooks, the
interpreter, or a Triton whose compiled kernel lacks the launcher attributes: the plain
JIT launch, every call. One thing is not re-checked per call: the JIT's test that
the module globals a kernel read have not changed since it was compiled (the kernels
here read only constants).
"""

import torch

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # a Triton without host-side descriptors: none can be passed
    TensorDescriptor = None

try:
    from triton.runtime.interpreter import InterpretedFunction
except ImportError:  # pragma: no cover - very old Triton
    InterpretedFunction = ()

__all__ = ["CachedLauncher", "Launch", "interpreted"]


def interpreted(kernel) -> bool:
    """Whether the triton.jit function `kernel` runs in Triton's interpreter
    (TRITON_INTERPRET=1 when it was decorated: the CPU tests)."""
    return isinstance(kernel, InterpretedFunction)

MAX_ENTRIES = 4096  # per kernel; the cache starts over beyond it


def tensor_key(t: torch.Tensor):
    """What a compiled kernel depends on in a tensor argument."""
    return t.dtype, t.data_ptr() % 16 == 0


def descriptor_key(d):
    """What a compiled kernel depends on in a host-side tensor descriptor."""
    return "tensordesc", d.base.dtype, tuple(d.block_shape), d.padding


def _scalars_key(scalars, types):
    if TensorDescriptor is None or TensorDescriptor not in types:
        return scalars
    return tuple([descriptor_key(a) if type(a) is TensorDescriptor else a for a in scalars])


def _hook_set(hook) -> bool:
    """A launch hook that would run: Triton 3.6+ keeps a HookChain (set when it holds
    calls), older releases None or a callable."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _hooks_probe():
    """A function telling whether Triton has launch enter/exit hooks set (profilers use
    them): those launches go through the JIT, which builds the hooks' metadata."""
    try:
        from triton import knobs

        rt = knobs.runtime
        rt.launch_enter_hook, rt.launch_exit_hook  # noqa: B018 - probe for the attributes
        return lambda: _hook_set(rt.launch_enter_hook) or _hook_set(rt.launch_exit_hook)
    except (ImportError, AttributeError):
        from triton.compiler import CompiledKernel

        return lambda: (_hook_set(getattr(CompiledKernel, "launch_enter_hook", None))
                        or _hook_set(getattr(CompiledKernel, "launch_exit_hook", None)))


class _Entry:
    """One compiled kernel and what its launcher needs besides the call's arguments."""

    __slots__ = ("run", "function", "metadata", "tail")

    def __init__(self, compiled, tail):
        self.run = compiled.run  # (in Triton 3.x a property that loads the module once)
        self.function = compiled.function
        self.metadata = compiled.packed_metadata
        self.tail = tail  # the constexpr values, in the kernel's parameter order


class Launch:
    """One launch with everything but its leading tensor arguments fixed: the grid, the
    scalar arguments after the tensors, the keyword arguments (constexprs, launch
    options), and whether it comes from the launcher's cache (`cached`; False: through
    Triton's JIT every call). A caller builds it once per distinct call (kernels/quant.py
    memoises them by shape) and launches it with `launcher.launch(plan, *tensors)`.
    Treat it as frozen: the launcher keys its compiled kernels by the object."""

    __slots__ = ("grid", "scalars", "kwargs", "cached")

    def __init__(self, grid, scalars=(), kwargs=None, cached=True):
        self.grid, self.scalars, self.kwargs = tuple(grid), tuple(scalars), dict(kwargs or {})
        self.cached = cached


class CachedLauncher:
    """Launch `kernel` as kernel[grid](*args, **kwargs) does, from a per-specialization
    cache of compiled kernels. Positional args are the kernel's leading runtime
    parameters; keyword args its constexprs (every one the kernel has after them) and
    launch options.

    A kernel that is not a compiled-mode JITFunction (e.g. under TRITON_INTERPRET=1),
    or a plan made with `cached=False`, launches through the JIT every call.
    get_device / get_stream default to Triton's own (the current CUDA device and its
    current stream, so CUDA graph capture sees the capture stream).
    """

    def __init__(self, kernel, get_device=None, get_stream=None):
        self.kernel = kernel
        self.compiles = 0  # entries made (tests count specializations with it)
        self._entries = {}
        self._get_device, self._get_stream = get_device, get_stream
        self._hooks_active = None  # resolved with the device functions, on first use
        self._n_tensors = None  # leading tensor arguments, counted on the first call
        params = getattr(kernel, "params", None)  # absent on the interpreter's kernels
        self._param_names = [p.name for p in params] if params is not None else None
        self._const_names = {p.name for p in params if p.is_constexpr} if params is not None else None

    def __call__(self, grid, *args, **kwargs):
        if self._param_names is None:
            self.kernel[grid](*args, **kwargs)
            return
        if self._hooks_active is None:
            self._init_runtime()
        n = self._n_tensors
        if n is None:
            n = self._n_tensors = next((i for i, a in enumerate(args) if not isinstance(a, torch.Tensor)), len(args))
        scalars = args[n:]
        types = tuple(map(type, scalars))
        try:
            if n > len(args) or torch.Tensor in types:
                raise AttributeError
            tensors = tuple([tensor_key(t) for t in args[:n]])
        except AttributeError:  # not the layout of the first call (tensors, then scalars)
            self.kernel[grid](*args, **kwargs)
            return
        device = self._get_device()
        key = (device, tensors, _scalars_key(scalars, types), types, tuple(kwargs.items()),
               tuple(map(type, kwargs.values())))
        self._launch(device, key, grid, args, kwargs)

    def launch(self, plan: "Launch", *tensors):
        """Launch `plan` (grid, scalars and keyword arguments fixed) with these leading
        arguments, tensors or host-side tensor descriptors:
        kernel[plan.grid](*tensors, *plan.scalars, **plan.kwargs). The key is the plan
        object itself, the device and what the JIT specializes on in each leading
        argument, so a call pays for neither binding nor hashing the fixed part."""
        if not plan.cached or self._param_names is None:
            self.kernel[plan.grid](*tensors, *plan.scalars, **plan.kwargs)
            return
        if self._hooks_active is None:
            self._init_runtime()
        device = self._get_device()
        key = (device, plan, *[descriptor_key(t) if type(t) is TensorDescriptor else tensor_key(t) for t in tensors])
        self._launch(device, key, plan.grid, tensors + plan.scalars, plan.kwargs)

    def _launch(self, device, key, grid, args, kwargs):
        """From the cache under `key`, or through the JIT (keeping what it compiled)."""
        entry = self._entries.get(key)
        if entry is not None and not self._hooks_active() and not getattr(self.kernel, "pre_run_hooks", None):
            entry.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
                      self._get_stream(device), entry.function, entry.metadata, None, None, None, *args, *entry.tail)
            return
        compiled = self.kernel[grid](*args, **kwargs)
        if entry is None:
            entry = self._make_entry(compiled, args, kwargs)
            if entry is not None:
                if len(self._entries) >= MAX_ENTRIES:
                    self._entries.clear()
                self._entries[key] = entry
                self.compiles += 1

    def _make_entry(self, compiled, args, kwargs):
        if hasattr(compiled, "result"):  # a future, where the JIT compiles asynchronously
            compiled = compiled.result()
        if not all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata")):
            return None  # not a Triton 3.x compiled kernel: keep the JIT launch
        names = self._param_names[len(args):]
        # every trailing parameter must be a constexpr given by keyword: the launcher
        # takes all parameters, constexprs included, in order
        if not all(n in self._const_names and n in kwargs for n in names):
            return None
        return _Entry(compiled, tuple(kwargs[n] for n in names))

    def _init_runtime(self):
        if self._get_device is None:
            from triton.runtime import driver

            self._get_device = driver.active.get_current_device
            self._get_stream = driver.active.get_current_stream
        self._hooks_active = _hooks_probe()
