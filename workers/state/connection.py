"""The one way this project opens the cluster's Redis, and the waits every client is sized for.

Why here and not with the slots' registrations: every process opens Redis for everything at once
(jobs, slots, the broker's queues), so how it connects is no part of any one store; a reader of the
slots' state, a job store and a worker's hooks all connect through `connect`.
"""
from __future__ import annotations

import redis

from workers.state.redis_tls import redis_options

#: Longer than any blocking call we make (BLPOP waits at most BLOCK_S), so a quiet wait is not an error.
SOCKET_TIMEOUT_S = 30.0
BLOCK_S = 10.0


def connect(url: str) -> redis.Redis:
    """The one way this project opens Redis: bounded connect, reads that outlast BLPOP waits, and for
    a rediss:// URL the certificates of `workers.state.redis_tls` (verified, the host's name checked)."""
    return redis.Redis.from_url(url, socket_connect_timeout=5, socket_timeout=SOCKET_TIMEOUT_S,
                                health_check_interval=30, **redis_options(url))
