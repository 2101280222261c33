#!/usr/bin/env bash
# ddp-comm's mpi backend against raw MPI_Allreduce, in the same run, 2 ranks, interleaved:
#   REPS x { mpi_allreduce.c ; mpi_allreduce.c --nonblocking ; ddp-bench allreduce --backend mpi ; the same with
#            DDP_MPI_FINGERPRINTS=0 ; ddp-bench --backend tcp ; ddp-bench --backend shm }
# then per size the median over runs of each, the busbw ratio ddp/raw and the latency added,
# and tcp/shm side by side (the README's backend table).
#
#   bench/peers/mpi_compare.sh                   # REPS=5 MIN_BYTES=1K MAX_BYTES=16M
#   RESULTS_DIR=/tmp/mpicmp REPS=3 bench/peers/mpi_compare.sh
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
(cd "$ROOT" && cargo build --release -q -p ddp-bench --features mpi)
BENCH="$ROOT/target/release/ddp-bench"
run() { timeout 900 mpirun --allow-run-as-root --oversubscribe --bind-to none ${MPIRUN_ARGS:-} -np 2 "$@"; }
for rep in $(seq "$REPS"); do
  run "$OUT/mpi_allreduce" --min-bytes "$MIN_BYTES" --max-bytes "$MAX_BYTES" --json >"$OUT/raw.$rep.jsonl"
  run "$OUT/mpi_allreduce" --nonblocking --min-bytes "$MIN_BYTES" --max-bytes "$MAX_BYTES" --json \
    >"$OUT/rawnb.$rep.jsonl"
  run -x DDP_MPI_FINGERPRINTS=1 "$BENCH" allreduce --backend mpi --min-bytes "$MIN_BYTES" \
    --max-bytes "$MAX_BYTES" --json >"$OUT/ddp.$rep.jsonl"
  run -x DDP_MPI_FINGERPRINTS=0 "$BENCH" allreduce --backend mpi --min-bytes "$MIN_BYTES" \
    --max-bytes "$MAX_BYTES" --json >"$OUT/nofp.$rep.jsonl"
  for b in tcp shm; do
    timeout 900 "$BENCH" allreduce --backend $b --nproc 2 --min-bytes "$MIN_BYTES" \
      --max-bytes "$MAX_BYTES" --json >"$OUT/$b.$rep.jsonl"
  done
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
    return {b: (statistics.median(x["time_us"] for x in rs), statistics.median(x["busbw_gbs"] for x in rs))
            for b, rs in by.items()}
raw, ddp, nofp, tcp, shm = med("raw"), med("ddp"), med("nofp"), med("tcp"), med("shm")
rawnb = med("rawnb")
print(f"# 2 ranks, medians of {reps} interleaved runs; ratio = ddp busbw / raw busbw; "
      f"+us = ddp time - raw time")
print(f"{'bytes':>10} {'raw_us':>10} {'ddp_us':>10} {'nofp_us':>10} {'raw_busbw':>10} {'ddp_busbw':>10} "
      f"{'ratio':>7} {'ratio_nofp':>10} {'+us':>8} {'+us_nofp':>8}")
for b in sorted(raw):
    if b not in ddp or b not in nofp:
        continue
    (rt, rb), (dt, db), (nt, nb) = raw[b], ddp[b], nofp[b]
    print(f"{b:>10} {rt:>10.2f} {dt:>10.2f} {nt:>10.2f} {rb:>10.3f} {db:>10.3f} "
          f"{db / rb:>7.3f} {nb / rb:>10.3f} {dt - rt:>8.2f} {nt - rt:>8.2f}")
print()
print("# against the non-blocking baseline (MPI_Iallreduce + MPI_Test, what the backend issues)")
print(f"{'bytes':>10} {'rawnb_us':>10} {'ddp_us':>10} {'ratio':>7} {'+us':>8}")
for b in sorted(rawnb):
    if b in ddp:
        (rt, rb), (dt, db) = rawnb[b], ddp[b]
        print(f"{b:>10} {rt:>10.2f} {dt:>10.2f} {db / rb:>7.3f} {dt - rt:>8.2f}")
print()
print(f"# side by side: time_us / busbw_GBs (medians)")
print(f"{'bytes':>10} {'raw MPI':>18} {'raw MPI_I*':>18} {'mpi':>18} {'tcp':>18} {'shm':>18}")
for b in sorted(raw):
    cells = [f"{d[b][0]:.1f} / {d[b][1]:.3f}" if b in d else "-" for d in (raw, rawnb, ddp, tcp, shm)]
    print(f"{b:>10} " + " ".join(f"{c:>18}" for c in cells))
PY
echo "# raw results in $OUT"
