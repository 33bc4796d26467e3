#!/usr/bin/env bash
# Launch pretrain_gpt.py on this machine with torchrun (one process per rank).
#
#   NPROC=16 GPUS_PER_NODE=8 bash scripts/launch_local.sh --tensor-model-parallel-size 2 ...
#
# NPROC          ranks to start (default: number of GPUs, else 2)
# GPUS_PER_NODE  pose as nodes of this many ranks (passed as --gpus-per-node), so one
#                machine exercises the intra-/inter-node groups of ZeRO++ (default: NPROC)
# MEGAQ_BACKEND  nccl (one rank per GPU) or gloo (CPU ranks, one thread each). Default:
#                nccl when there are GPUs, gloo when there are none. More ranks than
#                GPUs is refused unless CPU ranks are asked for (MEGAQ_BACKEND=gloo):
#                megaq never silently trains on the CPU of a GPU machine.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ngpu=0   # (grep -c prints 0 *and* fails when there is no match: count, then default)
if command -v nvidia-smi >/dev/null; then
  ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  ngpu=${ngpu:-0}
fi
NPROC="${NPROC:-$([ "$ngpu" -gt 0 ] && echo "$ngpu" || echo 2)}"
GPUS_PER_NODE="${GPUS_PER_NODE:-$NPROC}"
if [ -n "${MEGAQ_BACKEND:-}" ]; then
  backend="$MEGAQ_BACKEND"
elif [ "$ngpu" -eq 0 ]; then
  backend=gloo
  echo "launch_local: no GPUs found: $NPROC CPU ranks over gloo" >&2
elif [ "$NPROC" -le "$ngpu" ]; then
  backend=nccl
else
  echo "error: NPROC=$NPROC ranks but only $ngpu GPU(s): use NPROC<=$ngpu, or ask for CPU" \
       "ranks explicitly with MEGAQ_BACKEND=gloo" >&2
  exit 2
fi
case "$backend" in
  nccl) [ "$NPROC" -le "$ngpu" ] || { echo "error: MEGAQ_BACKEND=nccl needs a GPU per rank" \
          "(NPROC=$NPROC, $ngpu GPU(s)); lower NPROC or use MEGAQ_BACKEND=gloo" >&2; exit 2; } ;;
  gloo) ;;
  *) echo "error: MEGAQ_BACKEND=$backend: use nccl or gloo" >&2; exit 2 ;;
esac
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export CUDA_DEVICE_MAX_CONNECTIONS=1   # TP collectives issue before the matmuls that need them
export GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-lo}"
# NCCL's watchdog: a failed or timed-out collective tears the rank down instead of hanging,
# and a stuck watchdog thread is aborted (docs/RELIABILITY.md)
export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"
export TORCH_NCCL_ENABLE_MONITORING="${TORCH_NCCL_ENABLE_MONITORING:-1}"
export TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC="${TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC:-600}"
exec torchrun --standalone --nnodes 1 --nproc_per_node "$NPROC" \
  "$repo/pretrain_gpt.py" --gpus-per-node "$GPUS_PER_NODE" --distributed-backend "$backend" "$@"
