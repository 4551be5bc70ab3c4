"""The slots' store: every operation the control path and the slot workers perform on the slots'
shared state (registrations and their index, withdrawals, GPU claims, health marks, gang leases,
the dispatch view, the training groups ranks recorded), behind one interface.

Why an interface: the decisions that read the slots (which launch is lost and why, where a waiting
experiment may start, what `--status` shows, which training groups a stopped launch's clean-up
kills) are tested without a redis-server through the in-memory twin
(`workers.state.memory_store.InMemorySlotStore`); the Redis store (`RedisSlotStore`, here) keeps
the same contract, checked against both by tests/redis/test_slot_store_contract.py. It is the slots'
side of what `scheduler.cluster.stores.BaseJobStore` is for a job.

What each implementation promises is written once, on `BaseSlotStore`'s methods. Every method is
atomic (Redis: one command, a MULTI transaction or one Lua script; in memory: one uninterrupted
call). `RedisSlotStore` adds nothing of its own: it calls the modules that own each piece
(`registry`, `gang`, `slot_view`, `slot_health`, `rank_groups`), so their scripts stay the one place
each atomic step is written. What only Redis has (a release queued in a caller's pipeline; the
heartbeat, lease and health threads, which hold a client; whether a control worker is registered) is
on `RedisSlotStore` alone, as the Redis job store keeps its pipelines to itself.

Why one owner: outside this package the slots' state is reached only through this module (the
architecture test holds every other module of the package but `keys`, `connection`, `redis_url`,
`redis_tls` and `rendezvous` to it), so a change to a registration, a lease or a mark has one place
to look at. The timings callers size their own waits by (`HEARTBEAT_S`, `TTL_S`) and how a health
mark reads (`describe`) are named here for them.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

import redis

from workers.device.slot import Slot
from workers.state import gang, rank_groups, registry, slot_health, slot_view
from workers.state.gang import Renewal
from workers.state.registry import HEARTBEAT_S, TTL_S
from workers.state.slot_health import describe
from workers.state.slot_view import SlotView

__all__ = ["HEARTBEAT_S", "TTL_S", "BaseSlotStore", "Lease", "RedisSlotStore", "Renewal", "Running", "SlotView",
           "describe"]


class Running(Protocol):
    """A thread the store started for a worker (a heartbeat, a health watch), stopped at its shutdown."""

    def stop(self) -> None:
        """Stop the thread (a heartbeat also deletes what it kept alive)."""


class Lease(Protocol):
    """A running rank's hold on its own slot (`gang.SlotLease`), renewed from the rank's polls."""

    def renew(self) -> bool:
        """Renew when due; True when the launch no longer holds its slot. Raises redis.RedisError
        when Redis did not answer."""


class BaseSlotStore(Protocol):
    """The slots' shared state: registrations, withdrawals, GPU claims, health marks, gang leases."""

    # ------------------------------------------------------------ registrations

    def announce(self, queue: str, registration: str, ttl_s: float | None = None,
                 claims: dict[str, str] | None = None) -> None:
        """Write slot `queue`'s registration (JSON) and its `claims` (key -> value, with the same TTL)
        and index it; the view's epoch changes when the registration is new or changed. `ttl_s` None:
        kept until unregistered."""

    def announce_slot(self, slot: Slot, ttl_s: float | None = None) -> None:
        """`announce` of `slot` as its worker's heartbeat writes it."""

    def unregister(self, queue: str, claims: Iterable[str] = (), why: str | None = None) -> None:
        """Delete slot `queue`'s registration and `claims` and take it out of the index (a new epoch).
        `why`: the slot is withdrawn, and `withdrawn` says why for `registry.TTL_S`; None: a clean
        leave, which forgets an earlier withdrawal."""

    def live_slots(self) -> list[Slot]:
        """Every slot whose registration is current, by node then device."""

    def withdrawn(self, queues: list[str]) -> dict[str, str]:
        """Of `queues`, those whose worker withdrew its slot, with why."""

    def claim_gpu(self, slot: Slot) -> dict[str, str] | None:
        """Claim `slot`'s GPU (host, UUID) for `registry.TTL_S`: None when claimed (free, lapsed, or
        already this queue's), else the holder's {"queue", "worker"}. A slot without a GPU UUID
        claims nothing."""

    def read_view(self) -> SlotView:
        """The slots as a dispatch pass sees them (`slot_view.SlotView`): the free ones (registered,
        not reserved, not marked), the unreserved marked ones, every registered slot, and a memo
        kept while the epoch stays. An unreserved lapsed registration leaves the index (a new epoch)."""

    # ------------------------------------------------------------ health marks

    def mark_unhealthy(self, queue: str, used_bytes: int, why: str) -> None:
        """Take `queue`'s slot out of tuning for `slot_health.MARK_TTL_S`, keeping the first `since`
        of a mark still there."""

    def unhealthy(self, queues: Iterable[str]) -> dict[str, dict]:
        """The marked slots among `queues`: queue -> {"used_bytes", "since", "why"}."""

    # ------------------------------------------------------------ gang leases

    def reserve(self, queues: list[str], lease_s: float, owner: str = "") -> str | None:
        """A new token (starting with `owner#` when given) holding every queue for `lease_s` when
        each was free; else None and nothing held."""

    def keep(self, queue: str, token: str, lease_s: float, server: str = "") -> Renewal:
        """A rank's renewal of its slot (`gang.GangReservations.keep`): extended while `token` holds
        it; taken again when the key went with the server's data (`server` differs from the data's
        token now, '' never does); otherwise not held."""

    def holds(self, queues: list[str], token: str) -> bool:
        """Whether `token` still holds every one of `queues`."""

    def release(self, queues: list[str], token: str) -> int:
        """Free the queues `token` holds; how many it held."""

    def holders(self, queues: list[str]) -> dict[str, str]:
        """queue -> the owner of its lease (a token that names none: the token), for the reserved ones."""

    def owners(self, queues: list[str]) -> dict[str, str]:
        """queue -> the owner named at `reserve`, for the reserved ones that name one."""

    def held(self, queues: list[str]) -> set[str]:
        """Which of `queues` anyone holds now."""

    # ------------------------------------------------------------ ranks' training groups

    def write_rank_group(self, queue: str, task_id: str, record: str, pgid: int, ttl_s: int) -> None:
        """Keep, for `ttl_s`, rank `task_id`'s process `record` (JSON, opaque here) and its training
        group `pgid` on slot `queue` (`rank_groups.write`); written again, both are replaced."""

    def read_rank_groups(self, ranks: Iterable[tuple[str, str]]) -> dict[str, str]:
        """Of these (slot queue, task id) ranks, what their slots keep: key name (`keys.rank_process`,
        `keys.pgid`) -> value, for the non-empty ones; a rank never written or lapsed has neither."""


class RedisSlotStore:
    """`BaseSlotStore` in Redis, through the modules that own each key and script."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self._gangs: gang.GangReservations | None = None

    @property
    def gangs(self) -> gang.GangReservations:
        """The gang leases' scripts, registered on first use (a store that only reads slots loads none)."""
        if self._gangs is None:
            self._gangs = gang.GangReservations(self.client)
        return self._gangs

    # ------------------------------------------------------------ registrations

    def announce(self, queue: str, registration: str, ttl_s: float | None = None,
                 claims: dict[str, str] | None = None) -> None:
        registry.announce(self.client, queue, registration, ttl_s, claims)

    def announce_slot(self, slot: Slot, ttl_s: float | None = None) -> None:
        registry.announce_slot(self.client, slot, ttl_s)

    def unregister(self, queue: str, claims: Iterable[str] = (), why: str | None = None) -> None:
        registry.unregister(self.client, queue, claims, why)

    def live_slots(self) -> list[Slot]:
        return registry.live_slots(self.client)

    def withdrawn(self, queues: list[str]) -> dict[str, str]:
        return registry.withdrawn(self.client, queues)

    def claim_gpu(self, slot: Slot) -> dict[str, str] | None:
        return registry.claim_gpu(self.client, slot)

    def read_view(self) -> SlotView:
        return slot_view.read_view(self.client)

    # ------------------------------------------------------------ health marks

    def mark_unhealthy(self, queue: str, used_bytes: int, why: str) -> None:
        slot_health.mark_unhealthy(self.client, queue, used_bytes, why)

    def unhealthy(self, queues: Iterable[str]) -> dict[str, dict]:
        return slot_health.unhealthy(self.client, queues)

    # ------------------------------------------------------------ gang leases

    def reserve(self, queues: list[str], lease_s: float, owner: str = "") -> str | None:
        return self.gangs.reserve(queues, lease_s, owner)

    def keep(self, queue: str, token: str, lease_s: float, server: str = "") -> Renewal:
        return self.gangs.keep(queue, token, lease_s, server)

    def holds(self, queues: list[str], token: str) -> bool:
        return self.gangs.holds(queues, token)

    def release(self, queues: list[str], token: str) -> int:
        return self.gangs.release(queues, token)

    def holders(self, queues: list[str]) -> dict[str, str]:
        return self.gangs.holders(queues)

    def owners(self, queues: list[str]) -> dict[str, str]:
        return self.gangs.owners(queues)

    def held(self, queues: list[str]) -> set[str]:
        return self.gangs.held(queues)

    # ------------------------------------------------------------ ranks' training groups

    def write_rank_group(self, queue: str, task_id: str, record: str, pgid: int, ttl_s: int) -> None:
        rank_groups.write(self.client, queue, task_id, record, pgid, ttl_s)

    def read_rank_groups(self, ranks: Iterable[tuple[str, str]]) -> dict[str, str]:
        return rank_groups.read(self.client, ranks)

    # ------------------------------------------------------------ what only Redis has

    def release_in(self, pipe: redis.client.Pipeline, queues: list[str], token: str) -> None:
        """`release`, queued in `pipe` (its answer in the pipeline's results), so a caller frees the
        slots in the round trip of what it does next."""
        self.gangs.release_in(pipe, queues, token)

    def lease(self, queue: str, token: str, lease_s: float) -> Lease:
        """A running rank's hold on slot `queue` under `token`, renewed every `lease_s`/3 (`gang.SlotLease`)."""
        return gang.SlotLease(self.client, queue, token, lease_s)

    def register_slot(self, slot: Slot, withheld: Callable[[], str | None] = lambda: None) -> Running:
        """Announce `slot` (after `claim_gpu`) and keep announcing it, with its GPU's claim, while
        `withheld` gives no reason not to (`registry.register_slot`)."""
        return registry.register_slot(self.client, slot, withheld)

    def register_control(self, node: str, worker: str) -> Running:
        """Announce `node`'s control worker and keep announcing it (`control_alive` reads it)."""
        return registry.register_control(self.client, node, worker)

    def watch_health(self, queue: str, gpu: str, read_used: Callable[[str], int | None]) -> Running:
        """Start the watch that keeps slot `queue`'s health mark while others hold memory on `gpu` and
        lifts it once the GPU is free (`slot_health.HealthWatch`)."""
        return slot_health.HealthWatch(self.client, queue, gpu, read_used).start()

    def control_alive(self) -> bool:
        """Whether any control worker is registered now."""
        return registry.control_alive(self.client)
