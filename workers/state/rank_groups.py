"""The training groups a slot's ranks left their names under: each rank's process record and its pgid.

Why here: a rank's slot writes them when its training group starts (`workers.process.process_identity`
builds the record: which rank, its leader's start time), and a stopped launch's clean-up reads them
back on another machine (`deploy.cleanup`: the control worker, or `python -m deploy cleanup`), to kill
on their hosts the groups a worker that died for good never killed. Both go through the slots' store
(`store.BaseSlotStore.write_rank_group`, `read_rank_groups`), so the clean-up's choice of groups is
tested over the store's in-memory twin; this module is the Redis side, the keys' one writer.

The record is opaque here (JSON, parsed by its readers); both keys are named in the slot's index
(`keys.rank_index`, the slot itself in `keys.RANK_SLOTS`), which the slot's readers walk instead of
scanning the keyspace.
"""
from __future__ import annotations

from collections.abc import Iterable

import redis

from workers.state import keys


def write(client: redis.Redis, queue: str, task_id: str, record: str, pgid: int, ttl_s: int) -> None:
    """Write rank `task_id`'s process `record` and its group `pgid` on slot `queue`, both named in the
    slot's index, in one transaction; the index takes the same TTL (a slot's records all have the
    rank's), so it lasts as long as the newest of them."""
    names = (keys.rank_process(queue, task_id), keys.pgid(queue, task_id))
    with client.pipeline(transaction=True) as pipe:
        pipe.set(names[0], record, ex=ttl_s)
        pipe.set(names[1], pgid, ex=ttl_s)
        pipe.sadd(keys.rank_index(queue), *names)
        pipe.expire(keys.rank_index(queue), ttl_s)
        pipe.sadd(keys.RANK_SLOTS, queue)
        pipe.expire(keys.RANK_SLOTS, ttl_s)
        pipe.execute()


def read(client: redis.Redis, ranks: Iterable[tuple[str, str]]) -> dict[str, str]:
    """key name -> value of the set, non-empty records and pgids of these (slot queue, task id)
    ranks: one MGET. A value that is no text reads as text its parser refuses, not as an error."""
    names = [name for queue, task_id in ranks
             for name in (keys.rank_process(queue, task_id), keys.pgid(queue, task_id))]
    values = client.mget(names) if names else []
    return {name: value.decode(errors="replace") for name, value in zip(names, values) if value}
