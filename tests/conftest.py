"""Shared pytest setup: CPU-only, deterministic, Triton kernels in interpreter mode."""

import os

# Must be set before triton is imported anywhere in the test session.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

# the data tests' session fixtures (tiny_corpus, tiny_tokenizer, tiny_dataset)
pytest_plugins = ["data_fixtures"]

