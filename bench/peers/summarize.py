#!/usr/bin/env python3
"""Median-of-runs summaries for the peer benchmarks' --json output (used by run.sh).

    summarize.py collective LABEL FILE...   # rows {bytes,time_us,algbw_gbs,busbw_gbs,wrong}, one file per run
    summarize.py train FILE...              # last lines {world_size,mode,samples_per_s,step_ms}

Lines that are not JSON objects (comments, text rows) are ignored.
"""

import json
import statistics
import sys


def records(path):
    out = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
    return out


def collective(label, paths):
    by_size = {}
    for p in paths:
        for r in records(p):
            if "bytes" in r:
                by_size.setdefault(r["bytes"], []).append(r)
    print(f"# {label}: median of {len(paths)} runs (best = fastest single run)")
    print(f"{'bytes':>12} {'time_us':>12} {'algbw_GBs':>10} {'busbw_GBs':>10} {'wrong':>6} {'runs':>5} "
          f"{'best_us':>12} {'best_busbw':>10}")
    for b in sorted(by_size):
        rs = by_size[b]
        med = {k: statistics.median(r[k] for r in rs) for k in ("time_us", "algbw_gbs", "busbw_gbs")}
        wrong = max(r.get("wrong", 0) for r in rs)
        best = min(rs, key=lambda r: r["time_us"])
        print(f"{b:>12} {med['time_us']:>12.2f} {med['algbw_gbs']:>10.4f} {med['busbw_gbs']:>10.4f} "
              f"{wrong:>6} {len(rs):>5} {best['time_us']:>12.2f} {best['busbw_gbs']:>10.4f}")


def train(paths):
    by_cfg = {}
    for p in paths:
        for r in records(p):
            if "samples_per_s" in r:
                by_cfg.setdefault((r.get("mode", "ddp"), r["world_size"]), []).append(r)
    print("# torch DDP train (MLP 784-1024x4-10, batch 64/rank): median over runs (best = fastest run)")
    print(f"{'mode':>6} {'world':>5} {'samples_per_s':>14} {'step_ms':>10} {'runs':>5} {'best_sps':>10}")
    med = {}
    for cfg in sorted(by_cfg):
        rs = by_cfg[cfg]
        sps = statistics.median(r["samples_per_s"] for r in rs)
        ms = statistics.median(r["step_ms"] for r in rs)
        med[cfg] = sps
        best = max(r["samples_per_s"] for r in rs)
        print(f"{cfg[0]:>6} {cfg[1]:>5} {sps:>14.1f} {ms:>10.3f} {len(rs):>5} {best:>10.1f}")
    w2 = med.get(("ddp", 2))
    for base in (("ddp", 1), ("plain", 1)):
        if w2 and med.get(base):
            print(f"# scaling efficiency ddp world2 / (2 x {base[0]} world1) = {w2 / (2 * med[base]):.3f}")


def main(argv):
    if len(argv) >= 3 and argv[0] == "collective":
        collective(argv[1], argv[2:])
    elif len(argv) >= 2 and argv[0] == "train":
        train(argv[1:])
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
