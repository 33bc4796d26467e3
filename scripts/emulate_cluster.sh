#!/usr/bin/env bash
# Two emulated nodes on one machine (network namespaces + a tc-limited veth link).
# Thin wrapper: installs iproute2 when missing, prepares the Python environment, then
# hands over to tools/cluster/emulate_cluster.py (or tools/cluster/netns_zero_bench.py for `bench`).
#
#   scripts/emulate_cluster.sh probe --rate 1gbit                  # gloo check
#   scripts/emulate_cluster.sh run --rate 500mbit -- pretrain_gpt.py --mock-data ...
#   scripts/emulate_cluster.sh bench --rates 300mbit,1gbit,3gbit   # ZeRO-3 vs ZeRO++
#   scripts/emulate_cluster.sh sweep                               # stale namespaces
# Needs root (network namespaces). Traffic never leaves the machine: the only
# non-loopback interface in the namespaces is the private veth pair between them.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

if ! command -v ip >/dev/null 2>&1 || ! command -v tc >/dev/null 2>&1; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "emulate_cluster: iproute2 (ip, tc) is missing and installing it needs root" >&2
    exit 2
  fi
  echo "[emulate_cluster] installing iproute2"
  DEBIAN_FRONTEND=noninteractive apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 >/dev/null
fi
# shellcheck disable=SC1091
. "$repo/scripts/setup_env.sh"
cd "$repo"

driver=tools/cluster/emulate_cluster.py
if [ "${1:-}" = "bench" ]; then
  shift
  driver=tools/cluster/netns_zero_bench.py
fi

# Run the driver as a child (not exec) so this shell can clean up after it even when
# it is killed hard: the driver deletes its own namespaces on exit, SIGINT and
# SIGTERM; if it dies by SIGKILL, the sweep below removes what its pid left.
child=""
cleanup() {
  trap - INT TERM EXIT
  if [ -n "$child" ] && kill -0 "$child" 2>/dev/null; then
    kill -TERM "$child" 2>/dev/null || true
    wait "$child" 2>/dev/null || true
  fi
  if [ -n "$child" ]; then
    python tools/cluster/emulate_cluster.py sweep --owner "$child" >/dev/null 2>&1 || true
  fi
}
trap 'cleanup; exit 130' INT
trap 'cleanup; exit 143' TERM
trap cleanup EXIT
python "$driver" "$@" &
child=$!
set +e
wait "$child"
rc=$?
set -e
exit "$rc"
