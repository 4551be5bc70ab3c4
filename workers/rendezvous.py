"""Rank 0 tells the other ranks of its experiment where to meet (MASTER_ADDR, MASTER_PORT).

Rank 0 picks a free port on its slot's address and pushes "addr:port" once per waiting rank onto a
list keyed by the launch attempt; every other rank pops it with a blocking wait and a deadline.
No polling, and a rank that never hears gets `rendezvous_failed` instead of hanging.
"""
from __future__ import annotations

import socket
import time
from collections.abc import Callable

import redis

from workers import keys
from workers.registry import BLOCK_S

KEY_TTL_S = 3600


def free_port(address: str) -> int:
    """A TCP port that is free on `address` right now (the OS picks it)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
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
