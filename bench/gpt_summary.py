#!/usr/bin/env python3
"""Tables of bench/gpt.sh's results: the full recipe at worlds 1 and 2 (validation loss at each
evaluation, tokens/s, peak RSS) and the timing rounds (median ms/step at worlds 1 and 2, DDP's
added time per step = world 2 - world 1, tokens/s at world 2 against PyTorch's)."""
import json
import os
import statistics
import sys

rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
base = sys.argv[1][: -len(".jsonl")]
print("## Full recipe")
print("| framework | world | val loss @500 | @1000 | @2000 (final) | first step at val loss <= 2.0 | tokens/s | peak RSS/rank (MiB) |")
print("|---|---|---|---|---|---|---|---|")
recipe = sorted((r["run"] for r in rows if r["part"] == "recipe"), key=lambda r: (r["world_size"], r["framework"]))
for r in recipe:
    fw, w = r["framework"], r["world_size"]
    evals = {}
    path = f"{base}-{fw}-w{w}.metrics.jsonl"
    if os.path.exists(path):
        for l in open(path):
            e = json.loads(l)
            evals[e["step"]] = e
    at = lambda s: f"{evals[s]['val_loss']:.4f}" if s in evals and evals[s].get("val_loss") is not None else "-"
    first = next((f"{s} ({evals[s]['elapsed_s']:.0f} s)" for s in sorted(evals) if (evals[s].get("val_loss") or 9) <= 2.0), "-")
    print(f"| {fw} | {w} | {at(500)} | {at(1000)} | {r['val_loss']:.4f} | {first} | {r['tokens_per_s']:.0f} | {r['peak_rss_bytes'] / 2**20:.0f} |")

timing = [r["run"] for r in rows if r["part"].startswith("timing")]
if timing:
    print("\n## Timing (median over rounds)")
    print("| framework | ms/step world 1 | ms/step world 2 | DDP's added ms/step | tokens/s world 2 | vs PyTorch world 2 |")
    print("|---|---|---|---|---|---|")
    med = lambda fw, w, k: statistics.median([r[k] for r in timing if r["framework"] == fw and r["world_size"] == w] or [float("nan")])
    fws = sorted({r["framework"] for r in timing})
    torch_tps = med("pytorch", 2, "tokens_per_s") if "pytorch" in fws else float("nan")
    for fw in fws:
        m1, m2, tps = med(fw, 1, "ms_per_step"), med(fw, 2, "ms_per_step"), med(fw, 2, "tokens_per_s")
        print(f"| {fw} | {m1:.1f} | {m2:.1f} | {m2 - m1:.1f} | {tps:.0f} | {tps / torch_tps:.2f} |")
