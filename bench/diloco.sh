#!/usr/bin/env bash
# DiLoCo against DDP on slow links: train-gpt (candle, nanoGPT's CPU recipe, 2000 steps) at world
# 2 x NPROC, NPROC ranks in each of two network namespaces joined by one link (bench/lib/link.sh):
# a veth pair, or with DELAY_MS > 0 a relay holding every packet DELAY_MS each way (netem is not
# in these kernels); both ends shaped with tc tbf (RATES); TCP between them.
#
# A run's loss at each step does not depend on the link (the runs are deterministic: the link
# changes only time), so:
#   - DiLoCo methods (FULL) run the whole recipe on the slowest rate: loss, bytes and wall-clock
#     measured together;
#   - DDP, DDP + PowerSGD and post-local SGD (SHORT), which cross the link every step (post-local
#     SGD: every 4 steps), run STEPS_SHORT steps per rate: their recipe time is that step time x
#     2000 (derived, said so in the table); their loss curves are full runs on the unshaped link
#     (LOSS; DDP's at world 2: the newest bench/gpt.sh candle-w2 metrics);
#   - on the faster rates every method runs max(STEPS_SHORT, 2H) steps for its step time.
# One compute thread per rank. Prints a markdown table; rows in $OUT.jsonl, curves in $OUT.*.
# Needs root (ip netns, tc).
#   sudo bench/diloco.sh          RATES="10mbit 1gbit" STEPS_SHORT=30 NPROC=1 DELAY_MS=0
set -euo pipefail
cd "$(dirname "$0")/.."
RATES=${RATES:-"10mbit 1gbit"}
FULL=${FULL:-"diloco:50 diloco:100 diloco:500 streaming-diloco:100:4:5"}
SHORT=${SHORT:-"none powersgd:4:2 localsgd:4:100"}
# The full runs of the SHORT methods for their loss (at world 2 DDP's is bench/gpt.sh's).
LOSS=${LOSS:-"$([ "${NPROC:-1}" = 1 ] || echo none) powersgd:4:2 localsgd:4:100"}
STEPS=${STEPS:-2000}
STEPS_SHORT=${STEPS_SHORT:-30}
NPROC=${NPROC:-1}
DELAY_MS=${DELAY_MS:-0}
OUT=${OUT:-bench/results/diloco-$(date -u +%Y%m%d-%H%M)}
[ "$(id -u)" = 0 ] || { echo "diloco.sh: needs root (ip netns, tc)" >&2; exit 2; }
mkdir -p "$(dirname "$OUT")"
cargo build --release -q -p train-gpt -p ddprun
GPT=$PWD/target/release/train-gpt
RUN=$PWD/target/release/ddprun

. bench/lib/link.sh
link_up dl "$DELAY_MS"

# run RATE HOOK STEPS: one run, its JSON line (with rate and hook) appended to $OUT.jsonl.
port=29600
run() {
  local rate=$1 hook=$2 steps=$3 tag
  tag="w$((2 * NPROC))-d${DELAY_MS}-${rate}-${hook//:/_}-${steps}"
  shape "$rate"
  port=$((port + 1))
  local pids=()
  for i in 0 1; do
    ip netns exec "${NS[$i]}" env DDP_BACKEND=tcp RAYON_NUM_THREADS=1 OMP_NUM_THREADS=1 \
      "$RUN" --nnodes 2 --node-rank "$i" --nproc-per-node "$NPROC" --master-addr "${ADDR[0]}" \
      --master-port "$port" "$GPT" --framework candle --hook "$hook" --max-iters "$steps" \
      --metrics "$OUT.$tag.metrics.jsonl" --json >"$OUT.$tag.$i.out" 2>"$OUT.$tag.$i.err" &
    pids+=($!)
  done
  wait "${pids[@]}" # not the link's relay
  record "$tag" "$rate" "$hook" "$DELAY_MS"
}

# record TAG RATE HOOK DELAY: rank 0's JSON line of run TAG, with the rate, method and delay,
# appended to $OUT.jsonl.
record() {
  grep -h '{"framework"' "$OUT.$1.0.out" | sed 's/^[^{]*//' | python3 -c "
import json, sys
j = json.loads(sys.stdin.read())
j.update(rate='$2', method='$3', delay_ms=$4, metrics='$OUT.$1.metrics.jsonl')
print(json.dumps(j))" >>"$OUT.jsonl"
  echo "# $1: $(tail -n 1 "$OUT.jsonl" | cut -c1-160)" >&2
}

# run_local HOOK STEPS: the whole recipe on this host (no link: the loss curve only).
run_local() {
  local hook=$1 steps=$2 tag
  tag="w$((2 * NPROC))-local-${hook//:/_}-${steps}"
  port=$((port + 1))
  env DDP_BACKEND=tcp RAYON_NUM_THREADS=1 OMP_NUM_THREADS=1 "$RUN" --standalone \
    --nproc-per-node $((2 * NPROC)) --master-port "$port" "$GPT" --framework candle \
    --hook "$hook" --max-iters "$steps" --metrics "$OUT.$tag.metrics.jsonl" --json \
    >"$OUT.$tag.0.out" 2>"$OUT.$tag.0.err"
  record "$tag" local "$hook" 0
}

slowest=${RATES%% *}
for hook in $LOSS; do run_local "$hook" "$STEPS"; done
for hook in $FULL; do run "$slowest" "$hook" "$STEPS"; done
for rate in $RATES; do
  # Post-local SGD is timed after its warm-up (localsgd:P:0); its recipe time is WARMUP DDP
  # steps and the rest at that pace (derived).
  for hook in $SHORT; do run "$rate" "$(echo "$hook" | sed -E 's/^(localsgd:[0-9]+):[0-9]+$/\1:0/')" "$STEPS_SHORT"; done
  [ "$rate" = "$slowest" ] && continue
  for hook in $FULL; do
    h=${hook#*:}; h=${h%%:*}
    n=$((2 * h > STEPS_SHORT ? 2 * h : STEPS_SHORT))
    run "$rate" "$hook" "$n"
  done
done
python3 bench/diloco_summary.py "$OUT.jsonl" "$STEPS" | tee "$OUT.md"
