#!/usr/bin/env bash
# The test command: sets up the environment, then runs the whole suite on the CPU
# (gloo ranks posing as several nodes; Triton kernels under TRITON_INTERPRET=1).
#   bash scripts/test.sh            everything (CI)
#   bash scripts/test.sh --quick    the inner loop: -m "not slow", no forked ranks or
#                                   subprocesses (tests/conftest.py marks them)
# Other arguments go to pytest (e.g. -x, -k NAME).
# The tests run in MEGAQ_TEST_WORKERS pytest-xdist workers (default: the cores, at most 4;
# 1 runs them in this process), handed out test by test; each worker builds the module
# fixtures it needs in its own temporary folders. On CI's 2 cores this takes the suite
# from about 450 s to about 310 s (whole files per worker, --dist loadfile: about 345 s,
# the largest files handed out last).
set -euo pipefail
marks=()
if [ "${1:-}" = "--quick" ]; then
  shift
  marks=(-m "not slow")
fi
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck disable=SC1091
. "$repo/scripts/setup_env.sh"
cd "$repo"
export TRITON_INTERPRET="${TRITON_INTERPRET:-1}"
cores=$(python -c "import os; print(len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count() or 1)")
workers="${MEGAQ_TEST_WORKERS:-$(( cores < 4 ? cores : 4 ))}"
case "$workers" in
  ''|*[!0-9]*|0) echo "error: MEGAQ_TEST_WORKERS=$workers: give a whole number of workers, 1 or more (1: no workers)" >&2; exit 2 ;;
esac
parallel=()
if [ "$workers" -gt 1 ]; then
  parallel=(-n "$workers")
fi
set +e
python -m pytest -q ${parallel[@]+"${parallel[@]}"} ${marks[@]+"${marks[@]}"} "$@" tests
status=$?
set -e
# The interop tests skip when their pinned client is missing: say so, and how to run them.
if ! python -c "import megatron.core" >/dev/null 2>&1; then
  pin=$(grep -o 'megatron-core==[0-9.]*' pyproject.toml)
  echo "[test] megatron-core is not installed, so the Megatron-LM interop tests" \
       "(tests/test_data_indexed.py, tests/test_megatron_import.py) were skipped; include" \
       "them with: MEGAQ_TEST_EXTRAS='$pin' bash scripts/test.sh  (as .ci/run does)"
fi
if ! python -c "import tokenizers" >/dev/null 2>&1; then
  pin=$(grep -o 'tokenizers==[0-9.]*' pyproject.toml)
  echo "[test] tokenizers is not installed, so the GPT-2 BPE / HuggingFace tokenizer tests" \
       "(tests/test_data_tokenizer_bpe_hf.py) were skipped; include them with:" \
       "MEGAQ_TEST_EXTRAS='$pin' bash scripts/test.sh  (as .ci/run does)"
fi
exit "$status"
