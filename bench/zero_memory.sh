#!/usr/bin/env bash
# ZeRO memory and throughput: ddp-bench train with AdamW at --zero 0, 1, 2, 3 on an MLP of
# ~52 M parameters (784-2048x13-10), world 2 by default; RUNS runs each (interleaved), medians,
# and the per-rank formulas plus activations next to the measured peak RSS: 16Ψ, 8Ψ+8Ψ/N,
# 4Ψ+12Ψ/N bytes for fp32 AdamW plus what the forward's graph keeps (every linear layer's input
# and output, batch × width × 4 bytes each), and for stage 3 16Ψ/N + the largest gathered unit
# and its gradient (2·4U) + the activations it keeps (every unit's input, batch × width × 4
# bytes per unit; one unit's graph at a time). Stage 3 runs once per PREFETCH setting
# (`--backward-prefetch`, default "pre post none").
#   bench/zero_memory.sh [NPROC] [RUNS]        STAGES="0 1 2 3" by default; BIN=path/to/ddp-bench
#   uses that binary (e.g. target/debug/ddp-bench from `cargo test`, opt-level 3) instead of a
#   release build. LEAN=1 measures what is live rather than what the allocator keeps: freed
#   memory is not retained (`--no-retain-memory`, DDP_RETAIN_FREED_MEMORY=0) and every
#   allocation of 1 MiB or more is its own mapping, returned when freed
#   (MALLOC_MMAP_THRESHOLD_=1048576), at the cost of page faults on every step's buffers.
#   STAGED="1 2" (default) runs those stages with --staged: candle's plain loss.backward()
#   holds every full gradient at once (4Ψ) before any bucket is reduced, which stage 2 cannot
#   afford, and which stage 1, whose gradient buckets stay allocated between steps (they carry
#   the parameter all-gather and the next backward), would hold next to its buckets.
set -euo pipefail
NPROC=${1:-2}
RUNS=${2:-3}
HIDDEN=${HIDDEN:-2048}
LAYERS=${LAYERS:-13}
BATCH=${BATCH:-16}
STAGES=${STAGES:-0 1 2 3}
STAGED=${STAGED:-1 2}
PREFETCH=${PREFETCH:-pre post none}
cd "$(dirname "$0")/.."
if [ -z "${BIN:-}" ]; then
  cargo build --release -q -p ddp-bench
  BIN=./target/release/ddp-bench
fi
out=$(mktemp)
lean=()
if [ "${LEAN:-0}" = 1 ]; then
  export DDP_RETAIN_FREED_MEMORY=0 MALLOC_MMAP_THRESHOLD_=1048576
  lean=(--no-retain-memory)
fi
for run in $(seq "$RUNS"); do
  for z in $STAGES; do
    staged=()
    case " $STAGED " in *" $z "*) staged=(--staged) ;; esac
    prefetch=(none)
    [ "$z" = 3 ] && read -r -a prefetch <<<"$PREFETCH"
    for p in "${prefetch[@]}"; do
      bp=()
      [ "$z" = 3 ] && bp=(--backward-prefetch "$p")
      "$BIN" train --nproc "$NPROC" --hidden "$HIDDEN" --layers "$LAYERS" \
        --batch "$BATCH" --steps 4 --warmup 1 --optimizer adamw --zero "$z" --json \
        "${lean[@]}" "${staged[@]}" "${bp[@]}" |
        tail -n 1 >>"$out"
    done
  done
done
python3 - "$out" "$NPROC" "$BATCH" "$HIDDEN" "$LAYERS" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
n, batch, hidden, layers = (int(a) for a in sys.argv[2:6])
psi = rows[0]["params"]
key = lambda r: (r["zero"], r.get("backward_prefetch", ""))
stages = sorted({key(r) for r in rows})
unit = max((r.get("largest_unit_params", 0) for r in rows), default=0)
# Activations: the graph of stages 0-2 keeps every linear layer's input and output (784 and
# hidden wide in, hidden and 10 wide out); stage 3 keeps each unit's input only (one unit's
# graph at a time, inside its 2·4U).
acts_graph = 4 * batch * (784 + 2 * hidden * layers + 10)
acts_units = 4 * batch * (784 + hidden * layers)
formula = {0: 16 * psi, 1: 8 * psi + 8 * psi / n, 2: 4 * psi + 12 * psi / n,
           3: 16 * psi / n + 2 * 4 * unit}
print(f"params {psi/1e6:.1f} M, world {n}, AdamW fp32; largest unit {unit/1e6:.2f} M params; "
      f"activations {acts_graph/2**20:.1f} MiB (graph), {acts_units/2**20:.1f} MiB (unit inputs); "
      f"medians of {len(rows)//len(stages)} runs")
print("| stage | peak RSS/rank (MiB) | formula + activations (MiB) | ratio | bytes/step (MiB) | samples/s | vs stage 0 |")
print("|---|---|---|---|---|---|---|")
base = None
for z, p in stages:
    rs = [r for r in rows if key(r) == (z, p)]
    rss = statistics.median(r["peak_rss_bytes"] for r in rs)
    sps = statistics.median(r["samples_per_s"] for r in rs)
    base = base or sps
    f = formula[z] + (acts_units if z == 3 else acts_graph)
    name = f"{z} ({p})" if p else f"{z}"
    print(f"| {name} | {rss/2**20:.0f} | {f/2**20:.0f} | {rss/f:.2f} | {rs[0]['bytes_per_step']/2**20:.0f} | {sps:.1f} | {sps/base:.2f} |")
PY
rm -f "$out"
