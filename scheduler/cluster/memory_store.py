"""The job store in memory: `stores.BaseJobStore` over plain dicts, the twin of the Redis
`scheduler.cluster.job_store.JobStore`; and `stores.BaseActiveJobs` over it, the twin of
`scheduler.cluster.dispatch_reads.RedisActiveJobs`.

Why a twin: the control path's decisions (dispatch's refusals and misfit grace, the sweep's retry or
give-up, finish's close, fencing and uncounted requeue, the estimates of when busy slots free) are
tested with it in tests/unit, without a redis-server; tests/redis/test_job_store_contract.py runs one
contract against both stores, so a decision tested here behaves the same over Redis.

How it keeps the Redis store's semantics:
- atomicity: each method runs to its end before any other call can read (one process, no threads
  here), which is what the Redis store gets from its transactions and Lua scripts;
- copies: launches are kept as their JSON, as in Redis, so a caller's later change to an object it
  passed in or got back changes nothing stored;
- what Redis times by a key's TTL (the events kept `EVENTS_TTL_S` after the last push, the attempts
  `ATTEMPTS_TTL_S` after the last start, `settling` for `RESUME_SETTLE_S`) is timed by `MemoryJobs.clock`,
  which a test passes and moves on; a key past its time reads as absent, as in Redis;
- the shape index: a queued launch is also filed under its shape (`QueuedLaunch.shape`) and taken out
  of it on unqueue, the shape itself staying known, as in Redis (dispatch's heads read it);
- `next_event` does not block: nothing else can push an event while it waits;
- the leases' owners beside a start are read from the slots' store the twin is given
  (`BaseSlotStore.owners`), where Redis reads the gang keys in the same script.
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from scheduler.cluster import job_store
from scheduler.cluster.launches import FinishSpec, QueuedLaunch, RunningLaunch
from scheduler.cluster.stores import Heads, StepReads
from workers.state.store import BaseSlotStore


@dataclass
class _Job:
    """One job's keys, as Redis holds them."""

    spec: bytes | None = None
    queue: dict[str, str] = field(default_factory=dict)  #: name -> QueuedLaunch JSON
    shapes: dict[str, dict[str, int]] = field(default_factory=dict)  #: shape -> name -> seq
    running: dict[str, str] = field(default_factory=dict)  #: name -> RunningLaunch JSON
    recorded: set[str] = field(default_factory=set)
    walls: dict[str, list[float]] = field(default_factory=dict)
    state: dict[str, str] = field(default_factory=dict)
    settling_until: float | None = None
    attempts: dict[str, int] = field(default_factory=dict)
    attempts_until: float | None = None  #: when the attempts expire (None: never)
    events: list[str] = field(default_factory=list)
    events_until: float | None = None


class MemoryJobs:
    """The in-memory database every `InMemoryJobStore` of a test shares, in place of a Redis client:
    the active jobs in submission order, the submission sequence, each job's keys, the clock."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.sequence = 0
        self.order: dict[str, float] = {}  #: the active jobs' submission numbers (keys.JOBS)
        self.jobs: dict[str, _Job] = {}

    def store(self, job: str) -> InMemoryJobStore:
        return InMemoryJobStore(self, job)

    def reserve_seqs(self, count: int) -> int:
        """`job_store.reserve_seqs`: the first of `count` consecutive submission numbers."""
        self.sequence += count
        return self.sequence - count + 1

    def _job(self, job: str) -> _Job:
        """The job's keys, those past their time dropped first (Redis's expiry)."""
        found = self.jobs.setdefault(job, _Job())
        now = self.clock()
        if found.settling_until is not None and now >= found.settling_until:
            found.settling_until = None
        if found.attempts_until is not None and now >= found.attempts_until:
            found.attempts, found.attempts_until = {}, None
        if found.events_until is not None and now >= found.events_until:
            found.events, found.events_until = [], None
        return found


class InMemoryJobStore:
    """One job's state in a `MemoryJobs` (`stores.BaseJobStore`; the module docstring says how it
    keeps the Redis store's semantics)."""

    def __init__(self, db: MemoryJobs, job: str) -> None:
        self.db, self.job = db, job

    @property
    def _k(self) -> _Job:
        return self.db._job(self.job)

    # ------------------------------------------------------------ the job itself

    def spec_json(self) -> bytes | None:
        return self._k.spec

    def order(self) -> float | None:
        return self.db.order.get(self.job)

    def activate(self, spec_json: str, launched_before: bool = False) -> None:
        seq = self.db.reserve_seqs(1)
        fresh = self.db.jobs[self.job] = _Job(spec=spec_json.encode())
        if launched_before:
            fresh.state["dispatched"] = "1"
            fresh.settling_until = self.db.clock() + job_store.RESUME_SETTLE_S
        self.db.order[self.job] = float(seq)

    def end(self, event: dict[str, Any]) -> None:
        self.publish(event)
        old = self._k
        self.db.jobs[self.job] = _Job(attempts=old.attempts, attempts_until=old.attempts_until, events=old.events,
                                      events_until=old.events_until)
        self.db.order.pop(self.job, None)

    # ------------------------------------------------------------ events for the submitter

    def publish(self, event: dict[str, Any]) -> None:
        found = self._k
        found.events.append(json.dumps(event))
        found.events_until = self.db.clock() + job_store.EVENTS_TTL_S

    def next_event(self, timeout_s: float) -> dict[str, Any] | None:
        found = self._k
        if not found.events:
            return None
        raw = found.events.pop(0)
        if not found.events:
            found.events_until = None  # an emptied list is no key in Redis
        return json.loads(raw)

    def vanished(self) -> bool:
        return self._k.spec is None and not self._k.events

    # ------------------------------------------------------------ the queue

    def queue(self, launches: Iterable[QueuedLaunch]) -> None:
        found = self._k
        for launch in launches:
            found.queue[launch.name] = json.dumps(launch.to_json())
            found.shapes.setdefault(launch.shape, {})[launch.name] = launch.seq

    def unqueue(self, launch: QueuedLaunch) -> None:
        found = self._k
        found.queue.pop(launch.name, None)
        found.shapes.get(launch.shape, {}).pop(launch.name, None)

    def queued_names(self) -> set[str]:
        return set(self._k.queue)

    def queued(self, names: list[str]) -> list[QueuedLaunch]:
        found = self._k.queue
        return [QueuedLaunch.from_json(json.loads(found[name])) for name in names if name in found]

    def depth(self) -> int:
        return len(self._k.queue)

    # ------------------------------------------------------------ running launches

    def running(self) -> dict[str, RunningLaunch]:
        return {name: RunningLaunch.from_json(json.loads(raw)) for name, raw in self._k.running.items()}

    def running_of(self, names: list[str]) -> dict[str, RunningLaunch]:
        found = self._k.running
        return {name: RunningLaunch.from_json(json.loads(found[name])) for name in names if name in found}

    def running_names(self) -> set[str]:
        return set(self._k.running)

    def update_running(self, launch: RunningLaunch) -> None:
        self._k.running[launch.name] = json.dumps(launch.to_json())

    def next_exp_id(self) -> int:
        state = self._k.state
        state["exp_ids"] = str(int(state.get("exp_ids", 0)) + 1)
        return int(state["exp_ids"])

    def start(self, queued: QueuedLaunch, launch: RunningLaunch) -> int:
        found = self._k
        found.attempts[launch.name] = found.attempts.get(launch.name, 0) + 1
        found.attempts_until = self.db.clock() + job_store.ATTEMPTS_TTL_S
        self.unqueue(queued)
        self.update_running(launch)
        found.state["dispatched"] = "1"
        return self.next_exp_id()

    def finish(self, name: str, attempt: str) -> RunningLaunch | None:
        found = self._k
        raw = found.running.get(name)
        if raw is None or json.loads(raw)["attempt"] != attempt:
            return None
        del found.running[name]
        found.recorded.add(name)
        return RunningLaunch.from_json(json.loads(raw))

    def mark_recorded(self, name: str) -> None:
        self._k.recorded.add(name)

    def add_wall(self, shape: str, seconds: float) -> None:
        if shape:  # '' names no shape, as in the Redis store's script
            self._k.walls.setdefault(shape, []).append(float(seconds))

    def recorded_event(self, event: dict[str, Any] | None, wall: tuple[str, float] | None = None) -> None:
        if wall is not None:
            self.add_wall(*wall)
        if event is not None:
            self.publish(event)

    def requeue(self, launch: RunningLaunch, counted: bool = True) -> None:
        found = self._k
        found.running.pop(launch.name, None)
        if not counted:
            found.attempts[launch.name] = found.attempts.get(launch.name, 0) - 1
        self.queue([launch.queued()])

    def give_up(self, launch: RunningLaunch) -> None:
        found = self._k
        found.running.pop(launch.name, None)
        found.recorded.add(launch.name)

    def step_reads(self) -> StepReads:
        return StepReads(self.spec_json(), self.recorded(), self.attempts(), self.order(), self.queued_names(),
                         self.running_names())

    def announce_phases(self, phases: list[str], current: str | None = None) -> list[bool]:
        firsts = [self.announce(phase) for phase in phases]
        if current is not None:
            self.set_phase(current)
        return firsts

    def attempts(self) -> dict[str, int]:
        return dict(self._k.attempts)

    def attempts_of(self, name: str) -> int:
        return self._k.attempts.get(name, 0)

    def recorded(self) -> set[str]:
        return set(self._k.recorded)

    def walls(self, shapes: list[str]) -> dict[str, list[float]]:
        found = self._k.walls
        return {shape: list(found[shape]) for shape in shapes if shape in found}

    # ------------------------------------------------------------ state for --status and refusals

    def announce(self, phase: str) -> bool:
        state = self._k.state
        first = f"phase:{phase}" not in state
        state.setdefault(f"phase:{phase}", "1")
        return first

    def set_phase(self, phase: str) -> None:
        self._k.state["phase"] = phase

    def misfit_since(self, now: float) -> tuple[float, bool]:
        state = self._k.state
        since = state.setdefault("misfit_since", str(now))
        return float(since), "dispatched" in state

    def settling(self) -> bool:
        return self._k.settling_until is not None

    def clear_misfit(self) -> None:
        self._k.state.pop("misfit_since", None)

    def show(self, fields: dict[str, Any]) -> None:
        self._k.state.update({name: value.decode() if isinstance(value, bytes) else str(value)
                              for name, value in fields.items()})

    def shown(self) -> dict[str, str]:
        return dict(self._k.state)


class InMemoryActiveJobs:
    """Every active job of a `MemoryJobs` at once (`stores.BaseActiveJobs`), with the slots' store
    whose leases name the launches' owners."""

    def __init__(self, db: MemoryJobs, slots: BaseSlotStore) -> None:
        self.db, self.slots = db, slots

    def store(self, job: str) -> InMemoryJobStore:
        return self.db.store(job)

    def active_spec_jsons(self) -> list[bytes]:
        order = sorted(self.db.order, key=lambda job: (self.db.order[job], job))
        return [spec for job in order if (spec := self.store(job).spec_json()) is not None]

    def heads(self, jobs: list[str], free_slots: int) -> dict[str, Heads]:
        found = {}
        for job in jobs:
            held = self.db._job(job)
            names: list[str] = []
            for shape, seqs in held.shapes.items():
                nodes, _, rest = shape.partition("x")
                per_launch = max(1, int(nodes) * int(rest.partition(":")[0]))
                names += sorted(seqs, key=lambda name: (seqs[name], name))[:free_slots // per_launch + 1]
            launches = self.store(job).queued(names)
            found[job] = Heads(sorted(launches, key=lambda launch: launch.seq), len(held.queue), set(held.running))
        return found

    def running_by_job(self, jobs: list[str]) -> dict[str, list[RunningLaunch]]:
        return {job: list(self.store(job).running().values()) for job in jobs}

    def walls_by_job(self, shapes: dict[str, list[str]]) -> dict[str, dict[str, list[float]]]:
        return {job: self.store(job).walls(wanted) for job, wanted in shapes.items() if wanted}

    def show_all(self, shown: dict[str, dict[str, Any]], misfits_cleared: Iterable[str] = ()) -> None:
        for job in misfits_cleared:
            self.store(job).clear_misfit()
        for job, fields in shown.items():
            self.store(job).show(fields)

    def lease_owners(self, queues: list[str]) -> list[tuple[str, RunningLaunch | None]]:
        owners = self.slots.owners(queues)
        found = {}
        for queue in queues:
            owner = owners.get(queue)
            if owner is not None and owner not in found:
                job, slash, name = owner.rpartition("/")
                found[owner] = self.store(job).running_of([name]).get(name) if slash else None
        return list(found.items())

    def start_beside(self, job: str, queued: QueuedLaunch, launch: RunningLaunch,
                     beside: list[tuple[str, RunningLaunch]]) -> int:
        for other_job, other in beside:
            self.store(other_job).update_running(other)
        return self.store(job).start(queued, launch)

    def finish_launch(self, finish: FinishSpec, event: dict[str, Any],
                      wall: tuple[str, float] | None) -> StepReads | None:
        self.slots.release(finish.slots, finish.gang_token)
        store = self.store(finish.job)
        if store.finish(finish.name, finish.attempt) is None:
            return None
        store.recorded_event(event, wall)
        return store.step_reads()
