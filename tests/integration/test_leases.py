"""The gang reservation under contention, and a stale redelivered rank, against a real redis-server.

No Celery here. Every single-threaded lease rule of the Lua scripts (`workers.state.gang`) and the retry
cap of the control worker's sweep (`scheduler.cluster.sweep`) are in tests/redis/test_gang.py and
tests/redis/test_dispatch.py, which mutmut runs too. Each test uses its own Redis database, emptied first.
"""
from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import pytest
import redis

from workers.state.gang import GangReservations
from workers.slot.rank import run_rank
from workers.slot.rank_spec import RankSpec
from workers.device.slot import Slot

pytestmark = pytest.mark.integration


@pytest.fixture
def client(empty_redis: redis.Redis) -> redis.Redis:
    return empty_redis


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
