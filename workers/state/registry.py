"""Slots announce themselves in Redis and keep announcing while they live.

A registration is one JSON string with a short TTL that a heartbeat thread renews (one string, not a
hash: 1,024 HGETALLs cost a hundred ms). A worker that dies (SIGKILL, node lost) simply stops
renewing and its slot disappears from the cluster view within one TTL; a clean shutdown deletes it
at once. Nobody has to notice the death for the view to be right.

Each registration also puts its queue in the slot index (`keys.SLOT_INDEX`, one script with the
write: `announce`), and sets a fresh epoch (`keys.SLOT_EPOCH`) when it is new or changed. Readers
walk the index instead of scanning the whole keyspace (which grows with queued work and running
ranks), and a dispatch pass keeps its parsed slots until the epoch changes
(`workers.state.slot_view`); whoever finds an indexed registration lapsed prunes it and sets the epoch.
Every writer of a registration goes through `announce` (tests and benches too).
"""
from __future__ import annotations

import json
import logging
import threading
import uuid
from collections.abc import Callable, Iterable

import redis

from workers.state import keys
from workers.device.slot import Slot

HEARTBEAT_S = 3.0
TTL_S = 10.0

log = logging.getLogger(__name__)

_ANNOUNCE = """
-- KEYS[1] the slot's registration, KEYS[2] the slot index, KEYS[3] the index's epoch, KEYS[4..] claims
-- ARGV[1] the registration (JSON), ARGV[2] its TTL in ms (0: none), ARGV[3] the slot's queue,
-- ARGV[4] a fresh epoch token, set when the registration is new or changed; ARGV[5..] the claims'
-- values, written with the same TTL
local old = redis.call('GET', KEYS[1])
for i = 1, #KEYS do
  if i == 1 or i > 3 then
    local value = i == 1 and ARGV[1] or ARGV[i + 1]
    if tonumber(ARGV[2]) > 0 then
      redis.call('SET', KEYS[i], value, 'PX', ARGV[2])
    else
      redis.call('SET', KEYS[i], value)
    end
  end
end
if redis.call('SADD', KEYS[2], ARGV[3]) == 1 or old ~= ARGV[1] then
  redis.call('SET', KEYS[3], ARGV[4])
end
return 1
"""
_REGISTRATIONS = """
-- KEYS[1] the slot index; ARGV[1] the registrations' key prefix
-- returns the registrations of the indexed slots that are still there
local found = {}
for _, queue in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local raw = redis.call('GET', ARGV[1] .. queue)
  if raw then found[#found + 1] = raw end
end
return found
"""


def announce(client: redis.Redis | redis.client.Pipeline, queue: str, registration: str,
             ttl_s: float | None = None, claims: dict[str, str] | None = None) -> None:
    """Write slot `queue`'s registration (JSON) and its `claims` (key -> value) with its index entry,
    in one script, setting a fresh epoch when the registration is new or changed; `ttl_s` None: no
    TTL (tests). On a pipeline, it runs when the pipeline does."""
    claims = claims or {}
    script = client.register_script(_ANNOUNCE)
    script(keys=[keys.slot(queue), keys.SLOT_INDEX, keys.SLOT_EPOCH, *claims],
           args=[registration, int((ttl_s or 0) * 1000), queue, uuid.uuid4().hex, *claims.values()], client=client)


def announce_slot(client: redis.Redis | redis.client.Pipeline, slot: Slot, ttl_s: float | None = None) -> None:
    """`announce` of `slot` as its worker's heartbeat writes it."""
    announce(client, slot.queue, json.dumps(slot.to_redis()), ttl_s)


class Heartbeat:
    """Keeps string keys alive in Redis until stopped: a registration (JSON of `fields`) and any
    `claims` beside it (key -> value), renewed together and deleted together. `slot_queue`: the
    registration is that slot's, indexed (`announce`). `withheld` is asked before each beat: a
    reason (the worker's consumer is stuck, `workers.slot.consumer_watch`) deletes the registration
    until it answers None again."""

    def __init__(self, client: redis.Redis, key: str, fields: dict[str, str],
                 claims: dict[str, str] | None = None, slot_queue: str = "",
                 withheld: Callable[[], str | None] = lambda: None) -> None:
        self._client, self._key, self._slot_queue = client, key, slot_queue
        self._values = {key: json.dumps(fields), **(claims or {})}
        self._withheld, self._withholding = withheld, False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat {key}", daemon=True)

    def start(self) -> None:
        self._beat()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=HEARTBEAT_S + 1)
        try:
            self._unregister()
        except redis.RedisError as exc:
            log.warning("could not unregister %s: %s", self._key, exc)

    def _unregister(self, why: str | None = None) -> None:
        """Delete the registration; `why`: the slot is withdrawn, and the sweep reads why
        (`withdrawn`) to take its launch back at once rather than after `SLOT_GONE_S`."""
        if not self._slot_queue:
            self._client.delete(*self._values)
            return
        unregister(self._client, self._slot_queue, [key for key in self._values if key != self._key], why)

    def _beat(self) -> None:
        if self._slot_queue:
            announce(self._client, self._slot_queue, self._values[self._key], TTL_S,
                     {key: value for key, value in self._values.items() if key != self._key})
            return
        with self._client.pipeline(transaction=False) as pipe:
            for key, value in self._values.items():
                pipe.set(key, value, px=int(TTL_S * 1000))
            pipe.execute()

    def _run(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                why = self._withheld()
                if why is not None:
                    if not self._withholding:
                        log.error("%s withdrawn: %s", self._key, why)
                    self._withholding = True
                    self._unregister(why)
                    continue
                if self._withholding:
                    log.warning("%s announced again: its worker takes its queue's messages again", self._key)
                    self._client.delete(keys.withdrawn(self._slot_queue))
                    self._withholding = False
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


def register_slot(client: redis.Redis, slot: Slot, withheld: Callable[[], str | None] = lambda: None) -> Heartbeat:
    """Announce `slot` (after `claim_gpu`), keeping its GPU's claim alive with it, while `withheld`
    gives no reason not to (`Heartbeat`)."""
    beat = Heartbeat(client, keys.slot(slot.queue), slot.to_redis(), _gpu_claim(slot), slot_queue=slot.queue,
                     withheld=withheld)
    beat.start()
    return beat


def register_control(client: redis.Redis, node: str, worker: str) -> Heartbeat:
    beat = Heartbeat(client, keys.control(node), {"node": node, "worker": worker})
    beat.start()
    return beat


def unregister(client: redis.Redis, queue: str, claims: Iterable[str] = (), why: str | None = None) -> None:
    """Delete slot `queue`'s registration and `claims` and take it out of the index, with a fresh
    epoch, in one transaction. `why`: the slot is withdrawn, and `withdrawn` says why for `TTL_S`;
    None: a clean leave, which forgets an earlier withdrawal."""
    with client.pipeline(transaction=True) as pipe:
        pipe.delete(keys.slot(queue), *claims)
        pipe.srem(keys.SLOT_INDEX, queue)
        pipe.set(keys.SLOT_EPOCH, uuid.uuid4().hex)
        if why is None:
            pipe.delete(keys.withdrawn(queue))
        else:
            pipe.set(keys.withdrawn(queue), why, px=int(TTL_S * 1000))
        pipe.execute()


def withdrawn(client: redis.Redis, queues: list[str]) -> dict[str, str]:
    """Of `queues`, those whose worker withdrew its slot (`Heartbeat`'s `withheld`), with why."""
    if not queues:
        return {}
    reasons = client.mget([keys.withdrawn(queue) for queue in queues])
    return {queue: reason.decode() for queue, reason in zip(queues, reasons) if reason is not None}


def live_slots(client: redis.Redis) -> list[Slot]:
    """Every slot whose heartbeat is current, sorted by node then device (one round trip; each
    registration parsed once per process while it stays the same)."""
    raws = client.register_script(_REGISTRATIONS)(keys=[keys.SLOT_INDEX], args=[keys.slot("")])
    return sorted((parsed(raw) for raw in raws), key=lambda s: (s.node, s.device))


#: registration JSON -> its Slot: parsing 1,024 registrations took ~10 ms a dispatch pass.
_PARSED: dict[bytes, Slot] = {}
_PARSED_MAX = 65536


def parsed(raw: bytes) -> Slot:
    """The Slot of a registration's JSON, parsed once while this process keeps seeing it."""
    slot = _PARSED.get(raw)
    if slot is None:
        if len(_PARSED) >= _PARSED_MAX:  # restarted workers leave old registrations behind
            _PARSED.clear()
        slot = _PARSED[raw] = Slot.from_redis(json.loads(raw))
    return slot


def control_alive(client: redis.Redis) -> bool:
    return any(True for _ in client.scan_iter(match=keys.control("*"), count=100))
