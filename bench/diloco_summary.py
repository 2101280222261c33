"""The table of bench/diloco.sh: final validation loss, bytes and training time of the recipe
per method and link rate. Usage: diloco_summary.py ROWS.jsonl STEPS [CURVES]

With CURVES (a path prefix), each method timed in fewer steps than the recipe on a rate gets its
loss curve (its whole-recipe run on this host) with the recipe time it would have had there:
CURVES.METHOD-RATE-derived.metrics.jsonl (elapsed_s = steps x that rate's ms/step), for ddp-plot.

A method's loss per step does not depend on the link, so its recipe time on a rate where it ran
fewer steps is its measured ms/step there x STEPS (marked "derived"). DDP's loss is the newest
full run in the rows, else (world 2) the newest bench/gpt.sh candle world-2 run
(bench/results/gpt-*-candle-w2.metrics.jsonl).
"""
import glob
import json
import sys

rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
steps = int(sys.argv[2])
rates = sorted({r["rate"] for r in rows if r["rate"] not in ("none", "local")},
               key=lambda r: float(r.rstrip("mgkbit") or 0) * (1000 if "gbit" in r else 1))
methods = []
for r in rows:
    if r["method"] not in methods:
        methods.append(r["method"])


def last_val(path):
    vals = [json.loads(l)["val_loss"] for l in open(path) if l.strip()]
    return [v for v in vals if v is not None][-1]


world = rows[0].get("world_size", 2)
ddp_curves = []
if not any(r["method"] == "none" and r["steps"] == steps for r in rows) and world == 2:
    ddp_curves = sorted(glob.glob("bench/results/gpt-*-candle-w2.metrics.jsonl"))
ddp_loss = last_val(ddp_curves[-1]) if ddp_curves else None


def full(method):
    """The method's run of the whole recipe (on any rate), if any."""
    for r in rows:
        if r["method"] == method and r["steps"] == steps:
            return r
    return None


def at(method, rate):
    for r in rows:
        if r["method"] == method and r["rate"] == rate:
            return r
    return None


def derive_curve(whole, method, rate, ms, warmup, warmup_ms):
    """The method's loss curve as it would have run on `rate` (see the module doc)."""
    name = "ddp" if method == "none" else method.replace(":", "_")
    with open(f"{sys.argv[3]}.{name}-{rate}-derived.metrics.jsonl", "w") as out:
        for line in open(whole["metrics"]):
            m = json.loads(line)
            if "step" not in m:
                continue
            s = m["step"]
            m["elapsed_s"] = (min(s, warmup) * warmup_ms + max(s - warmup, 0) * ms) / 1e3
            out.write(json.dumps(m) + "\n")


out = []
head = "| method | final val loss | vs DDP | bytes sent (MB) | DDP's / this |"
for rate in rates:
    head += f" training time at {rate} (s) | DDP's / this |"
delay = rows[-1].get("delay_ms", 0)
print(f"world {world}, one-way delay {delay} ms\n")
print(head)
print("|" + "---|" * (head.count("|") - 1))
ddp_bytes = None
ddp_time = {}
ddp_ms = {}
f = full("none")
timing_only = [m for m in methods if m.startswith("localsgd:") and m.endswith(":0")]
for method in ["none"] + [m for m in methods if m != "none" and m not in timing_only]:
    whole = full(method)
    loss = whole["val_loss"] if whole else (ddp_loss if method == "none" else None)
    if method == "none" and whole:
        ddp_loss = loss
    any_run = whole or next((r for r in rows if r["method"] == method), None)
    if any_run is None:
        continue
    per_step_bytes = any_run["comm_bytes"] / any_run["steps"]
    total_bytes = whole["comm_bytes"] if whole else per_step_bytes * steps
    if method == "none":
        ddp_bytes = total_bytes
    cells = [
        "DDP" if method == "none" else method,
        f"{loss:.4f}" if loss is not None else "–",
        f"{loss - ddp_loss:+.4f}" if loss is not None and ddp_loss is not None else "–",
        f"{total_bytes / 1e6:.1f}" + ("" if whole else " (derived)"),
        f"{ddp_bytes / total_bytes:.0f}x" if ddp_bytes else "–",
    ]
    for rate in rates:
        r = at(method, rate)
        warmup = 0
        if r is None and method.startswith("localsgd:"):
            # Timed after its warm-up (localsgd:P:0): WARMUP steps of DDP, the rest at that pace.
            period, warmup = method.split(":")[1:3]
            r, warmup = at(f"localsgd:{period}:0", rate), int(warmup)
        if r is None or (warmup and rate not in ddp_ms):
            cells += ["–", "–"]
            continue
        t = (r["ms_per_step"] * (steps - warmup) + (ddp_ms[rate] * warmup if warmup else 0)) / 1e3
        if r["steps"] != steps and whole and len(sys.argv) > 3:
            derive_curve(whole, method, rate, r["ms_per_step"], warmup, ddp_ms.get(rate, 0))
        derived = "" if r["steps"] == steps else " (derived)"
        if method == "none":
            ddp_time[rate] = t
            ddp_ms[rate] = r["ms_per_step"]
        cells.append(f"{t:.0f}{derived}")
        cells.append(f"{ddp_time[rate] / t:.1f}x" if rate in ddp_time else "–")
    print("| " + " | ".join(cells) + " |")
if ddp_curves:
    print(f"\nDDP's loss: {ddp_curves[-1]}")
