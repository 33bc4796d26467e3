"""Shared pytest setup: CPU-only, deterministic, Triton kernels in interpreter mode."""

import os

# Must be set before triton is imported anywhere in the test session.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

# Import once in the parent: forked ranks inherit it instead of each paying a few
# seconds the first time they hit a custom autograd Function or checkpoint.
import torch._dynamo  # noqa: E402,F401
