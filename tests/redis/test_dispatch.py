"""Dispatch, finish and sweep (`scheduler.cluster.dispatch`, `.finish`, `.sweep`) against a real
redis-server, with no Celery: slots are registered by writing their keys, `RecordedWork` (conftest)
keeps what would be sent, and every expectation is read back from the raw keys (running hash, gang
keys and their TTLs, state hash, events list) and compared with values worked out by hand.

Here: what only Redis shows: a pass's raw keys (gang keys and their TTLs, the queue's shape index),
the beside script across jobs, the cluster lock, the chord callback's pipeline and its round trip,
the sweep over Redis, and a launch Redis forgot. The decisions are tested over the in-memory stores
(their contracts with Redis: tests/redis/*_contract.py): whole dispatch passes
(tests/unit/test_dispatch_passes.py, test_dispatch_refusals.py), a shape's refusal and grace, when busy
slots free (test_dispatch_decisions.py); why a launch is lost, its retry or give-up, its requeue for a
busy GPU, whole sweeps over every job (test_sweep_decisions.py); a finished launch's close, which
launch's record counts and the adoption of one Redis forgot (test_finish_decisions.py)."""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pytest
import redis

from scheduler.cluster.co_runners import co_runners_of
from scheduler.cluster.dispatch import cluster_lock, dispatch
from scheduler.cluster.dispatch_reads import RedisActiveJobs
from scheduler.cluster.finish import record_and_read, record_finished, requeue_for_busy_gpu
from scheduler.cluster.sweep import sweep
from scheduler.cluster.job_store import JobStore, reserve_seqs
from scheduler.cluster.jobs import JobSpec, cancel, load_spec, run_fixed, submit
from scheduler.cluster.launches import FinishSpec, QueuedLaunch, RunningLaunch
from scheduler.search.space import Experiment
from workers.slot.records import ExperimentRecord
from workers.state import keys
from workers.state.gang import GangReservations
from workers.state.registry import announce_slot
from workers.state.store import RedisSlotStore
from workers.device.slot import Slot

GiB = 2**30


def make_slot(node: str, device: int, kind: str = "cpu", memory: int = GiB, address: str = "10.0.0.1",
              cuda_index: int = -1, host: str = "") -> Slot:
    return Slot(node, device, kind, memory, address, 1, (device,), worker=f"gpu{device}@{node}",
                instance=f"inst-{node}-{device}", cuda_index=cuda_index, host=host,
                gpu_uuid=f"GPU-{node}-{cuda_index}" if kind == "cuda" else "")


def register(client: redis.Redis, *slots: Slot) -> list[Slot]:
    for slot in slots:
        announce_slot(client, slot)  # as a slot's heartbeat writes it (indexed)
    return list(slots)


def exp(name: str, stage: int = 0, mbs: int = 1, nodes: int = 1, gpus: int = 1, memory: int = 0,
        metric_file: str = "metrics.json") -> dict:
    return Experiment(name, stage, mbs, 1, {"train_micro_batch_size_per_gpu": mbs, "zero_optimization": {"stage": stage}},
                      num_nodes=nodes, num_gpus=gpus, min_memory=memory, metric_file=metric_file).to_json()


def make_spec(tmp_path: Path, job: str = "j", **overrides) -> JobSpec:
    fields = {"results_root": str(tmp_path / job), "cwd": str(tmp_path), "timeout_s": 100.0, "experiments": [],
              "lease_s": 30.0, "lost_grace_s": 20.0, "max_attempts": 2, **overrides}
    return JobSpec(job=job, **fields)


def enqueue(client: redis.Redis, spec: JobSpec, *exps: dict) -> list[QueuedLaunch]:
    first = reserve_seqs(client, len(exps))
    launches = [QueuedLaunch(first + i, e, ["train.py", "--flag", e["name"]]) for i, e in enumerate(exps)]
    JobStore(client, spec.job).queue(launches)
    return launches


def active(client: redis.Redis, work, spec: JobSpec, *exps: dict) -> list[QueuedLaunch]:
    submit(client, work, spec)
    return enqueue(client, spec, *exps)


def running(client: redis.Redis, job: str) -> dict[str, RunningLaunch]:
    return {name.decode(): RunningLaunch.from_json(json.loads(raw))
            for name, raw in client.hgetall(keys.job_running(job)).items()}


def state(client: redis.Redis, job: str) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in client.hgetall(keys.job_state(job)).items()}


def events(client: redis.Redis, job: str) -> list[dict]:
    return [json.loads(raw) for raw in client.lrange(keys.job_events(job), 0, -1)]


def started(work) -> list[tuple[str, list[str]]]:
    return [(finish.name, finish.slots) for _, finish, _, _ in work.launched]


# ---------------------------------------------------------------- dispatch: what starts, and its records


def test_without_active_jobs_nothing_happens(client: redis.Redis, work) -> None:
    register(client, make_slot("n0", 0))
    registered = {key: client.dump(key) for key in client.keys("*")}  # the slot, its index entry and epoch
    dispatch(client, work)
    assert work.launched == [] and {key: client.dump(key) for key in client.keys("*")} == registered


def test_a_pass_over_redis_writes_what_the_in_memory_pass_does(client: redis.Redis, work, tmp_path: Path) -> None:
    """The pass of tests/unit/test_dispatch_passes.py's `test_a_launch_is_recorded_before_it_is_sent...`
    over Redis, read back from the raw keys: the gang keys with the job's lease, the running hash
    (co-runners written by the beside script), the queue and its shape index, the attempts, the state."""
    register(client, make_slot("n0", 0), make_slot("n0", 1))
    spec = make_spec(tmp_path, local_rank_arg=True)
    a, b, c = active(client, work, spec, exp("a", 1, 2), exp("b"), exp("c"))
    before = time.time()
    dispatch(client, work)
    after = time.time()
    assert started(work) == [("a", ["n0.gpu0"]), ("b", ["n0.gpu1"])]
    [rank], finish = work.launched[0][:2]
    token = client.get(keys.gang("n0.gpu0")).decode()
    assert token.startswith("j/a#") and client.get(keys.gang("n0.gpu1")).decode().startswith("j/b#")
    assert finish.gang_token == token and rank.spec.gang_token == token and finish.exp_id == 1
    launched = running(client, "j")
    assert sorted(launched) == ["a", "b"]
    rec = launched["a"]
    assert before <= rec.started <= after and rec.deadline == rec.started + 100 + 20
    assert rec == RunningLaunch(seq=a.seq, exp=a.exp, argv=a.argv, attempt=finish.attempt, queues=["n0.gpu0"],
                                token=token, rank_tasks={"n0.gpu0": rank.task_id}, started=rec.started,
                                deadline=rec.deadline, instances={"n0.gpu0": "inst-n0-0"}, missing_since=None,
                                co_runners=["j/b"])  # b started beside it on node n0, after it
    assert launched["b"].co_runners == ["j/a"]  # and a ran there already
    for queue in ("n0.gpu0", "n0.gpu1"):
        assert 20_000 < client.pttl(keys.gang(queue)) <= 30_000  # the job's lease
    assert client.hkeys(keys.job_queue("j")) == [b"c"]
    assert client.zrange(keys.job_queue_shape("j", "1x1:0"), 0, -1) == [b"c"]
    assert client.hgetall(keys.job_attempts("j")) == {b"a": b"1", b"b": b"1"}
    shown_state = state(client, "j")
    assert before - 0.1 <= float(shown_state.pop("updated")) <= after + 0.1
    assert shown_state == {"dispatched": "1", "exp_ids": "2", "results_dir": spec.results_root, "pending": "1",
                           "running": "a,b", "head": "c",
                           "head_waits": "needs 1 node(s) x 1 free slot(s) at once; the slots that fit are reserved"}


def test_co_runners_across_jobs_over_redis(client: redis.Redis, work, tmp_path: Path) -> None:
    """The beside script reads another job's launch from its gang key's owner, and the start writes
    both in one transaction; `co_runners_of` answers the finishing launch, [] for an older attempt."""
    register(client, make_slot("n0", 0), make_slot("n0", 1), make_slot("n1", 0))
    active(client, work, make_spec(tmp_path, "j1"), exp("a"))
    dispatch(client, work)
    active(client, work, make_spec(tmp_path, "j2"), exp("b"), exp("c"))
    dispatch(client, work)
    assert started(work) == [("a", ["n0.gpu0"]), ("b", ["n0.gpu1"]), ("c", ["n1.gpu0"])]
    assert running(client, "j1")["a"].co_runners == ["j2/b"]
    assert running(client, "j2")["b"].co_runners == ["j1/a"] and running(client, "j2")["c"].co_runners == []
    finish_b = work.launched[1][1]
    assert co_runners_of(client, finish_b) == ["j1/a"]
    assert co_runners_of(client, FinishSpec.from_json({**finish_b.to_json(), "attempt": "older"})) == []


def test_cancel_stops_every_running_launch_and_then_waits_for_their_clean_ups(client: redis.Redis, work,
                                                                             tmp_path: Path) -> None:
    """Ctrl-C's cancel: each running launch revoked, its slots freed, the kill of its recorded
    groups started; the job ended; then the wait for those kills (the command exits next, and its
    exit stopped one halfway: SIGABRT)."""
    spec = make_spec(tmp_path)
    submit(client, work, spec)
    gangs = GangReservations(client)
    token = gangs.reserve(["n0.gpu0"], 30.0, "j/a")
    JobStore(client, "j").update_running(RunningLaunch(1, exp("a"), ["t.py"], "att", ["n0.gpu0"], token,
                                                       {"n0.gpu0": "task-a"}, 1.0, 2.0))
    cancel(client, work, "j")
    assert work.revoked == ["task-a"] and work.cleaned == ["a"] and gangs.held(["n0.gpu0"]) == set()
    assert work.waited_for_clean_ups == [["a"]]  # once, after every clean-up had started
    assert load_spec(client, "j") is None


def test_the_cluster_lock(client: redis.Redis) -> None:
    lock = cluster_lock(client)
    assert (lock.name, lock.timeout, lock.blocking_timeout, lock.sleep) == ("autotune:lock:dispatch", 120.0, 240.0, 0.001)
    with lock:
        assert 110_000 < client.pttl("autotune:lock:dispatch") <= 120_000
        assert not cluster_lock(client).acquire(blocking=False)
    assert not client.exists("autotune:lock:dispatch")


# ---------------------------------------------------------------- the chord callback's bookkeeping


def _dispatched(client: redis.Redis, work, tmp_path: Path, name: str = "a") -> FinishSpec:
    register(client, make_slot("n0", 0), make_slot("n0", 1))
    active(client, work, make_spec(tmp_path), exp(name, 2, 8, gpus=2))
    dispatch(client, work)
    return work.launched[-1][1]


def test_record_finished_frees_closes_and_tells_once(client: redis.Redis, work, tmp_path: Path) -> None:
    finish = _dispatched(client, work, tmp_path)
    record = ExperimentRecord.from_json({"name": "a", "status": "ok", "wall_s": 12.5, "metrics": {"throughput": 3.0}})
    assert record_finished(RedisActiveJobs(client), finish, record) is True
    assert not client.exists(keys.gang("n0.gpu0"), keys.gang("n0.gpu1"))
    assert client.hlen(keys.job_running("j")) == 0 and client.smembers(keys.job_recorded("j")) == {b"a"}
    assert client.hgetall(keys.job_walls("j")) == {b"2/8": b"[12.5]"}
    assert events(client, "j") == [{"kind": "record", "record": record.to_json()}]
    assert record_finished(RedisActiveJobs(client), finish, record) is False  # stale: closed already
    assert events(client, "j") == [{"kind": "record", "record": record.to_json()}]
    assert client.hgetall(keys.job_walls("j")) == {b"2/8": b"[12.5]"}


def test_recording_and_the_steps_reads_are_one_round_trip(client: redis.Redis, work, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The chord callback frees, closes, tells and reads what the job's step needs in one round
    trip (each was one of its own on the way to the next experiment), and the reads see the close."""
    finish = _dispatched(client, work, tmp_path)
    sends = []
    original = redis.connection.AbstractConnection.send_packed_command
    monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command",
                        lambda self, command, *args, **kwargs: (sends.append(1), original(self, command, *args, **kwargs)))
    measured = ExperimentRecord.from_json({"name": "a", "status": "ok", "wall_s": 2.0})
    recorded, read = record_and_read(RedisActiveJobs(client), finish, measured)
    monkeypatch.undo()
    assert recorded and len(sends) == 1
    assert read is not None and read.spec is not None and "a" in read.recorded and "a" not in read.running
    assert read == JobStore(client, "j").step_reads()
    assert not client.exists(keys.gang("n0.gpu0")) and client.hgetall(keys.job_walls("j")) == {b"2/8": b"[2.0]"}
    assert record_and_read(RedisActiveJobs(client), finish, measured) == (False, None)


def test_a_stale_finish_frees_only_its_own_slots(client: redis.Redis, work, tmp_path: Path) -> None:
    finish = _dispatched(client, work, tmp_path)
    client.set(keys.gang("n0.gpu1"), "newer#1")  # its slot was given to a newer launch meanwhile
    JobStore(client, "j").give_up(running(client, "j")["a"])
    late = ExperimentRecord.from_json({"name": "a", "status": "ok", "wall_s": 1.0})
    assert record_finished(RedisActiveJobs(client), finish, late) is False
    assert client.keys(keys.gang("*")) == [keys.gang("n0.gpu1").encode()]
    assert client.get(keys.gang("n0.gpu1")) == b"newer#1" and events(client, "j") == []
    other = FinishSpec.from_json({**finish.to_json(), "attempt": "another"})
    JobStore(client, "j").update_running(RunningLaunch(1, exp("a", 2, 8), [], "current", [], "t", {}, 0, 0))
    assert record_finished(RedisActiveJobs(client), other, late) is False
    assert "a" in running(client, "j") and not client.exists(keys.job_walls("j"))


def test_a_launch_not_started_for_a_busy_gpu_frees_its_slots_and_waits_again(client: redis.Redis, work,
                                                                              tmp_path: Path) -> None:
    """`gpu_busy` in Redis: the launch's slots are freed and it waits again uncounted in the job's
    Redis store (what the job's state becomes: tests/unit/test_sweep_decisions.py); a second
    callback of the same launch is stale and changes nothing."""
    finish = _dispatched(client, work, tmp_path)
    assert client.hget(keys.job_attempts("j"), "a") == b"1"
    busy = [{"slot": "n0.gpu1", "status": "gpu_busy", "device_foreign_bytes": 20 * GiB}]
    assert requeue_for_busy_gpu(RedisSlotStore(client), JobStore(client, "j"), finish, busy) is True
    assert not client.keys(keys.gang("*")) and client.hlen(keys.job_running("j")) == 0
    assert client.hget(keys.job_attempts("j"), "a") == b"0" and client.hexists(keys.job_queue("j"), "a")
    assert len(events(client, "j")) == 1
    assert requeue_for_busy_gpu(RedisSlotStore(client), JobStore(client, "j"), finish, busy) is False
    assert client.hget(keys.job_attempts("j"), "a") == b"0" and len(events(client, "j")) == 1


# ---------------------------------------------------------------- lost launches, found by the sweep


def test_the_attempt_cap_ends_in_lost(client: redis.Redis, work, tmp_path: Path) -> None:
    """A launch that never reports is retried while attempts remain, then recorded `lost`, once."""
    spec = make_spec(tmp_path, "capped", timeout_s=1.0, max_attempts=3)
    submit(client, work, spec)
    register(client, make_slot("n", 0))
    launch = enqueue(client, spec, exp("z0_gas1_tmbspg1"))[0]
    gangs, store = GangReservations(client), JobStore(client, "capped")
    outcomes = []
    for attempt in range(1, 4):
        token = gangs.reserve(["n.gpu0"], 30)
        assert token is not None
        store.start(launch, RunningLaunch(1, launch.exp, ["t.py"], f"att{attempt}", ["n.gpu0"], token,
                                          {"n.gpu0": f"task{attempt}"}, time.time() - 100, time.time() - 1,
                                          {"n.gpu0": "inst-n-0"}))
        outcomes.append(sweep(client, work))
        assert gangs.held(["n.gpu0"]) == set()  # every lost launch frees its slot
        assert client.hexists(keys.job_queue("capped"), launch.name) is (attempt < 3), f"attempt {attempt}"
    assert outcomes == [set(), set(), {"capped"}]
    assert work.revoked == ["task1", "task2", "task3"]
    record = json.loads((tmp_path / "capped" / launch.name / "result.json").read_text())
    assert record["status"] == "lost" and record["cause"]["error"] == (
        "no record from the slot workers within the time limit plus 20s (a worker or node died, or Redis lost "
        "the task); gave up after 3 attempts")
    assert client.smembers(keys.job_recorded("capped")) == {launch.name.encode()}
    # recorded once; with nothing running or queued its step is due at every sweep (and would end it)
    assert sweep(client, work) == {"capped"} and len(events(client, "capped")) == 1


def test_the_record_of_a_launch_redis_forgot_answers_its_experiment(client: redis.Redis, work, tmp_path: Path) -> None:
    """Redis lost its data mid-launch; the job was submitted again and waited for the launch, whose
    ranks ran on. Its record is adopted: the experiment is recorded and the job told, once. A stale
    finish of an experiment the job runs, queues or recorded itself is not."""
    finish = _dispatched(client, work, tmp_path)
    client.delete(keys.job_running("j"))  # what Redis lost; the job spec is back (submitted again)
    record = ExperimentRecord.from_json({"name": "a", "status": "ok", "wall_s": 2.0, "metrics": {"throughput": 3.0}})
    assert record_finished(RedisActiveJobs(client), finish, record) is True
    assert client.smembers(keys.job_recorded("j")) == {b"a"} and events(client, "j")[-1] == {"kind": "record",
                                                                                           "record": record.to_json()}
    assert record_finished(RedisActiveJobs(client), finish, record) is False  # recorded: once
    assert len([e for e in events(client, "j") if e["kind"] == "record"]) == 1
    spec = make_spec(tmp_path)
    enqueue(client, spec, exp("b", 2, 8))
    other = FinishSpec.from_json({**finish.to_json(), "name": "b"})
    queued = ExperimentRecord.from_json({"name": "b", "status": "ok"})
    assert record_finished(RedisActiveJobs(client), other, queued) is False  # queued: a newer launch will run


def test_a_job_waiting_only_for_a_launch_redis_forgot_is_stepped_by_the_sweep(client: redis.Redis, work,
                                                                              tmp_path: Path) -> None:
    """The job, submitted again after Redis lost its data, waits for a launch whose ranks ran on; if
    its record never comes (its chord went with the data), no callback steps the job when the leases
    lapse: with nothing running or queued, its step is due at every sweep. A job with work in flight
    is stepped by that work's events, not by the sweep."""
    register(client, make_slot("n0", 0))
    spec = make_spec(tmp_path)
    [a] = active(client, work, spec, exp("a", 2, 8))
    assert sweep(client, work) == set()  # queued: a dispatch starts it, its callback steps the job
    dispatch(client, work)
    assert list(running(client, "j")) == ["a"] and sweep(client, work) == set()  # running, not lost
    client.delete(keys.job_running("j"))  # what Redis lost: the job knows no launch of its own now
    assert sweep(client, work) == {"j"}
    JobStore(client, "j").queue([a])
    assert sweep(client, work) == set()


def test_a_fixed_run_says_when_its_launch_waits_for_a_busy_gpu(client: redis.Redis, work, tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """`python -m scheduler.run` (jobs.run_fixed) tells its user why the run has not started."""
    def answer(job: str) -> None:  # the control worker's answer to the job's first step
        store = JobStore(client, job)
        store.publish({"kind": "gpu_busy", "name": "run", "slots": ["n0.gpu1 (20.0 GiB used by other processes)"]})
        store.publish({"kind": "done"})

    work.advance = answer
    spec = make_spec(tmp_path, experiments=[{**exp("run"), "argv": ["t.py"]}])
    with caplog.at_level(logging.WARNING, logger="scheduler.cluster.jobs"):
        run_fixed(client, work, spec)
    assert caplog.messages == ["run not started: other processes hold memory on n0.gpu1 (20.0 GiB used by "
                               "other processes); it waits until that memory goes"]
