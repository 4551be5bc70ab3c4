"""A finished launch's bookkeeping, run by the chord callback on the control worker: free its
slots, close it in its job, tell the job's submitter; or, for a launch whose ranks did not start
because others held memory on their GPUs, queue it again uncounted.

Apart from `scheduler.cluster.dispatch` because it is the other end of a launch: dispatch decides
where a queued experiment starts, this records how it ended (and a record of a launch Redis forgot
is adopted, `scheduler.cluster.fencing`). Like dispatch it reads and writes only through the stores
(`stores.BaseActiveJobs`, `workers.state.store.BaseSlotStore`), so its decisions are unit-tested over
the in-memory twins (tests/unit/test_finish_decisions.py); the Redis stores' pipeline and round trip
stay in tests/redis/test_dispatch.py.
"""
from __future__ import annotations

import logging
from typing import Any

from scheduler.cluster.fencing import adopted
from scheduler.cluster.launches import FinishSpec
from scheduler.cluster.stores import BaseActiveJobs, BaseJobStore, StepReads
from workers.slot.records import ExperimentRecord
from workers.state.store import BaseSlotStore, describe

log = logging.getLogger(__name__)


def record_finished(jobs: BaseActiveJobs, finish: FinishSpec, record: ExperimentRecord) -> bool:
    """The chord callback's bookkeeping: free the launch's slots, close it, tell the job's submitter.
    False for a stale launch (retried or given up meanwhile, or Redis lost the job)."""
    return record_and_read(jobs, finish, record)[0]


def record_and_read(jobs: BaseActiveJobs, finish: FinishSpec,
                    record: ExperimentRecord) -> tuple[bool, StepReads | None]:
    """`record_finished`, and the job step's reads after it (`BaseJobStore.step_reads`), in one round
    trip (`BaseActiveJobs.finish_launch`): each was a round trip of its own between a rank's end and the
    next experiment's start. Only a measured, successful run's wall time feeds the estimates. The reads
    are None where the launch was stale (adopting a record writes more, so the step reads again)."""
    wall = (finish.shape, record.wall_s) if record.ok and record.wall_s and finish.shape else None
    read = jobs.finish_launch(finish, {"kind": "record", "record": record.to_json()}, wall)
    if read is None:  # that attempt is not the running launch
        return adopted(jobs.store(finish.job), finish, record), None
    return True, read


def requeue_for_busy_gpu(slots: BaseSlotStore, store: BaseJobStore, finish: FinishSpec,
                         busy_ranks: list[dict[str, Any]]) -> bool:
    """A launch that a rank did not start because others held memory on its GPU (`gpu_busy`,
    workers.state.slot_health): its slots are freed and it waits again at its old place, on other slots
    or later; not counted as an attempt (it never ran). The submitter is told which slots left
    tuning. False for a stale launch (its slots freed all the same, token-checked)."""
    slots.release(finish.slots, finish.gang_token)
    return requeue_uncounted(store, finish, busy_ranks)


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
