#!/usr/bin/env bash
# The test command: sets up the environment, then runs the whole suite on the CPU
# (gloo ranks posing as several nodes; Triton kernels under TRITON_INTERPRET=1).
#   bash scripts/test.sh            everything (CI)
#   bash scripts/test.sh --quick    the inner loop: -m "not slow", no forked ranks or
#                                   subprocesses (tests/conftest.py marks them)
# Other arguments go to pytest (e.g. -x, -k NAME).
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
set +e
python -m pytest -q ${marks[@]+"${marks[@]}"} "$@" tests
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
