"""The job store (`scheduler.cluster.job_store`, `.dispatch_reads`) against a real redis-server:
what only the Redis store has (its keys and their TTLs, one transaction or script where it claims
one, the shape index's promise that dispatch decides exactly as it would over the whole queue). The
contract it shares with the in-memory twin is tests/redis/test_job_store_contract.py.
"""
from __future__ import annotations

import json
import random
import time

import pytest
import redis

from scheduler.cluster.backfill import Waiting, backfill, strict_fifo
from scheduler.cluster.dispatch_reads import heads
from scheduler.cluster.job_store import JobStore, active_jobs, any_active, reserve_seqs, shown_states
from scheduler.cluster.launches import FinishSpec, QueuedLaunch, RunningLaunch
from workers.state import keys
from workers.device.slot import Slot


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


# ---------------------------------------------------------------- the raw keys, read back

WEEK_S = 7 * 24 * 3600


def _week_ttl(client: redis.Redis, key: str) -> bool:
    return WEEK_S - 600 < client.ttl(key) <= WEEK_S


def test_activate_takes_the_next_sequence_number_and_forgets_the_old_life(client: redis.Redis) -> None:
    client.set(keys.SEQUENCE, 41)
    store = JobStore(client, "j")
    client.hset(keys.job_attempts("j"), "old", 3)
    client.rpush(keys.job_events("j"), "{}")
    client.sadd(keys.job_shapes("j"), "9x9:0")
    client.zadd(keys.job_queue_shape("j", "9x9:0"), {"old": 1})
    client.hset(keys.job_walls("j"), "0/1", "[1]")
    store.activate('{"job": "j"}')
    assert client.get(keys.SEQUENCE) == b"42" and client.zrange(keys.JOBS, 0, -1, withscores=True) == [(b"j", 42.0)]
    assert store.order() == 42.0 and JobStore(client, "other").order() is None
    assert sorted(client.keys("*")) == sorted([keys.SEQUENCE.encode(), keys.JOBS.encode(), keys.job_spec("j").encode()])
    assert store.spec_json() == b'{"job": "j"}' and JobStore(client, "other").spec_json() is None


def test_end_leaves_only_the_last_event_and_the_attempts(client: redis.Redis) -> None:
    store, other = JobStore(client, "j"), JobStore(client, "k")
    store.activate("{}")
    other.activate("{}")
    store.queue([queued("a", 1), queued("b", 2, gpus=2)])
    store.unqueue(queued("b", 2, gpus=2))  # its shape stays indexed, with an empty queue
    store.start(queued("a", 1), running(queued("a", 1)))
    store.publish({"kind": "phase"})
    store.end({"kind": "done"})
    assert sorted(k.decode() for k in client.keys("autotune:job:j:*")) == [keys.job_attempts("j"), keys.job_events("j")]
    assert [json.loads(raw) for raw in client.lrange(keys.job_events("j"), 0, -1)] == [{"kind": "phase"}, {"kind": "done"}]
    assert _week_ttl(client, keys.job_events("j")) and _week_ttl(client, keys.job_attempts("j"))
    assert active_jobs(client) == ["k"] and any_active(client) and other.spec_json() == b"{}"
    other.end({"kind": "failed"})
    assert active_jobs(client) == [] and not any_active(client)


def test_events_are_kept_a_week_and_popped_in_order(client: redis.Redis) -> None:
    store = JobStore(client, "j")
    assert store.vanished()
    store.publish({"n": 1})
    store.publish({"n": 2})
    assert _week_ttl(client, keys.job_events("j")) and not store.vanished()  # an event is pending
    assert store.next_event(1) == {"n": 1} and store.next_event(1) == {"n": 2}
    started = time.monotonic()
    assert store.next_event(0.2) is None and time.monotonic() - started >= 0.15
    client.set(keys.job_spec("j"), "{}")
    assert not store.vanished()  # the spec is there


def test_shown_states_by_job(client: redis.Redis) -> None:
    JobStore(client, "b").activate("{}")  # keys of other types do not match the pattern
    JobStore(client, "b").show({"running": "x", "pending": 3})
    JobStore(client, "a").show({"running": "-"})
    JobStore(client, "a").set_phase("z1")
    assert shown_states(client) == [{"job": "a", "running": "-", "phase": "z1"},
                                    {"job": "b", "running": "x", "pending": "3"}]
    assert client.hgetall(keys.job_state("a")) == {b"running": b"-", b"phase": b"z1"}


def test_sequence_numbers_come_in_blocks(client: redis.Redis) -> None:
    assert reserve_seqs(client, 3) == 1 and reserve_seqs(client, 1) == 4 and reserve_seqs(client, 2) == 5
    assert client.get(keys.SEQUENCE) == b"6"


def test_queue_indexes_every_launch_by_shape(client: redis.Redis) -> None:
    store = JobStore(client, "j")
    a, b, c = queued("a", 5), queued("b", 3, gpus=2, memory=9), queued("c", 4)
    store.queue([a, b, c])
    assert client.smembers(keys.job_shapes("j")) == {b"1x1:0", b"1x2:9"}
    assert client.zrange(keys.job_queue_shape("j", "1x1:0"), 0, -1, withscores=True) == [(b"c", 4.0), (b"a", 5.0)]
    assert client.zrange(keys.job_queue_shape("j", "1x2:9"), 0, -1, withscores=True) == [(b"b", 3.0)]
    assert json.loads(client.hget(keys.job_queue("j"), "b")) == b.to_json()
    assert store.queued(["c", "gone", "a"]) == [c, a] and store.queued([]) == []
    store.queue([queued("a", 1)])  # the same name again: replaced, at its new place
    assert store.depth() == 3 and client.zscore(keys.job_queue_shape("j", "1x1:0"), "a") == 1.0
    store.unqueue(c)
    assert store.queued_names() == {"a", "b"} and client.zrange(keys.job_queue_shape("j", "1x1:0"), 0, -1) == [b"a"]


def test_queue_in_a_callers_pipeline_waits_for_its_execute(client: redis.Redis) -> None:
    store = JobStore(client, "j")
    pipe = client.pipeline(transaction=True)
    store.queue([queued("a", 1)], pipe)
    assert store.depth() == 0  # not sent yet
    pipe.execute()
    assert store.queued_names() == {"a"}


def test_heads_take_per_shape_only_what_the_free_slots_can_use(client: redis.Redis) -> None:
    store = JobStore(client, "j")
    store.queue([queued(f"one{i}", 100 + i) for i in range(12)])  # 1 slot each
    store.queue([queued(f"four{i}", 10 + i, nodes=2, gpus=2) for i in range(6)])  # 4 slots each
    store.queue([queued("gone", 1)])
    client.hdel(keys.job_queue("j"), "gone")  # indexed, but no longer queued
    JobStore(client, "idle").activate("{}")
    found = heads(client, ["j", "idle", "never"], 9)
    assert found["idle"] == [] and found["never"] == []
    # 9 // 4 + 1 = 3 of the 4-slot shape, 9 // 1 + 1 = 10 of the 1-slot shape (one of them unqueued)
    assert [launch.name for launch in found["j"]] == ["four0", "four1", "four2", *(f"one{i}" for i in range(9))]
    assert [launch.name for launch in heads(client, ["j"], 0)["j"]] == ["four0"]  # the one 1-slot head is gone
    assert [launch.name for launch in heads(client, ["j"], 3)["j"]] == ["four0", "one0", "one1", "one2"]
    assert heads(client, [], 5) == {}


def test_heads_skip_a_shape_whose_queue_is_empty(client: redis.Redis) -> None:
    store = JobStore(client, "j")
    store.queue([queued("a", 2), queued("b", 1, gpus=2)])
    store.unqueue(queued("b", 1, gpus=2))
    assert heads(client, ["j"], 4) == {"j": [queued("a", 2)]}
    store.unqueue(queued("a", 2))
    assert heads(client, ["j"], 4) == {"j": []}


def test_start_counts_the_attempt_first_and_marks_the_job_dispatched(client: redis.Redis) -> None:
    store = JobStore(client, "j")
    a = queued("a", 1)
    store.queue([a, queued("b", 2)])
    launch = running(a)
    store.start(a, launch)
    assert client.hgetall(keys.job_attempts("j")) == {b"a": b"1"} and _week_ttl(client, keys.job_attempts("j"))
    assert client.hget(keys.job_state("j"), "dispatched") == b"1"
    assert json.loads(client.hget(keys.job_running("j"), "a")) == launch.to_json()
    assert store.running() == {"a": launch} and store.running_names() == {"a"}
    assert client.zrange(keys.job_queue_shape("j", "1x1:0"), 0, -1) == [b"b"] and store.queued_names() == {"b"}
    store.update_running(launch.missing_from(7.0))
    assert store.running()["a"].missing_since == 7.0
    assert store.attempts() == {"a": 1} and store.attempts_of("a") == 1 and store.attempts_of("b") == 0
    assert store.misfit_since(3.0) == (3.0, True)


def test_requeue_and_give_up(client: redis.Redis) -> None:
    store = JobStore(client, "j")
    a = queued("a", 4, gpus=2)
    store.start(a, running(a))
    store.requeue(running(a))
    assert not client.exists(keys.job_running("j")) and json.loads(client.hget(keys.job_queue("j"), "a")) == a.to_json()
    assert client.zrange(keys.job_queue_shape("j", "1x2:0"), 0, -1, withscores=True) == [(b"a", 4.0)]
    assert client.smembers(keys.job_shapes("j")) == {b"1x2:0"}
    store.start(a, running(a, "a2"))
    store.give_up(running(a, "a2"))
    assert not client.exists(keys.job_running("j")) and store.recorded() == {"a"} and store.depth() == 0
    assert store.attempts() == {"a": 2}


def test_walls_exp_ids_phases_and_misfits_in_the_state_hash(client: redis.Redis) -> None:
    store = JobStore(client, "j")
    store.add_wall("1/2", 1.5)
    store.add_wall("1/2", 2.5)
    assert client.hgetall(keys.job_walls("j")) == {b"1/2": b"[1.5, 2.5]"}
    assert store.walls([]) == {} and store.walls(["1/2", "3/4"]) == {"1/2": [1.5, 2.5]}
    assert store.next_exp_id() == 1 and store.next_exp_id() == 2
    assert store.announce("z1") is True and store.announce("z1") is False and store.announce("z2") is True
    store.set_phase("z2")
    assert store.misfit_since(10.5) == (10.5, False) and store.misfit_since(99.0) == (10.5, False)
    assert client.hgetall(keys.job_state("j")) == {b"exp_ids": b"2", b"phase:z1": b"1", b"phase:z2": b"1",
                                                  b"phase": b"z2", b"misfit_since": b"10.5"}
    store.clear_misfit()
    assert not client.hexists(keys.job_state("j"), "misfit_since")
    store.show({"head": "x", "pending": 2})
    assert client.hget(keys.job_state("j"), "head") == b"x" and client.hget(keys.job_state("j"), "pending") == b"2"


# ---------------------------------------------------------------- one transaction where the docstring says so


def sent(client: redis.Redis, action) -> list[str]:
    """The names of the commands `action` sent to Redis, in order, as MONITOR saw them executed."""
    with client.monitor() as monitor:
        client.echo("action-starts")
        action()
        client.echo("action-ended")
        while not monitor.next_command()["command"].startswith("ECHO action-starts"):
            pass
        names = []
        while not (command := monitor.next_command()["command"]).startswith("ECHO action-ended"):
            names.append(command.split()[0])
    return names


def test_every_multi_key_change_is_one_transaction(client: redis.Redis) -> None:
    store = JobStore(client, "j")
    a = queued("a", 1)
    launch = running(a)
    assert sent(client, lambda: store.activate("{}")) == ["INCRBY", "SMEMBERS", "MULTI", "DEL", "SET", "ZADD", "EXEC"]
    assert sent(client, lambda: store.queue([a])) == ["MULTI", "HSET", "SADD", "ZADD", "EXEC"]
    assert sent(client, lambda: store.unqueue(a)) == ["MULTI", "HDEL", "ZREM", "EXEC"]
    assert sent(client, lambda: store.start(a, launch)) == [
        "MULTI", "HINCRBY", "EXPIRE", "HDEL", "ZREM", "HSET", "HSET", "HINCRBY", "EXEC"]
    assert sent(client, lambda: store.requeue(launch)) == ["MULTI", "HDEL", "HSET", "SADD", "ZADD", "EXEC"]
    store.start(a, launch)
    store.finish("a", "stale")  # its script loaded: a script runs whole, like a transaction
    assert sent(client, lambda: store.finish("a", "a1")) == ["EVALSHA", "HGET", "HDEL", "SADD"]
    store.recorded_event(None)
    assert sent(client, lambda: store.recorded_event({}, ("0/1", 2.0))) == [
        "EVALSHA", "HGET", "HSET", "RPUSH", "EXPIRE"]
    assert sent(client, lambda: store.give_up(launch)) == ["MULTI", "HDEL", "SADD", "EXEC"]
    assert sent(client, lambda: store.misfit_since(1.0)) == ["MULTI", "HSETNX", "HGET", "HEXISTS", "EXEC"]
    assert sent(client, lambda: store.publish({})) == ["MULTI", "RPUSH", "EXPIRE", "EXEC"]
    assert sent(client, lambda: store.end({})) == ["SMEMBERS", "MULTI", "RPUSH", "EXPIRE", "DEL", "ZREM", "EXEC"]


def test_end_of_a_job_with_no_earlier_event_still_expires_its_events(client: redis.Redis) -> None:
    store = JobStore(client, "j")
    store.activate("{}")
    store.end({"kind": "done"})
    assert _week_ttl(client, keys.job_events("j"))


def test_heads_read_in_one_script(client: redis.Redis) -> None:
    """One round trip for every job (a pass after each record pays it): the script, then what it reads."""
    JobStore(client, "j").queue([queued("a", 1), queued("b", 2, gpus=2)])
    heads(client, ["j"], 0)  # the script loaded
    commands = sent(client, lambda: heads(client, ["j", "k"], 1))
    assert commands[0] == "EVALSHA" and sorted(commands[1:]) == sorted(
        ["SMEMBERS", "ZRANGE", "ZRANGE", "HMGET", "HMGET", "HLEN", "HKEYS", "SMEMBERS", "HLEN", "HKEYS"]), commands
