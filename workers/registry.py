"""Slots announce themselves in Redis and keep announcing while they live.

A registration is one JSON string with a short TTL that a heartbeat thread renews (one string, not a
hash: dispatch reads every slot on every pass, and one MGET of 1,024 small strings costs a few ms
where 1,024 HGETALLs cost a hundred). A worker that dies
(SIGKILL, node lost) simply stops renewing and its slot disappears from the cluster view within one
TTL; a clean shutdown deletes it at once. Nobody has to notice the death for the view to be right.
"""
from __future__ import annotations

import json
import logging
import threading

import redis

from workers import keys
from workers.redis_tls import redis_options
from workers.slot import Slot

#: Longer than any blocking call we make (BLPOP waits at most BLOCK_S), so a quiet wait is not an error.
SOCKET_TIMEOUT_S = 30.0
BLOCK_S = 10.0
HEARTBEAT_S = 3.0
TTL_S = 10.0

log = logging.getLogger(__name__)


def connect(url: str) -> redis.Redis:
    """The one way this project opens Redis: bounded connect, reads that outlast BLPOP waits, and for
    a rediss:// URL the certificates of `workers.redis_tls` (verified, the host's name checked)."""
    return redis.Redis.from_url(url, socket_connect_timeout=5, socket_timeout=SOCKET_TIMEOUT_S,
                                health_check_interval=30, **redis_options(url))


class Heartbeat:
    """Keeps one hash key alive in Redis until stopped."""

    def __init__(self, client: redis.Redis, key: str, fields: dict[str, str]) -> None:
        self._client, self._key, self._fields = client, key, fields
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat {key}", daemon=True)

    def start(self) -> None:
        self._beat()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=HEARTBEAT_S + 1)
        try:
            self._client.delete(self._key)
        except redis.RedisError as exc:
            log.warning("could not unregister %s: %s", self._key, exc)

    def _beat(self) -> None:
        self._client.set(self._key, json.dumps(self._fields), px=int(TTL_S * 1000))

    def _run(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self._beat()
            except redis.RedisError as exc:  # Redis restarting: keep trying, re-register after
                log.warning("heartbeat for %s failed: %s", self._key, exc)


def served_elsewhere(slot: Slot, live: list[Slot]) -> Slot | None:
    """A live slot of another queue serving the same GPU of the same machine as `slot`, if any: two
    workers under different node names, or with overlapping inherited CUDA_VISIBLE_DEVICES, would
    otherwise offer one GPU twice and run two experiments on it, each measuring the other."""
    if slot.kind != "cuda" or not slot.gpu_uuid:
        return None
    return next((other for other in live if other.kind == "cuda" and other.queue != slot.queue
                 and other.gpu_uuid == slot.gpu_uuid and other.host == slot.host), None)


def register_slot(client: redis.Redis, slot: Slot) -> Heartbeat:
    beat = Heartbeat(client, keys.slot(slot.queue), slot.to_redis())
    beat.start()
    return beat


def register_control(client: redis.Redis, node: str, worker: str) -> Heartbeat:
    beat = Heartbeat(client, keys.control(node), {"node": node, "worker": worker})
    beat.start()
    return beat


def live_slots(client: redis.Redis) -> list[Slot]:
    """Every slot whose heartbeat is current, sorted by node then device."""
    found = list(client.scan_iter(match=keys.SLOT_PATTERN, count=1000))
    slots = [Slot.from_redis(json.loads(raw)) for raw in (client.mget(found) if found else []) if raw]
    return sorted(slots, key=lambda s: (s.node, s.device))


def control_alive(client: redis.Redis) -> bool:
    return any(True for _ in client.scan_iter(match=keys.control("*"), count=100))
