#!/usr/bin/env bash
# The main job: one command on a fresh machine.
#
#   bash scripts/demo.sh
#
# 1. sets up the environment (scripts/setup_env.sh);
# 2. builds the built-in corpus (Python stdlib text) + SentencePiece tokenizer if missing;
# 3. trains a small Llama-style model (RoPE, RMSNorm, SwiGLU, GQA, untied, no biases) with
#    TP=2 x PP=2 x DP=4 on 16 ranks posing as 2 nodes of 8 (--gpus-per-node 8), ZeRO-3
#    with all of ZeRO++ on (qwZ int8 weights, hpZ over the 2 in-node DP ranks, qgZ int4
#    gradients). Megatron's default rank order (rank = tp + 2 (dp + 4 pp)) would put each
#    pipeline stage on 8 consecutive ranks, i.e. every DP group inside one node; with
#    --use-tp-pp-dp-mapping (rank = tp + 2 (pp + 2 dp)) every DP group (e.g. ranks
#    0, 4, 8, 12) spans both nodes with 2 ranks on each, so qwZ, hpZ and qgZ all cross
#    the node boundary;
# 4. saves a checkpoint, writes the metrics file and a loss-curve PNG, samples text;
# 5. exports the checkpoint to $DEMO_DIR/hf in Hugging Face transformers form.
#
# CPU ranks over gloo unless 16+ GPUs are visible (then NCCL + bf16). Knobs (env):
#   DEMO_DIR (default <repo>/demo)  DEMO_ITERS (default 100)  DEMO_DEVICE=cpu|gpu
#   DEMO_WEIGHTS=qwz|deltas (default qwz: int8 weight gathers; deltas: --zero-weight-deltas,
#   4-bit weight differences across nodes and every gather in-node from hpZ's references)
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck disable=SC1091
. "$repo/scripts/setup_env.sh"
cd "$repo"
start=$(date +%s)
DEMO_DIR="${DEMO_DIR:-$repo/demo}"
ITERS="${DEMO_ITERS:-100}"
NPROC=16
mkdir -p "$DEMO_DIR"

echo "[demo] built-in corpus and tokenizer (built on first use)"
python -c "from megaq.data.builtin import ensure_builtin_corpus as e; p, m = e(); print('[demo] data', p); print('[demo] tokenizer', m)"

ngpu=$( (command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | grep -c '^GPU') || echo 0)
device="${DEMO_DEVICE:-$([ "$ngpu" -ge "$NPROC" ] && echo gpu || echo cpu)}"
if [ "$device" = gpu ]; then
  backend=nccl; precision=(--bf16)
else
  backend=gloo; precision=()
  export OMP_NUM_THREADS=1
fi

case "${DEMO_WEIGHTS:-qwz}" in
  qwz) zeropp=(--zero-quantized-weights --zero-hpz-partition-size 2 --zero-quantized-gradients) ;;
  deltas) zeropp=(--zero-weight-deltas --zero-hpz-partition-size 2 --zero-quantized-gradients) ;;
  *) echo "error: DEMO_WEIGHTS=${DEMO_WEIGHTS} is not qwz or deltas" >&2; exit 2 ;;
esac

rm -f "$DEMO_DIR/metrics.jsonl"
echo "[demo] training: TP=2 x PP=2 x DP=4 on $NPROC $device ranks posing as 2 nodes of 8"
export CUDA_DEVICE_MAX_CONNECTIONS=1 GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-lo}"
set +e
torchrun --standalone --nnodes 1 --nproc_per_node "$NPROC" pretrain_gpt.py \
  --distributed-backend "$backend" --gpus-per-node 8 --use-tp-pp-dp-mapping \
  --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \
  --num-layers 4 --hidden-size 128 --num-attention-heads 4 \
  --group-query-attention --num-query-groups 2 \
  --seq-length 128 --max-position-embeddings 128 \
  --position-embedding-type rope --normalization RMSNorm --swiglu \
  --disable-bias-linear --untie-embeddings-and-output-weights \
  --attention-dropout 0.0 --hidden-dropout 0.0 \
  --micro-batch-size 2 --global-batch-size 16 --train-iters "$ITERS" \
  --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 10 \
  --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0 "${precision[@]}" \
  --zero-stage 3 "${zeropp[@]}" \
  --demo-corpus --split 98,2,0 \
  --log-interval 10 --log-throughput --eval-interval 25 --eval-iters 2 \
  --save "$DEMO_DIR/checkpoints" --save-interval 50 --ckpt-format torch_dist --async-save \
  --metrics-file "$DEMO_DIR/metrics.jsonl" 2>&1 | tee "$DEMO_DIR/train.log"
status=${PIPESTATUS[0]}
set -e
if [ "$status" -ne 0 ]; then echo "[demo] training failed (exit $status); log: $DEMO_DIR/train.log"; exit "$status"; fi

python tools/plot_metrics.py "$DEMO_DIR/metrics.jsonl" --output "$DEMO_DIR/loss.png" --labels demo
python - "$DEMO_DIR/metrics.jsonl" <<'PYEOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
tr = [r for r in rows if r["type"] == "train"]
va = [r for r in rows if r["type"] == "validation"]
first, last = tr[0], tr[-1]
print(f"[demo] lm loss {first['lm_loss']:.3f} (iteration {first['iteration']}) -> "
      f"{last['lm_loss']:.3f} (iteration {last['iteration']})"
      + (f"; validation loss {va[0]['val_loss']:.3f} -> {va[-1]['val_loss']:.3f}" if va else ""))
c = last["comm"]
z = lambda k: c.get(k, {}).get("inter_node", 0) / 2**10
deltas = "weight_delta_gather" in c  # DEMO_WEIGHTS=deltas
print(f"[demo] cross-node KiB per node per iteration: weight_gather_fwd {z('weight_gather_fwd'):.0f} "
      f"({'weight deltas: next line' if deltas else 'qwZ'}), weight_gather_bwd {z('weight_gather_bwd'):.0f} (hpZ keeps it in-node), "
      f"grad_reduce {z('grad_reduce'):.0f} (qgZ), pp {z('pp'):.0f}; "
      f"M = {last['zero_model_bytes'] / 2**10:.0f} KiB (fp32) per DP group")
if deltas:
    print(f"[demo] weight deltas, cross-node KiB per node per iteration: weight_delta_gather "
          f"{z('weight_delta_gather'):.0f} (4-bit differences), weight_ref_gather "
          f"{z('weight_ref_gather'):.0f} (in-node, from hpZ's references)")
PYEOF
echo "[demo] sample from the checkpoint (consolidated from TP=2 x PP=2 onto one process):"
python tools/generate.py --load "$DEMO_DIR/checkpoints" --prompt "def " --max-new-tokens 60
echo "[demo] export to Hugging Face transformers form (docs/INTEROP.md):"
python tools/convert_checkpoint.py --to hf --input "$DEMO_DIR/checkpoints" --output "$DEMO_DIR/hf" --overwrite
echo "[demo] metrics: $DEMO_DIR/metrics.jsonl  curves: $DEMO_DIR/loss.png  checkpoint: $DEMO_DIR/checkpoints"
echo "[demo] done in $(( $(date +%s) - start )) s"
