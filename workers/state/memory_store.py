"""The slots' store in memory: `store.BaseSlotStore` over plain dicts, the twin of the Redis
`store.RedisSlotStore`.

Why a twin: the decisions that read the slots (the sweep's lost launches, dispatch's view and
reservations, `--status`) are tested with it in tests/unit, without a redis-server;
tests/redis/test_slot_store_contract.py runs one contract against both stores, so a decision tested
here behaves the same over Redis.

How it keeps the Redis store's semantics:
- atomicity: each method runs to its end before any other call can read (one process, no threads
  here), which is what the Redis store gets from its scripts and transactions;
- keys with a TTL (registrations and claims, withdrawals, health marks, gang leases, ranks' groups)
  are kept with when they lapse, timed by `MemorySlots.clock`, which a test passes and moves on; a key past its
  time reads as absent, as in Redis. The TTLs are read from their modules at each call
  (`registry.TTL_S`, `slot_health.MARK_TTL_S`), so a test that shortens them shortens both stores';
- the index and its epoch: a registration stays indexed until it is unregistered or a view finds it
  lapsed while unreserved (`slot_view`'s script), and the epoch changes exactly when Redis's does;
  the parsed slots and the caller's memo are kept per epoch, as `slot_view` keeps them per process;
  the ranks' groups need no index (`rank_groups`' is for the slot workers' own readers, in Redis only);
- the server's data token (`keys.SERVER_EPOCH`) is set by the first renewal, and `MemorySlots.flush`
  forgets everything, as a Redis restart without its data does.
"""
from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterable

from workers.device.slot import Slot
from workers.state import keys, registry, slot_health
from workers.state.gang import Renewal
from workers.state.slot_view import SlotView, _Parsed


class _Expiring:
    """Keys with values and optional lapse times, read as Redis reads them (lapsed: absent)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.values: dict[str, tuple[str, float | None]] = {}

    def get(self, key: str) -> str | None:
        found = self.values.get(key)
        if found is None:
            return None
        if found[1] is not None and self.clock() >= found[1]:
            del self.values[key]
            return None
        return found[0]

    def set(self, key: str, value: str, ttl_s: float | None = None) -> None:
        self.values[key] = (value, None if not ttl_s else self.clock() + ttl_s)

    def expire(self, key: str, ttl_s: float) -> None:
        if self.get(key) is not None:
            self.values[key] = (self.values[key][0], self.clock() + ttl_s)

    def delete(self, key: str) -> None:
        self.values.pop(key, None)


class MemorySlots:
    """The in-memory database every `InMemorySlotStore` of a test shares, in place of a Redis client:
    registrations, claims, withdrawals, marks and leases, the index, its epoch, the clock."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.flush()

    def flush(self) -> None:
        """Forget everything: Redis restarted without its data."""
        self.registrations = _Expiring(self.clock)  #: queue -> registration JSON
        self.claims = _Expiring(self.clock)  #: claim key -> value
        self.withdrawals = _Expiring(self.clock)  #: queue -> why
        self.marks = _Expiring(self.clock)  #: queue -> health mark JSON
        self.leases = _Expiring(self.clock)  #: queue -> owner token
        self.rank_groups = _Expiring(self.clock)  #: a rank's record or pgid key name -> its value
        self.index: set[str] = set()
        self.epoch: bytes | None = None
        self.server: str | None = None
        self.parsed: _Parsed | None = None

    def store(self) -> InMemorySlotStore:
        return InMemorySlotStore(self)

    def new_epoch(self) -> None:
        self.epoch = uuid.uuid4().hex.encode()


class InMemorySlotStore:
    """The slots' state in a `MemorySlots` (`store.BaseSlotStore`; the module docstring says how it
    keeps the Redis store's semantics)."""

    def __init__(self, db: MemorySlots) -> None:
        self.db = db

    # ------------------------------------------------------------ registrations

    def announce(self, queue: str, registration: str, ttl_s: float | None = None,
                 claims: dict[str, str] | None = None) -> None:
        old = self.db.registrations.get(queue)
        self.db.registrations.set(queue, registration, ttl_s)
        for key, value in (claims or {}).items():
            self.db.claims.set(key, value, ttl_s)
        if queue not in self.db.index or old != registration:
            self.db.new_epoch()
        self.db.index.add(queue)

    def announce_slot(self, slot: Slot, ttl_s: float | None = None) -> None:
        self.announce(slot.queue, json.dumps(slot.to_redis()), ttl_s)

    def unregister(self, queue: str, claims: Iterable[str] = (), why: str | None = None) -> None:
        self.db.registrations.delete(queue)
        for key in claims:
            self.db.claims.delete(key)
        self.db.index.discard(queue)
        self.db.new_epoch()
        if why is None:
            self.db.withdrawals.delete(queue)
        else:
            self.db.withdrawals.set(queue, why, registry.TTL_S)

    def live_slots(self) -> list[Slot]:
        raws = [raw for queue in self.db.index if (raw := self.db.registrations.get(queue)) is not None]
        return sorted((registry.parsed(raw.encode()) for raw in raws), key=lambda s: (s.node, s.device))

    def withdrawn(self, queues: list[str]) -> dict[str, str]:
        return {queue: why for queue in queues if (why := self.db.withdrawals.get(queue)) is not None}

    def claim_gpu(self, slot: Slot) -> dict[str, str] | None:
        for key, mine in registry._gpu_claim(slot).items():
            raw = self.db.claims.get(key)
            if raw is not None and json.loads(raw).get("queue") != slot.queue:
                return json.loads(raw)
            self.db.claims.set(key, mine, registry.TTL_S)
        return None

    def read_view(self) -> SlotView:
        free: set[str] = set()
        sick: dict[str, dict] = {}
        gone = 0
        for queue in sorted(self.db.index):
            if self.db.leases.get(queue) is not None:
                continue
            if self.db.registrations.get(queue) is None:
                self.db.index.discard(queue)
                gone += 1
            elif (mark := self.db.marks.get(queue)) is not None:
                sick[queue] = json.loads(mark)
            else:
                free.add(queue)
        if gone or self.db.epoch is None:
            self.db.new_epoch()
        assert self.db.epoch is not None
        cached = self.db.parsed
        if cached is None or cached.epoch != self.db.epoch:
            cached = self.db.parsed = _Parsed(self.db.epoch, self.live_slots())
        return SlotView(self.db.epoch, frozenset(free), sick, cached.slots, cached.memo)

    # ------------------------------------------------------------ health marks

    def mark_unhealthy(self, queue: str, used_bytes: int, why: str) -> None:
        raw = self.db.marks.get(queue)
        since = json.loads(raw).get("since", self.db.clock()) if raw else self.db.clock()
        self.db.marks.set(queue, json.dumps({"used_bytes": used_bytes, "since": since, "why": why}),
                          slot_health.MARK_TTL_S)

    def unhealthy(self, queues: Iterable[str]) -> dict[str, dict]:
        return {queue: json.loads(raw) for queue in queues if (raw := self.db.marks.get(queue))}

    # ------------------------------------------------------------ gang leases

    def reserve(self, queues: list[str], lease_s: float, owner: str = "") -> str | None:
        token = f"{owner}#{uuid.uuid4().hex}" if owner else uuid.uuid4().hex
        wanted = sorted(set(queues))
        if any(self.db.leases.get(queue) is not None for queue in wanted):
            return None
        for queue in wanted:
            self.db.leases.set(queue, token, lease_s)
        return token

    def keep(self, queue: str, token: str, lease_s: float, server: str = "") -> Renewal:
        if self.db.server is None:
            self.db.server = uuid.uuid4().hex
        holder = self.db.leases.get(queue)
        if holder == token:
            self.db.leases.expire(queue, lease_s)
            return Renewal(True, self.db.server)
        if holder is None and server not in ("", self.db.server):
            self.db.leases.set(queue, token, lease_s)
            return Renewal(True, self.db.server)
        return Renewal(False, self.db.server)

    def holds(self, queues: list[str], token: str) -> bool:
        return all(self.db.leases.get(queue) == token for queue in set(queues))

    def release(self, queues: list[str], token: str) -> int:
        held = [queue for queue in sorted(set(queues)) if self.db.leases.get(queue) == token]
        for queue in held:
            self.db.leases.delete(queue)
        return len(held)

    def holders(self, queues: list[str]) -> dict[str, str]:
        return {queue: token.partition("#")[0] or "?" for queue, token in self._tokens(queues).items()}

    def owners(self, queues: list[str]) -> dict[str, str]:
        return {queue: token.rsplit("#", 1)[0] for queue, token in self._tokens(queues).items() if "#" in token}

    def held(self, queues: list[str]) -> set[str]:
        return set(self._tokens(queues))

    # ------------------------------------------------------------ ranks' training groups

    def write_rank_group(self, queue: str, task_id: str, record: str, pgid: int, ttl_s: int) -> None:
        self.db.rank_groups.set(keys.rank_process(queue, task_id), record, ttl_s)
        self.db.rank_groups.set(keys.pgid(queue, task_id), str(pgid), ttl_s)

    def read_rank_groups(self, ranks: Iterable[tuple[str, str]]) -> dict[str, str]:
        names = [name for queue, task_id in ranks
                 for name in (keys.rank_process(queue, task_id), keys.pgid(queue, task_id))]
        return {name: value for name in names if (value := self.db.rank_groups.get(name))}

    def _tokens(self, queues: list[str]) -> dict[str, str]:
        return {queue: token for queue in sorted(set(queues)) if (token := self.db.leases.get(queue)) is not None}
