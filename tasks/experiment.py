"""The two tasks of an experiment chord: one `run_rank` per rank on its slot, then `finish_experiment`.

    chord([run_rank(spec_r) on <node>.gpu<i> for each rank r], finish_experiment(exp) on control)

`run_rank` never raises (it returns a record with a failure class), because a header task that
raises makes Celery skip the chord body, and the experiment would never be recorded.
"""
from __future__ import annotations

import json
from typing import Any

from celery import chord

from tasks import app
from tasks.worker_hooks import redis_client
from workers import keys
from workers.gang import GangReservations
from workers.paths import safe_child, write_json
from workers.rank import RankSpec, run_rank as run_rank_body, slot_from_env
from workers.records import aggregate

#: Celery's hard limit is only a backstop behind our own per-experiment timeout and group kill.
TIME_LIMIT_GRACE_S = 300
EVENTS_TTL_S = 7 * 24 * 3600


@app.task(name="autotune.run_rank", bind=True, acks_late=True)
def run_rank(self, spec: dict[str, Any]) -> dict[str, Any]:
    """Run one rank of an experiment on this worker's slot; returns the rank's record."""
    return run_rank_body(RankSpec.from_json(spec), slot_from_env(), redis_client(app.conf),
                         task_id=self.request.id or "")


@app.task(name="autotune.finish_experiment")
def finish_experiment(rank_records: list[dict[str, Any]], exp: dict[str, Any]) -> dict[str, Any]:
    """Aggregate the ranks, write result.json and metrics.json, and tell the job's driver."""
    if rank_records and all(r.get("stale") for r in rank_records):
        return {"name": exp["name"], "status": "lost", "stale": True}  # a newer launch owns the folder
    record = aggregate(exp, rank_records)
    result_dir = safe_child(exp["results_root"], exp["name"])
    if record["status"] == "ok" and record["metrics"] is not None \
            and exp.get("metric_file", "metrics.json") == "metrics.json":
        write_json(result_dir / "metrics.json", record["metrics"], indent=None)
    write_json(result_dir / "result.json", record)
    client = redis_client(app.conf)
    if exp.get("gang_token"):
        GangReservations(client).release(exp["slots"], exp["gang_token"])
    pipe = client.pipeline()
    event = {"name": exp["name"], "attempt": exp["attempt"], "record": record}
    pipe.rpush(keys.job_events(exp["job"]), json.dumps(event))
    pipe.expire(keys.job_events(exp["job"]), EVENTS_TTL_S)
    pipe.execute()
    return record


def experiment_signature(exp: dict[str, Any], rank_specs: list[tuple[str, dict[str, Any]]]):
    """The chord for one experiment: rank tasks routed to their slots' queues, callback on control."""
    limit = int(exp["timeout_s"]) + TIME_LIMIT_GRACE_S
    header = [run_rank.s(spec).set(queue=queue, time_limit=limit) for queue, spec in rank_specs]
    return chord(header, finish_experiment.s(exp).set(queue="control"))


