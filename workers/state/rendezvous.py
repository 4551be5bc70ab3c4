"""Rank 0 tells the other ranks of its experiment where to meet (MASTER_ADDR, MASTER_PORT).

Rank 0 picks a free port on its slot's address and pushes "addr:port" once per waiting rank onto a
list keyed by the launch attempt; every other rank pops it with a blocking wait and a deadline.
No polling, and a rank that never hears gets `rendezvous_failed` instead of hanging.

The port is free when rank 0 picks it and is bound again seconds later by the training's TCPStore.
A port from the kernel's ephemeral range can be taken in between by any outgoing connection on a
busy node (the experiment then crashes with EADDRINUSE); so the port is drawn below that range,
where the kernel never hands out ports on its own (`rendezvous_ports`).
"""
from __future__ import annotations

import random
import socket
import time
from collections.abc import Callable
from pathlib import Path

import redis

from workers.state import keys
from workers.state.connection import BLOCK_S

KEY_TTL_S = 3600
LOCAL_PORT_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
#: Linux's default ephemeral range, when /proc does not say.
DEFAULT_EPHEMERAL = (32768, 60999)
#: Ports tried at random before the kernel is asked for any free one.
PORT_TRIES = 32


def rendezvous_ports(ephemeral: tuple[int, int]) -> range:
    """Where rank 0 draws its port: from 20000 (above most well-known services) up to the ephemeral
    range's start, or above its end when the range starts too low to leave 1000 ports below it."""
    low, high = ephemeral
    if low - 20000 >= 1000:
        return range(20000, low)
    if 65535 - high >= 1000:
        return range(high + 1, 65536)
    return range(max(1024, low - 1000), low) if low > 2024 else range(0)


def ephemeral_range() -> tuple[int, int]:
    try:
        low, high = (int(field) for field in LOCAL_PORT_RANGE.read_text().split())
        return low, high
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL


def free_port(address: str) -> int:
    """A TCP port that is free on `address` right now, outside the kernel's ephemeral range when one
    can be found there (see the module), else any the kernel picks."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    ports = rendezvous_ports(ephemeral_range())
    for port in random.sample(ports, min(PORT_TRIES, len(ports))):
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((address, port))
            except OSError:
                continue
            return port
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((address, 0))
        return sock.getsockname()[1]


def publish(client: redis.Redis, attempt: str, address: str, port: int, waiting_ranks: int) -> None:
    key = keys.rendezvous(attempt)
    if waiting_ranks > 0:
        pipe = client.pipeline()
        pipe.rpush(key, *[f"{address}:{port}"] * waiting_ranks)
        pipe.expire(key, KEY_TTL_S)
        pipe.execute()


def wait(client: redis.Redis, attempt: str, timeout_s: float, keep_alive: Callable[[], object] = lambda: None,
         every_s: float = BLOCK_S) -> tuple[str, int] | None:
    """(addr, port) published by rank 0, or None if nothing arrived within `timeout_s`.
    `keep_alive` runs at least every `every_s` seconds while waiting (the rank's lease renewal)."""
    deadline = time.monotonic() + timeout_s
    while (remaining := deadline - time.monotonic()) > 0:
        keep_alive()
        popped = client.blpop([keys.rendezvous(attempt)],
                              timeout=max(1, int(min(remaining, BLOCK_S, every_s))))
        if popped is not None:
            address, _, port = popped[1].decode().rpartition(":")
            return address, int(port)
    return None


def all_arrived(client: redis.Redis, barrier: str, count: int, timeout_s: float,
                keep_alive: Callable[[], object] = lambda: None, every_s: float = 0.5) -> bool:
    """Count this process in at `barrier` and wait until `count` have: True then, False when
    `keep_alive` returns true (stop) or `timeout_s` passes first."""
    key = keys.rendezvous(barrier)
    counted = False
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if keep_alive():
            return False
        try:
            if not counted:
                pipe = client.pipeline()
                pipe.incr(key)
                pipe.expire(key, KEY_TTL_S)
                pipe.execute()
                counted = True
            if int(client.get(key) or 0) >= count:
                return True
        except redis.RedisError:
            pass  # an outage is not a reason to stop: the lease decides (workers.slot.rank_peers.StopCheck)
        time.sleep(every_s)
    return False
