#!/usr/bin/env bash
# Peak GPU memory and step time of each --recompute-granularity mode (and --optimizer
# sgd), one GPU, mock data: what docs/TRAINING.md "Activation recomputation" quotes.
#
#   bash tools/bench/recompute_modes.sh [OUT_DIR]     (default: $OUT or ./recompute_out)
#
# Each run: a ~0.4B GPT (24 layers, hidden 1024, seq 2048, micro-batch 4), bf16, 12
# iterations, --log-memory-to-tensorboard (peak_memory_bytes in the metrics file) and
# --timing-log-level 1. Prints one line per mode: peak GiB, ms per iteration (last
# interval), forward-backward ms. About a minute per mode on an H200.
set -uo pipefail
out=${1:-${OUT:-./recompute_out}}
mkdir -p "$out"
model=(--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 2048
       --max-position-embeddings 2048 --micro-batch-size 4 --global-batch-size 4
       --train-iters 12 --lr 1e-4 --bf16 --mock-data --vocab-size 32000
       --attention-dropout 0.1 --hidden-dropout 0.1 --log-interval 6 --eval-iters 0
       --log-throughput --log-memory-to-tensorboard --timing-log-level 1
       --data-cache-path "$out/cache")
declare -A modes=(
  [none]=""
  [selective]="--recompute-granularity selective"
  [full_uniform_1]="--recompute-granularity full --recompute-method uniform --recompute-num-layers 1"
  [full_uniform_4]="--recompute-granularity full --recompute-method uniform --recompute-num-layers 4"
  [full_block_12]="--recompute-granularity full --recompute-method block --recompute-num-layers 12"
  [sgd]="--optimizer sgd"
)
for name in none selective full_uniform_1 full_uniform_4 full_block_12 sgd; do
  # shellcheck disable=SC2086  # the mode's flags are words
  torchrun --standalone --nproc_per_node 1 pretrain_gpt.py "${model[@]}" ${modes[$name]} \
    --metrics-file "$out/$name.jsonl" > "$out/$name.log" 2>&1 || { echo "$name: FAILED (see $out/$name.log)"; continue; }
  python - "$out/$name.jsonl" "$out/$name.log" "$name" <<'PYEOF'
import json, re, sys
rows = [json.loads(x) for x in open(sys.argv[1]) if '"train"' in x]
last = rows[-1]
fb = re.findall(r"forward-backward \.+: \(([\d.]+), ", open(sys.argv[2]).read())
print(f"{sys.argv[3]:>15}: peak {max(last['peak_memory_bytes']) / 2**30:6.2f} GiB | "
      f"{last['elapsed_ms']:8.1f} ms/iteration | forward-backward {fb[-1] if fb else '?'} ms | "
      f"{last['tflops_per_gpu']:.1f} TFLOP/s (model FLOPs) | loss {last['lm_loss']:.4f}")
PYEOF
done
