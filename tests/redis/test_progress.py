"""A job's step (`scheduler.cluster.progress`) against a real redis-server, with no Celery: a fixed job of two
experiments is advanced step by step while its records appear on disk, and every expectation is read
back from the raw keys (queue, state hash, events list) and compared with what the module docstring
says the step does."""
from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import pytest
import redis

from scheduler.cluster import job_store, progress
from scheduler.cluster.job_store import JobStore
from scheduler.cluster.jobs import JobSpec, TuneSpec, load_spec, submit
from scheduler.search.live_search import LiveSearches
from scheduler.cluster.progress import advance, record_lookup
from scheduler.search.space import Experiment
from workers.state import keys
from workers.state.registry import announce_slot
from workers.device.slot import Slot

CONFIGS = {"a": {"train_micro_batch_size_per_gpu": 1}, "b": {"train_micro_batch_size_per_gpu": 2}}


def experiment(name: str) -> Experiment:
    return Experiment(name, 0, CONFIGS[name]["train_micro_batch_size_per_gpu"], 1, CONFIGS[name])


def fixed_job(tmp_path: Path, max_attempts: int = 2) -> JobSpec:
    return JobSpec(job="j", results_root=str(tmp_path / "results"), cwd=str(tmp_path), timeout_s=100.0,
                   experiments=[{**experiment(n).to_json(), "argv": ["train.py", "--exp", n]} for n in ("a", "b")],
                   lease_s=30.0, lost_grace_s=20.0, max_attempts=max_attempts)


def write_record(spec: JobSpec, name: str, **fields) -> None:
    folder = Path(spec.results_root) / name
    folder.mkdir(parents=True, exist_ok=True)
    record = {"name": name, "status": "ok", "ds_config": CONFIGS[name], "metrics": {"throughput": 1.0}, **fields}
    (folder / "result.json").write_text(json.dumps(record))


def events(client: redis.Redis) -> list[dict]:
    return [json.loads(raw) for raw in client.lrange(keys.job_events("j"), 0, -1)]


def queue(client: redis.Redis) -> dict[str, list[str]]:
    store = JobStore(client, "j")
    return {launch.name: launch.argv for launch in store.queued(sorted(store.queued_names()))}


@pytest.fixture(autouse=True)
def fresh_searches(monkeypatch) -> None:
    """Each test starts as a new control process: no live search left by another test."""
    monkeypatch.setattr(progress, "LIVE_SEARCHES", LiveSearches())


def test_a_fixed_job_queues_its_phase_once_and_ends_when_every_record_is_in(client, work, tmp_path: Path) -> None:
    spec = fixed_job(tmp_path)
    submit(client, work, spec)
    advance(client, "j")
    assert queue(client) == {"a": ["train.py", "--exp", "a"], "b": ["train.py", "--exp", "b"]}
    assert client.hget(keys.job_state("j"), "phase") == b"run"
    assert events(client) == [{"kind": "phase", "name": "run", "todo": 2, "reused": 0}]

    advance(client, "j")  # nothing new: nothing queued twice, no second phase event
    assert JobStore(client, "j").depth() == 2 and len(events(client)) == 1

    store = JobStore(client, "j")
    [launch_a] = store.queued(["a"])
    store.unqueue(launch_a)
    write_record(spec, "a")
    client.sadd(keys.job_recorded("j"), "a")
    advance(client, "j")
    assert queue(client) == {"b": ["train.py", "--exp", "b"]} and load_spec(client, "j") == spec

    [launch_b] = store.queued(["b"])
    store.unqueue(launch_b)
    write_record(spec, "b")
    client.sadd(keys.job_recorded("j"), "b")
    advance(client, "j")
    assert events(client)[-1] == {"kind": "done", "winner": None}
    assert load_spec(client, "j") is None and not client.exists(keys.job_queue("j"))


def test_the_pass_goes_before_the_step_only_when_the_step_cannot_change_what_it_starts(client, work, tmp_path: Path,
                                                                                      monkeypatch) -> None:
    """A chord callback's dispatch pass runs before the job's step when the step can only add
    experiments or end the job (its search is live here, no queued experiment has a record), and
    again after it only if it did; otherwise the step goes first."""
    spec = fixed_job(tmp_path)
    submit(client, work, spec)
    calls: list[str] = []
    real_step = progress._step
    monkeypatch.setattr(progress, "_step", lambda *args: calls.append("step") or real_step(*args))

    def step() -> list[str]:
        calls.clear()
        advance(client, "j", lambda: calls.append("pass"))
        return calls

    assert step() == ["step", "pass"]  # the search is built here: the step queues the phase first
    assert step() == ["pass", "step"]  # live, nothing queued has a record: nothing for a second pass
    write_record(spec, "a")
    client.sadd(keys.job_recorded("j"), "a")  # a queued experiment with a record: the step takes it off
    assert step() == ["step", "pass"] and set(queue(client)) == {"b"}
    store = JobStore(client, "j")
    store.unqueue(store.queued(["b"])[0])
    write_record(spec, "b")
    client.sadd(keys.job_recorded("j"), "b")
    assert step() == ["pass", "step", "pass"] and events(client)[-1] == {"kind": "done", "winner": None}


def test_a_rebuilt_step_unqueues_what_an_older_launch_already_answered(client, work, tmp_path: Path,
                                                                        monkeypatch) -> None:
    """Redis lost track of a finished launch: its record is on disk and marked recorded, yet the name
    is still queued. A new control process rebuilds the search and takes it off the queue."""
    spec = fixed_job(tmp_path)
    submit(client, work, spec)
    advance(client, "j")
    write_record(spec, "a")
    client.sadd(keys.job_recorded("j"), "a")
    monkeypatch.setattr(progress, "LIVE_SEARCHES", LiveSearches())
    advance(client, "j")
    assert set(queue(client)) == {"b"}


def test_a_step_that_fails_ends_the_job_with_the_error(client, work, tmp_path: Path) -> None:
    spec = fixed_job(tmp_path)
    spec.experiments[1].pop("stage")
    submit(client, work, spec)
    advance(client, "j")
    last = events(client)[-1]
    assert last["kind"] == "failed" and last["usage"] is False and last["error"].startswith("TypeError")
    assert load_spec(client, "j") is None


def test_advancing_a_job_that_is_gone_does_nothing(client) -> None:
    advance(client, "nobody")
    assert client.keys("*") == []


@pytest.mark.parametrize(
    ("fields", "recorded", "attempts", "answers"),
    [({}, True, 0, True),
     ({}, False, 0, False),  # a fixed job never reuses a record made before it
     ({"stale": True}, True, 0, False),
     ({"ds_config": {"train_micro_batch_size_per_gpu": 9}}, True, 0, False),  # another config's folder
     ({"status": "lost"}, True, 1, False),  # lost with an attempt left: run again
     ({"status": "lost"}, True, 2, True),  # lost with none left: the record stands
     ({"status": "crashed", "op_build_failed": "fused_adam: OSError: no CUDA_HOME"}, True, 0, True)],  # this job's
)
def test_which_record_on_disk_answers_an_experiment(client, work, tmp_path: Path, fields: dict, recorded: bool,
                                                    attempts: int, answers: bool) -> None:
    spec = fixed_job(tmp_path, max_attempts=2)
    submit(client, work, spec)
    write_record(spec, "a", **fields)
    if recorded:
        client.sadd(keys.job_recorded("j"), "a")
    if attempts:
        client.hset(keys.job_attempts("j"), "a", attempts)
    found = record_lookup(client, spec)(experiment("a"))
    assert (found is not None) is answers
    if answers:
        assert found["name"] == "a" and found["ds_config"] == CONFIGS["a"]


def test_an_earlier_jobs_op_that_could_not_be_built_is_launched_again(client, work, tmp_path: Path) -> None:
    """A tuning job reuses records of earlier jobs, but not one that stopped a job because an op could
    not be built (workers.in_rank.op_build): resumed, the node may build it now."""
    tune = TuneSpec(str(tmp_path / "cfg.json"), {}, str(tmp_path / "exps"), "train.py", [], {}, 2**30, 2, 2, "cpu", 1)
    spec = replace(fixed_job(tmp_path), experiments=None, tune=tune)
    write_record(spec, "a", status="crashed", op_build_failed="fused_adam: OSError: no CUDA_HOME")
    write_record(spec, "b", status="crashed")
    lookup = record_lookup(client, spec, recorded=set())
    assert lookup(experiment("a")) is None and lookup(experiment("b"))["status"] == "crashed"


def test_an_experiment_whose_ranks_still_hold_slots_is_not_queued_again(client, work, tmp_path: Path) -> None:
    """After Redis lost its data the job is submitted again while a launch of its experiment `a` runs
    on: its ranks took their slot back (the gang key, owner j/a). Queueing `a` would run it twice at
    once: only `b` is queued; once the slot is free (the launch ended), `a` is queued too."""
    slot = Slot("n0", 0, "cpu", 2**30, "127.0.0.1", 1, (0,), worker="gpu0@n0", instance="i")
    announce_slot(client, slot)
    client.set(keys.gang(slot.queue), "j/a#0123abcd")
    client.set(keys.gang("n9.gpu7"), "j/b#0123abcd")  # no live slot: no launch of this job holds it
    spec = fixed_job(tmp_path)
    submit(client, work, spec)
    advance(client, "j")
    assert list(queue(client)) == ["b"]
    client.delete(keys.gang(slot.queue))
    advance(client, "j")
    assert sorted(queue(client)) == ["a", "b"]


def test_a_job_submitted_again_after_redis_lost_its_data_queues_nothing_until_its_ranks_could_renew(
        client, work, tmp_path: Path, monkeypatch) -> None:
    """Redis restarted without its data: the command submits the job again within seconds, before a
    launch that ran on has taken its slot back (its ranks retry every second, its workers announce
    every HEARTBEAT_S). Its step queues nothing for RESUME_SETTLE_S (a key Redis expires); after
    that, what no rank took back is queued. A job submitted afresh is never held."""
    monkeypatch.setattr(job_store, "RESUME_SETTLE_S", 0.5)
    spec = fixed_job(tmp_path)
    submit(client, work, spec, launched_before=True)
    advance(client, "j")
    assert queue(client) == {} and load_spec(client, "j") is not None
    deadline = time.monotonic() + 10
    while client.exists(keys.job_settling("j")) and time.monotonic() < deadline:
        time.sleep(0.05)
    advance(client, "j")  # the sweep's next step
    assert sorted(queue(client)) == ["a", "b"]


def test_a_job_submitted_afresh_is_not_held(client, work, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(job_store, "RESUME_SETTLE_S", 3600.0)
    submit(client, work, fixed_job(tmp_path))
    advance(client, "j")
    assert sorted(queue(client)) == ["a", "b"] and not client.exists(keys.job_settling("j"))
