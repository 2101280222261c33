#!/usr/bin/env python3
"""Tables for bench/shaped_link.sh: medians over the repeats in OUT/*.jsonl.

usage: shaped_link_summary.py OUT "RATES" "HOOKS"
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


def main():
    out, rates, hooks = sys.argv[1], sys.argv[2].split(), sys.argv[3].split()
    for rate in rates:
        ar = rows(out, f"allreduce_{rate}")
        bw = f", all_reduce 4 MiB algbw {ar[0]['algbw_gbs'] * 8:.3f} Gbit/s" if ar else ""
        print(f"\n### {rate}{bw}\n")
        print("| hook | ddp-rs time to target (s) | vs none | steps | ms/step | final acc | bytes/step "
              "| PyTorch time (s) | vs none | steps | ms/step | PyTorch acc | ddp-rs ÷ PyTorch time "
              "| ddp-bench ms/step | ddp-bench bytes/step | runs (ddp-rs/PyTorch, reached) |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        base = {}
        for h in hooks:
            d, t = rows(out, f"ddp_{rate}_{h}"), rows(out, f"torch_{rate}_{h}")
            b = rows(out, f"bench_{rate}_{h}")
            dt, tt = med([r["time_to_target_s"] for r in d]), med([r["time_to_target_s"] for r in t])
            if h == hooks[0]:
                base = {"d": dt, "t": tt}
            sp = lambda x, k: None if x is None or base.get(k) is None else base[k] / x
            ratio = None if dt is None or tt is None else dt / tt
            reached = lambda rs: sum(r["time_to_target_s"] is not None for r in rs)
            steps = lambda rs: (fmt(med([r["steps"] for r in rs]), ".0f") + " | " + fmt(med(
                [r["train_time_s"] / r["steps"] * 1e3 for r in rs if r["steps"]]), ".1f"))
            print(f"| {h} | {fmt(dt)} | {fmt(sp(dt, 'd'), '.2f')}× | {steps(d)} | "
                  f"{fmt(med([r['test_accuracy'] for r in d]), '.4f')} | "
                  f"{fmt(med([r.get('bytes_per_step') for r in d]), '.0f')} | {fmt(tt)} | "
                  f"{fmt(sp(tt, 't'), '.2f')}× | {steps(t)} | "
                  f"{fmt(med([r['test_accuracy'] for r in t]), '.4f')} | "
                  f"{fmt(ratio)} | {fmt(med([r['step_ms'] for r in b]), '.1f')} | "
                  f"{fmt(med([r['bytes_per_step'] for r in b]), '.0f')} | "
                  f"{len(d)}/{len(t)}, {reached(d)}/{reached(t)} |")


if __name__ == "__main__":
    main()
