"""One contract for both job stores (`stores.BaseJobStore`): the Redis `JobStore` on the session's
redis-server and its in-memory twin (`memory_store.InMemoryJobStore`), every interface method, run
against each. The twin is what tests/unit tests the control path's decisions with, so what passes
here for both is what makes those tests say something about Redis.

The TTLs are shortened (monkeypatched) so Redis's own expiry runs within the test; `later` sleeps
for Redis and moves the twin's clock. What only Redis has (pipelines, the key layout, Lua's round
trips) stays in tests/redis/test_job_store.py.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

import pytest

from scheduler.cluster import job_store
from scheduler.cluster.job_store import JobStore
from scheduler.cluster.launches import QueuedLaunch, RunningLaunch
from scheduler.cluster.memory_store import MemoryJobs
from scheduler.cluster.stores import BaseJobStore, StepReads


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


class Backend:
    """A store per job on one backend, and how time passes for it."""

    def __init__(self, store: Callable[[str], BaseJobStore], later: Callable[[float], None]) -> None:
        self.store, self.later = store, later


@pytest.fixture(params=["redis", "memory"])
def backend(request: pytest.FixtureRequest) -> Backend:
    if request.param == "redis":
        client = request.getfixturevalue("client")  # the session's redis-server (conftest), emptied
        return Backend(lambda job: JobStore(client, job), time.sleep)
    clock = Clock()
    db = MemoryJobs(clock)

    def later(seconds: float) -> None:
        clock.now += seconds
    return Backend(db.store, later)


def queued(name: str, seq: int, gpus: int = 1) -> QueuedLaunch:
    return QueuedLaunch(seq, {"name": name, "num_nodes": 1, "num_gpus": gpus, "min_memory": 0, "stage": 0,
                              "micro_batch_size": 1}, ["train.py", f"--n={seq}"])


def running(launch: QueuedLaunch, attempt: str = "a1") -> RunningLaunch:
    return RunningLaunch(seq=launch.seq, exp=launch.exp, argv=launch.argv, attempt=attempt, queues=["n.gpu0"],
                         token="tok", rank_tasks={"n.gpu0": "task"}, started=10.0, deadline=70.0,
                         instances={"n.gpu0": "i1"})


def events(store: BaseJobStore) -> list[dict]:
    found = []
    while (event := store.next_event(0.01)) is not None:
        found.append(event)
    return found


class TestJobStoreContract:
    def test_activate_stores_the_spec_in_submission_order(self, backend: Backend) -> None:
        one, two = backend.store("one"), backend.store("two")
        assert one.spec_json() is None and one.order() is None
        one.activate('{"job": "one"}')
        two.activate('{"job": "two"}')
        assert one.spec_json() == b'{"job": "one"}' and two.spec_json() == b'{"job": "two"}'
        assert isinstance(one.order(), float) and one.order() < two.order()
        one.activate('{"job": "one", "again": 1}')  # submitted again: behind two
        assert one.order() > two.order() and one.spec_json() == b'{"job": "one", "again": 1}'

    def test_activate_forgets_an_earlier_life(self, backend: Backend) -> None:
        store = backend.store("j")
        store.activate("{}")
        a, b = queued("a", 1), queued("b", 2)
        store.queue([a, b])
        store.start(a, running(a))
        store.add_wall("0/1", 2.0)
        store.mark_recorded("r")
        store.show({"pending": 1})
        store.publish({"kind": "phase"})
        store.activate('{"new": 1}')
        assert store.step_reads() == StepReads(b'{"new": 1}', set(), {}, store.order(), set(), set())
        assert store.walls(["0/1"]) == {} and store.shown() == {} and events(store) == []
        assert not store.settling() and store.misfit_since(5.0) == (5.0, False)

    def test_a_job_submitted_again_after_a_loss_counts_as_launched_and_settles(
            self, backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(job_store, "RESUME_SETTLE_S", 0.3)
        store = backend.store("j")
        store.activate("{}", launched_before=True)
        assert store.settling() and store.shown() == {"dispatched": "1"}
        assert store.misfit_since(7.0) == (7.0, True)
        backend.later(0.4)
        assert not store.settling() and store.spec_json() == b"{}"

    def test_end_forgets_all_but_the_events_and_the_attempts(self, backend: Backend) -> None:
        store, other = backend.store("j"), backend.store("k")
        store.activate("{}")
        other.activate("{}")
        a = queued("a", 1)
        store.queue([a, queued("b", 2, gpus=2)])
        store.start(a, running(a))
        store.add_wall("0/1", 1.0)
        store.announce("p")
        store.publish({"kind": "phase"})
        store.end({"kind": "done"})
        assert store.spec_json() is None and store.order() is None and other.order() is not None
        assert store.step_reads() == StepReads(None, set(), {"a": 1}, None, set(), set())
        assert store.walls(["0/1"]) == {} and store.shown() == {} and store.depth() == 0
        assert not store.vanished()  # its events wait for the submitter
        assert events(store) == [{"kind": "phase"}, {"kind": "done"}]
        assert store.vanished() and other.spec_json() == b"{}"

    def test_events_pop_in_order_and_expire_after_the_last_push(self, backend: Backend,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(job_store, "EVENTS_TTL_S", 1)
        store = backend.store("j")
        assert store.next_event(0.01) is None and store.vanished()
        store.publish({"n": 1})
        store.publish({"n": 2})
        assert store.next_event(0.01) == {"n": 1} and not store.vanished()
        backend.later(0.6)
        store.publish({"n": 3})  # the TTL starts again
        backend.later(0.6)
        assert store.next_event(0.01) == {"n": 2}
        backend.later(1.1)
        assert store.next_event(0.01) is None and store.vanished()

    def test_the_queue(self, backend: Backend) -> None:
        store = backend.store("j")
        a, b, c = queued("a", 1), queued("b", 2, gpus=2), queued("c", 3)
        store.queue([a, b, c])
        assert store.queued_names() == {"a", "b", "c"} and store.depth() == 3
        assert store.queued(["c", "x", "a"]) == [c, a] and store.queued([]) == []
        moved = replace(a, argv=["other.py"])
        store.queue([moved])  # the same name: replaced
        assert store.depth() == 3 and store.queued(["a"]) == [moved]
        store.unqueue(b)
        assert store.queued_names() == {"a", "c"} and store.queued(["b"]) == []

    def test_running_launches(self, backend: Backend) -> None:
        store = backend.store("j")
        a, b = running(queued("a", 1)), running(queued("b", 2))
        store.update_running(a)
        store.update_running(b)
        assert store.running() == {"a": a, "b": b} and store.running_names() == {"a", "b"}
        assert store.running_of(["b", "x"]) == {"b": b} and store.running_of([]) == {}
        seen = a.missing_from(12.0)
        store.update_running(seen)
        assert store.running()["a"] == seen and store.depth() == 0

    def test_start_counts_the_attempt_moves_the_launch_and_numbers_it(self, backend: Backend) -> None:
        store = backend.store("j")
        a, b = queued("a", 1), queued("b", 2)
        store.queue([a, b])
        assert store.next_exp_id() == 1
        assert store.start(a, running(a)) == 2  # exp ids shared with next_exp_id
        assert store.queued_names() == {"b"} and store.running() == {"a": running(a)}
        assert store.attempts() == {"a": 1} and store.attempts_of("a") == 1 and store.attempts_of("b") == 0
        assert store.shown() == {"dispatched": "1", "exp_ids": "2"}
        assert store.misfit_since(3.0) == (3.0, True)

    def test_attempts_expire_after_the_last_start(self, backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(job_store, "ATTEMPTS_TTL_S", 1)
        store = backend.store("j")
        a = queued("a", 1)
        store.start(a, running(a))
        backend.later(0.6)
        store.requeue(running(a))
        store.start(a, running(a, "a2"))  # the TTL starts again
        backend.later(0.6)
        assert store.attempts() == {"a": 2}
        backend.later(1.1)
        assert store.attempts() == {} and store.attempts_of("a") == 0

    def test_finish_closes_only_the_running_attempt_once(self, backend: Backend) -> None:
        store = backend.store("j")
        a = queued("a", 1)
        store.start(a, running(a, "a1"))
        assert store.finish("a", "stale") is None and store.running_names() == {"a"} and store.recorded() == set()
        assert store.finish("a", "a1") == running(a, "a1")
        assert store.running_names() == set() and store.recorded() == {"a"}
        assert store.finish("a", "a1") is None and store.finish("never", "a1") is None

    def test_recorded_names_walls_and_recorded_events(self, backend: Backend) -> None:
        store = backend.store("j")
        store.mark_recorded("x")
        store.add_wall("1/2", 10.0)
        store.add_wall("1/2", 20.5)
        store.recorded_event({"kind": "record", "n": 1}, ("1/2", 3))
        store.recorded_event(None, ("3/8", 7.0))
        store.recorded_event({"kind": "record", "n": 2})
        store.recorded_event(None, ("", 9.0))  # '' names no shape
        assert store.recorded() == {"x"}
        assert store.walls(["1/2", "3/8", "0/0"]) == {"1/2": [10.0, 20.5, 3.0], "3/8": [7.0]}
        assert store.walls([]) == {} and store.walls([""]) == {}
        assert events(store) == [{"kind": "record", "n": 1}, {"kind": "record", "n": 2}]

    def test_requeue_counted_or_not_and_give_up(self, backend: Backend) -> None:
        store = backend.store("j")
        early, late = queued("early", 1), queued("late", 9)
        store.queue([late])
        store.start(early, running(early))
        store.requeue(running(early))
        assert store.running_names() == set() and store.queued(["early"]) == [early] and store.attempts_of("early") == 1
        store.start(early, running(early, "a2"))
        store.requeue(running(early, "a2"), counted=False)
        assert store.attempts_of("early") == 1 and store.depth() == 2
        store.start(early, running(early, "a3"))
        store.give_up(running(early, "a3"))
        assert store.running_names() == set() and store.recorded() == {"early"} and store.queued_names() == {"late"}

    def test_step_reads_are_the_separate_reads(self, backend: Backend) -> None:
        store = backend.store("j")
        store.activate('{"j": 1}')
        a, b, c = queued("a", 1), queued("b", 2), queued("c", 3)
        store.queue([a, b, c])
        store.start(a, running(a))
        store.start(b, running(b))
        store.finish("b", "a1")
        assert store.step_reads() == StepReads(b'{"j": 1}', {"b"}, {"a": 1, "b": 1}, store.order(), {"c"}, {"a"})
        assert store.step_reads() == StepReads(store.spec_json(), store.recorded(), store.attempts(), store.order(),
                                               store.queued_names(), store.running_names())

    def test_phases_and_the_shown_state(self, backend: Backend) -> None:
        store = backend.store("j")
        assert store.announce("p1") is True and store.announce("p1") is False
        assert store.announce_phases(["p1", "p2", "p2"]) == [False, True, False]
        assert store.announce_phases(["p3"], current="p3") == [True]
        store.set_phase("p4")
        store.show({"pending": 3, "running": "a,b", "updated": 12.5})
        store.show({"pending": 2})
        assert store.shown() == {"phase:p1": "1", "phase:p2": "1", "phase:p3": "1", "phase": "p4", "pending": "2",
                                 "running": "a,b", "updated": "12.5"}

    def test_the_misfit_clock(self, backend: Backend) -> None:
        store = backend.store("j")
        assert store.misfit_since(100.5) == (100.5, False)
        assert store.misfit_since(200.0) == (100.5, False)  # kept from the first
        assert store.shown() == {"misfit_since": "100.5"}
        store.clear_misfit()
        assert store.misfit_since(300.0) == (300.0, False) and store.shown() == {"misfit_since": "300.0"}
        store.clear_misfit()
        store.clear_misfit()  # nothing to clear: no error
        assert store.shown() == {}

    def test_what_is_stored_is_a_copy(self, backend: Backend) -> None:
        store = backend.store("j")
        a = queued("a", 1)
        store.queue([a])
        store.update_running(running(a))
        a.exp["name_changed"] = True  # the caller's object changes after the call
        store.queued(["a"])[0].exp["stage"] = 99
        store.running()["a"].exp["stage"] = 99
        assert "name_changed" not in store.queued(["a"])[0].exp and store.queued(["a"])[0].exp["stage"] == 0
        assert store.running()["a"].exp["stage"] == 0 and "name_changed" not in store.running()["a"].exp

    def test_jobs_are_apart(self, backend: Backend) -> None:
        one, two = backend.store("one"), backend.store("two")
        a = queued("a", 1)
        one.queue([a])
        one.start(a, running(a))
        one.add_wall("s", 1.0)
        one.publish({"n": 1})
        one.announce("p")
        assert two.step_reads() == StepReads(None, set(), {}, None, set(), set())
        assert two.walls(["s"]) == {} and two.shown() == {} and two.next_event(0.01) is None

