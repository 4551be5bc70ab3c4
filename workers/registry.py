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
    """Keeps string keys alive in Redis until stopped: a registration (JSON of `fields`) and any
    `claims` beside it (key -> value), renewed together and deleted together."""

    def __init__(self, client: redis.Redis, key: str, fields: dict[str, str],
                 claims: dict[str, str] | None = None) -> None:
        self._client, self._key = client, key
        self._values = {key: json.dumps(fields), **(claims or {})}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat {key}", daemon=True)

    def start(self) -> None:
        self._beat()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=HEARTBEAT_S + 1)
        try:
            self._client.delete(*self._values)
        except redis.RedisError as exc:
            log.warning("could not unregister %s: %s", self._key, exc)

    def _beat(self) -> None:
        with self._client.pipeline(transaction=False) as pipe:
            for key, value in self._values.items():
                pipe.set(key, value, px=int(TTL_S * 1000))
            pipe.execute()

    def _run(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self._beat()
            except redis.RedisError as exc:  # Redis restarting: keep trying, re-register after
                log.warning("heartbeat for %s failed: %s", self._key, exc)


def _gpu_claim(slot: Slot) -> dict[str, str]:
    """The claim key of `slot`'s GPU on its machine and the value saying who holds it; {} for a slot
    without one (CPU slots share cores by design)."""
    if slot.kind != "cuda" or not slot.gpu_uuid:
        return {}
    return {keys.gpu_claim(slot.host, slot.gpu_uuid): json.dumps({"queue": slot.queue, "worker": slot.worker})}


def claim_gpu(client: redis.Redis, slot: Slot) -> dict[str, str] | None:
    """Claim `slot`'s GPU of its machine (host, GPU UUID) for its queue, or say who holds it: the
    holder's {"queue", "worker"} when a live slot of another queue does, else None (claimed). Two
    workers under different node names, or with overlapping inherited CUDA_VISIBLE_DEVICES, would
    otherwise offer one GPU twice and run two experiments on it, each measuring the other. One
    SET NX decides, so two workers starting at once cannot both pass a look at the live slots. The
    claim lives as long as the slot's registration (`register_slot` renews it); the same queue
    claiming again is its restarted worker, which takes over."""
    for key, mine in _gpu_claim(slot).items():
        while not client.set(key, mine, nx=True, px=int(TTL_S * 1000)):
            raw = client.get(key)
            if raw is None:  # expired between the two calls: claim again
                continue
            holder = json.loads(raw)
            if holder.get("queue") != slot.queue:
                return holder
            client.set(key, mine, px=int(TTL_S * 1000))
            break
    return None


def register_slot(client: redis.Redis, slot: Slot) -> Heartbeat:
    """Announce `slot` (after `claim_gpu`), keeping its GPU's claim alive with it."""
    beat = Heartbeat(client, keys.slot(slot.queue), slot.to_redis(), _gpu_claim(slot))
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
