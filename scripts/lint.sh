#!/usr/bin/env bash
# Lint: pyflakes (pinned by scripts/setup_env.sh) over every tracked Python file;
# fails on unused imports, undefined names and the other mistakes pyflakes reports.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck disable=SC1091
. "$repo/scripts/setup_env.sh"
cd "$repo"
git ls-files -z --cached --others --exclude-standard '*.py' | xargs -0 python -m pyflakes
echo "[lint] pyflakes: clean"
