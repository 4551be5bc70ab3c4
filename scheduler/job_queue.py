"""A job's waiting experiments in Redis, indexed so that dispatch reads only what could start.

Why an index: a dispatch pass runs after every completion. Reading and parsing every waiting entry
of every job made a pass O(queue): 10,000 queued experiments cost ~250 ms per pass under the cluster
lock. But within one job and one shape (nodes x slots per node, minimum memory) the entries are
interchangeable for placement, and a shape that finds no room in a pass finds none for the rest of
it (busy slots only accumulate). So at most `free slots // slots per entry + 1` entries of each
(job, shape) can matter in a pass: the ones that start, then the first that does not fit. Dispatch
asks for exactly those (`heads`), and the pass costs O(shapes + free slots), whatever the depth.

Keys (see `workers.keys`):

    autotune:job:<job>:queue            hash  experiment name -> waiting entry (JSON: seq, exp, argv)
    autotune:job:<job>:shapes           set   the shapes that have an index below
    autotune:job:<job>:queue:<shape>    zset  experiment name scored by its seq (submission order)

Every write goes through here, in one pipeline per operation, so the hash and the index never
disagree.
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import redis

from workers import keys


def shape_of(entry: dict[str, Any]) -> str:
    """'<nodes>x<slots per node>:<min memory>': entries of one shape place the same way."""
    exp = entry["exp"]
    return f"{exp['num_nodes']}x{exp['num_gpus']}:{exp.get('min_memory', 0)}"


def add(pipe: redis.client.Pipeline, job: str, entries: Iterable[dict[str, Any]]) -> None:
    """Add to `pipe` (the caller's transaction) the queueing of entries (each with its `seq`),
    replacing entries of the same experiment name."""
    for entry in entries:
        shape, name = shape_of(entry), entry["exp"]["name"]
        pipe.hset(keys.job_queue(job), name, json.dumps(entry))
        pipe.sadd(keys.job_shapes(job), shape)
        pipe.zadd(keys.job_queue_shape(job, shape), {name: entry["seq"]})


def remove(pipe: redis.client.Pipeline, job: str, entry: dict[str, Any]) -> None:
    """Add the removal of `entry` to `pipe` (the caller's transaction)."""
    pipe.hdel(keys.job_queue(job), entry["exp"]["name"])
    pipe.zrem(keys.job_queue_shape(job, shape_of(entry)), entry["exp"]["name"])


def names(client: redis.Redis, job: str) -> set[str]:
    """The experiment names waiting in the job's queue."""
    return {name.decode() for name in client.hkeys(keys.job_queue(job))}


def entries(client: redis.Redis, job: str, names: list[str] | None = None) -> list[dict[str, Any]]:
    """The waiting entries of `names` (those still queued), or of the whole queue."""
    if names is None:
        return [json.loads(raw) for raw in client.hvals(keys.job_queue(job))]
    if not names:
        return []
    return [json.loads(raw) for raw in client.hmget(keys.job_queue(job), names) if raw is not None]


def depth(client: redis.Redis, job: str) -> int:
    return int(client.hlen(keys.job_queue(job)))


def heads(client: redis.Redis, jobs: list[str], free_slots: int) -> dict[str, list[dict[str, Any]]]:
    """Per job, the entries that can matter to a pass with `free_slots` free slots (module
    docstring), in submission order. Two round trips, whatever the depth of the queues."""
    pipe = client.pipeline(transaction=False)
    for job in jobs:
        pipe.smembers(keys.job_shapes(job))
    shapes_by_job = dict(zip(jobs, pipe.execute()))
    wanted: list[tuple[str, str]] = []
    for job, shapes in shapes_by_job.items():
        for raw in sorted(shapes):
            shape = raw.decode()
            nodes, _, rest = shape.partition("x")
            per_entry = int(nodes) * int(rest.partition(":")[0])
            pipe.zrange(keys.job_queue_shape(job, shape), 0, free_slots // max(1, per_entry))
            wanted.append((job, shape))
    names_by_index = pipe.execute() if wanted else []
    for (job, _), names in zip(wanted, names_by_index):
        if names:
            pipe.hmget(keys.job_queue(job), names)
    fetched = iter(pipe.execute() if any(names_by_index) else [])
    found: dict[str, list[dict[str, Any]]] = {job: [] for job in jobs}
    for (job, _), names in zip(wanted, names_by_index):
        if names:
            found[job] += [json.loads(raw) for raw in next(fetched) if raw is not None]
    return {job: sorted(items, key=lambda entry: entry["seq"]) for job, items in found.items()}


def index_keys(client: redis.Redis, job: str) -> list[str]:
    """The job's queue keys beyond `keys.job_keys` (one index per shape), for deleting a job."""
    return [keys.job_shapes(job)] + [keys.job_queue_shape(job, raw.decode())
                                     for raw in client.smembers(keys.job_shapes(job))]
