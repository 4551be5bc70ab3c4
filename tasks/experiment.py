"""The tasks of a tuning job, thin shells over `workers/` (what runs on a slot) and `scheduler/`
(what the control workers decide).

An experiment is a chord sent by `scheduler.cluster.dispatch`:

    chord([run_rank(spec_r) on <node>.gpu<i> for each rank r], finish_experiment(exp) on control)

`run_rank` never raises (it returns a record with a failure class), because a header task that
raises makes Celery skip the chord body, and the experiment would never be recorded.
`finish_experiment`, under the cluster lock, checks that its launch still holds the experiment
(`scheduler.cluster.fencing`: a launch relaunched elsewhere meanwhile is not counted and writes
nothing), shows the launch's metrics, description, command and logs under DeepSpeed's plain names
(`workers.process.launch_files`: each launch writes its own), writes the record to the results folder (the
durable record), then closes the launch,
advances the job (the next phase, or the job's end) and dispatches whatever can start now (before the step when the step cannot change that:
`scheduler.cluster.progress.advance`). A launch a rank did not start because others' memory sat on its
GPU (`gpu_busy`, workers.state.slot_health) is no experiment: nothing is written, it is queued again.
`advance_job` is the same step for a job just submitted.

Celery's own writes on that path are kept to what is read: a rank's result (the chord joins it, and
`Work.finished` asks whether it is ready), but not its STARTED state, which nothing reads (Flower
follows the workers' events); the callback's and the job step's results are never read at all, so
they are not stored (`ignore_result`, which also skips their STARTED state). Each of those writes
was a GET and a SET with a PUBLISH between a rank's end and the next experiment's start.
"""
from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from celery import signals

from tasks.app import app
from tasks.work import CeleryWork
from tasks.worker_hooks import task_client
from workers.files import layout
from workers.in_rank.failure import Status
from workers.state.store import RedisSlotStore
from workers.process.launch_files import LaunchFiles
from workers.files.layout import experiment_file
from workers.files.paths import safe_child, write_json
from workers.slot.rank import run_rank as run_rank_body, slot_from_env
from workers.slot.rank_spec import RankSpec
from workers.slot.records import ExperimentRecord, RankRecord, experiment_record

log = logging.getLogger(__name__)
#: The control path's messages, sent through this app (`scheduler.cluster.work.Work`).
WORK = CeleryWork(app)


@signals.worker_process_init.connect
def prewarm(**_: object) -> None:
    """Import the control path when a pool child starts, not inside the first experiment's callback."""
    import scheduler.cluster.dispatch  # noqa: F401
    import scheduler.cluster.finish  # noqa: F401
    import scheduler.cluster.progress  # noqa: F401


@app.task(name="autotune.run_rank", bind=True, acks_late=True, track_started=False)
def run_rank(self, spec: dict[str, Any]) -> dict[str, Any]:
    """Run one rank of an experiment on this worker's slot; returns the rank's record."""
    return run_rank_body(RankSpec.from_json(spec), slot_from_env(), task_client(app.conf),
                         task_id=self.request.id or "")


@app.task(name="autotune.finish_experiment", ignore_result=True)
def finish_experiment(rank_records: list[dict[str, Any]], finish_json: dict[str, Any]) -> dict[str, Any]:
    """Aggregate the ranks, write result.json and metrics.json (model_info.json for the profile run),
    show the counted launch's exp.json, cmd.txt and logs under their plain names, then take the
    job's next step. A launch that no longer holds its experiment is not counted: where the folder
    has no result yet, its record goes there marked `stale` (never ranked, never listed), so a
    folder the job went on without says why it holds a launch's files."""
    from scheduler.cluster.co_runners import co_runners_of
    from scheduler.cluster.dispatch import cluster_lock, dispatch
    from scheduler.cluster.dispatch_reads import RedisActiveJobs
    from scheduler.cluster.finish import record_and_read, requeue_for_busy_gpu
    from scheduler.cluster.launches import FinishSpec
    from scheduler.cluster.fencing import holds_experiment
    from scheduler.cluster.progress import advance

    finish = FinishSpec.from_json(finish_json)
    ranks = [RankRecord.from_json(r) for r in rank_records]
    if ranks and all(r.stale for r in ranks):
        return ExperimentRecord.lost(finish.name, stale=True).to_json()  # a newer launch owns the folder
    client = task_client(app.conf)
    jobs, slots = RedisActiveJobs(client), RedisSlotStore(client)
    busy = [r for r, typed in zip(rank_records, ranks) if typed.status is Status.GPU_BUSY]
    if busy:  # not started beside others' memory: no record, queued again (workers.state.slot_health)
        with cluster_lock(client):
            requeued = requeue_for_busy_gpu(slots, jobs.store(finish.job), finish, busy)
            dispatch(client, WORK)
        return {"name": finish.name, "status": Status.GPU_BUSY.value, "requeued": requeued}
    record = experiment_record(finish.to_json(), rank_records)
    co_runners = co_runners_of(client, finish)
    if co_runners:  # launches of any job that held a slot on its nodes while it ran
        record = replace(record, co_runners=co_runners)
    result_dir = safe_child(finish.results_root, finish.name)
    with cluster_lock(client):
        if not holds_experiment(jobs.store(finish.job), finish):  # fenced: a newer launch holds it
            slots.release(finish.slots, finish.gang_token)
            log.warning("%s: a record of launch %s, which no longer holds the experiment, is not counted",
                        finish.name, finish.attempt)
            stale = {**record.to_json(), "stale": True, "attempt": finish.attempt}
            result = experiment_file(result_dir, layout.RESULT)
            if not result.exists():  # the folder says why it holds files no result counts
                write_json(result, stale)  # a later launch that holds the experiment writes over it
            return {"name": finish.name, "status": record.status.value, "stale": True}
        if record.ok and record.metrics is not None and \
                finish.metric_file in (layout.METRICS, layout.MODEL_INFO):  # DeepSpeed's name for the counted launch's
            write_json(experiment_file(result_dir, finish.metric_file), record.metrics, indent=None)
        # exp.json, cmd.txt, stdout.log...: this launch's, before the record (a replay reads exp.json beside it)
        LaunchFiles.of(result_dir, finish.attempt, finish.metric_file).adopt(finish.world_size)
        written = record.to_json()
        write_json(experiment_file(result_dir, layout.RESULT), written)  # the durable record, before Redis's
        _, read = record_and_read(jobs, finish, record)  # with the step's reads: one round trip
        advance(client, finish.job, lambda: dispatch(client, WORK), read)  # the pass before the step when it can
    return written


@app.task(name="autotune.advance_job", ignore_result=True)
def advance_job(job: str) -> None:
    """A job's first step after submission (or after its submitter re-attached)."""
    from scheduler.cluster.dispatch import cluster_lock, dispatch
    from scheduler.cluster.progress import advance

    client = task_client(app.conf)
    with cluster_lock(client):
        advance(client, job)
        dispatch(client, WORK)
