#!/usr/bin/env python3
"""DDP training throughput of ddp-rs against PyTorch DDP-gloo in one run (optional; not in CI).

MLP 784-1024x4-10, batch 64 per rank, one compute thread per rank, synthetic data. Runs,
interleaved REPS times: `ddp-bench train --nproc 1|2` (plain backward, --backend as given) and
`torch_ddp_train.py --nproc 1|2` (DDP on gloo); prints median samples/s, ms/step, scaling
efficiency (world-2 samples/s / (2 x world-1 samples/s)) and the ratio ours/peer at world 2.

    cargo build --release -p ddp-bench
    python3 bench/peers/compare_train.py [--reps 3] [--steps 50] [--backend auto] \
        [--weight-layout out-in,in-out]

`--framework candle,burn` adds `ddp-bench train --framework burn` (ddp-burn on burn-flex) as the
side `burn`; every side also gets DDP's added time per step (world-2 ms/step - world-1 ms/step)
and its ratio to PyTorch's.

`--weight-layout` takes a comma-separated list: each layout is its own ddp-rs side (`ours-w2` for
the first, `ours:in-out-w2` and so on for the others).
"""
import argparse, json, os, statistics, subprocess, sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def last_json(cmd, env):
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    if out.returncode != 0:
        print(f"# FAILED {' '.join(cmd)}: {out.stderr[-800:]}", file=sys.stderr)
        return None
    lines = [l for l in out.stdout.splitlines() if l.strip().startswith("{")]
    return json.loads(lines[-1]) if lines else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--weight-layout", default="out-in")
    ap.add_argument("--framework", default="candle", help="comma-separated: candle, burn")
    ap.add_argument("--bench", default=os.environ.get("DDP_BENCH", os.path.join(ROOT, "target/release/ddp-bench")))
    a = ap.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", RAYON_NUM_THREADS="1")
    sides = {}
    layouts = a.weight_layout.split(",")
    for n in (1, 2):
        for i, layout in enumerate(layouts):
            name = "ours" if i == 0 else f"ours:{layout}"
            sides[f"{name}-w{n}"] = [a.bench, "train", "--nproc", str(n), "--backend", a.backend, "--steps", str(a.steps),
                                     "--weight-layout", layout, "--json"]
        if "burn" in a.framework.split(","):
            sides[f"burn-w{n}"] = [a.bench, "train", "--framework", "burn", "--nproc", str(n), "--backend", a.backend,
                                   "--steps", str(a.steps), "--json"]
        sides[f"torch-w{n}"] = [sys.executable, os.path.join(HERE, "torch_ddp_train.py"), "--nproc", str(n), "--mode", "ddp", "--steps", str(a.steps), "--json"]
    res = {k: [] for k in sides}
    for rep in range(a.reps):
        for name, cmd in sides.items():
            print(f"# rep {rep + 1}/{a.reps}: {name} (load {open('/proc/loadavg').read().split()[0]})", file=sys.stderr)
            r = last_json(cmd, env)
            if r:
                res[name].append(r)
    med = lambda k, f: statistics.median([r[f] for r in res[k]]) if res[k] else float("nan")
    print(f"# MLP 784-1024x4-10, batch 64/rank, 1 thread/rank, median of {a.reps} interleaved runs")
    print("%-18s %12s %10s %14s" % ("side", "samples/s", "ms/step", "comm_wait_ms"))
    for k in sides:
        print("%-18s %12.1f %10.2f %14s" % (k, med(k, "samples_per_s"), med(k, "step_ms"),
                                            "%.2f" % med(k, "comm_wait_ms") if not k.startswith("torch") else "-"))
    names = ["ours" if i == 0 else f"ours:{l}" for i, l in enumerate(layouts)]
    if "burn" in a.framework.split(","):
        names.append("burn")
    for side in names + ["torch"]:
        eff = med(f"{side}-w2", "samples_per_s") / (2 * med(f"{side}-w1", "samples_per_s"))
        print(f"# scaling efficiency {side}: {eff:.2f}")
    for side in names:
        print("# world-2 samples/s %s/torch: %.2f" % (side, med(f"{side}-w2", "samples_per_s") / med("torch-w2", "samples_per_s")))
    added = lambda side: med(f"{side}-w2", "step_ms") - med(f"{side}-w1", "step_ms")
    for side in names + ["torch"]:
        print("# DDP added ms/step %s: %.2f (%.2f of torch's %.2f)" % (side, added(side), added(side) / added("torch"), added("torch")))


if __name__ == "__main__":
    main()
