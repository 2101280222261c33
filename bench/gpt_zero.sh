#!/usr/bin/env bash
# train-gpt's larger configuration (6 layers, 6 heads, 384-dim embeddings, context 256: 10.7 M
# parameters) at world NPROC (default 2) with --zero 0, 1, 2, 3 (candle) and 0, 1, 2 (Burn):
# peak resident memory per rank (the largest rank's VmHWM) and tokens/s, RUNS rounds (default
# 1; the order shuffled per round), STEPS steps (default 6) of BATCH windows per rank (default
# 4), one thread per rank. Next to each stage, ZeRO's per-rank model-state formula for fp32
# AdamW (16Ψ, 8Ψ+8Ψ/N, 4Ψ+12Ψ/N, 16Ψ/N): the rest of the peak is the activations the forward
# keeps (candle and Burn keep every op's inputs for the backward), the libraries and the
# allocator. train-gpt runs the plain backward (one `loss.backward()`), so stage 2's peak still
# holds every full gradient once (4Ψ) before the reduce-scatter frees them.
#   bench/gpt_zero.sh          NPROC=2 RUNS=1 STEPS=6 BATCH=4
set -euo pipefail
cd "$(dirname "$0")/.."
NPROC=${NPROC:-2}
RUNS=${RUNS:-1}
STEPS=${STEPS:-6}
BATCH=${BATCH:-4}
export RAYON_NUM_THREADS=1 OMP_NUM_THREADS=1
OUT=${OUT:-bench/results/gpt-zero-$(date -u +%Y%m%d-%H%M).jsonl}
mkdir -p "$(dirname "$OUT")"
cargo build --release -q -p train-gpt
for round in $(seq "$RUNS"); do
  for job in $(printf '%s\n' candle:0 candle:1 candle:2 candle:3 burn:0 burn:1 burn:2 | shuf); do
    fw=${job%%:*} zero=${job##*:}
    ./target/release/train-gpt --framework "$fw" --zero "$zero" --nproc "$NPROC" \
      --n-layer 6 --n-head 6 --n-embd 384 --block-size 256 --batch-size "$BATCH" \
      --max-iters "$STEPS" --warmup-iters 2 --eval-interval 1000000 --eval-iters 1 --json \
      2>/dev/null | tail -n 1 >>"$OUT"
  done
done
python3 - "$OUT" "$NPROC" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
n = int(sys.argv[2])
psi = 10_749_696  # parameters of the tied model (the untied stage-3 one: + 77 x 384)
formula = {0: 16 * psi, 1: 8 * psi + 8 * psi / n, 2: 4 * psi + 12 * psi / n, 3: 16 * psi / n}
print(f"| framework | --zero | peak RSS/rank (MiB) | ZeRO model states (MiB) | tokens/s (world {n}) | ms/step |")
print("|---|---|---|---|---|---|")
for fw in ("candle", "burn"):
    for z in range(4):
        rs = [r for r in rows if r["framework"] == fw and r["zero"] == z]
        if not rs:
            continue
        med = lambda k: statistics.median(r[k] for r in rs)
        print(f"| {fw} | {z} | {med('peak_rss_bytes') / 2**20:.0f} | {formula[z] / 2**20:.0f} | {med('tokens_per_s'):.0f} | {med('ms_per_step'):.0f} |")
PY
