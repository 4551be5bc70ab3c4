"""The control worker's sweep for lost launches: those no event announces, because the worker,
node or Redis data that would have announced them is gone.

A launch is `lost` when no record came within its time limit plus a grace, when a worker of its
slots restarted, stopped sending heartbeats or withdrew its slot (its consumer stopped taking
messages, `workers.slot.consumer_watch`: at once, without waiting out a blip), or when its lease lapsed
on a slot whose rank has not reported (the ranks renew their own slots' leases, so a lapse means
that rank's worker or node is gone). A lost launch is revoked and queued again at its old place
while attempts remain (counted in Redis before each launch), then recorded `lost`. After Redis lost
its data, a launch whose ranks ran on (they take their slots back) is not launched a second time by
its resubmitted job (`progress.launches_holding_slots`); its record, when it comes, is adopted
(`scheduler.cluster.fencing`), which also keeps a launch that lost its hold from being recorded.

Apart from `scheduler.cluster.dispatch`: dispatch starts launches on events; this runs every
`SWEEP_S` (`scheduler.cluster.control_loop`) and decides which running launches will never report.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping

import redis

from scheduler.cluster.job_store import JobStore
from scheduler.cluster.jobs import JobSpec, active_specs, stop_launch
from scheduler.cluster.launches import RunningLaunch
from scheduler.cluster.stores import BaseJobStore
from scheduler.cluster.work import Work
from workers.files.layout import RESULT, experiment_file
from workers.files.paths import safe_child, write_json
from workers.slot.records import ExperimentRecord
from workers.state.store import HEARTBEAT_S, TTL_S, BaseSlotStore, RedisSlotStore

SWEEP_S = 2.0  #: how often the control worker sweeps
SLOT_GONE_S = TTL_S + HEARTBEAT_S  #: a slot unregistered this long has lost its worker (not a blip)

log = logging.getLogger(__name__)


def sweep(client: redis.Redis, work: Work) -> set[str]:
    """Find lost launches (module docstring); returns the jobs whose step is due: those that recorded
    one as `lost`, and those with nothing running or queued. Such a job waits only for launches Redis
    forgot (`progress.launches_holding_slots`), whose record may never come (their chord went with
    Redis's data): no event would step it when their leases lapse, so the sweep does."""
    return sweep_jobs(RedisSlotStore(client), active_specs(client), lambda job: JobStore(client, job), work,
                      lambda lost: stop_launch(client, work, lost), time.time())


def sweep_jobs(slots: BaseSlotStore, specs: Iterable[JobSpec], store_of: Callable[[str], BaseJobStore], work: Work,
               stop: Callable[[RunningLaunch], None], now: float) -> set[str]:
    """`sweep` at `now` over the stores it reads: the slots', and each job's (`store_of`); `stop`
    stops a lost launch (`jobs.stop_launch`)."""
    live = {slot.queue: slot.instance for slot in slots.live_slots()}
    due: set[str] = set()
    for spec in specs:
        store = store_of(spec.job)
        running = store.running().values()
        taken_back = slots.withdrawn(sorted({q for launch in running for q in launch.queues if q not in live}))
        for launch in running:
            why = _why_lost(store, work, slots, spec, launch, live, now, taken_back)
            if why is not None and _lose(store, spec, launch, why, stop):
                due.add(spec.job)
        if not running and not store.depth():
            due.add(spec.job)
    return due


def _why_lost(store: BaseJobStore, work: Work, slots: BaseSlotStore, spec: JobSpec, launch: RunningLaunch,
              live: dict[str, str], now: float, taken_back: Mapping[str, str] | None = None) -> str | None:
    """Why `launch` is lost at `now` (module docstring), None while it is not; `live` maps each live
    slot to its worker's instance, `taken_back` the withdrawn slots to why. Notes in the store when
    a slot of the launch was first seen gone."""
    gone = [q for q in launch.queues if q not in live]
    taken_back = taken_back or {}
    withdrawn_here = [q for q in gone if q in taken_back]
    if withdrawn_here:  # its worker said why it left: no need to wait out a blip
        return f"the worker of {withdrawn_here[0]} withdrew its slot ({taken_back[withdrawn_here[0]]})"
    restarted = [q for q in launch.queues if q in live and live[q] != launch.instances.get(q)]
    if gone and launch.missing_since is None:
        launch = launch.missing_from(now)
        store.update_running(launch)
    if now > launch.deadline:
        return (f"no record from the slot workers within the time limit plus {spec.lost_grace_s:.0f}s "
                "(a worker or node died, or Redis lost the task)")
    if restarted:
        return f"the worker of {', '.join(restarted)} restarted during the run"
    if gone and launch.missing_since is not None and now - launch.missing_since > SLOT_GONE_S:
        return f"the worker of {', '.join(gone)} stopped sending heartbeats"
    if now - launch.started > spec.lease_s and not slots.holds(launch.queues, launch.token):
        silent = [q for q, task in launch.rank_tasks.items() if not work.finished(task)]
        if silent and not slots.holds(silent, launch.token):
            return f"the lease of {', '.join(silent)} expired: its rank stopped renewing it (worker or node gone)"
    return None


def _lose(store: BaseJobStore, spec: JobSpec, launch: RunningLaunch, why: str,
          stop: Callable[[RunningLaunch], None]) -> bool:
    """Stop a lost launch (`stop`: `jobs.stop_launch`); queue it again at its old place while attempts
    remain, else record it `lost`. Returns True when it was recorded (the job's phase may be complete now)."""
    stop(launch)
    attempts = store.attempts_of(launch.name)
    if attempts < spec.max_attempts:
        log.warning("%s lost (%s); retrying, attempt %d of %d", launch.name, why, attempts + 1, spec.max_attempts)
        store.requeue(launch)
        return False
    record = ExperimentRecord.lost(launch.name, f"{why}; gave up after {attempts} attempts", metrics=None,
                                   ds_config=launch.exp["ds_config"], slots=launch.queues).to_json()
    write_json(experiment_file(safe_child(spec.results_root, launch.name), RESULT), record)
    store.give_up(launch)
    store.publish({"kind": "record", "record": record})
    return True
