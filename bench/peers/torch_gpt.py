#!/usr/bin/env python3
"""PyTorch DDP peer of `train-gpt`: nanoGPT's model (its `model.py` layer order: pre-LayerNorm
blocks of causal self-attention and a GELU MLP, tied head, no biases by default) and its
`shakespeare_char` recipe, on the same data file, split, window order and validation windows
as train-gpt, data-parallel with DistributedDataParallel over gloo, one thread per rank.

Same flags as train-gpt where they exist (--n-layer --n-head --n-embd --block-size
--batch-size --max-iters --lr --min-lr --warmup-iters --weight-decay --beta2 --grad-clip
--dropout --seed --eval-interval --eval-iters --metrics --json). Training windows: a
DistributedSampler (seed --seed, drop_last) over every start position of the training text,
rank r's batch k being its sampler indices k*b .. (k+1)*b (train-gpt's ddp-core sampler is
PyTorch's, index for index, so both see the same windows). Evaluation: rank 0, the same evenly
spaced validation windows. Timing: the training steps only (evaluations excluded).

Every rank, world 1 included, joins a gloo group and wraps the model in DDP (the per-step
cost of DDP's hooks is then in both worlds; `--mode plain` is a loop without DDP, world 1).

Usage: python3 bench/peers/torch_gpt.py --nproc 2 [--max-iters 2000] [--json] [--metrics F]
"""

import argparse
import datetime
import gzip
import json
import math
import os
import resource
import sys
import time

from local_launch import launch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
DATA = os.path.join(ROOT, "examples", "train-gpt", "data", "shakespeare.txt.gz")


def corpus():
    text = gzip.open(DATA, "rt", encoding="utf-8").read()
    vocab = sorted(set(text))
    lookup = {c: i for i, c in enumerate(vocab)}
    data = [lookup[c] for c in text]
    split = int(0.9 * len(data))
    return vocab, data[:split], data[split:]


def build(torch, args, vocab_size):
    nn = torch.nn
    F = torch.nn.functional

    class LayerNorm(nn.Module):
        def __init__(self, n, bias):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(n))
            self.bias = nn.Parameter(torch.zeros(n)) if bias else None

        def forward(self, x):
            return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            c = args.n_embd
            self.c_attn = nn.Linear(c, 3 * c, bias=args.bias)
            self.c_proj = nn.Linear(c, c, bias=args.bias)
            self.drop = nn.Dropout(args.dropout)
            self.register_buffer("mask", torch.tril(torch.ones(args.block_size, args.block_size)).view(1, 1, args.block_size, args.block_size))

        def forward(self, x):
            b, t, c = x.size()
            nh = args.n_head
            q, k, v = self.c_attn(x).split(c, dim=2)
            q, k, v = (z.view(b, t, nh, c // nh).transpose(1, 2) for z in (q, k, v))
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(self.mask[:, :, :t, :t] == 0, float("-inf"))
            att = self.drop(F.softmax(att, dim=-1))
            y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
            return self.drop(self.c_proj(y))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            c = args.n_embd
            self.ln_1 = LayerNorm(c, args.bias)
            self.attn = Attention()
            self.ln_2 = LayerNorm(c, args.bias)
            self.c_fc = nn.Linear(c, 4 * c, bias=args.bias)
            self.c_proj = nn.Linear(4 * c, c, bias=args.bias)
            self.drop = nn.Dropout(args.dropout)

        def forward(self, x):
            x = x + self.attn(self.ln_1(x))
            return x + self.drop(self.c_proj(F.gelu(self.c_fc(self.ln_2(x)))))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            c = args.n_embd
            self.wte = nn.Embedding(vocab_size, c)
            self.wpe = nn.Embedding(args.block_size, c)
            self.drop = nn.Dropout(args.dropout)
            self.h = nn.ModuleList([Block() for _ in range(args.n_layer)])
            self.ln_f = LayerNorm(c, args.bias)
            self.lm_head = nn.Linear(c, vocab_size, bias=False)
            self.lm_head.weight = self.wte.weight  # tied, as nanoGPT
            self.apply(self._init)
            for name, p in self.named_parameters():
                if name.endswith("c_proj.weight"):
                    torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * args.n_layer))

        def _init(self, m):
            if isinstance(m, nn.Linear):
                torch.nn.init.normal_(m.weight, mean=0.0, std=0.02)
                if m.bias is not None:
                    torch.nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Embedding):
                torch.nn.init.normal_(m.weight, mean=0.0, std=0.02)

        def forward(self, idx, targets):
            b, t = idx.size()
            pos = torch.arange(0, t, dtype=torch.long)
            x = self.drop(self.wte(idx) + self.wpe(pos))
            for blk in self.h:
                x = blk(x)
            logits = self.lm_head(self.ln_f(x))
            return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

    return GPT()


def lr_at(args, it):
    if it < args.warmup_iters:
        return args.lr * (it + 1) / (args.warmup_iters + 1)
    if it > args.max_iters:
        return args.min_lr
    ratio = (it - args.warmup_iters) / max(1, args.max_iters - args.warmup_iters)
    return args.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (args.lr - args.min_lr)


def train(args):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DistributedSampler

    torch.set_num_threads(1)
    ddp = args.mode == "ddp"
    rank, world = 0, 1
    if ddp:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
        rank, world = dist.get_rank(), dist.get_world_size()
    vocab, train_ids, val_ids = corpus()
    train_t = torch.tensor(train_ids, dtype=torch.long)
    val_t = torch.tensor(val_ids, dtype=torch.long)
    torch.manual_seed(args.seed)
    model = build(torch, args, len(vocab))
    raw = model
    if ddp:
        model = DDP(model)
    decay = [p for p in raw.parameters() if p.dim() >= 2]
    no_decay = [p for p in raw.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, args.beta2), eps=1e-8)
    count = len(train_ids) - args.block_size
    sampler = DistributedSampler(range(count), num_replicas=world, rank=rank, shuffle=True,
                                 seed=args.seed, drop_last=True)
    epoch = 0
    sampler.set_epoch(epoch)
    order, pos = list(iter(sampler)), 0
    n_val = len(val_ids) - args.block_size
    val_count = args.eval_iters * args.batch_size
    val_starts = [i * n_val // val_count for i in range(val_count)]
    offs = torch.arange(args.block_size)

    def windows(data, starts):
        s = torch.tensor(starts).unsqueeze(1) + offs
        return data[s], data[s + 1]

    def evaluate():
        raw.eval()
        total, n = 0.0, 0
        with torch.no_grad():
            for i in range(0, len(val_starts), args.batch_size):
                x, y = windows(val_t, val_starts[i:i + args.batch_size])
                total += raw(x, y).item()
                n += 1
        raw.train()
        return total / n

    metrics = open(args.metrics, "w") if args.metrics and rank == 0 else None
    train_time, steps, last, t0 = 0.0, 0, {}, time.perf_counter()
    for it in range(args.max_iters):
        start = time.perf_counter()
        if pos + args.batch_size > len(order):
            epoch += 1
            sampler.set_epoch(epoch)
            order, pos = list(iter(sampler)), 0
        x, y = windows(train_t, order[pos:pos + args.batch_size])
        pos += args.batch_size
        for g in opt.param_groups:
            g["lr"] = lr_at(args, it)
        loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if args.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(raw.parameters(), args.grad_clip)
        opt.step()
        train_time += time.perf_counter() - start
        steps += 1
        done = it + 1
        if done % args.eval_interval == 0 or done == args.max_iters:
            tokens_per_s = steps * args.batch_size * args.block_size * world / train_time
            last = {"step": done, "train_loss": loss.item(), "elapsed_s": time.perf_counter() - t0,
                    "tokens_per_s": tokens_per_s, "val_loss": evaluate() if rank == 0 else None}
            if rank == 0:
                print(f"step {done}: train loss {last['train_loss']:.4f}, val loss {last['val_loss']:.4f}, "
                      f"{tokens_per_s:.0f} tokens/s", flush=True)
                if metrics:
                    metrics.write(json.dumps(last) + "\n")
                    metrics.flush()
            if ddp:
                dist.barrier()
    peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0], dtype=torch.float64)
    if ddp:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if rank == 0 and args.json:
        print(json.dumps({
            "framework": "pytorch", "world_size": world, "steps": steps, "val_loss": last.get("val_loss"),
            "train_loss": last.get("train_loss"),
            "tokens_per_s": steps * args.batch_size * args.block_size * world / train_time,
            "ms_per_step": 1e3 * train_time / steps, "peak_rss_bytes": int(peak.item()), "tied": True,
            "n_layer": args.n_layer, "n_embd": args.n_embd, "block_size": args.block_size,
            "batch_size": args.batch_size, "torch": torch.__version__,
        }), flush=True)
    if ddp:
        dist.destroy_process_group()
    return 0


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--mode", choices=["ddp", "plain"], default="ddp")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=12)
    p.add_argument("--max-iters", type=int, default=2000)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--min-lr", type=float, default=1e-4)
    p.add_argument("--warmup-iters", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--beta2", type=float, default=0.99)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--bias", action="store_true")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--eval-interval", type=int, default=250)
    p.add_argument("--eval-iters", type=int, default=20)
    p.add_argument("--metrics")
    p.add_argument("--json", action="store_true")
    p.add_argument("--timeout", type=int, default=3600)
    args = p.parse_args()
    if "RANK" in os.environ or args.mode == "plain":
        return train(args)
    return launch(__file__, args.nproc, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
