#!/usr/bin/env bash
# ZeRO speed against DDP: ddp-bench train on the benchmark MLP (784-1024x4-10, batch 64 per rank,
# one thread per rank) at --zero 0 (DDP), 1 and 2, world NPROC (default 2), RUNS rounds; within
# a round the stages run in a random order, so that the machine's drift falls on every stage
# alike. Prints, per stage, the median samples/s, the ratio of medians against stage 0 and the
# median (and quartiles) of the per-round ratios against stage 0 of the same round.
#   bench/zero_speed.sh [NPROC] [RUNS]     BACKEND=shm|tcp (default shm), OPTIM=sgd|adamw
#   (default sgd), STEPS (default 150), STAGES="0 1 2", FRAMEWORK=candle|burn (default candle);
#   BIN=path/to/ddp-bench uses that binary instead of a release build.
set -euo pipefail
NPROC=${1:-2}
RUNS=${2:-9}
BACKEND=${BACKEND:-shm}
OPTIM=${OPTIM:-sgd}
STEPS=${STEPS:-150}
STAGES=${STAGES:-0 1 2}
FRAMEWORK=${FRAMEWORK:-candle}
cd "$(dirname "$0")/.."
if [ -z "${BIN:-}" ]; then
  cargo build --release -q -p ddp-bench
  BIN=./target/release/ddp-bench
fi
out=$(mktemp)
for run in $(seq "$RUNS"); do
  for z in $(printf '%s\n' $STAGES | shuf); do
    line=$("$BIN" train --framework "$FRAMEWORK" --nproc "$NPROC" --backend "$BACKEND" --optimizer "$OPTIM" \
      --zero "$z" --steps "$STEPS" --json | tail -n 1)
    echo "$run $line" >>"$out"
  done
done
python3 - "$out" "$BACKEND" "$OPTIM" "$NPROC" <<'PY'
import json, statistics, sys
rows = []
for l in open(sys.argv[1]):
    run, js = l.split(" ", 1)
    rows.append((int(run), json.loads(js)))
stages = sorted({r["zero"] for _, r in rows})
sps = {(run, r["zero"]): r["samples_per_s"] for run, r in rows}
runs = sorted({run for run, _ in rows})
med = lambda xs: statistics.median(xs)
base = med([sps[(k, 0)] for k in runs])
print(f"{sys.argv[2]}, {sys.argv[3]}, world {sys.argv[4]}, {len(runs)} rounds; "
      f"DDP median {base:.0f} samples/s")
print("| stage | samples/s (median) | ratio of medians | median paired ratio (quartiles) |")
print("|---|---|---|---|")
for z in stages:
    s = med([sps[(k, z)] for k in runs])
    pr = sorted(sps[(k, z)] / sps[(k, 0)] for k in runs)
    q = statistics.quantiles(pr, n=4) if len(pr) > 1 else [pr[0]] * 3
    print(f"| {z} | {s:.0f} | {s / base:.3f} | {q[1]:.3f} ({q[0]:.3f}-{q[2]:.3f}) |")
PY
