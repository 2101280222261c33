#!/usr/bin/env bash
# Comm hooks on a link we throttle ourselves: two network namespaces ("hosts") joined by a veth
# pair whose both ends are shaped with tc tbf (netem is not in these kernels), one rank per
# namespace, TCP across (DDP_BACKEND=tcp for ddp-rs, gloo over GLOO_SOCKET_IFNAME for PyTorch).
#
# For each rate and hook it runs, REPEATS times (interleaved; repeat k uses seed k-1 on both sides,
# since the steps to the target depend on the initialization):
#   - train-digits --hidden $HIDDEN --hook H --target-accuracy $TARGET  (time-to-accuracy; candle)
#   - train-digits-burn, the same flags (the same data, split and recipe; Burn's flex backend)
#   - bench/peers/torch_digits_hooks.py, the same recipe with PyTorch DDP-gloo and its own hooks
#   - once per rate and hook: ddp-bench train --hook H (step time and bytes_per_step)
# and prints medians as markdown tables (also written to $OUT/tables.md). Every rank runs one
# compute thread (OMP_NUM_THREADS=1 for PyTorch, RAYON_NUM_THREADS=1 for candle), as ddprun and
# torchrun set it for several workers per host: candle's spinning gemm threads otherwise triple
# its step time on a shared 2-core machine.
#
# Needs root (ip netns, tc), release builds of train-digits, train-digits-burn and ddp-bench, and
# python3 with torch and numpy for the peer (skipped, with a note, when `import torch` fails).
#
#   sudo bench/shaped_link.sh                       # 100mbit and 1gbit, 3 repeats
#   RATES=100mbit REPEATS=1 HOOKS="none bf16" sudo -E bench/shaped_link.sh
#   FRAMEWORKS=candle sudo -E bench/shaped_link.sh  # ddp-rs sides (default "candle burn";
#                                                   # candle-staged: --backward staged)
#   ACC_EPOCHS=0 sudo -E bench/shaped_link.sh       # skip the fixed-length accuracy runs
#   BATCH=8 sudo -E bench/shaped_link.sh   # per-rank batch (default 32): a smaller one makes the
#                                          # step communication-bound, as on GPUs
set -euo pipefail

RATES=${RATES:-"100mbit 1gbit"}
# PowerSGD from step 2 (the earliest PyTorch allows with error feedback) and from step 10.
HOOKS=${HOOKS:-"none fp16 bf16 powersgd:2:2 powersgd:4:2 powersgd:2:10 localsgd:4:20"}
FRAMEWORKS=${FRAMEWORKS:-"candle burn"}
# Final accuracy is compared after a fixed number of epochs (a run stopped at the target ends
# wherever the target was crossed), on the unshaped link: REPEATS runs of ACC_EPOCHS per side.
ACC_EPOCHS=${ACC_EPOCHS:-10}
REPEATS=${REPEATS:-3}
HIDDEN=${HIDDEN:-4096}
BATCH=${BATCH:-32}
TARGET=${TARGET:-0.95}
EPOCHS=${EPOCHS:-30}
OUT=${OUT:-$(mktemp -d /tmp/shaped_link.XXXXXX)}
mkdir -p "$OUT"
ROOT=$(cd "$(dirname "$0")/.." && pwd)
TD=$ROOT/target/release/train-digits
TB=$ROOT/target/release/train-digits-burn
DB=$ROOT/target/release/ddp-bench
PEER=$ROOT/bench/peers/torch_digits_hooks.py

[ "$(id -u)" = 0 ] || { echo "shaped_link.sh: needs root (ip netns, tc)" >&2; exit 2; }
for b in "$TD" "$TB" "$DB"; do
    [ -x "$b" ] || { echo "missing $b: cargo build --release -p train-digits -p train-digits-burn -p ddp-bench" >&2; exit 2; }
done
HAVE_TORCH=1
python3 -c "import torch" 2>/dev/null || { HAVE_TORCH=0; echo "# torch not importable: no PyTorch peer" >&2; }

# The two hosts and their link (unshaped until `shape RATE LOG`).
. "$ROOT/bench/lib/link.sh"
link_up hk 0

# ddp_side FW: the command of ddp-rs side FW (candle, candle-staged or burn).
ddp_side() {
    case $1 in
        candle) echo "$TD" ;;
        candle-staged) echo "$TD --backward staged" ;;
        burn) echo "$TB" ;;
        *) echo "unknown framework $1" >&2; exit 2 ;;
    esac
}

PORT=29700
# run_pair NAME CMD...: rank i runs CMD in namespace i with the torchrun environment; rank 0's
# last line goes to $OUT/NAME.jsonl.
run_pair() {
    local name=$1; shift
    PORT=$((PORT + 1))
    local pids=()
    for i in 0 1; do
        ip netns exec "${NS[$i]}" env RANK=$i WORLD_SIZE=2 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 \
            MASTER_ADDR="${ADDR[0]}" MASTER_PORT=$PORT DDP_BACKEND=tcp \
            GLOO_SOCKET_IFNAME="${DEV[$i]}" OMP_NUM_THREADS=1 RAYON_NUM_THREADS=1 \
            timeout 900 "$@" >"$OUT/rank$i.log" 2>&1 &
        pids+=($!)
    done
    local rc=0
    for p in "${pids[@]}"; do wait "$p" || rc=$?; done
    if [ $rc -ne 0 ]; then
        echo "# $name failed ($rc):" >&2; tail -n 5 "$OUT/rank0.log" "$OUT/rank1.log" >&2 || true
        return 0
    fi
    grep '^{' "$OUT/rank0.log" | tail -1 >>"$OUT/$name.jsonl"
}

echo "# results in $OUT; hidden $HIDDEN, batch $BATCH per rank, target accuracy $TARGET, $REPEATS repeats" >&2
echo "# machine: $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg)" | tee "$OUT/machine.txt" >&2
if [ "$ACC_EPOCHS" -gt 0 ]; then
    for rep in $(seq "$REPEATS"); do
        for h in $HOOKS; do
            echo "# accuracy after $ACC_EPOCHS epochs, rep $rep $h" >&2
            for fw in $FRAMEWORKS; do
                # shellcheck disable=SC2046
                run_pair "acc_${fw}_$h" $(ddp_side "$fw") --backend tcp --hidden "$HIDDEN" --epochs "$ACC_EPOCHS" \
                    --log-every 0 --json --hook "$h" --seed $((rep - 1)) --batch-size "$BATCH"
            done
            if [ $HAVE_TORCH = 1 ]; then
                run_pair "acc_torch_$h" python3 -W ignore "$PEER" --hidden "$HIDDEN" \
                    --epochs "$ACC_EPOCHS" --hook "$h" --seed $((rep - 1)) --batch-size "$BATCH"
            fi
        done
    done
fi
for rate in $RATES; do
    shape "$rate" "$OUT/shaping.txt"
    grep -F "$rate " "$OUT/shaping.txt" | tail -n 2 >&2
    run_pair "allreduce_$rate" "$DB" allreduce --backend tcp --min-bytes 4M --max-bytes 4M --json
    for h in $HOOKS; do
        # Compression from the first step here (START_ITER / WARMUP set to 0): 10 timed steps.
        hb=$(echo "$h" | sed -E 's/^(powersgd|localsgd):([0-9]+):[0-9]+$/\1:\2:0/')
        run_pair "bench_${rate}_$h" "$DB" train --backend tcp --hidden 1024 --layers 2 \
            --steps 10 --warmup 2 --json --hook "$hb"
    done
    for rep in $(seq "$REPEATS"); do
        for h in $HOOKS; do
            echo "# $rate rep $rep $h" >&2
            for fw in $FRAMEWORKS; do
                # shellcheck disable=SC2046 # the side's command and its flags, word-split
                run_pair "${fw}_${rate}_$h" $(ddp_side "$fw") --backend tcp --hidden "$HIDDEN" --epochs "$EPOCHS" \
                    --log-every 0 --json --target-accuracy "$TARGET" --hook "$h" --seed $((rep - 1)) --batch-size "$BATCH"
            done
            if [ $HAVE_TORCH = 1 ]; then
                run_pair "torch_${rate}_$h" python3 -W ignore "$PEER" --hidden "$HIDDEN" \
                    --epochs "$EPOCHS" --target-accuracy "$TARGET" --hook "$h" --seed $((rep - 1)) --batch-size "$BATCH"
            fi
        done
    done
done
python3 "$ROOT/bench/shaped_link_summary.py" "$OUT" "$RATES" "$HOOKS" "$FRAMEWORKS" "$ACC_EPOCHS" | tee "$OUT/tables.md"
