#!/usr/bin/env bash
# The test command: sets up the environment, then runs the whole suite on the CPU
# (gloo ranks posing as several nodes; Triton kernels under TRITON_INTERPRET=1).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck disable=SC1091
. "$repo/scripts/setup_env.sh"
cd "$repo"
export TRITON_INTERPRET="${TRITON_INTERPRET:-1}"
set +e
python -m pytest -q "$@" tests
status=$?
set -e
# The Megatron interop tests skip when megatron-core is missing: say so, and how to run them.
if ! python -c "import megatron.core" >/dev/null 2>&1; then
  pin=$(grep -o 'megatron-core==[0-9.]*' pyproject.toml)
  echo "[test] megatron-core is not installed, so the Megatron-LM interop tests" \
       "(tests/test_data_indexed.py) were skipped; include them with:" \
       "MEGAQ_TEST_EXTRAS='$pin' bash scripts/test.sh  (as .ci/run does)"
fi
exit "$status"
