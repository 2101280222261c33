#!/usr/bin/env bash
# Runs the peer baselines (PyTorch gloo allreduce, OpenMPI allreduce, PyTorch DDP-gloo training)
# REPS times each (default 3, interleaved so machine noise spreads over all of them) and prints
# medians. Optional; not run by CI. Every run is bounded by `timeout`.
#
#   bench/peers/run.sh                      # everything
#   REPS=1 MAX_BYTES=4M bench/peers/run.sh  # quicker
#   SKIP_MPI=1 / SKIP_GLOO=1 / SKIP_TRAIN=1 # skip a part
#   RESULTS_DIR=/some/dir                   # keep the raw per-run JSON there (default: a new /tmp dir)
#   MPIRUN_ARGS="--mca mpi_yield_when_idle 1"  # extra mpirun flags
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPS="${REPS:-3}"
MIN_BYTES="${MIN_BYTES:-1K}"
MAX_BYTES="${MAX_BYTES:-64M}"
STEPS="${STEPS:-100}"
PY="${PYTHON:-python3}"
RESULTS_DIR="${RESULTS_DIR:-$(mktemp -d /tmp/ddp-peers.XXXXXX)}"
mkdir -p "$RESULTS_DIR"

if [[ -z "${SKIP_GLOO:-}" || -z "${SKIP_TRAIN:-}" ]]; then
  if ! timeout 120 "$PY" -c "import torch.distributed as d; assert d.is_gloo_available()" 2>/dev/null; then
    echo "run.sh: PyTorch with gloo not importable by $PY; install it (see bench/peers/README.md) or set SKIP_GLOO=1 SKIP_TRAIN=1" >&2
    exit 1
  fi
fi
if [[ -z "${SKIP_MPI:-}" ]]; then
  command -v mpicc >/dev/null && command -v mpirun >/dev/null || {
    echo "run.sh: mpicc/mpirun not found; apt-get install openmpi-bin libopenmpi-dev, or set SKIP_MPI=1" >&2
    exit 1
  }
  mpicc -O2 -o "$RESULTS_DIR/mpi_allreduce" "$HERE/mpi_allreduce.c"
fi

echo "# peer baselines: $(nproc) cores, $(uname -sr), reps=$REPS, results in $RESULTS_DIR"
echo "# load at start: $(cut -d' ' -f1-3 /proc/loadavg)"

for rep in $(seq 1 "$REPS"); do
  echo "# rep $rep/$REPS (load $(cut -d' ' -f1-3 /proc/loadavg))" >&2
  if [[ -z "${SKIP_GLOO:-}" ]]; then
    timeout 900 "$PY" "$HERE/gloo_allreduce.py" --op all_reduce --nproc 2 --min-bytes "$MIN_BYTES" \
      --max-bytes "$MAX_BYTES" --timeout 840 --json > "$RESULTS_DIR/gloo.$rep.jsonl"
  fi
  if [[ -z "${SKIP_MPI:-}" ]]; then
    # --bind-to none: the two ranks share 2 cores with everything else; let the kernel place them.
    # shellcheck disable=SC2086
    timeout 900 mpirun --allow-run-as-root --oversubscribe --bind-to none ${MPIRUN_ARGS:-} -np 2 \
      "$RESULTS_DIR/mpi_allreduce" --min-bytes "$MIN_BYTES" --max-bytes "$MAX_BYTES" --json \
      > "$RESULTS_DIR/mpi.$rep.jsonl"
  fi
  if [[ -z "${SKIP_TRAIN:-}" ]]; then
    timeout 900 "$PY" "$HERE/torch_ddp_train.py" --nproc 1 --mode plain --steps "$STEPS" --timeout 840 --json \
      > "$RESULTS_DIR/train.plain1.$rep.jsonl"
    timeout 900 "$PY" "$HERE/torch_ddp_train.py" --nproc 1 --mode ddp --steps "$STEPS" --timeout 840 --json \
      > "$RESULTS_DIR/train.ddp1.$rep.jsonl"
    timeout 900 "$PY" "$HERE/torch_ddp_train.py" --nproc 2 --mode ddp --steps "$STEPS" --timeout 840 --json \
      > "$RESULTS_DIR/train.ddp2.$rep.jsonl"
  fi
done

echo "# load at end: $(cut -d' ' -f1-3 /proc/loadavg)"
[[ -n "${SKIP_GLOO:-}" ]] || { echo; "$PY" "$HERE/summarize.py" collective "torch gloo all_reduce (2 ranks)" "$RESULTS_DIR"/gloo.*.jsonl; }
[[ -n "${SKIP_MPI:-}" ]] || { echo; "$PY" "$HERE/summarize.py" collective "OpenMPI MPI_Allreduce (2 ranks)" "$RESULTS_DIR"/mpi.*.jsonl; }
[[ -n "${SKIP_TRAIN:-}" ]] || { echo; "$PY" "$HERE/summarize.py" train "$RESULTS_DIR"/train.*.jsonl; }
