"""Shared by the peer scripts: run `--nproc` copies of the calling script as local ranks.

Each rank gets the torchrun environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR=127.0.0.1,
a free MASTER_PORT) and OMP_NUM_THREADS=1. The launcher waits at most `timeout` seconds, kills
every rank still running on the way out (also on SIGTERM), and returns the first failure's exit
status (124 on timeout), else 0.
"""
import os
import signal
import socket
import subprocess
import sys
import time


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(script, nproc, timeout):
    name = os.path.splitext(os.path.basename(script))[0]
    # `timeout`/Ctrl-C on the launcher must not orphan the ranks: exit through the `finally` below.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    port = free_port()
    procs = []
    for rank in range(nproc):
        env = dict(os.environ)
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(script)] + sys.argv[1:], env=env))
    deadline = time.monotonic() + timeout
    rc = 0
    try:
        for rank, p in enumerate(procs):
            try:
                r = p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                print(f"{name}: rank {rank} still running after --timeout {timeout}s; killing all ranks",
                      file=sys.stderr)
                rc = 124
                break
            if r != 0:
                print(f"{name}: rank {rank} exited with status {r}", file=sys.stderr)
                rc = rc or r
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return rc
