"""A stand-in Triton driver for a machine without a GPU: Triton's own CUDA backend
compiles kernels (PTX and cubin, on the CPU), and only what needs a device is replaced:
loading the binary and the C launcher, which records its arguments and launches nothing.

With it, Triton's real JIT launch path (argument binding, specialization, cache key,
globals check, compiled-kernel launcher call) runs in Python as on a GPU machine, so its
host cost can be timed on CPU, and a cached launch can be compared argument for argument
with the JIT's own. Needs TRITON_INTERPRET unset when the kernel is decorated (or a
triton.runtime.jit.JITFunction built directly).

    with host_driver() as calls:
        kernel[grid](...)        # compiles for sm_90 the first time, then launches nothing
        calls[-1]                # (grid x, y, z, stream, function, *rest) as the launcher got them
"""

import contextlib

# H200-like properties: what the compiler asks of a device
_PROPS = {"max_shared_mem": 232448, "multiprocessor_count": 132, "max_num_regs": 65536, "warpSize": 32,
          "sm_clock_rate": 1980000, "mem_clock_rate": 2619000, "mem_bus_width": 5120}


class _Utils:
    def load_binary(self, name, kernel, shared, device):
        return None, id(kernel), 32, 0, 1024  # module, function handle, registers, spills, max threads

    def get_device_properties(self, device):
        return dict(_PROPS)


class _Driver:
    def __init__(self, calls):
        from triton.backends.compiler import GPUTarget

        self.utils, self._target, self._calls = _Utils(), GPUTarget("cuda", 90, 32), calls
        calls_ = calls

        class Launcher:
            """Triton's C launcher, stood in for: it records what it would launch, so
            the host path up to the launch is timed without a GPU (by design)."""

            def __init__(self, src, metadata):  # nothing to build: no GPU module to load
                del src, metadata

            def __call__(self, *args):
                calls_.append(args)

        self.launcher_cls = Launcher

    def is_active(self):
        return True

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 7  # any stream handle: nothing runs on it

    def get_current_target(self):
        return self._target

    def get_active_torch_device(self):
        import torch

        return torch.device("cpu")


@contextlib.contextmanager
def host_driver():
    """Make the stand-in driver Triton's active one; yields the list of launcher calls."""
    from triton.runtime import driver

    calls = []
    lazy = hasattr(driver, "_active")  # Triton 3.x: the active driver is made on first use
    previous = driver._active if lazy else driver.active
    driver.set_active(_Driver(calls))
    try:
        yield calls
    finally:
        if lazy:
            driver._active = previous  # possibly None again: no GPU driver is created here
        else:
            driver.set_active(previous)
