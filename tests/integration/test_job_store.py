"""The job store (`scheduler.job_store`) against a real redis-server: every operation, its
atomicity where it claims one, and the shape index's promise that dispatch decides exactly as it
would over the whole queue.
"""
from __future__ import annotations

import random
import time

import pytest
import redis

from scheduler.backfill import Waiting, backfill, strict_fifo
from scheduler.job_store import JobStore, active_jobs, any_active, heads, reserve_seqs
from scheduler.launches import FinishSpec, QueuedLaunch, RunningLaunch
from workers import keys
from workers.slot import Slot

pytestmark = pytest.mark.integration


@pytest.fixture
def client(empty_redis: redis.Redis) -> redis.Redis:
    return empty_redis


def queued(name: str, seq: int, nodes: int = 1, gpus: int = 1, memory: int = 0) -> QueuedLaunch:
    return QueuedLaunch(seq, {"name": name, "num_nodes": nodes, "num_gpus": gpus, "min_memory": memory,
                              "stage": 0, "micro_batch_size": seq}, ["train.py", f"--n={seq}"])


def running(launch: QueuedLaunch, attempt: str = "a1") -> RunningLaunch:
    return RunningLaunch(seq=launch.seq, exp=launch.exp, argv=launch.argv, attempt=attempt, queues=["n.gpu0"],
                         token="tok", rank_tasks={"n.gpu0": "task"}, started=time.time(),
                         deadline=time.time() + 60, instances={"n.gpu0": "i1"})


def test_records_round_trip_through_json() -> None:
    first = queued("a", 3, 2, 4, 5)
    launch = running(first)
    finish = FinishSpec("j", "a", 7, "a1", ["n.gpu0"], "tok", "/r", 1, {"x": 1}, 60.0)
    assert QueuedLaunch.from_json(first.to_json()) == first and first.shape == "2x4:5"
    assert RunningLaunch.from_json(launch.to_json()) == launch and launch.queued() == first
    assert FinishSpec.from_json(finish.to_json()) == finish


def test_a_launch_moves_from_queue_to_running_and_is_finished_once(client: redis.Redis) -> None:
    store = JobStore(client, "j")
    store.activate('{"job": "j"}')
    a, b = queued("a", 1), queued("b", 2)
    store.queue([a, b])
    assert store.queued_names() == {"a", "b"} and store.depth() == 2
    store.start(a, running(a))
    assert store.queued_names() == {"b"} and store.running_names() == {"a"} and store.attempts_of("a") == 1
    assert client.zrange(keys.job_queue_shape("j", a.shape), 0, -1) == [b"b"]  # the index moved too
    assert store.finish("a", "stale-attempt") is None and store.running_names() == {"a"}
    closed = store.finish("a", "a1")
    assert closed is not None and (closed.name, closed.attempt, closed.argv) == ("a", "a1", a.argv)
    assert store.running_names() == set() and store.recorded() == {"a"}
    assert store.finish("a", "a1") is None  # finished once


def test_a_lost_launch_waits_again_at_its_old_place(client: redis.Redis) -> None:
    store = JobStore(client, "j")
    early, late = queued("early", 1), queued("late", 9)
    store.queue([late])
    store.start(early, running(early))
    store.requeue(running(early))
    assert [launch.name for launch in heads(client, ["j"], 0)["j"]] == ["early"]  # first again
    store.start(early, running(early, "a2"))
    assert store.attempts_of("early") == 2
    store.give_up(running(early, "a2"))
    assert store.running_names() == set() and "early" in store.recorded()


def test_end_removes_every_key_of_the_job(client: redis.Redis) -> None:
    store = JobStore(client, "j")
    store.activate('{"job": "j"}')
    store.queue([queued("a", 1), queued("b", 2, gpus=2), queued("c", 3, memory=7)])
    store.start(queued("a", 1), running(queued("a", 1)))
    store.add_wall("0/1", 2.5)
    store.announce("phase1")
    assert any_active(client) and active_jobs(client) == ["j"]
    store.end({"kind": "done"})
    left = sorted(k.decode() for k in client.scan_iter(match="autotune:job:j:*"))
    assert left == [keys.job_attempts("j"), keys.job_events("j")]  # what a submitter still reads
    assert not any_active(client) and store.next_event(1) == {"kind": "done"} and store.vanished()


def test_activate_forgets_an_earlier_life(client: redis.Redis) -> None:
    store = JobStore(client, "j")
    store.activate('{"v": 1}')
    store.queue([queued("a", 1)])
    store.publish({"kind": "old"})
    first = store.order()
    store.activate('{"v": 2}')
    assert store.depth() == 0 and store.next_event(1) is None and store.order() != first
    assert store.spec_json() == b'{"v": 2}'


def test_state_for_status_and_refusals(client: redis.Redis) -> None:
    store = JobStore(client, "j")
    assert store.announce("p1") and not store.announce("p1")
    since, dispatched = store.misfit_since(100.0)
    assert (since, dispatched) == (100.0, False)
    assert store.misfit_since(250.0)[0] == 100.0  # the first time it did not fit is kept
    store.clear_misfit()
    assert store.misfit_since(300.0)[0] == 300.0
    assert store.walls(["0/1"]) == {} and store.next_exp_id() == 1 and store.next_exp_id() == 2
    store.add_wall("0/1", 1.0)
    store.add_wall("0/1", 3.0)
    assert store.walls(["0/1", "0/2"]) == {"0/1": [1.0, 3.0]}
    assert reserve_seqs(client, 5) + 4 == reserve_seqs(client, 1) - 1


def _slots(nodes: int, per_node: int) -> list[Slot]:
    return [Slot(f"n{n}", d, "cpu", (1 + n % 2) * 2**30, "10.0.0.1", 1, (), host="m")
            for n in range(nodes) for d in range(per_node)]


@pytest.mark.parametrize("seed", range(6))
def test_heads_decide_exactly_like_the_whole_queue(client: redis.Redis, seed: int) -> None:
    """Random queues of mixed shapes in two jobs, random busy slots: the policies given only the
    heads start exactly what they start given every waiting launch."""
    rng = random.Random(seed)
    slots = _slots(4, 4)
    jobs = {"j1": JobStore(client, "j1"), "j2": JobStore(client, "j2")}
    seq = 0
    for store in jobs.values():
        launches = []
        for i in range(rng.randrange(20, 60)):
            seq += rng.randrange(1, 3)
            launches.append(queued(f"{store.job}-{i}", seq, nodes=rng.choice([1, 1, 2]), gpus=rng.choice([1, 2, 4]),
                                   memory=rng.choice([0, 0, 2**31])))
        store.queue(launches)
    for _ in range(10):
        busy = {s.queue for s in slots if rng.random() < rng.choice([0.2, 0.6, 0.95])}
        free = len(slots) - len(busy)
        frees_at = {q: time.time() + rng.uniform(1, 100) for q in busy}
        everything = sorted((launch for store in jobs.values()
                             for launch in store.queued(sorted(store.queued_names()))), key=lambda l: l.seq)
        indexed = heads(client, list(jobs), free)
        some = sorted((launch for launches in indexed.values() for launch in launches), key=lambda l: l.seq)
        assert len(some) <= len(everything)

        def items(launches: list[QueuedLaunch]) -> list[Waiting]:
            # every launch of a job has the job's time limit as its estimate, as in dispatch
            return [Waiting(l.name, l.exp["num_nodes"], l.exp["num_gpus"], 60.0 if l.name.startswith("j1") else 300.0,
                            l.exp["min_memory"]) for l in launches]
        for policy in (backfill, strict_fifo):
            full = [(s.name, s.queues) for s in policy(items(everything), slots, frees_at, time.time())]
            fast = [(s.name, s.queues) for s in policy(items(some), slots, frees_at, time.time())]
            assert fast == full, (policy.__name__, free)
