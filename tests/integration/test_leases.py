"""Every lease rule of the gang reservation, and the retry cap, against a real redis-server.

No Celery here: the rules live in Lua scripts (`workers.gang`) and in the control worker's sweep
(`scheduler.dispatch.sweep`), and Celery is not what they are about. A recorder of the message
layer (`scheduler.work.Work`) keeps the revokes the sweep sends. Each test uses its own Redis database, emptied first.
"""
from __future__ import annotations

import json
import random
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis

from scheduler.dispatch import sweep
from scheduler.jobs import JobSpec, submit
from scheduler.space import Experiment
from workers import keys
from workers.gang import GangReservations
from workers.rank import RankSpec, run_rank
from workers.slot import Slot

pytestmark = pytest.mark.integration


@pytest.fixture
def client(empty_redis: redis.Redis) -> redis.Redis:
    return empty_redis


class RecordedWork:
    """What the sweep asks of the message layer (`scheduler.work.Work`), recorded, not sent."""

    def __init__(self) -> None:
        self.revoked: list[str] = []
        self.advanced: list[str] = []

    def launch(self, ranks: list[Any], finish: Any, time_limit_s: int, shown: str) -> None:
        raise AssertionError("the sweep never launches")

    def revoke(self, task_ids: list[str]) -> None:
        self.revoked.extend(task_ids)

    def advance(self, job: str) -> None:
        self.advanced.append(job)

    def finished(self, task_id: str) -> bool:
        return False


# ---------------------------------------------------------------- reservations under contention


def test_concurrent_reservers_never_double_book(client: redis.Redis) -> None:
    """Six threads reserve overlapping gangs for 3 s. Two independent detectors: each holder marks
    its slots in a Redis counter while it holds them (a second holder sees a count above 1 at once),
    and every interval is logged per thread and checked for overlap after all threads ended.
    An exception in a thread is collected and fails the test."""
    queues = [f"contended.gpu{i}" for i in range(4)]
    gangs = [queues[0:3], queues[1:4], queues[0:2], queues[2:4], [queues[1]], queues]
    logs: list[list[tuple[str, float, float]]] = [[] for _ in range(6)]
    counts = {"attempts": 0, "acquired": 0, "max_holders": 0}
    errors: list[BaseException] = []
    lock = threading.Lock()
    deadline = time.monotonic() + 3.0

    def reserver(seed: int) -> None:
        try:
            own = redis.Redis(connection_pool=client.connection_pool)  # the pool hands each thread its own connection
            reservations, rng = GangReservations(own), random.Random(seed)
            while time.monotonic() < deadline:
                gang = rng.choice(gangs)
                token = reservations.reserve(gang, lease_s=30)
                with lock:
                    counts["attempts"] += 1
                if token is None:
                    continue
                start = time.monotonic()
                holders = [own.incr(f"test:holders:{q}") for q in gang]
                time.sleep(rng.uniform(0.001, 0.005))
                for q in gang:
                    own.decr(f"test:holders:{q}")
                end = time.monotonic()
                logs[seed].extend((q, start, end) for q in gang)
                released = reservations.release(gang, token)
                with lock:
                    counts["acquired"] += 1
                    counts["max_holders"] = max(counts["max_holders"], *holders)
                if released != len(gang):
                    raise AssertionError(f"released {released} of {len(gang)} held slots")
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's own thread below
            errors.append(exc)

    threads = [threading.Thread(target=reserver, args=(seed,)) for seed in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    intervals: dict[str, list[tuple[float, float]]] = {q: [] for q in queues}
    for log in logs:
        for queue, start, end in log:
            intervals[queue].append((start, end))
    overlaps = [(q, a, b) for q, spans in intervals.items() for a, b in zip(sorted(spans), sorted(spans)[1:])
                if b[0] < a[1]]
    print(f"\nreservations attempted {counts['attempts']}, acquired {counts['acquired']}, "
          f"overlapping holds {len(overlaps)}, most simultaneous holders of a slot {counts['max_holders']}")
    assert counts["acquired"] > 50 and counts["attempts"] > counts["acquired"]  # real contention happened
    assert counts["max_holders"] == 1 and overlaps == []


def test_reserve_is_all_or_nothing(client: redis.Redis) -> None:
    gangs = GangReservations(client)
    first = gangs.reserve(["n.gpu1"], 30)
    assert first is not None
    assert gangs.reserve(["n.gpu0", "n.gpu1", "n.gpu2"], 30) is None
    assert gangs.held(["n.gpu0", "n.gpu1", "n.gpu2"]) == {"n.gpu1"}  # the free two were not taken
    second = gangs.reserve(["n.gpu0", "n.gpu2"], 30, owner="job/exp")
    assert second is not None and second.startswith("job/exp#")
    assert gangs.holders(["n.gpu0", "n.gpu1", "n.gpu2"]) == {"n.gpu0": "job/exp", "n.gpu1": first, "n.gpu2": "job/exp"}


def test_a_stale_token_cannot_release_or_keep(client: redis.Redis) -> None:
    gangs = GangReservations(client)
    stale = gangs.reserve(["n.gpu0", "n.gpu1"], 0.3)
    time.sleep(0.5)  # its lease lapsed: the slots are free ...
    assert gangs.held(["n.gpu0", "n.gpu1"]) == set()
    fresh = gangs.reserve(["n.gpu0", "n.gpu1"], 30)  # ... and another launch takes them
    assert fresh is not None and stale is not None
    assert gangs.release(["n.gpu0", "n.gpu1"], stale) == 0
    assert gangs.keep("n.gpu0", stale, 90) is False
    assert gangs.holds(["n.gpu0", "n.gpu1"], fresh) and not gangs.holds(["n.gpu0"], stale)
    ttl = client.pttl(keys.gang("n.gpu0"))
    assert 25_000 < ttl <= 30_000  # the stale renewals did not touch the new owner's lease


def test_keep_extends_only_its_own_slots_lease(client: redis.Redis) -> None:
    gangs = GangReservations(client)
    token = gangs.reserve(["n.gpu0", "n.gpu1"], 1.0)
    assert token is not None
    assert gangs.keep("n.gpu0", token, 120)
    assert client.pttl(keys.gang("n.gpu0")) > 110_000 and client.pttl(keys.gang("n.gpu1")) <= 1_000


def test_keep_retakes_a_slot_whose_key_redis_lost(client: redis.Redis) -> None:
    gangs = GangReservations(client)
    token = gangs.reserve(["n.gpu0"], 30)
    assert token is not None
    client.delete(keys.gang("n.gpu0"))  # Redis restarted without its data
    assert gangs.keep("n.gpu0", token, 30)
    assert gangs.holds(["n.gpu0"], token) and client.pttl(keys.gang("n.gpu0")) > 25_000


def test_a_lapsed_lease_frees_the_slot(client: redis.Redis) -> None:
    gangs = GangReservations(client)
    assert gangs.reserve(["n.gpu0"], 0.3) is not None
    assert gangs.reserve(["n.gpu0"], 30) is None
    time.sleep(0.5)
    assert gangs.held(["n.gpu0"]) == set()
    assert gangs.reserve(["n.gpu0"], 30) is not None


# ---------------------------------------------------------------- the retry cap


def _launch(client: redis.Redis, spec: JobSpec, exp: Experiment, token: str) -> None:
    """What dispatch records for one launch (its attempt counted first), with a deadline already past."""
    client.hincrby(keys.job_attempts(spec.job), exp.name, 1)
    client.hdel(keys.job_queue(spec.job), exp.name)
    client.hset(keys.job_running(spec.job), exp.name, json.dumps({
        "seq": 1, "exp": exp.to_json(), "argv": ["t.py"], "attempt": uuid.uuid4().hex, "queues": ["n.gpu0"],
        "token": token, "rank_tasks": {"n.gpu0": uuid.uuid4().hex}, "started": time.time() - 100,
        "deadline": time.time() - 1, "instances": {}, "missing_since": None}))


def test_the_attempt_cap_ends_in_lost(client: redis.Redis, tmp_path: Path) -> None:
    """A launch that never reports is retried while attempts remain, then recorded `lost`, once."""
    work = RecordedWork()
    spec = JobSpec(job="capped", results_root=str(tmp_path), cwd=str(tmp_path), timeout_s=1.0, max_attempts=3,
                   experiments=[])
    submit(client, work, spec)
    exp = Experiment("z0_gas1_tmbspg1", 0, 1, 1, {"train_micro_batch_size_per_gpu": 1})
    gangs = GangReservations(client)
    outcomes = []
    for attempt in range(1, 4):
        token = gangs.reserve(["n.gpu0"], 30)
        assert token is not None
        _launch(client, spec, exp, token)
        outcomes.append(sweep(client, work))
        assert gangs.held(["n.gpu0"]) == set()  # every lost launch frees its slot
        requeued = client.hexists(keys.job_queue(spec.job), exp.name)
        assert requeued is (attempt < 3), f"attempt {attempt}"
    assert outcomes == [set(), set(), {"capped"}]
    assert len(work.revoked) == 3 and work.advanced == ["capped"]
    record = json.loads((tmp_path / exp.name / "result.json").read_text())
    assert record["status"] == "lost" and "gave up after 3 attempts" in record["cause"]["error"]
    assert client.sismember(keys.job_recorded(spec.job), exp.name)
    assert sweep(client, work) == set()  # nothing left running: recorded once


# ---------------------------------------------------------------- a stale redelivered rank


def test_a_stale_redelivered_rank_refuses_to_run(client: redis.Redis, tmp_path: Path) -> None:
    """A rank message delivered again after its launch was given up (its reservation gone, or the
    slot taken by a newer launch) returns a `lost` record and starts nothing."""
    gangs = GangReservations(client)
    newer = gangs.reserve(["n.gpu0"], 30)
    assert newer is not None
    slot = Slot("n", 0, "cpu", 2**30, "127.0.0.1", 1, (0,))
    spec = RankSpec(job="j", name="z0_gas1_tmbspg1", attempt="old", results_root=str(tmp_path),
                    script_argv=[str(tmp_path / "never.py")], ds_config={}, rank=0, world_size=1, local_rank=0,
                    local_world_size=1, node_rank=0, timeout_s=10.0, gang_token="stale-token")
    record = run_rank(spec, slot, client)
    assert record["status"] == "lost" and record["stale"] is True and record["exit"] == "not started"
    assert not (tmp_path / "z0_gas1_tmbspg1").exists()  # the newer launch's folder was not touched
    assert gangs.holds(["n.gpu0"], newer)
