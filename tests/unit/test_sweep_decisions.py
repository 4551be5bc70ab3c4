"""The ends of a launch decided over the in-memory job store (`scheduler.cluster.memory_store`), with
no redis-server: which running launch is lost and why (`sweep._why_lost`), a lost launch's retry or
give-up (`sweep._lose`), the uncounted requeue of a launch that found its GPU busy
(`finish.requeue_uncounted`).

tests/redis/test_job_store_contract.py runs the store's contract against the twin and Redis alike;
what these decisions meet only in Redis (the slot registry, the gang leases' Lua, a sweep's round
trips) stays in tests/redis/test_dispatch.py. Every expectation is worked out by hand.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from scheduler.cluster.finish import requeue_uncounted
from scheduler.cluster.launches import FinishSpec, QueuedLaunch, RunningLaunch
from scheduler.cluster.memory_store import MemoryJobs
from scheduler.cluster.sweep import SLOT_GONE_S, _lose, _why_lost
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
