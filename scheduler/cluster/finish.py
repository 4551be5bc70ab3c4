"""A finished launch's bookkeeping, run by the chord callback on the control worker: free its
slots, close it in its job, tell the job's submitter; or, for a launch whose ranks did not start
because others held memory on their GPUs, queue it again uncounted.

Apart from `scheduler.cluster.dispatch` because it is the other end of a launch: dispatch decides
where a queued experiment starts, this records how it ended (and a record of a launch Redis forgot
is adopted, `scheduler.cluster.fencing`).
"""
from __future__ import annotations

import logging
from typing import Any

import redis

from scheduler.cluster.fencing import adopted
from scheduler.cluster.job_store import JobStore, StepReads, step_reads_from
from scheduler.cluster.launches import FinishSpec
from scheduler.cluster.stores import BaseJobStore
from workers.slot.records import ExperimentRecord
from workers.state.store import RedisSlotStore, describe

log = logging.getLogger(__name__)


def record_finished(client: redis.Redis, finish: FinishSpec, record: ExperimentRecord) -> bool:
    """The chord callback's bookkeeping: free the launch's slots, close it, tell the job's submitter.
    False for a stale launch (retried or given up meanwhile, or Redis lost the job)."""
    return record_and_read(client, finish, record)[0]


def record_and_read(client: redis.Redis, finish: FinishSpec,
                    record: ExperimentRecord) -> tuple[bool, StepReads | None]:
    """`record_finished`, and the job step's reads after it (`JobStore.step_reads`), in one round
    trip: each was a round trip of its own between a rank's end and the next experiment's start
    (bench/dispatch_overhead.py). The reads are None where the launch was stale (adopting a record
    writes more, so the step reads again)."""
    store = JobStore(client, finish.job)
    wall = (finish.shape, record.wall_s) if record.ok and record.wall_s and finish.shape else None
    pipe = client.pipeline(transaction=False)
    RedisSlotStore(client).release_in(pipe, finish.slots, finish.gang_token)
    store.finish_recorded_in(pipe, finish.name, finish.attempt, {"kind": "record", "record": record.to_json()}, wall)
    store.step_reads_in(pipe)
    results = pipe.execute()
    if results[1] is None:  # the finish script's answer: that attempt is not the running launch
        return adopted(client, store, finish, record), None
    return True, step_reads_from(results)


def requeue_for_busy_gpu(client: redis.Redis, finish: FinishSpec, busy_ranks: list[dict[str, Any]]) -> bool:
    """A launch that a rank did not start because others held memory on its GPU (`gpu_busy`,
    workers.state.slot_health): its slots are freed and it waits again at its old place, on other slots
    or later; not counted as an attempt (it never ran). The submitter is told which slots left
    tuning. False for a stale launch."""
    RedisSlotStore(client).release(finish.slots, finish.gang_token)
    return requeue_uncounted(JobStore(client, finish.job), finish, busy_ranks)


def requeue_uncounted(store: BaseJobStore, finish: FinishSpec, busy_ranks: list[dict[str, Any]]) -> bool:
    """`requeue_for_busy_gpu` in the job's store, its slots freed already."""
    launch = store.running_of([finish.name]).get(finish.name)
    if launch is None or launch.attempt != finish.attempt:
        return False
    store.requeue(launch, counted=False)
    shown = [describe(rank["slot"], {"used_bytes": rank.get("device_foreign_bytes") or 0}) for rank in busy_ranks]
    log.warning("%s not started: %s; queued again", finish.name, ", ".join(shown))
    store.publish({"kind": "gpu_busy", "name": finish.name, "slots": shown})
    return True
