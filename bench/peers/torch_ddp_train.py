#!/usr/bin/env python3
"""PyTorch DDP (gloo, CPU) training throughput: the peer baseline for ddp-rs's training benchmark.

Model: MLP 784 -> 1024 x4 -> 10, i.e.
    Linear(784,1024), ReLU, 3 x [Linear(1024,1024), ReLU], Linear(1024,10)
(4 hidden layers of width 1024; 3,962,890 parameters, ~15.9 MB of fp32 gradients).
Synthetic data (a fixed pool of random batches per rank), batch --batch (64) per
rank, SGD lr 0.01, cross-entropy, torch.set_num_threads(1) per rank.

--mode ddp   (default) every rank, including --nproc 1, joins a gloo process group
             and wraps the model in DistributedDataParallel (default bucket_cap_mb=25).
             With --nproc 1 this is the fair per-step comparison: same DDP hooks and
             bucketing, but the allreduce is a world-1 no-op.
--mode plain no process group, no DDP: a plain single-process training loop
             (only valid with --nproc 1).

--device cuda  the model and batches on GPU LOCAL_RANK % device_count
             (torch.cuda.set_device(local_rank)); the process group is NCCL when every
             rank has its own GPU and gloo when ranks share one (NCCL refuses two ranks on
             one device), the same choice ddp-rs's device backend makes. Steps end with
             torch.cuda.synchronize() before the clock is read.

After --warmup (10) untimed steps, all ranks barrier and --steps (100) steps are
timed as one wall-clock span (ending with a barrier). Rank 0 prints global
samples/s (= nproc * batch * steps / elapsed) and ms/step, and with --json a
last line {"world_size", "mode", "samples_per_s", "step_ms"}.

Usage:
    python3 bench/peers/torch_ddp_train.py --nproc 2 [--mode ddp] [--steps 100] [--json] [--device cuda]
"""

import argparse
import datetime
import json
import os
import sys
import time

from local_launch import launch


def build_model(torch):
    nn = torch.nn
    layers = [nn.Linear(784, 1024), nn.ReLU()]
    for _ in range(3):
        layers += [nn.Linear(1024, 1024), nn.ReLU()]
    layers.append(nn.Linear(1024, 10))
    return nn.Sequential(*layers)


def train(args):
    import torch

    torch.set_num_threads(1)
    ddp = args.mode == "ddp"
    rank, world = 0, 1
    device = torch.device("cpu")
    backend = "gloo"
    if args.device == "cuda":
        if not torch.cuda.is_available():
            print("torch_ddp_train: --device cuda but torch sees no CUDA device", file=sys.stderr)
            return 2
        count = torch.cuda.device_count()
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local % count)
        device = torch.device("cuda", local % count)
        # NCCL needs one GPU per rank ("Duplicate GPU detected" otherwise): gloo when shared.
        backend = "nccl" if int(os.environ.get("WORLD_SIZE", "1")) <= count else "gloo"
    if ddp:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP

        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.timeout))
        rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)  # same initial weights everywhere (DDP also broadcasts them from rank 0)
    model = build_model(torch).to(device)
    if ddp:
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    loss_fn = torch.nn.CrossEntropyLoss()

    g = torch.Generator().manual_seed(1000 + rank)
    pool = [(torch.randn(args.batch, 784, generator=g).to(device),
             torch.randint(0, 10, (args.batch,), generator=g).to(device))
            for _ in range(8)]

    def step(i):
        x, y = pool[i % len(pool)]
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        return loss

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()
        if ddp:
            dist.barrier()

    for i in range(args.warmup):
        step(i)
    sync()
    t0 = time.perf_counter()
    for i in range(args.steps):
        loss = step(i)
    sync()
    elapsed = time.perf_counter() - t0

    nparams = sum(p.numel() for p in model.parameters())
    samples_per_s = world * args.batch * args.steps / elapsed
    step_ms = elapsed / args.steps * 1e3
    if rank == 0:
        print(f"# torch_ddp_train: torch {torch.__version__} mode={args.mode} device={device} "
              f"backend={backend if ddp else '-'} world_size={world} "
              f"params={nparams} batch/rank={args.batch} warmup={args.warmup} steps={args.steps} "
              f"final_loss={loss.item():.4f}", flush=True)
        print(f"samples/s {samples_per_s:.1f}  ms/step {step_ms:.3f}", flush=True)
        if args.json:
            print(json.dumps(dict(world_size=world, mode=args.mode, device=device.type,
                                  backend=backend if ddp else None, samples_per_s=round(samples_per_s, 3),
                                  step_ms=round(step_ms, 4))), flush=True)
    if ddp:
        dist.destroy_process_group()
    return 0


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=1, choices=[1, 2, 3, 4], help="local ranks (1 or 2 on this machine)")
    p.add_argument("--mode", choices=["ddp", "plain"], default="ddp",
                   help="ddp: gloo group + DDP even at world 1; plain: no process group (nproc 1 only)")
    p.add_argument("--steps", type=int, default=100, help="timed steps (after --warmup)")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--batch", type=int, default=64, help="batch size per rank")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--timeout", type=float, default=600, help="seconds before everything is killed")
    p.add_argument("--json", action="store_true", help="end with a JSON summary line")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cuda: GPU LOCAL_RANK %% count; NCCL if every rank has its own GPU, else gloo")
    args = p.parse_args()
    if args.mode == "plain" and args.nproc != 1:
        p.error("--mode plain needs --nproc 1")
    if args.steps < 1:
        p.error("--steps must be >= 1")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return train(args)  # launched by us (or by torchrun)
    return launch(__file__, args.nproc, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
