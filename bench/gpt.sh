#!/usr/bin/env bash
# train-gpt against PyTorch's own DDP GPT (bench/peers/torch_gpt.py): the same model, data,
# split, window order and recipe (nanoGPT's shakespeare_char, small CPU configuration), one
# thread per rank (RAYON_NUM_THREADS=OMP_NUM_THREADS=1 here, torch.set_num_threads(1) in the
# peer: otherwise a world-1 Rust run would use both cores and PyTorch's one), on this machine.
# Two parts, each interleaved (the order shuffled per round):
#  1. the full recipe (ITERS, default 2000 steps) at RECIPE_WORLDS (default "1 2") for candle,
#     Burn and PyTorch: validation loss at every EVAL_INTERVAL (default 250) steps, tokens/s,
#     ms/step, peak RSS;
#  2. TIMING_ITERS (default 200) steps at worlds 1 and 2, RUNS rounds (default 3): ms/step
#     and DDP's added time per step (world 2 minus world 1, the same per-rank batch).
# Results: one JSON line per run in OUT (default bench/results/gpt-<date>.jsonl), the metrics
# files beside it, and the tables printed by bench/gpt_summary.py.
#   bench/gpt.sh          ITERS=2000 TIMING_ITERS=200 RUNS=3 FRAMEWORKS="candle burn pytorch"
set -euo pipefail
cd "$(dirname "$0")/.."
ITERS=${ITERS:-2000}
TIMING_ITERS=${TIMING_ITERS:-200}
RUNS=${RUNS:-3}
EVAL_INTERVAL=${EVAL_INTERVAL:-250}
FRAMEWORKS=${FRAMEWORKS:-candle burn pytorch}
RECIPE_WORLDS=${RECIPE_WORLDS:-1 2}
export RAYON_NUM_THREADS=1 OMP_NUM_THREADS=1
stamp=$(date -u +%Y%m%d-%H%M)
OUT=${OUT:-bench/results/gpt-$stamp.jsonl}
mkdir -p "$(dirname "$OUT")"
cargo build --release -q -p train-gpt
BIN=./target/release/train-gpt
python3 -c 'import torch' 2>/dev/null || { echo "bench/gpt.sh: PyTorch is needed (pip install torch)" >&2; exit 2; }

run() { # part framework world iters [metrics]
  local part=$1 fw=$2 world=$3 iters=$4 metrics=${5:-/dev/null}
  local common=(--max-iters "$iters" --eval-interval "$EVAL_INTERVAL" --metrics "$metrics" --json)
  local line
  if [ "$fw" = pytorch ]; then
    line=$(python3 bench/peers/torch_gpt.py --nproc "$world" "${common[@]}" | tail -n 1)
  else
    line=$("$BIN" --framework "$fw" --nproc "$world" "${common[@]}" | tail -n 1)
  fi
  echo "{\"part\": \"$part\", \"run\": $(echo "$line")}" >>"$OUT"
}

for job in $(for fw in $FRAMEWORKS; do for w in $RECIPE_WORLDS; do echo "$fw:$w"; done; done | shuf); do
  fw=${job%%:*} w=${job##*:}
  run recipe "$fw" "$w" "$ITERS" "${OUT%.jsonl}-$fw-w$w.metrics.jsonl"
done
for round in $(seq "$RUNS"); do
  for job in $(for fw in $FRAMEWORKS; do echo "$fw:1"; echo "$fw:2"; done | shuf); do
    run "timing-$round" "${job%%:*}" "${job##*:}" "$TIMING_ITERS"
  done
done
python3 bench/gpt_summary.py "$OUT"
