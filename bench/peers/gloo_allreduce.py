#!/usr/bin/env python3
"""PyTorch gloo collective benchmark: the peer baseline for ddp-rs's `ddp-bench`.

Launches itself as --nproc local processes (default 2) over the gloo backend
(MASTER_ADDR=127.0.0.1, a free port, torch.set_num_threads(1) per rank) and, for
each size from --min-bytes to --max-bytes in x4 steps (float32), runs --warmup
untimed and then timed iterations of one collective. Rank 0 prints nccl-tests
style rows

    bytes  time_us  algbw_GBs  busbw_GBs  wrong

or, with --json, one JSON object per line with keys
bytes, time_us, algbw_gbs, busbw_gbs, wrong (lines starting with '#' are comments).

Timing: every iteration starts with dist.barrier(); each rank times its own
collective with time.perf_counter(); the per-iteration time is the max over
ranks and time_us is the median over iterations.
    algbw = bytes / time   (GB = 1e9 bytes)
    busbw = algbw * factor, factor as in nccl-tests:
        all_reduce      2(N-1)/N
        all_gather      (N-1)/N   bytes = total output bytes (N * per-rank input)
        reduce_scatter  (N-1)/N   bytes = total input bytes  (N * per-rank output)
        broadcast       1         bytes = buffer bytes (root 0)
`wrong` counts mismatching elements (summed over ranks) in a separate pass with
known inputs; it must be 0.

Usage:
    python3 bench/peers/gloo_allreduce.py [--op all_reduce] [--nproc 2] \
        [--min-bytes 1K] [--max-bytes 64M] [--iters 20] [--small-iters 200] \
        [--warmup 5] [--timeout 600] [--json]
"""

import argparse
import datetime
import json
import os
import statistics
import sys
import time

from local_launch import launch

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
SMALL = 1 << 20  # sizes below 1 MiB use --small-iters


def parse_size(s):
    s = s.strip()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if s and s[-1].upper() in mult:
        return int(float(s[:-1]) * mult[s[-1].upper()])
    return int(s)


def busbw_factor(op, n):
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) / n
    return 1.0


def make_inputs(torch, op, count, rank, world):
    """Return (input, output, expected-output) for the correctness pass."""
    base = torch.arange(count, dtype=torch.float32) % 97
    if op == "all_reduce":
        return base * (rank + 1), None, base * (world * (world + 1) / 2)
    if op == "broadcast":
        return (base + 1 if rank == 0 else torch.zeros(count)), None, base + 1
    chunk = count // world
    if op == "all_gather":
        inp = base[:chunk] * (rank + 1)
        exp = torch.cat([base[:chunk] * (r + 1) for r in range(world)])
        return inp, torch.empty(count), exp
    # reduce_scatter: every rank contributes base*(rank+1); rank r keeps chunk r of the sum.
    inp = base * (rank + 1)
    exp = (base * (world * (world + 1) / 2))[rank * chunk:(rank + 1) * chunk]
    return inp, torch.empty(chunk), exp


def run_rank(args):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()

    def reduce_scatter(out, inp):
        try:
            dist.reduce_scatter_tensor(out, inp)
        except (RuntimeError, NotImplementedError, ValueError):
            # older gloo builds lack the flat variant; use the list form
            dist.reduce_scatter(out, list(inp.chunk(world)))

    def collective(inp, out):
        if args.op == "all_reduce":
            dist.all_reduce(inp)
        elif args.op == "broadcast":
            dist.broadcast(inp, src=0)
        elif args.op == "all_gather":
            dist.all_gather_into_tensor(out, inp)
        else:
            reduce_scatter(out, inp)

    if rank == 0:
        print(f"# gloo_allreduce: torch {torch.__version__} gloo {args.op}, world={world}, warmup={args.warmup}, "
              f"iters={args.iters} (small-iters={args.small_iters} below 1 MiB), time = median over iters of "
              f"max-over-ranks per-iteration time", flush=True)
        if not args.json:
            print(f"{'bytes':>12} {'time_us':>12} {'algbw_GBs':>10} {'busbw_GBs':>10} {'wrong':>6}", flush=True)

    factor = busbw_factor(args.op, world)
    bytes_ = args.min_bytes
    lat = {}
    while bytes_ <= args.max_bytes:
        count = bytes_ // 4
        if args.op in ("all_gather", "reduce_scatter"):
            count -= count % world
        nbytes = count * 4
        n = args.small_iters if nbytes < SMALL else args.iters
        if args.op == "all_gather":
            inp, out = torch.ones(count // world), torch.empty(count)
        elif args.op == "reduce_scatter":
            inp, out = torch.ones(count), torch.empty(count // world)
        else:
            inp, out = torch.ones(count), None
        for _ in range(args.warmup):
            collective(inp, out)
            if args.op == "all_reduce":
                inp.fill_(1.0)  # keep values finite
        times = torch.empty(n, dtype=torch.float64)
        for i in range(n):
            dist.barrier()
            t0 = time.perf_counter()
            collective(inp, out)
            times[i] = time.perf_counter() - t0
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        med = statistics.median(times.tolist())

        inp, out, exp = make_inputs(torch, args.op, count, rank, world)
        collective(inp, out)
        got = inp if out is None else out
        wrong = torch.tensor([int((got != exp).sum())], dtype=torch.int64)
        dist.all_reduce(wrong)

        algbw = nbytes / med / 1e9
        row = dict(bytes=nbytes, time_us=round(med * 1e6, 3), algbw_gbs=round(algbw, 6),
                   busbw_gbs=round(algbw * factor, 6), wrong=int(wrong.item()))
        lat[nbytes] = row["time_us"]
        if rank == 0:
            if args.json:
                print(json.dumps(row), flush=True)
            else:
                print(f"{nbytes:>12} {row['time_us']:>12.2f} {row['algbw_gbs']:>10.4f} "
                      f"{row['busbw_gbs']:>10.4f} {row['wrong']:>6}", flush=True)
        bytes_ *= 4
    if rank == 0:
        for b, name in ((1024, "1 KiB"), (4096, "4 KiB")):
            if b in lat:
                print(f"# latency {name}: {lat[b]:.2f} us", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--op", choices=OPS, default="all_reduce")
    p.add_argument("--nproc", type=int, default=2, help="number of local ranks (default 2)")
    p.add_argument("--min-bytes", type=parse_size, default=1024, help="smallest size, K/M/G suffixes ok (1K)")
    p.add_argument("--max-bytes", type=parse_size, default=64 << 20, help="largest size (64M)")
    p.add_argument("--iters", type=int, default=20, help="timed iterations for sizes >= 1 MiB")
    p.add_argument("--small-iters", type=int, default=200, help="timed iterations for sizes < 1 MiB")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--timeout", type=float, default=600, help="seconds before everything is killed")
    p.add_argument("--json", action="store_true", help="one JSON object per row")
    args = p.parse_args()
    if args.nproc < 1 or args.min_bytes < 4 or args.max_bytes < args.min_bytes or args.iters < 1:
        p.error("need --nproc >= 1, 4 <= --min-bytes <= --max-bytes, --iters >= 1")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return run_rank(args)  # launched by us (or by torchrun)
    return launch(__file__, args.nproc, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
