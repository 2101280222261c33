#!/usr/bin/env python3
"""ddp-rs all_reduce against its peers in one run (optional; not run by CI).

Runs, interleaved REPS times (so machine noise spreads over all of them), 2-process all_reduce
sweeps of: ddp-bench --backend tcp, ddp-bench --backend shm, torch gloo, and OpenMPI if mpicc is
available; prints per size the median busbw (GB/s) and time (us) of each, and the ratios
ours/peer.

    cargo build --release -p ddp-bench
    python3 bench/peers/compare_allreduce.py [--reps 3] [--min-bytes 1K] [--max-bytes 64M]
"""
import argparse, json, os, shutil, statistics, subprocess, sys, tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def run_json(cmd, timeout):
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        print(f"# FAILED {' '.join(cmd)}: {out.stderr[-500:]}", file=sys.stderr)
        return {}
    rows = {}
    for line in out.stdout.splitlines():
        line = line.strip()
        if line.startswith("{"):
            r = json.loads(line)
            rows[int(r["bytes"])] = r
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--min-bytes", default="1K")
    ap.add_argument("--max-bytes", default="64M")
    ap.add_argument("--bench", default=os.environ.get("DDP_BENCH", os.path.join(ROOT, "target/release/ddp-bench")))
    a = ap.parse_args()
    sides = {
        "tcp": [a.bench, "allreduce", "--backend", "tcp", "--nproc", "2", "--min-bytes", a.min_bytes, "--max-bytes", a.max_bytes, "--json"],
        "shm": [a.bench, "allreduce", "--backend", "shm", "--nproc", "2", "--min-bytes", a.min_bytes, "--max-bytes", a.max_bytes, "--json"],
        "gloo": [sys.executable, os.path.join(HERE, "gloo_allreduce.py"), "--nproc", "2", "--min-bytes", a.min_bytes, "--max-bytes", a.max_bytes, "--json"],
    }
    if shutil.which("mpicc") and shutil.which("mpirun"):
        exe = os.path.join(tempfile.mkdtemp(), "mpi_allreduce")
        subprocess.run(["mpicc", "-O2", "-o", exe, os.path.join(HERE, "mpi_allreduce.c")], check=True)
        sizes = lambda s: str(int(s[:-1]) * {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[s[-1]]) if s[-1] in "KMG" else s
        sides["mpi"] = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-np", "2", exe,
                        "--min-bytes", sizes(a.min_bytes), "--max-bytes", sizes(a.max_bytes), "--json"]
    runs = {k: [] for k in sides}
    for rep in range(a.reps):
        for name, cmd in sides.items():
            print(f"# rep {rep + 1}/{a.reps}: {name} (load {open('/proc/loadavg').read().split()[0]})", file=sys.stderr)
            runs[name].append(run_json(cmd, 900))
    sizes = sorted({b for rs in runs.values() for r in rs for b in r})
    med = lambda name, b, key: statistics.median([r[b][key] for r in runs[name] if b in r]) if any(b in r for r in runs[name]) else float("nan")
    names = list(sides)
    print("# all_reduce, 2 processes, f32; median of %d interleaved runs; busbw GB/s (time us)" % a.reps)
    print("%10s" % "bytes" + "".join("%22s" % n for n in names) + "%12s%12s" % ("tcp/gloo", "shm/gloo") + ("%12s" % "shm/mpi" if "mpi" in names else ""))
    for b in sizes:
        cells = "".join("%22s" % ("%.3f (%.1f)" % (med(n, b, "busbw_gbs"), med(n, b, "time_us"))) for n in names)
        g = med("gloo", b, "busbw_gbs")
        ratios = "%12.2f%12.2f" % (med("tcp", b, "busbw_gbs") / g, med("shm", b, "busbw_gbs") / g)
        if "mpi" in names:
            ratios += "%12.2f" % (med("shm", b, "busbw_gbs") / med("mpi", b, "busbw_gbs"))
        print("%10d" % b + cells + ratios)
    wrong = sum(r[b].get("wrong", 0) for n in ("tcp", "shm") for r in runs[n] for b in r)
    print(f"# wrong elements in ddp-rs runs: {wrong}")


if __name__ == "__main__":
    main()
