#!/usr/bin/env bash
# DiLoCo against DDP on slow links: train-gpt (candle, nanoGPT's CPU recipe, 2000 steps) at world
# 2, one rank in each of two network namespaces joined by a veth pair whose both ends are shaped
# with tc tbf (RATES; netem, hence a fixed delay, is not in these kernels), TCP between them.
#
# A run's loss at each step does not depend on the link (the runs are deterministic: the link
# changes only time), so:
#   - DiLoCo methods (FULL) run the whole recipe on the slowest rate: loss, bytes and wall-clock
#     measured together;
#   - DDP and DDP + PowerSGD (SHORT), whose every step crosses the link, run STEPS_SHORT steps per
#     rate: their recipe time is that step time x 2000 (derived, said so in the table); their
#     loss curves are full runs on the unshaped pair (DDP's: the newest bench/gpt.sh candle-w2
#     metrics; PowerSGD's: run here, LOSS);
#   - on the faster rates every method runs max(STEPS_SHORT, 2H) steps for its step time.
# One compute thread per rank. Prints a markdown table; rows in $OUT.jsonl, curves in $OUT.*.
# Needs root (ip netns, tc).
#   sudo bench/diloco.sh          RATES="10mbit 1gbit" STEPS_SHORT=30
set -euo pipefail
cd "$(dirname "$0")/.."
RATES=${RATES:-"10mbit 1gbit"}
FULL=${FULL:-"diloco:50 diloco:100 diloco:500 streaming-diloco:100:4:5"}
SHORT=${SHORT:-"none powersgd:4:2"}
LOSS=${LOSS:-"powersgd:4:2"}
STEPS=${STEPS:-2000}
STEPS_SHORT=${STEPS_SHORT:-30}
OUT=${OUT:-bench/results/diloco-$(date -u +%Y%m%d-%H%M)}
[ "$(id -u)" = 0 ] || { echo "diloco.sh: needs root (ip netns, tc)" >&2; exit 2; }
mkdir -p "$(dirname "$OUT")"
cargo build --release -q -p train-gpt -p ddprun
GPT=$PWD/target/release/train-gpt
RUN=$PWD/target/release/ddprun

TAG=$$
NS=("dl${TAG}a" "dl${TAG}b")
DEV=("dl${TAG}x" "dl${TAG}y")
ADDR=(10.79.0.1 10.79.0.2)
cleanup() { for n in "${NS[@]}"; do ip netns del "$n" 2>/dev/null || true; done; }
trap cleanup EXIT INT TERM
ip netns add "${NS[0]}"
ip netns add "${NS[1]}"
ip link add "${DEV[0]}" netns "${NS[0]}" type veth peer name "${DEV[1]}" netns "${NS[1]}"
for i in 0 1; do
  ip -n "${NS[$i]}" addr add "${ADDR[$i]}/24" dev "${DEV[$i]}"
  ip -n "${NS[$i]}" link set lo up
  ip -n "${NS[$i]}" link set "${DEV[$i]}" up
done

# tbf on the egress of both ends (burst >= rate / HZ); "none": unshaped.
shape() {
  local rate=$1 burst
  for i in 0 1; do
    tc -n "${NS[$i]}" qdisc del dev "${DEV[$i]}" root 2>/dev/null || true
    [ "$rate" = none ] && continue
    case $rate in
      10mbit) burst=16kb ;;
      100mbit) burst=64kb ;;
      *) burst=512kb ;;
    esac
    tc -n "${NS[$i]}" qdisc replace dev "${DEV[$i]}" root tbf rate "$rate" burst "$burst" latency 50ms
  done
}

# run RATE HOOK STEPS: one run, its JSON line (with rate and hook) appended to $OUT.jsonl.
port=29600
run() {
  local rate=$1 hook=$2 steps=$3 tag
  tag="${rate}-${hook//:/_}-${steps}"
  shape "$rate"
  port=$((port + 1))
  for i in 0 1; do
    ip netns exec "${NS[$i]}" env DDP_BACKEND=tcp RAYON_NUM_THREADS=1 OMP_NUM_THREADS=1 \
      "$RUN" --nnodes 2 --node-rank "$i" --nproc-per-node 1 --master-addr "${ADDR[0]}" \
      --master-port "$port" "$GPT" --framework candle --hook "$hook" --max-iters "$steps" \
      --metrics "$OUT.$tag.metrics.jsonl" --json >"$OUT.$tag.$i.out" 2>"$OUT.$tag.$i.err" &
  done
  wait
  grep -h '{"framework"' "$OUT.$tag.0.out" | sed 's/^[^{]*//' | python3 -c "
import json, sys
j = json.loads(sys.stdin.read())
j.update(rate='$rate', method='$hook', metrics='$OUT.$tag.metrics.jsonl')
print(json.dumps(j))" >>"$OUT.jsonl"
  echo "# $tag: $(tail -n 1 "$OUT.jsonl" | cut -c1-160)" >&2
}

slowest=${RATES%% *}
for hook in $LOSS; do run none "$hook" "$STEPS"; done
for hook in $FULL; do run "$slowest" "$hook" "$STEPS"; done
for rate in $RATES; do
  for hook in $SHORT; do run "$rate" "$hook" "$STEPS_SHORT"; done
  [ "$rate" = "$slowest" ] && continue
  for hook in $FULL; do
    h=${hook#*:}; h=${h%%:*}
    n=$((2 * h > STEPS_SHORT ? 2 * h : STEPS_SHORT))
    run "$rate" "$hook" "$n"
  done
done
python3 bench/diloco_summary.py "$OUT.jsonl" "$STEPS" | tee "$OUT.md"
