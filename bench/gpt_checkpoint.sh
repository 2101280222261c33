#!/usr/bin/env bash
# The stall a checkpoint costs train-gpt, synchronous against --checkpoint-async, on the larger
# configuration (6 layers, 6 heads, 384-dim, context 256: 10.7 M parameters; a checkpoint of
# parameters and AdamW state is ~129 MB) at world NPROC (default 2): STEPS steps (default 6)
# with a checkpoint every EVERY (default 2), RUNS rounds (default 3, the order shuffled), both
# frameworks. The stall is rank 0's time inside the save call (the JSON line's
# checkpoint_stall_ms: mean per save); the background write's own time is not in it.
#   bench/gpt_checkpoint.sh          NPROC=2 RUNS=3 STEPS=6 EVERY=2 BATCH=2
set -euo pipefail
cd "$(dirname "$0")/.."
NPROC=${NPROC:-2}
RUNS=${RUNS:-3}
STEPS=${STEPS:-6}
EVERY=${EVERY:-2}
BATCH=${BATCH:-2}
export RAYON_NUM_THREADS=1 OMP_NUM_THREADS=1
OUT=${OUT:-bench/results/gpt-checkpoint-$(date -u +%Y%m%d-%H%M).jsonl}
mkdir -p "$(dirname "$OUT")"
cargo build --release -q -p train-gpt
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
for round in $(seq "$RUNS"); do
  for job in $(printf '%s\n' candle:sync candle:async burn:sync burn:async | shuf); do
    fw=${job%%:*} how=${job##*:}
    rm -rf "$dir/ck"
    flag=()
    [ "$how" = async ] && flag=(--checkpoint-async)
    ./target/release/train-gpt --framework "$fw" --nproc "$NPROC" \
      --n-layer 6 --n-head 6 --n-embd 384 --block-size 256 --batch-size "$BATCH" \
      --max-iters "$STEPS" --warmup-iters 2 --eval-interval 1000000 --eval-iters 1 \
      --checkpoint-dir "$dir/ck" --checkpoint-every "$EVERY" "${flag[@]}" --json \
      2>/dev/null | tail -n 1 >>"$OUT"
  done
done
python3 - "$OUT" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
print("| framework | synchronous stall (ms/save) | asynchronous stall (ms/save) | async / sync |")
print("|---|---|---|---|")
for fw in ("candle", "burn"):
    med = lambda a: statistics.median(r["checkpoint_stall_ms"] for r in rows if r["framework"] == fw and r["checkpoint_async"] == a)
    s, a = med(False), med(True)
    print(f"| {fw} | {s:.1f} | {a:.1f} | {a / s:.3f} |")
PY
