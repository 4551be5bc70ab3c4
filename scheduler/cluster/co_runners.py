"""Which launches ran beside which: each launch's co-runners, recorded as it starts.

A launch's co-runners are the launches of any job holding a slot on its nodes when it starts, and
those starting beside it later; its record names them (`co_runners_of`), so an experiment measured
beside others can be told from one measured alone. The holders are the gang keys' owners
("job/experiment", workers.state.gang).

Why one read: at each start the owners of the busy slots beside it and their running launches
are read in one round trip (`beside`, through `stores.BaseActiveJobs.lease_owners`: one script over
Redis); the updates of those launches go into the starting launch's own transaction
(`stores.BaseActiveJobs.start_beside`). Reading each owner job's whole running hash
(as this did first) cost a pass after a completion 10 ms a start at 1,024 slots (bench/scale.py).
"""
from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import replace

import redis

from scheduler.cluster.job_store import JobStore
from scheduler.cluster.launches import FinishSpec, RunningLaunch
from scheduler.cluster.stores import BaseActiveJobs
from workers.device.slot import Slot


def queues_by_node(slots: Iterable[Slot]) -> dict[str, list[str]]:
    """node -> the queues of its slots: what `beside` looks up (once per pass, not once per start)."""
    found: dict[str, list[str]] = {}
    for slot in slots:
        found.setdefault(slot.node, []).append(slot.queue)
    return found


def beside(jobs: BaseActiveJobs, key: str, placement: Sequence[Sequence[Slot]], by_node: Mapping[str, list[str]],
           busy: Collection[str]) -> tuple[list[str], list[tuple[str, RunningLaunch]]]:
    """For launch `key` ("job/experiment") starting on `placement`: its co-runners (the owners of
    the busy slots on its nodes, `by_node`: `queues_by_node`), and the running launches among them
    that do not name it yet, as (job, launch with `key` added) for the caller to write with its
    start. No round trip when no other slot of its nodes is busy."""
    nodes = {slot.node for node in placement for slot in node}
    taken = {slot.queue for node in placement for slot in node}
    mates = sorted(queue for node in nodes for queue in by_node.get(node, ()) if queue in busy and queue not in taken)
    if not mates:
        return [], []
    owners, updates = [], []
    for owner, other in jobs.lease_owners(mates):
        if owner == key:
            continue
        owners.append(owner)
        if other is not None and key not in other.co_runners:
            updates.append((owner.rpartition("/")[0], replace(other, co_runners=[*other.co_runners, key])))
    return sorted(owners), updates


def co_runners_of(client: redis.Redis, finish: FinishSpec) -> list[str]:
    """The launches that ran beside this one (`RunningLaunch.co_runners`), for its record; [] for a
    launch no longer running under this attempt, or while Redis cannot be read: the record is
    written first whatever Redis does."""
    try:
        launch = JobStore(client, finish.job).running_of([finish.name]).get(finish.name)
    except redis.RedisError:
        return []
    return list(launch.co_runners) if launch is not None and launch.attempt == finish.attempt else []
