#!/usr/bin/env bash
# Launch pretrain_gpt.py on this machine with torchrun (one process per rank).
#
#   NPROC=16 GPUS_PER_NODE=8 bash scripts/launch_local.sh --tensor-model-parallel-size 2 ...
#
# NPROC          ranks to start (default: number of GPUs, else 2)
# GPUS_PER_NODE  pose as nodes of this many ranks (passed as --gpus-per-node), so one
#                machine exercises the intra-/inter-node groups of ZeRO++ (default: NPROC)
# Without GPUs (or with MEGAQ_BACKEND=gloo) ranks run on the CPU over gloo, one thread each.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ngpu=$( (command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | grep -c '^GPU') || echo 0)
NPROC="${NPROC:-$([ "$ngpu" -gt 0 ] && echo "$ngpu" || echo 2)}"
GPUS_PER_NODE="${GPUS_PER_NODE:-$NPROC}"
backend="${MEGAQ_BACKEND:-$([ "$ngpu" -ge "$NPROC" ] && echo nccl || echo gloo)}"
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
