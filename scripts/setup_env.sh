#!/usr/bin/env bash
# Prepare a Python environment for megaq; sourced by demo.sh and test.sh.
# - uses the active virtualenv, or creates/activates .venv in the repo root;
# - installs torch==2.13.0 (CPU build) only when no torch is importable: a user's
#   CUDA torch is never replaced;
# - installs triton, sentencepiece, numpy, pytest, pytest-xdist, tqdm, matplotlib, setuptools (with
#   bdist_wheel: tests/test_install.py builds a wheel offline), pyflakes==4.1.0 (the lint
#   step of .ci/run) and megaq itself (editable);
# - MEGAQ_TEST_EXTRAS: more pip requirements to install (.ci/run passes pyproject.toml's
#   `test` extra: the pinned interop clients).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ -z "${VIRTUAL_ENV:-}" ]; then
  if [ ! -x "$repo/.venv/bin/python" ]; then
    echo "[setup] creating virtual environment $repo/.venv"
    python3 -m venv "$repo/.venv"
  fi
  # shellcheck disable=SC1091
  . "$repo/.venv/bin/activate"
fi
PY=python
if ! $PY -c "import torch" >/dev/null 2>&1; then
  echo "[setup] no torch importable: installing the CPU build torch==2.13.0"
  $PY -m pip install -q "torch==2.13.0"
fi
missing=$($PY - <<'PYEOF'
import importlib.util as u
need = {"triton": "triton", "sentencepiece": "sentencepiece", "numpy": "numpy",
        "pytest": "pytest", "xdist": "pytest-xdist==3.8.0",  # test.sh's workers
        "tqdm": "tqdm", "matplotlib": "matplotlib",
        "setuptools": "setuptools",  # the editable install below (3.12+ venvs lack it)
        "pyflakes": "pyflakes==4.1.0"}  # the lint step of .ci/run
absent = {m for m in need if u.find_spec(m) is None}  # module names
missing = [need[m] for m in need if m in absent]       # what pip installs
if "setuptools" not in absent:
    # building a wheel (tests/test_install.py) needs bdist_wheel: part of setuptools
    # since 70.1 (the wheel package now only re-exports it), so an older one is upgraded
    import os
    here = u.find_spec("setuptools").submodule_search_locations[0]
    if not os.path.isfile(os.path.join(here, "command", "bdist_wheel.py")):
        missing.append("setuptools==84.2.1")
if "pyflakes" not in absent:
    from importlib.metadata import version
    if version("pyflakes") != "4.1.0":
        missing.append("pyflakes==4.1.0")
print(" ".join(missing))
PYEOF
)
if [ -n "$missing" ]; then
  echo "[setup] installing: $missing"
  $PY -m pip install -q $missing
fi
if [ -n "${MEGAQ_TEST_EXTRAS:-}" ]; then
  $PY -m pip install -q $MEGAQ_TEST_EXTRAS || echo "[setup] optional test extras unavailable: $MEGAQ_TEST_EXTRAS"
fi
if ! $PY -c "import megaq.kernels" >/dev/null 2>&1 || [ "$($PY -c 'import megaq,os;print(os.path.dirname(os.path.dirname(megaq.__file__)))' 2>/dev/null)" != "$repo" ]; then
  echo "[setup] installing megaq (editable)"
  $PY -m pip install -q --no-deps --no-build-isolation -e "$repo"
fi
