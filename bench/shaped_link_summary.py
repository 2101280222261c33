#!/usr/bin/env python3
"""Tables for bench/shaped_link.sh: medians over the repeats in OUT/*.jsonl.

usage: shaped_link_summary.py OUT "RATES" "HOOKS" ["FRAMEWORKS" [ACC_EPOCHS]]

One row per hook and side: ddp-rs with each framework (OUT/<framework>_<rate>_<hook>.jsonl;
`ddp_` is the name an older run gave candle's) and PyTorch DDP-gloo (OUT/torch_<rate>_<hook>.jsonl).
"vs none" is the side's own uncompressed time over this hook's; "÷ PyTorch" is the side's time
over PyTorch's with the same hook (below 1: ddp-rs reached the target sooner).
"""
import json
import os
import statistics
import sys


def rows(out, name):
    path = os.path.join(out, name + ".jsonl")
    if not os.path.exists(path):
        return []
    return [json.loads(l) for l in open(path) if l.strip()]


def med(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def fmt(v, spec=".2f"):
    return "–" if v is None else format(v, spec)


def side_rows(out, fw, rate, hook):
    if fw == "torch":
        return rows(out, f"torch_{rate}_{hook}")
    return rows(out, f"{fw}_{rate}_{hook}") or (
        rows(out, f"ddp_{rate}_{hook}") if fw == "candle" else [])


LABEL = {"candle": "ddp-rs candle", "candle-staged": "ddp-rs candle, staged backward",
         "burn": "ddp-rs Burn", "torch": "PyTorch DDP-gloo"}


def main():
    out, rates, hooks = sys.argv[1], sys.argv[2].split(), sys.argv[3].split()
    frameworks = sys.argv[4].split() if len(sys.argv) > 4 else ["candle"]
    acc_epochs = sys.argv[5] if len(sys.argv) > 5 else "?"
    sides = frameworks + ["torch"]
    acc = {(s, h): rows(out, f"acc_{s}_{h}") for s in sides for h in hooks}
    if any(acc.values()):
        print(f"\n### Held-out accuracy after {acc_epochs} epochs (unshaped link), median "
              "(min–max) over the repeats, and its difference from the side's uncompressed run\n")
        print("| hook | " + " | ".join(LABEL.get(s, s) for s in sides) + " |")
        print("|---|" + "---|" * len(sides))
        for h in hooks:
            cells = []
            for s in sides:
                a = [r["test_accuracy"] for r in acc[(s, h)]]
                b = med([r["test_accuracy"] for r in acc[(s, hooks[0])]])
                if not a:
                    cells.append("–")
                    continue
                d = "" if h == hooks[0] or b is None else f", {(med(a) - b) * 100:+.2f} pt"
                cells.append(f"{med(a):.4f} ({min(a):.4f}–{max(a):.4f}){d}")
            print(f"| {h} | " + " | ".join(cells) + " |")
    for rate in rates:
        ar = rows(out, f"allreduce_{rate}")
        bw = f", all_reduce 4 MiB algbw {ar[0]['algbw_gbs'] * 8:.3f} Gbit/s" if ar else ""
        print(f"\n### {rate}{bw}\n")
        print("| hook | side | time to target (s) | vs none | steps | ms/step | final acc "
              "| bytes/step | ÷ PyTorch | runs, reached |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        base = {s: med([r["time_to_target_s"] for r in side_rows(out, s, rate, hooks[0])])
                for s in sides}
        for h in hooks:
            torch_t = med([r["time_to_target_s"] for r in side_rows(out, "torch", rate, h)])
            for s in sides:
                d = side_rows(out, s, rate, h)
                if not d:
                    continue
                t = med([r["time_to_target_s"] for r in d])
                vs = None if t is None or base[s] is None else base[s] / t
                ratio = None if s == "torch" or t is None or torch_t is None else t / torch_t
                ms = med([r["train_time_s"] / r["steps"] * 1e3 for r in d if r["steps"]])
                reached = sum(r["time_to_target_s"] is not None for r in d)
                print(f"| {h} | {LABEL.get(s, s)} | {fmt(t)} | {fmt(vs)}× | "
                      f"{fmt(med([r['steps'] for r in d]), '.0f')} | {fmt(ms, '.1f')} | "
                      f"{fmt(med([r['test_accuracy'] for r in d]), '.4f')} | "
                      f"{fmt(med([r.get('bytes_per_step') for r in d]), '.0f')} | "
                      f"{fmt(ratio)} | {len(d)}, {reached} |")
        bench = [(h, rows(out, f"bench_{rate}_{h}")) for h in hooks]
        if any(b for _, b in bench):
            print(f"\nddp-bench train (hidden 1024, 2 layers, compression from step 0), {rate}:\n")
            print("| hook | ms/step | bytes/step |")
            print("|---|---|---|")
            for h, b in bench:
                print(f"| {h} | {fmt(med([r['step_ms'] for r in b]), '.1f')} | "
                      f"{fmt(med([r['bytes_per_step'] for r in b]), '.0f')} |")


if __name__ == "__main__":
    main()
