#!/usr/bin/env python3
"""A point-to-point link with a fixed one-way delay between two network namespaces, for kernels
without netem (tc's delay qdisc): two TUN devices, one in each namespace, and this process
between them holding every packet DELAY_MS after it left one namespace before handing it to the
other. Rates stay tc's job: shape the TUN devices' egress with tbf (what the kernel sends into a
TUN device is what this relay reads).

    delay_link.py NS_A DEV_A ADDR_A NS_B DEV_B ADDR_B DELAY_MS

Creates DEV_A and DEV_B (MTU 65000: few, large packets, so a Python relay keeps up with
1 Gbit/s), moves them into NS_A and NS_B with ADDR_A and ADDR_B as peer-to-peer addresses, prints
"ready" and relays until killed. Needs root.
"""
import collections
import fcntl
import os
import select
import struct
import subprocess
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000
MTU = 65000


def tun(name):
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


def place(ns, dev, addr, peer):
    for cmd in (
        ["ip", "link", "set", dev, "netns", ns],
        ["ip", "-n", ns, "addr", "add", addr, "peer", peer, "dev", dev],
        ["ip", "-n", ns, "link", "set", dev, "mtu", str(MTU), "up"],
        ["ip", "-n", ns, "link", "set", "lo", "up"],
    ):
        subprocess.run(cmd, check=True)


def main():
    if len(sys.argv) != 8:
        sys.exit(__doc__)
    ns_a, dev_a, addr_a, ns_b, dev_b, addr_b, delay_ms = sys.argv[1:]
    delay = float(delay_ms) / 1000.0
    fa, fb = tun(dev_a), tun(dev_b)
    place(ns_a, dev_a, addr_a, addr_b)
    place(ns_b, dev_b, addr_b, addr_a)
    # Per direction, packets in arrival order with the time each is due (the delay is fixed, so
    # arrival order is due order).
    queue = {fa: collections.deque(), fb: collections.deque()}
    other = {fa: fb, fb: fa}
    print("ready", flush=True)
    while True:
        now = time.monotonic()
        for src, q in queue.items():
            while q and q[0][0] <= now:
                try:
                    os.write(other[src], q.popleft()[1])
                except BlockingIOError:
                    break  # the namespace's stack is busy: the packet is lost, as on a wire
        due = [q[0][0] for q in queue.values() if q]
        timeout = max(0.0, min(due) - time.monotonic()) if due else None
        ready, _, _ = select.select([fa, fb], [], [], timeout)
        now = time.monotonic()
        for fd in ready:
            while True:
                try:
                    packet = os.read(fd, MTU + 64)
                except BlockingIOError:
                    break
                queue[fd].append((now + delay, packet))


if __name__ == "__main__":
    main()
