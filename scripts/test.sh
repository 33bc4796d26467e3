#!/usr/bin/env bash
# The test command: sets up the environment, then runs the whole suite on the CPU
# (gloo ranks posing as several nodes; Triton kernels under TRITON_INTERPRET=1).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck disable=SC1091
. "$repo/scripts/setup_env.sh"
cd "$repo"
export TRITON_INTERPRET="${TRITON_INTERPRET:-1}"
exec python -m pytest -q "$@" tests
