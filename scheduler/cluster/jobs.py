"""A job on the cluster: what a submitter hands the control workers, and the job's life in Redis.

Why a job lives in Redis rather than in the process that submitted it: the control workers advance
it (each experiment's chord callback starts the next phase, dispatch launches experiments), so a
tuning job goes on when `python -m scheduler.autotune` dies. The submitter writes the spec, asks a
control worker for the first step, and watches the job's event list to print progress.

A job is either a tuning job (`tune`: a search replayed from the results folder, see
`scheduler.cluster.progress`) or a fixed list of experiments (`experiments`: `python -m scheduler.run`,
`--run`, benchmarks). Its spec is JSON; its state lives in `scheduler.cluster.job_store`, and a stored spec means active.

    submit    spec written, job added to keys.JOBS, `autotune.advance_job` sent to the control queue
    advance   (control) replay the search; queue the next phase's experiments, or end the job
    dispatch  (control) reserve gangs for queued experiments and send their chords
    finish    (control, chord callback) record the experiment, then advance and dispatch again
    sweep     (control, every few seconds) lost launches: retried, or recorded `lost`
    end       a `done` or `failed` event for the submitter; the job's keys deleted in one step

Redis losing the job (a restart without persistence) is noticed by the watching submitter, which
submits the same spec again: the search replays from the results folder, so nothing measured is
lost. A tuning job's id is derived from its results folder, so running the same command while its
job is still active attaches to it instead of starting a second job on the same folders.
"""
from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import redis

from scheduler.launch.environment import env_number
from scheduler.errors import AutotuneError, UsageError
from scheduler.cluster.job_store import JobStore, active_spec_jsons
from scheduler.cluster.launches import RunningLaunch
from scheduler.cluster.work import Work
from workers.files.layout import RESULT
from workers.files.paths import read_json, safe_child
from workers.slot.records import ExperimentRecord
from workers.state.store import RedisSlotStore

LEASE_S = env_number("AUTOTUNE_LEASE_S", 60.0)  #: how long a dead rank can hold its slot
LOST_GRACE_S = env_number("AUTOTUNE_LOST_GRACE_S", 120.0)
MAX_ATTEMPTS = int(env_number("AUTOTUNE_MAX_ATTEMPTS", 3))  #: launches of one experiment, counted in Redis
REDIS_OUTAGE_S = 300.0  #: how long a submitter waits for a restarting Redis before giving up
WATCH_BLOCK_S = 2
#: How long a cancel waits for the group kills it started (TERM, a 5 s grace, KILL): Ctrl-C ends
#: within 15 s, so a user who interrupts a job gets the terminal back promptly.
CANCEL_CLEAN_UP_WAIT_S = 10.0

log = logging.getLogger(__name__)


class JobFailed(UsageError):
    """The job was refused or stopped for a reason the user can fix (config, cluster shape, metric)."""


class JobCrashed(AutotuneError):
    """A control worker hit an internal error while advancing the job."""


@dataclass(frozen=True)
class TuneSpec:
    """A tuning job: the user's config and script, and the slot facts the search was sized for."""

    config_path: str
    ds_config: dict[str, Any]
    exps_dir: str
    script: str
    base_args: list[str]
    mappings: dict[str, str]
    capacity_bytes: int
    num_nodes: int
    num_gpus: int
    device_kind: str
    concurrency: int


@dataclass(frozen=True)
class JobSpec:
    """Everything a control worker needs to run a job without its submitter. JSON in Redis."""

    job: str
    results_root: str  #: absolute; experiment folders are results_root/<name>
    cwd: str  #: where the script runs on the slot hosts
    timeout_s: float  #: each experiment's wall-clock limit
    tune: TuneSpec | None = None
    experiments: list[dict[str, Any]] | None = None  #: fixed job: Experiment JSON plus its "argv"
    pinned: list[list[str]] | None = None  #: run every experiment on exactly these slots (per node)
    policy: str = "backfill"  #: or "strict_fifo" (DeepSpeed's rule, for side-by-side benchmarks)
    min_memory: int = 0  #: bytes every slot of every experiment must offer (heterogeneous clusters)
    slot_kind: str = ""  #: "cuda" or "cpu": every slot of every experiment is of this kind ("" = any one)
    #: the only slot queues its experiments may reserve (the resource pool: --hostfile/--include/--exclude,
    #: `scheduler.launch.pool`); None: every slot
    allowed: list[str] | None = None
    local_rank_arg: bool = False  #: each rank gets `--local_rank=N` after the script, as from DeepSpeed's launcher
    lease_s: float = LEASE_S
    lost_grace_s: float = LOST_GRACE_S
    max_attempts: int = MAX_ATTEMPTS
    submitted_at: float = field(default=0.0, compare=False)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> JobSpec:
        data = json.loads(text)
        tune = data.pop("tune")
        return cls(**data, tune=TuneSpec(**tune) if tune else None)


def job_id_for(results_root: Path) -> str:
    """A tuning job's id: one per results folder, so a re-run finds its own job."""
    return hashlib.sha256(str(results_root.resolve()).encode()).hexdigest()[:16]


def load_spec(client: redis.Redis, job: str) -> JobSpec | None:
    raw = JobStore(client, job).spec_json()
    return JobSpec.from_json(raw) if raw else None


def active_specs(client: redis.Redis) -> list[JobSpec]:
    """The specs of the active jobs, in submission order (two round trips, whatever the jobs)."""
    return [JobSpec.from_json(raw) for raw in active_spec_jsons(client)]


def stop_launch(client: redis.Redis, work: Work, launch: RunningLaunch) -> None:
    """Stop one running launch: revoke its rank tasks (their workers kill the training groups) and
    free its slots, token-checked. A worker that died for good kills nothing, so the groups its
    ranks recorded are also killed on their hosts (`Work.clean_up`), in the background."""
    slots = RedisSlotStore(client)
    work.revoke(list(launch.rank_tasks.values()))
    slots.release(launch.queues, launch.token)
    work.clean_up(slots, launch.name, launch.to_json())


def submit(client: redis.Redis, work: Work, spec: JobSpec, launched_before: bool = False) -> bool:
    """Make `spec` an active job and ask a control worker to start it. Returns True when an identical
    job was already active (its submitter died): the caller then just watches it. `launched_before`:
    submitted again after Redis lost it, so its slots may only be re-registering, and it gets the
    grace a job that launched gets before a shape is refused (`dispatch.REFUSE_GRACE_S`)."""
    current = load_spec(client, spec.job)
    if current is not None and current == spec:
        work.advance(spec.job)
        return True
    if current is not None:
        cancel(client, work, spec.job)  # the same folder with another config: the newer one wins
    spec = replace(spec, submitted_at=spec.submitted_at or time.time())
    JobStore(client, spec.job).activate(spec.to_json(), launched_before)
    work.advance(spec.job)
    return False


def publish(client: redis.Redis, job: str, event: dict[str, Any]) -> None:
    """An event for the job's submitter (phase started, experiment recorded)."""
    JobStore(client, job).publish(event)


def end(client: redis.Redis, job: str, event: dict[str, Any]) -> None:
    """End the job: its last event and the removal of its keys, in one transaction."""
    JobStore(client, job).end(event)


def cancel(client: redis.Redis, work: Work, job: str) -> None:
    """Stop every running experiment of the job (revoke + group kill), free its slots, forget it;
    then wait (at most `CANCEL_CLEAN_UP_WAIT_S`) for the group kills, which run in the background:
    the command that cancels (Ctrl-C) exits next, and its exit would stop them halfway."""
    for launch in JobStore(client, job).running().values():
        stop_launch(client, work, launch)
    end(client, job, {"kind": "failed", "error": "cancelled", "usage": True})
    if not work.wait_for_clean_ups(CANCEL_CLEAN_UP_WAIT_S):
        log.warning("the clean-up of job %s's training groups is still running after %.0f s; the slot "
                    "workers kill their own ranks' groups", job, CANCEL_CLEAN_UP_WAIT_S)


def watch(client: redis.Redis, work: Work, spec: JobSpec, on_event: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Print-side of a job: hand every event to `on_event` until the job ends; returns the `done`
    event, raises JobFailed / JobCrashed for a `failed` one. Waits out Redis restarts and submits
    the job again if Redis lost it."""
    outage_since: float | None = None
    warned_no_control = False
    store = JobStore(client, spec.job)
    while True:
        try:
            event = store.next_event(WATCH_BLOCK_S)
            if event is None and store.vanished():
                log.warning("job %s vanished from Redis (restarted without its data); submitting it again",
                            spec.job)
                submit(client, work, spec, launched_before=True)
            if event is None:
                control_down = not RedisSlotStore(client).control_alive()
                if control_down and not warned_no_control:
                    log.warning("no control worker is alive: the job waits until one starts "
                                "(`celery -A tasks worker -Q control -n control@%s`)", "%h")
                warned_no_control = control_down
            outage_since = None
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            outage_since = outage_since or time.monotonic()
            if time.monotonic() - outage_since > REDIS_OUTAGE_S:
                raise
            log.warning("Redis unreachable (%s); waiting for it", exc)
            time.sleep(1.0)
            continue
        if event is None:
            continue
        if event.get("kind") == "done":
            return event
        if event.get("kind") == "failed":
            raise (JobFailed if event.get("usage") else JobCrashed)(event.get("error", "job failed"))
        on_event(event)


def run_fixed(client: redis.Redis, work: Work, spec: JobSpec,
              on_record: Callable[[dict[str, Any]], None] = lambda record: None) -> list[dict[str, Any]]:
    """Run a fixed job to its end and return one record per experiment, in the spec's order.
    Ctrl-C (KeyboardInterrupt) cancels it on the cluster."""
    submit(client, work, spec)

    def on_event(event: dict[str, Any]) -> None:
        if event.get("kind") == "record":
            on_record(event["record"])
        elif event.get("kind") == "gpu_busy":  # finish.requeue_for_busy_gpu
            log.warning("%s not started: other processes hold memory on %s; it waits until that memory goes",
                        event.get("name"), ", ".join(event.get("slots", [])))

    try:
        watch(client, work, spec, on_event)
    except KeyboardInterrupt:
        cancel(client, work, spec.job)
        raise
    return [read_json(safe_child(spec.results_root, exp["name"]) / RESULT) or
            ExperimentRecord.lost(exp["name"]).to_json() for exp in spec.experiments or []]
