"""The ends of a launch decided over the in-memory job store (`scheduler.cluster.memory_store`), with
no redis-server: which running launch is lost and why (`sweep._why_lost`), a lost launch's retry or
give-up (`sweep._lose`), the uncounted requeue of a launch that found its GPU busy
(`finish.requeue_uncounted`), and whole sweeps over every job (`sweep.sweep_jobs`).

tests/redis/test_job_store_contract.py runs the store's contract against the twin and Redis alike;
what these decisions meet only in Redis (the slot registry, the gang leases' Lua, a sweep's round
trips) stays in tests/redis/test_dispatch.py. Every expectation is worked out by hand.
"""
from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

import pytest

from memory_cluster import Cluster, make_slot
from scheduler.cluster.finish import requeue_uncounted
from scheduler.cluster.jobs import JobSpec
from scheduler.cluster.launches import FinishSpec, QueuedLaunch, RunningLaunch
from scheduler.cluster.memory_store import MemoryJobs
from scheduler.cluster.sweep import SLOT_GONE_S, _lose, _why_lost, sweep_jobs
from test_dispatch_decisions import events, exp, make_spec

GiB = 2**30
START, LEASE = 1000.0, 30.0
LIVE = {"n0.gpu0": "i0", "n0.gpu1": "i1", "n0.gpu2": "i2"}


class Leases:
    """The gang leases as the sweep asks them (`workers.state.store.BaseSlotStore.holds`): queue -> the
    token holding it."""

    def __init__(self, held: dict[str, str]) -> None:
        self.held = held

    def holds(self, queues: list[str], token: str) -> bool:
        return all(self.held.get(queue) == token for queue in queues)


class Reported:
    """The message layer as the sweep asks it: which rank tasks have reported."""

    def __init__(self) -> None:
        self.reported: set[str] = set()

    def finished(self, task_id: str) -> bool:
        return task_id in self.reported


def _running_launch(tmp_path: Path, attempts: int = 1, **changes) -> tuple:
    """A running launch on n0.gpu0 + n0.gpu1 started at START, due at START + 200, its gang held,
    launched `attempts` times."""
    spec = make_spec(tmp_path)
    store = MemoryJobs().store("j")
    store.activate(spec.to_json())
    launch = RunningLaunch(seq=7, exp=exp("a"), argv=["t.py"], attempt="att", queues=["n0.gpu0", "n0.gpu1"],
                           token="tok", rank_tasks={"n0.gpu0": "t0", "n0.gpu1": "t1"}, started=START,
                           deadline=START + 200, instances={"n0.gpu0": "i0", "n0.gpu1": "i1"}, **changes)
    for _ in range(attempts):
        store.start(launch.queued(), launch)
    return spec, store, Leases({"n0.gpu0": "tok", "n0.gpu1": "tok"}), launch


# ---------------------------------------------------------------- lost launches: why


def test_a_healthy_launch_is_not_lost(tmp_path: Path) -> None:
    spec, store, gangs, launch = _running_launch(tmp_path)
    for now in (START + 1, START + LEASE + 1, START + 200):
        assert _why_lost(store, Reported(), gangs, spec, launch, LIVE, now) is None
    assert store.running()["a"] == launch  # nothing rewritten


def test_past_the_deadline_a_launch_is_lost(tmp_path: Path) -> None:
    spec, store, gangs, launch = _running_launch(tmp_path)
    assert _why_lost(store, Reported(), gangs, spec, launch, LIVE, START + 200.5) == (
        "no record from the slot workers within the time limit plus 20s (a worker or node died, or Redis lost the task)")


def test_a_restarted_worker_loses_the_launch(tmp_path: Path) -> None:
    spec, store, gangs, launch = _running_launch(tmp_path)
    live = {**LIVE, "n0.gpu1": "i1-new"}
    assert _why_lost(store, Reported(), gangs, spec, launch, live, START + 1) == (
        "the worker of n0.gpu1 restarted during the run")
    live["n0.gpu0"] = "i0-new"
    assert _why_lost(store, Reported(), gangs, spec, launch, live, START + 1) == (
        "the worker of n0.gpu0, n0.gpu1 restarted during the run")


def test_a_withdrawn_slot_loses_the_launch_at_once(tmp_path: Path) -> None:
    spec, store, gangs, launch = _running_launch(tmp_path)
    assert _why_lost(store, Reported(), gangs, spec, launch, {"n0.gpu0": "i0"}, START + 1,
                     {"n0.gpu1": "its consumer stopped"}) == (
        "the worker of n0.gpu1 withdrew its slot (its consumer stopped)")
    assert store.running()["a"] == launch  # said why at once: no sighting noted


def test_a_slot_gone_longer_than_its_heartbeats_loses_the_launch(tmp_path: Path) -> None:
    spec, store, gangs, launch = _running_launch(tmp_path)
    work, live = Reported(), {"n0.gpu0": "i0"}
    assert _why_lost(store, work, gangs, spec, launch, live, START + 5) is None
    seen = store.running()["a"]
    assert seen.missing_since == START + 5 and seen.queues == launch.queues  # first seen gone, recorded
    assert _why_lost(store, work, gangs, spec, seen, live, START + 5 + SLOT_GONE_S) is None
    assert store.running()["a"].missing_since == START + 5  # the first sighting is kept
    assert _why_lost(store, work, gangs, spec, seen, live, START + 5.5 + SLOT_GONE_S) == (
        "the worker of n0.gpu1 stopped sending heartbeats")
    assert _why_lost(store, work, gangs, spec, seen, {}, START + 5.5 + SLOT_GONE_S) == (
        "the worker of n0.gpu0, n0.gpu1 stopped sending heartbeats")
    # back again: an old sighting alone loses nothing
    assert _why_lost(store, work, gangs, spec, seen, LIVE, START + 100) is None


def test_a_slot_gone_since_before_the_deadline_is_reported_as_the_deadline(tmp_path: Path) -> None:
    spec, store, gangs, launch = _running_launch(tmp_path)
    why = _why_lost(store, Reported(), gangs, spec, launch, {"n0.gpu0": "i0"}, START + 201)
    assert why.startswith("no record from the slot workers") and store.running()["a"].missing_since == START + 201


def test_a_lapsed_lease_of_a_silent_rank_loses_the_launch(tmp_path: Path) -> None:
    spec, store, gangs, launch = _running_launch(tmp_path)
    work = Reported()
    gangs.held.clear()
    assert _why_lost(store, work, gangs, spec, launch, LIVE, START + LEASE) is None  # not yet a full lease
    assert _why_lost(store, work, gangs, spec, launch, LIVE, START + LEASE + 0.5) == (
        "the lease of n0.gpu0, n0.gpu1 expired: its rank stopped renewing it (worker or node gone)")
    work.reported.add("t0")  # rank 0 reported: only rank 1 is silent
    assert _why_lost(store, work, gangs, spec, launch, LIVE, START + LEASE + 0.5) == (
        "the lease of n0.gpu1 expired: its rank stopped renewing it (worker or node gone)")
    work.reported.add("t1")  # every rank reported: the record is on its way
    assert _why_lost(store, work, gangs, spec, launch, LIVE, START + LEASE + 0.5) is None


def test_a_silent_rank_that_still_renews_is_not_lost(tmp_path: Path) -> None:
    spec, store, gangs, launch = _running_launch(tmp_path)
    work = Reported()
    del gangs.held["n0.gpu0"]  # rank 0 reported and stopped renewing; rank 1 still runs
    work.reported.add("t0")
    assert _why_lost(store, work, gangs, spec, launch, LIVE, START + 100) is None
    gangs.held["n0.gpu1"] = "newer#1"  # its slot now belongs to another launch
    assert _why_lost(store, work, gangs, spec, launch, LIVE, START + 100).startswith("the lease of n0.gpu1 expired")


# ---------------------------------------------------------------- lost launches: what then


def test_a_lost_launch_with_attempts_left_waits_again(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    spec, store, _, launch = _running_launch(tmp_path, attempts=1)
    stopped: list[RunningLaunch] = []
    with caplog.at_level(logging.WARNING, logger="scheduler.cluster.sweep"):
        assert _lose(store, spec, launch, "why", stopped.append) is False
    assert caplog.messages == ["a lost (why); retrying, attempt 2 of 2"]
    assert stopped == [launch]  # revoked, its slots freed (jobs.stop_launch)
    assert store.running_names() == set() and store.attempts_of("a") == 1
    assert store.queued(["a"]) == [QueuedLaunch(7, exp("a"), ["t.py"])]  # at its old place: its seq
    assert events(store) == [] and store.recorded() == set() and not (tmp_path / "j").exists()


def test_a_lost_launch_out_of_attempts_is_recorded_lost(tmp_path: Path) -> None:
    spec, store, _, launch = _running_launch(tmp_path, attempts=2)
    stopped: list[RunningLaunch] = []
    assert _lose(store, spec, launch, "why", stopped.append) is True
    record = {"name": "a", "status": "lost", "metrics": None, "ds_config": exp("a")["ds_config"],
              "slots": ["n0.gpu0", "n0.gpu1"], "cause": {"error": "why; gave up after 2 attempts"}}
    assert json.loads((tmp_path / "j" / "a" / "result.json").read_text()) == record
    assert events(store) == [{"kind": "record", "record": record}]
    assert store.running_names() == set() and store.depth() == 0 and store.recorded() == {"a"}
    assert stopped == [launch]


# ---------------------------------------------------------------- a launch that found its GPU busy


def test_a_launch_not_started_for_a_busy_gpu_waits_again_uncounted(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """A rank found others' memory on its GPU and did not start (`gpu_busy`): the launch waits again
    at its old place with its attempt given back, the submitter is told, nothing is recorded; a
    second callback of the same launch is stale and changes nothing."""
    _, store, _, launch = _running_launch(tmp_path)
    finish = FinishSpec("j", "a", 1, "att", launch.queues, "tok", str(tmp_path / "j"), 2, {}, 100.0)
    busy = [{"slot": "n0.gpu1", "status": "gpu_busy", "device_foreign_bytes": 20 * GiB}]
    with caplog.at_level(logging.WARNING, logger="scheduler.cluster.finish"):
        assert requeue_uncounted(store, finish, busy) is True
    assert caplog.messages == ["a not started: n0.gpu1 (20.0 GiB used by other processes); queued again"]
    assert store.running_names() == set() and store.attempts_of("a") == 0
    assert store.queued(["a"]) == [launch.queued()] and store.queued(["a"])[0].seq == 7
    assert events(store) == [{"kind": "gpu_busy", "name": "a", "slots": ["n0.gpu1 (20.0 GiB used by other processes)"]}]
    assert store.recorded() == set() and not (tmp_path / "j").exists()
    assert requeue_uncounted(store, finish, busy) is False
    assert store.attempts_of("a") == 0 and events(store) == []
    store.start(launch.queued(), launch.__class__.from_json({**launch.to_json(), "attempt": "newer"}))
    assert requeue_uncounted(store, finish, busy) is False and store.running_names() == {"a"}  # another attempt's


# ---------------------------------------------------------------- whole sweeps over the in-memory stores


class Stopped:
    """The message layer as a sweep's stop uses it (`jobs.stop_launch`): the revoked rank tasks."""

    def __init__(self) -> None:
        self.revoked: list[str] = []

    def finished(self, task_id: str) -> bool:
        return False


def test_sweep_checks_every_running_launch_of_every_job(tmp_path: Path) -> None:
    """`sweep.sweep_jobs` over the slots' and the jobs' stores: three jobs with one launch each; j1's
    and j3's are past their deadline, j2's is due later. j1 has an attempt left, j3 none."""
    cluster = Cluster()
    cluster.register(make_slot("n0", 0), make_slot("n0", 1), make_slot("n0", 2))
    work = Stopped()

    def stop(launch: RunningLaunch) -> None:  # jobs.stop_launch, without the hosts' clean-up
        work.revoked.extend(launch.rank_tasks.values())
        cluster.slots.release(launch.queues, launch.token)

    def sweep(now: float) -> set[str]:
        specs = [JobSpec.from_json(raw) for raw in cluster.jobs.active_spec_jsons()]
        return sweep_jobs(cluster.slots, specs, cluster.jobs.store, work, stop, now)

    now = 5000.0
    for i, job in enumerate(("j1", "j2", "j3")):
        cluster.submit(make_spec(tmp_path, job, max_attempts=1, lease_s=120.0))
        token = cluster.slots.reserve([f"n0.gpu{i}"], 60)
        due = now - 1 if job != "j2" else now + 500
        launch = RunningLaunch(1, exp(f"e{i}"), ["t.py"], "att", [f"n0.gpu{i}"], token, {f"n0.gpu{i}": f"t{i}"},
                               now, due, {f"n0.gpu{i}": f"inst-n0-{i}"})
        if job == "j3":
            cluster.jobs.store(job).start(launch.queued(), launch)  # its one attempt counted
        else:
            cluster.jobs.store(job).update_running(launch)
    assert sweep(now) == {"j3"}  # j1's first attempt waits again; j3's is recorded lost
    assert sorted(work.revoked) == ["t0", "t2"]
    assert cluster.slots.held(["n0.gpu0", "n0.gpu1", "n0.gpu2"]) == {"n0.gpu1"}
    assert cluster.jobs.store("j1").queued_names() == {"e0"} and cluster.jobs.store("j3").recorded() == {"e2"}
    assert list(cluster.running("j2")) == ["e1"]
    # a launch whose lease lapsed while its rank stayed silent is lost too
    e1 = cluster.running("j2")["e1"]
    cluster.slot_db.leases.delete("n0.gpu1")
    cluster.jobs.store("j2").start(e1.queued(), replace(e1, started=now - 200))
    assert sweep(now) == {"j2", "j3"} and work.revoked[-1] == "t1"  # j3: nothing running or queued
    assert json.loads((tmp_path / "j2" / "e1" / "result.json").read_text())["cause"]["error"] == (
        "the lease of n0.gpu1 expired: its rank stopped renewing it (worker or node gone); gave up after 1 attempts")
    cluster.jobs.store("j2").update_running(RunningLaunch(1, exp("e1"), ["t.py"], "att2", ["n0.gpu1"], "x",
                                                          {"n0.gpu1": "t1"}, now, now + 500,
                                                          {"n0.gpu1": "inst-n0-1"}))
    # a slot whose worker vanished is noted in the running launch by the sweep itself
    cluster.slot_db.registrations.delete("n0.gpu1")
    assert sweep(now) == {"j3"}  # not j2: its launch is not lost yet
    assert cluster.running("j2")["e1"].missing_since == now
