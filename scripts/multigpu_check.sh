#!/usr/bin/env bash
# Several GPUs of one host posing as 2 nodes: numerics of TP x PP x ZeRO-3 / ZeRO++
# against one process, NCCL's transport per channel (socket between the halves), and
# ZeRO-3 vs qwZ vs qwZ+hpZ vs ZeRO++ step times on a ~1.1B Llama-style model.
#
#   bash scripts/multigpu_check.sh                                  # every GPU, nccl
#   bash scripts/multigpu_check.sh --out docs/results/multigpu_h200x2.json
#   bash scripts/multigpu_check.sh --device cpu --gpus 2 --model tiny --steps 2   # no GPU
#
# Arguments go to tools/cluster/multigpu_check.py (see --help there and docs/MULTIGPU.md).
# NVLink multicast stays off in every process this starts (it can take a shared
# host's GPUs out of service): the three variables below are exported here and set
# again by the driver for each child.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export NCCL_MNNVL_ENABLE=0
export PYTHONUNBUFFERED=1
# $PYTHON if set, else the active virtualenv's python, else python3
if [ -n "${VIRTUAL_ENV:-}" ]; then PY="${PYTHON:-python}"; else PY="${PYTHON:-python3}"; fi
# The driver and its workers import this checkout's megaq (tools/_checkout.py; megaq/
# serves megaq.kernels from the top-level kernels/), installed copy or not.
cd "$repo"
exec "$PY" tools/cluster/multigpu_check.py "$@"
