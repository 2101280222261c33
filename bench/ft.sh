#!/usr/bin/env bash
# What a lost rank costs train-gpt (candle, the default 4x128 model, world 3 under ddprun on one
# host), two ways, side by side:
#   restart  today's path: ddprun --max-restarts 1 stops every worker, starts 3 new ones, and
#            they resume from the last checkpoint (--checkpoint-every EVERY, default 100)
#   inplace  ddprun --fault-tolerance: the survivors regroup and go on at world 2, no checkpoint
# Each trial SIGKILLs rank VICTIM (default 2) DELAY seconds after the workers started (a seeded
# draw in [MIN_DELAY, MAX_DELAY), the same draws for both ways), then records
#   steps lost   = steps completed when the kill came - the step training went on from, + 1 (the
#                  step in flight, partially trained)
#   recovery (s) = from the kill to the first step completed after it (by the restarted workers,
#                  or by the survivors at world 2)
# TRIALS rounds (default 5), the two ways interleaved. One thread per rank (RAYON_NUM_THREADS=1).
#   bench/ft.sh          TRIALS=5 STEPS=600 EVERY=100 MIN_DELAY=4 MAX_DELAY=12 VICTIM=2
set -euo pipefail
cd "$(dirname "$0")/.."
TRIALS=${TRIALS:-5}
STEPS=${STEPS:-600}
EVERY=${EVERY:-100}
MIN_DELAY=${MIN_DELAY:-4}
MAX_DELAY=${MAX_DELAY:-12}
VICTIM=${VICTIM:-2}
export RAYON_NUM_THREADS=1 OMP_NUM_THREADS=1
OUT=${OUT:-bench/results/ft-$(date -u +%Y%m%d-%H%M).jsonl}
mkdir -p "$(dirname "$OUT")"
cargo build --release -q -p train-gpt -p ddprun
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
now_ms() { date +%s%3N; }

trial() { # way delay_ms trial
  local way=$1 delay=$2 t=$3
  rm -rf "$dir/pids" "$dir/ck" "$dir/out" "$dir/err"
  mkdir -p "$dir/pids"
  local launch=(--standalone --nproc-per-node 3)
  local extra=()
  if [ "$way" = restart ]; then
    launch+=(--max-restarts 1)
    extra=(--checkpoint-dir "$dir/ck" --checkpoint-every "$EVERY" --resume)
  else
    launch+=(--fault-tolerance)
  fi
  TRAIN_GPT_DEBUG_PID_DIR="$dir/pids" ./target/release/ddprun "${launch[@]}" \
    ./target/release/train-gpt --framework candle --max-iters "$STEPS" \
    --eval-interval 1000000 --json "${extra[@]}" >"$dir/out" 2>"$dir/err" &
  local job=$!
  while [ ! -s "$dir/pids/rank$VICTIM.pid" ]; do sleep 0.01; done
  sleep "$(python3 -c "print($delay / 1000)")"
  local done_at_kill
  done_at_kill=$(cat "$dir/pids/rank$VICTIM.step" 2>/dev/null || echo 0)
  local kill_ms
  kill_ms=$(now_ms)
  kill -9 "$(cat "$dir/pids/rank$VICTIM.pid")"
  wait "$job" || { echo "ddprun failed ($way, trial $t):" >&2; tail -n 20 "$dir/err" >&2; exit 1; }
  python3 - "$way" "$t" "$delay" "$done_at_kill" "$kill_ms" "$dir/out" >>"$OUT" <<'PY'
import json, sys
way, t, delay, done, kill_ms, out = sys.argv[1:]
line = [l for l in open(out) if '{"framework"' in l][-1]
j = json.loads(line[line.index("{"):])
if way == "inplace":
    r = j["regroups"][0]
    went_on_from, first = r["step"], r["first_step_unix_ms"]
else:
    went_on_from, first = j["start_step"], j["first_step_unix_ms"]
print(json.dumps({
    "way": way, "trial": int(t), "delay_ms": int(delay), "done_at_kill": int(done),
    "went_on_from": went_on_from, "steps_lost": int(done) - went_on_from + 1,
    "recovery_s": (first - int(kill_ms)) / 1000, "final_world": j["world_size"],
    "val_loss": j["val_loss"], "replicas_identical": j["replicas_identical"],
}))
PY
}

for t in $(seq "$TRIALS"); do
  delay=$(python3 -c "import random; r = random.Random($t); print(int(1000 * r.uniform($MIN_DELAY, $MAX_DELAY)))")
  for way in $(printf '%s\n' restart inplace | shuf); do
    trial "$way" "$delay" "$t"
  done
done
python3 - "$OUT" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
print("| way | trials | steps lost (median, max) | recovery s (median, max) | final world |")
print("|---|---|---|---|---|")
for way in ("restart", "inplace"):
    rs = [r for r in rows if r["way"] == way]
    lost = [r["steps_lost"] for r in rs]
    rec = [r["recovery_s"] for r in rs]
    print(f"| {way} | {len(rs)} | {statistics.median(lost):.0f}, {max(lost)} | "
          f"{statistics.median(rec):.2f}, {max(rec):.2f} | {rs[0]['final_world']} |")
PY
