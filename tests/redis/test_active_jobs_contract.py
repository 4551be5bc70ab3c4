"""One contract for both stores of every active job at once (`stores.BaseActiveJobs`), what a dispatch
pass reads and writes across jobs: the Redis `dispatch_reads.RedisActiveJobs` (its Lua and pipelines)
on the session's redis-server, and the twin `memory_store.InMemoryActiveJobs`, run against each. The
twin is what tests/unit runs whole dispatch passes over, so what passes here for both is what makes
those tests say something about Redis. Round trips and the key layout stay in tests/redis/test_job_store.py.
"""
from __future__ import annotations

from dataclasses import replace

import pytest

from scheduler.cluster.dispatch_reads import RedisActiveJobs
from scheduler.cluster.launches import FinishSpec, QueuedLaunch, RunningLaunch
from scheduler.cluster.memory_store import InMemoryActiveJobs, MemoryJobs
from scheduler.cluster.stores import BaseActiveJobs, Heads
from workers.state.memory_store import MemorySlots
from workers.state.store import BaseSlotStore, RedisSlotStore


@pytest.fixture(params=["redis", "memory"])
def stores(request: pytest.FixtureRequest) -> tuple[BaseActiveJobs, BaseSlotStore]:
    """(the active jobs' store, the slots' store whose leases it reads), on one backend."""
    if request.param == "redis":
        client = request.getfixturevalue("client")  # the session's redis-server (conftest), emptied
        return RedisActiveJobs(client), RedisSlotStore(client)
    slots = MemorySlots().store()
    return InMemoryActiveJobs(MemoryJobs(), slots), slots


def queued(name: str, seq: int, nodes: int = 1, gpus: int = 1, memory: int = 0) -> QueuedLaunch:
    return QueuedLaunch(seq, {"name": name, "num_nodes": nodes, "num_gpus": gpus, "min_memory": memory,
                              "stage": 0, "micro_batch_size": 1}, ["train.py", f"--n={seq}"])


def running(launch: QueuedLaunch, attempt: str = "a1", queues: tuple[str, ...] = ("n.gpu0",)) -> RunningLaunch:
    return RunningLaunch(seq=launch.seq, exp=launch.exp, argv=launch.argv, attempt=attempt, queues=list(queues),
                         token="tok", rank_tasks={q: f"task-{q}" for q in queues}, started=10.0, deadline=99.0)


def test_the_active_specs_in_submission_order(stores) -> None:
    jobs, _ = stores
    assert jobs.active_spec_jsons() == []
    for job in ("b", "a", "c"):
        jobs.store(job).activate(f'{{"job": "{job}"}}')
    jobs.store("c").end({"kind": "done"})
    assert jobs.active_spec_jsons() == [b'{"job": "b"}', b'{"job": "a"}']
    jobs.store("b").activate('{"job": "b", "again": 1}')  # submitted again: last in the order
    assert jobs.active_spec_jsons() == [b'{"job": "a"}', b'{"job": "b", "again": 1}']
    assert jobs.store("a").spec_json() == b'{"job": "a"}'  # `store` is the job's own store


def test_the_heads_are_the_launches_of_each_shape_that_can_matter(stores) -> None:
    jobs, _ = stores
    ones = [queued(f"one{i}", 10 + i) for i in range(5)]
    pairs = [queued(f"pair{i}", 20 + i, gpus=2) for i in range(3)]
    big = [queued(f"big{i}", 1 + i, nodes=2, gpus=2) for i in range(2)]
    roomy = [queued("roomy", 30, memory=5)]
    store = jobs.store("j")
    store.queue([*reversed(ones), *pairs, *big, *roomy])
    store.update_running(running(queued("r", 9)))
    found = jobs.heads(["j", "idle"], 3)
    assert found["idle"] == Heads([], 0, set())
    # 3 free slots: of 1x1 the first 4 by seq, of 1x2 the first 2, of 2x2 the first 1, of 1x1:5 its one
    assert found["j"] == Heads([big[0], *ones[:4], *pairs[:2], roomy[0]], 11, {"r"})
    store.unqueue(ones[0])
    store.unqueue(big[0])
    assert [launch.name for launch in jobs.heads(["j"], 0)["j"].launches] == ["big1", "one1", "pair0", "roomy"]
    assert jobs.heads([], 5) == {}


def test_the_running_launches_and_wall_times_agree_with_each_jobs_store(stores) -> None:
    jobs, _ = stores
    one, two, idle = jobs.store("one"), jobs.store("two"), jobs.store("idle")
    for store, names in ((one, ("a", "b")), (two, ("c",))):
        for seq, name in enumerate(names):
            store.update_running(running(queued(name, seq)))
    one.add_wall("0/1", 1.5)
    one.add_wall("0/1", 2.5)
    two.add_wall("2/8", 4.0)
    found = jobs.running_by_job(["one", "two", "idle"])
    assert {job: {launch.name: launch for launch in launches} for job, launches in found.items()} == {
        "one": one.running(), "two": two.running(), "idle": idle.running()}
    assert jobs.walls_by_job({"one": ["0/1", "x"], "two": ["2/8"], "idle": []}) == {
        "one": one.walls(["0/1", "x"]), "two": two.walls(["2/8"])} == {"one": {"0/1": [1.5, 2.5]}, "two": {"2/8": [4.0]}}


def test_show_all_clears_the_misfits_named_and_shows_each_jobs_fields(stores) -> None:
    jobs, _ = stores
    for job in ("a", "b", "c"):
        jobs.store(job).misfit_since(7.0)
    jobs.show_all({"a": {"pending": 2, "head": "x", "updated": 5000.0}, "b": {"head": "-"}}, ["a", "c"])
    assert jobs.store("a").shown() == {"pending": "2", "head": "x", "updated": "5000.0"}
    assert jobs.store("b").shown() == {"head": "-", "misfit_since": "7.0"}
    assert jobs.store("c").shown() == {}
    jobs.show_all({"b": {"head": "y"}})
    assert jobs.store("b").shown() == {"head": "y", "misfit_since": "7.0"}


def test_the_lease_owners_and_their_running_launches(stores) -> None:
    jobs, slots = stores
    a = running(queued("a", 1), queues=("n.gpu0", "n.gpu1"))
    jobs.store("j").update_running(a)
    assert slots.reserve(["n.gpu0", "n.gpu1"], 30.0, "j/a")
    assert slots.reserve(["n.gpu2"], 30.0, "k/gone")  # a job that runs no such launch
    assert slots.reserve(["n.gpu3"], 30.0, "plain")  # an owner naming no job
    assert slots.reserve(["n.gpu4"], 30.0)  # no owner at all
    found = jobs.lease_owners(["n.gpu3", "n.gpu1", "n.gpu9", "n.gpu0", "n.gpu4", "n.gpu2"])
    assert found == [("plain", None), ("j/a", a), ("k/gone", None)]
    assert jobs.lease_owners([]) == [] and jobs.lease_owners(["n.gpu9"]) == []


def test_a_start_beside_others_writes_theirs_and_its_own(stores) -> None:
    jobs, _ = stores
    other = running(queued("a", 1))
    jobs.store("j").update_running(other)
    b = queued("b", 2)
    jobs.store("k").queue([b, queued("c", 3)])
    updated = replace(other, co_runners=["k/b"])
    b_running = replace(running(b, queues=("n.gpu1",)), co_runners=["j/a"])
    assert jobs.start_beside("k", b, b_running, [("j", updated)]) == 1
    assert jobs.store("j").running() == {"a": updated}
    store = jobs.store("k")
    assert store.running() == {"b": b_running} and store.queued_names() == {"c"}
    assert store.attempts() == {"b": 1} and store.shown()["dispatched"] == "1"
    assert jobs.heads(["k"], 4)["k"] == Heads([queued("c", 3)], 1, {"b"})
    assert jobs.start_beside("k", queued("c", 3), running(queued("c", 3)), []) == 2


def test_a_finished_launch_frees_its_slots_closes_once_and_reads_the_step(stores) -> None:
    """`finish_launch`: the launch's slots freed (token-checked), its attempt closed with its event and
    wall time, and the step's reads after that; a second finish, or one of another attempt, closes
    nothing and adds no event or wall time, but still frees what its token holds."""
    jobs, slots = stores
    store = jobs.store("j")
    store.activate('{"job": "j"}')
    token = slots.reserve(["n.gpu0", "n.gpu1"], 30.0, "j/a")
    assert token is not None
    launch = replace(running(queued("a", 1, gpus=2), queues=("n.gpu0", "n.gpu1")), token=token)
    store.update_running(launch)
    finish = FinishSpec(job="j", name="a", exp_id=1, attempt="a1", slots=["n.gpu0", "n.gpu1"], gang_token=token,
                        results_root="/r", world_size=2, ds_config={}, timeout_s=60.0, shape="0/1")
    event = {"kind": "record", "record": {"name": "a", "status": "ok"}}
    assert jobs.finish_launch(finish, event, ("0/1", 2.5)) == store.step_reads()
    read = store.step_reads()
    assert read.recorded == {"a"} and read.running == set() and read.spec == b'{"job": "j"}'
    assert slots.held(["n.gpu0", "n.gpu1"]) == set()
    assert store.walls(["0/1"]) == {"0/1": [2.5]} and store.next_event(0.01) == event
    assert slots.reserve(["n.gpu1"], 30.0, "k/b") is not None  # the slot's next launch
    assert jobs.finish_launch(finish, event, ("0/1", 9.0)) is None  # closed already
    assert slots.held(["n.gpu1"]) == {"n.gpu1"}  # another token's lease stays
    assert store.walls(["0/1"]) == {"0/1": [2.5]} and store.next_event(0.01) is None
    store.update_running(launch)
    other = replace(finish, attempt="a0")
    assert jobs.finish_launch(other, event, None) is None and store.running_names() == {"a"}
