#!/usr/bin/env python3
"""PyTorch DDP (gloo, CPU) on the UCI digits with PyTorch's own comm hooks: the peer of
`train-digits --hook ...` in bench/shaped_link.sh.

One rank per process, started with the torchrun environment (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT; GLOO_SOCKET_IFNAME picks the link). Same model and recipe as train-digits:
MLP 64 -> --hidden -> 10 (ReLU), nn.Linear's default init, SGD lr 0.2 (no momentum), batch 32
per rank, DistributedSampler(shuffle, seed --seed), torch.manual_seed(--seed), cross-entropy, the embedded digits.csv.gz with
an 80/20 split (torch.randperm seeded 20240601: the same sizes as train-digits', not the same
images). After every epoch rank 0 evaluates on the held-out 20% (outside the timed span) and
every rank stops once --target-accuracy is reached. The steps to a target depend on the seed
(train-digits at hidden 4096 needs 46, 69 or 92 steps at seeds 3, 2, 1): compare medians over
several seeds, or time per step.

--hook none | bf16 | fp16 | powersgd:R:S | localsgd:P:W map to PyTorch's
default_hooks.bf16_compress_hook / fp16_compress_hook, powerSGD_hook with
PowerSGDState(matrix_approximation_rank=R, start_powerSGD_iter=S) (other fields default), and
post_localSGD_hook with PostLocalSGDState(subgroup = each rank alone, start_localSGD_iter=W)
plus PeriodicModelAverager(period=P, warmup_steps=W); with local SGD the model is averaged once
more at the end, as train-digits does.

Rank 0 prints one JSON line: hook, steps, time_to_target_s (null if not reached),
train_time_s, test_accuracy.
"""

import argparse
import datetime
import gzip
import json
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

DATA = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "train-digits", "data",
                    "digits.csv.gz")


def load():
    rows = [list(map(int, l.split(","))) for l in gzip.open(DATA, "rt") if l.strip()]
    t = torch.tensor(rows)
    x, y = t[:, :64].float() / 16.0, t[:, 64].long()
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(20240601))
    n = len(y) * 8 // 10
    return (x[perm[:n]], y[perm[:n]]), (x[perm[n:]], y[perm[n:]])


def register(model, spec):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps
    name, *args = spec.split(":")
    if name == "none":
        return None
    if name in ("bf16", "fp16"):
        hook = default_hooks.bf16_compress_hook if name == "bf16" else default_hooks.fp16_compress_hook
        model.register_comm_hook(None, hook)
        return None
    if name == "powersgd":
        r, s = (int(args[0]) if args else 1), (int(args[1]) if len(args) > 1 else 1000)
        state = ps.PowerSGDState(process_group=None, matrix_approximation_rank=r,
                                 start_powerSGD_iter=s)
        model.register_comm_hook(state, ps.powerSGD_hook)
        return None
    if name == "localsgd":
        from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as pl
        from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
        p, w = (int(args[0]) if args else 4), (int(args[1]) if len(args) > 1 else 100)
        subgroup, _ = dist.new_subgroups(group_size=1)
        model.register_comm_hook(pl.PostLocalSGDState(process_group=None, subgroup=subgroup,
                                                      start_localSGD_iter=w), pl.post_localSGD_hook)
        return PeriodicModelAverager(period=p, warmup_steps=w)
    raise SystemExit(f"unknown --hook {spec!r}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hook", default="none")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--lr", type=float, default=0.2)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--target-accuracy", type=float, default=None)
    ap.add_argument("--timeout", type=int, default=600)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0,
                    help="seed of the initialization and of the sampler's shuffle (train-digits' --seed)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    (xtr, ytr), (xte, yte) = load()
    torch.manual_seed(a.seed)
    net = torch.nn.Sequential(torch.nn.Linear(64, a.hidden), torch.nn.ReLU(),
                              torch.nn.Linear(a.hidden, 10))
    model = DDP(net)
    averager = register(model, a.hook)
    opt = torch.optim.SGD(model.parameters(), lr=a.lr)
    loss_fn = torch.nn.CrossEntropyLoss()
    sampler = torch.utils.data.distributed.DistributedSampler(range(len(ytr)), world, rank,
                                                              shuffle=True, seed=a.seed)
    steps, paused, ttt = 0, 0.0, None
    dist.barrier()
    start = time.perf_counter()
    for epoch in range(a.epochs):
        sampler.set_epoch(epoch)
        idx = torch.tensor(list(sampler))
        for b in range(0, len(idx), a.batch_size):
            j = idx[b:b + a.batch_size]
            opt.zero_grad(set_to_none=True)
            loss_fn(model(xtr[j]), ytr[j]).backward()
            opt.step()
            if averager is not None:
                averager.average_parameters(model.parameters())
            steps += 1
        if a.target_accuracy is not None:
            t = time.perf_counter()
            flag = torch.zeros(1)
            if rank == 0:
                with torch.no_grad():
                    acc = (net(xte).argmax(1) == yte).float().mean().item()
                flag[0] = float(acc >= a.target_accuracy)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            paused += time.perf_counter() - t
            if flag[0] > 0:
                ttt = time.perf_counter() - start - paused
                break
    train_time = time.perf_counter() - start - paused
    if averager is not None:
        for p in net.parameters():
            dist.all_reduce(p.data)
            p.data /= world
    if rank == 0:
        with torch.no_grad():
            acc = (net(xte).argmax(1) == yte).float().mean().item()
        print(json.dumps({"hook": a.hook, "steps": steps, "time_to_target_s": ttt,
                          "train_time_s": train_time, "test_accuracy": acc}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
