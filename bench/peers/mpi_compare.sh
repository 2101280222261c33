#!/usr/bin/env bash
# ddp-comm's mpi backend against raw MPI_Allreduce, in the same run, 2 ranks, interleaved:
#   REPS x { mpi_allreduce.c (MPI_Init; MPI_THREAD_MULTIPLE; --nonblocking) ;
#            ddp-bench allreduce --backend mpi with DDP_MPI_FINGERPRINTS=1/0, each blocking
#            (default) and with DDP_MPI_NONBLOCKING=1 ; ddp-bench --backend tcp ; --backend shm }
# then per size the median over runs of each, the busbw ratio to raw and the latency added,
# and tcp/shm side by side (the README's backend table).
#
#   bench/peers/mpi_compare.sh                   # REPS=5 MIN_BYTES=1K MAX_BYTES=16M
#   RESULTS_DIR=/tmp/mpicmp REPS=3 PRIO="nice -n -10" bench/peers/mpi_compare.sh
#
# Needs mpicc/mpirun (apt-get install openmpi-bin libopenmpi-dev) and libclang (bindgen).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
REPS=${REPS:-5}
MIN_BYTES=${MIN_BYTES:-1K}
MAX_BYTES=${MAX_BYTES:-16M}
OUT=${RESULTS_DIR:-$(mktemp -d /tmp/mpi_compare.XXXXXX)}
mkdir -p "$OUT"
mpicc -O2 -o "$OUT/mpi_allreduce" "$HERE/mpi_allreduce.c"
[ -n "${BENCH:-}" ] || (cd "$ROOT" && cargo build --release -q -p ddp-bench --features mpi)
BENCH=${BENCH:-$ROOT/target/release/ddp-bench}
# PRIO (e.g. "nice -n -10", as root) runs every job at that priority: on a machine shared
# with builds, spinning ranks otherwise lose their cores for whole time slices.
run() { ${PRIO:-} timeout 900 mpirun --allow-run-as-root --oversubscribe --bind-to none ${MPIRUN_ARGS:-} -np 2 "$@"; }
# EXTRA: more arguments for both programs (e.g. "--iters 50": more timed iterations per size).
S=(--min-bytes "$MIN_BYTES" --max-bytes "$MAX_BYTES" --json ${EXTRA:-})
# KINDS: which runs, of: raw rawmt rawnb mpi_fp1 mpi_fp0 mpinb_fp1 mpinb_fp0 tcp shm (default all).
KINDS=${KINDS:-raw rawmt rawnb mpi_fp1 mpi_fp0 mpinb_fp1 mpinb_fp0 tcp shm}
one() {
  case $1 in
    raw) run "$OUT/mpi_allreduce" "${S[@]}" ;;
    rawmt) run "$OUT/mpi_allreduce" --thread-multiple "${S[@]}" ;;
    rawnb) run "$OUT/mpi_allreduce" --nonblocking "${S[@]}" ;;
    mpi_fp?) run -x DDP_MPI_FINGERPRINTS=${1#mpi_fp} "$BENCH" allreduce --backend mpi "${S[@]}" ;;
    mpinb_fp?) run -x DDP_MPI_FINGERPRINTS=${1#mpinb_fp} -x DDP_MPI_NONBLOCKING=1 "$BENCH" allreduce \
      --backend mpi "${S[@]}" ;;
    tcp | shm) ${PRIO:-} timeout 900 "$BENCH" allreduce --backend "$1" --nproc 2 "${S[@]}" ;;
  esac
}
for rep in $(seq "$REPS"); do
  for k in $KINDS; do one "$k" >"$OUT/$k.$rep.jsonl"; done
done
python3 - "$OUT" "$REPS" <<'PY'
import json, statistics, sys, glob
out, reps = sys.argv[1], sys.argv[2]
def med(kind):
    by = {}
    for p in glob.glob(f"{out}/{kind}.*.jsonl"):
        for line in open(p):
            if line.startswith("{"):
                r = json.loads(line)
                by.setdefault(r["bytes"], []).append(r)
                assert r["wrong"] == 0, (kind, r)
    return {b: (statistics.median(x["time_us"] for x in rs), statistics.median(x["busbw_gbs"] for x in rs), len(rs))
            for b, rs in by.items()}
kinds = ["raw", "rawmt", "rawnb", "mpi_fp1", "mpi_fp0", "mpinb_fp1", "mpinb_fp0", "tcp", "shm"]
d = {k: med(k) for k in kinds}
kinds = [k for k in kinds if d[k]]
raw = d["raw"]
print(f"# 2 ranks, medians of {reps} interleaved runs (n = runs per cell). raw: MPI_Allreduce after MPI_Init;")
print("# rawmt: the same after MPI_Init_thread(MULTIPLE); rawnb: MPI_Iallreduce + MPI_Test; mpi_fpX:")
print("# ddp-bench --backend mpi, fingerprints on/off; mpinb_fpX: the same with DDP_MPI_NONBLOCKING=1")
print("# time_us / busbw_GBs:")
print(f"{'bytes':>10} " + " ".join(f"{k:>17}" for k in kinds))
for b in sorted(raw):
    cells = [f"{d[k][b][0]:.1f} / {d[k][b][1]:.2f}" if b in d[k] else "-" for k in kinds]
    print(f"{b:>10} " + " ".join(f"{c:>17}" for c in cells))
print()
print("# against raw MPI_Allreduce: busbw ratio and +us (time - raw time)")
mpis = [k for k in kinds if k not in ("raw", "tcp", "shm")]
print(f"{'bytes':>10} " + " ".join(f"{k:>17}" for k in mpis))
for b in sorted(raw):
    rt, rb, _ = raw[b]
    cells = [f"{d[k][b][1] / rb:.3f} {d[k][b][0] - rt:+.1f}" if b in d[k] else "-" for k in mpis]
    print(f"{b:>10} " + " ".join(f"{c:>17}" for c in cells))
PY
echo "# raw results in $OUT"
