"""The other end of a launch decided over the in-memory stores, with no redis-server: the chord
callback's bookkeeping (`finish.record_and_read`: free the slots, close the launch, tell the submitter,
feed the estimates, read the step), which launch's record counts (`fencing.holds_experiment`), the
adoption of a launch its job lost track of (`fencing.adopted`), and a busy GPU's requeue with its
slots freed (`finish.requeue_for_busy_gpu`).

tests/redis/test_active_jobs_contract.py holds `finish_launch` alike over Redis and the twin; the
pipeline's one round trip and the raw keys stay in tests/redis/test_dispatch.py. Every expectation
is worked out by hand.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from memory_cluster import Cluster, exp, make_slot, make_spec
from scheduler.cluster.fencing import holds_experiment
from scheduler.cluster.finish import record_and_read, record_finished, requeue_for_busy_gpu
from scheduler.cluster.launches import FinishSpec
from workers.slot.records import ExperimentRecord

GiB = 2**30


def _dispatched(tmp_path: Path, name: str = "a") -> tuple[Cluster, FinishSpec]:
    """A cluster whose job "j" runs `name` (stage 2, micro batch 8) on n0.gpu0 + n0.gpu1."""
    cluster = Cluster()
    cluster.register(make_slot("n0", 0), make_slot("n0", 1))
    cluster.active(make_spec(tmp_path), exp(name, 2, 8, gpus=2))
    cluster.dispatch()
    finish = cluster.work.launched[-1][1]
    assert cluster.running("j").keys() == {name} and cluster.lease("n0.gpu0") is not None
    return cluster, finish


def _record(name: str = "a", **fields) -> ExperimentRecord:
    return ExperimentRecord.from_json({"name": name, **fields})


def test_a_finished_launch_frees_its_slots_closes_and_tells_once(tmp_path: Path) -> None:
    cluster, finish = _dispatched(tmp_path)
    record = _record(status="ok", wall_s=12.5, metrics={"throughput": 3.0})
    store = cluster.jobs.store("j")
    recorded, read = record_and_read(cluster.jobs, finish, record)
    assert recorded is True and read == store.step_reads()
    assert read.recorded == {"a"} and read.running == set() and read.attempts == {"a": 1}
    assert cluster.lease("n0.gpu0") is None and cluster.lease("n0.gpu1") is None
    assert store.walls(["2/8"]) == {"2/8": [12.5]}
    told = [event for event in cluster.events("j") if event["kind"] == "record"]
    assert told == [{"kind": "record", "record": record.to_json()}]
    assert record_and_read(cluster.jobs, finish, record) == (False, None)  # closed already: stale
    assert [event for event in cluster.events("j") if event["kind"] == "record"] == told
    assert store.walls(["2/8"]) == {"2/8": [12.5]}


@pytest.mark.parametrize("written", [{"status": "oom", "wall_s": 3.0}, {"status": "ok", "wall_s": 0},
                                     {"status": "ok"}, {"wall_s": 4.0}])
def test_only_a_measured_ok_run_counts_as_a_wall_time(tmp_path: Path, written: dict) -> None:
    cluster, finish = _dispatched(tmp_path)
    assert record_finished(cluster.jobs, finish, _record(**written)) is True
    assert cluster.jobs.store("j").walls(["2/8"]) == {} and cluster.jobs.store("j").recorded() == {"a"}


def test_a_stale_finish_frees_only_its_own_slots_and_counts_nothing(tmp_path: Path) -> None:
    cluster, finish = _dispatched(tmp_path)
    store = cluster.jobs.store("j")
    launch = store.running()["a"]
    store.give_up(launch)  # the sweep gave it up meanwhile
    cluster.slots.release(["n0.gpu1"], finish.gang_token)
    cluster.hold("n0.gpu1", "newer#1")  # and gave its slot to a newer launch
    events = cluster.events("j")
    late = _record(status="ok", wall_s=1.0)
    assert record_finished(cluster.jobs, finish, late) is False
    assert cluster.lease("n0.gpu0") is None and cluster.lease("n0.gpu1") == "newer#1"
    assert cluster.events("j") == events and store.walls(["2/8"]) == {}
    relaunched = replace(launch, attempt="current")
    store.update_running(relaunched)
    assert record_finished(cluster.jobs, finish, late) is False  # another attempt's
    assert store.running() == {"a": relaunched} and store.walls(["2/8"]) == {}


# ---------------------------------------------------------------- which record counts (fencing)


def test_only_the_running_attempt_holds_its_experiment(tmp_path: Path) -> None:
    cluster, finish = _dispatched(tmp_path)
    store = cluster.jobs.store("j")
    assert holds_experiment(store, finish) is True
    assert holds_experiment(store, replace(finish, attempt="older")) is False
    store.update_running(replace(store.running()["a"], attempt="newer"))  # relaunched after a lost lease
    assert holds_experiment(store, finish) is False


def test_a_launch_its_job_lost_track_of_is_adopted_once(tmp_path: Path) -> None:
    """Redis lost its data mid-launch and the job was submitted again: the launch is neither running,
    queued nor recorded, so its record answers its experiment, once."""
    cluster, finish = _dispatched(tmp_path)
    store = cluster.jobs.store("j")
    cluster.job_db.jobs["j"].running.clear()  # what Redis lost; the spec is back (submitted again)
    assert holds_experiment(store, finish) is True
    record = _record(status="ok", wall_s=2.0, metrics={"throughput": 3.0})
    assert record_and_read(cluster.jobs, finish, record) == (True, None)  # adopted: the step reads again
    assert store.recorded() == {"a"} and cluster.events("j")[-1] == {"kind": "record", "record": record.to_json()}
    assert store.walls(["2/8"]) == {}  # an adopted launch's wall time is not an estimate
    assert holds_experiment(store, finish) is False  # recorded now
    assert record_finished(cluster.jobs, finish, record) is False
    assert [event["kind"] for event in cluster.events("j")].count("record") == 1


@pytest.mark.parametrize("where", ["queued", "recorded", "no job"])
def test_a_lost_launch_is_not_adopted_where_the_job_went_on_without_it(tmp_path: Path, where: str) -> None:
    """Queued: a newer launch will run it; recorded: it has its answer; no job: nothing to answer."""
    cluster, finish = _dispatched(tmp_path)
    store = cluster.jobs.store("j")
    cluster.job_db.jobs["j"].running.clear()
    if where == "queued":
        cluster.enqueue(make_spec(tmp_path), exp("a", 2, 8, gpus=2))
    elif where == "recorded":
        store.mark_recorded("a")
    else:
        cluster.job_db.jobs["j"].spec = None
    events = cluster.events("j")
    assert holds_experiment(store, finish) is False
    assert record_finished(cluster.jobs, finish, _record(status="ok", wall_s=2.0)) is False
    assert cluster.events("j") == events and store.recorded() == ({"a"} if where == "recorded" else set())


# ---------------------------------------------------------------- a launch that found its GPU busy


def test_a_busy_gpus_launch_frees_its_slots_and_waits_again(tmp_path: Path) -> None:
    """Its slots are freed whether or not it still runs (token-checked: a newer lease stays); the
    requeue itself is `requeue_uncounted`'s (tests/unit/test_sweep_decisions.py)."""
    cluster, finish = _dispatched(tmp_path)
    store = cluster.jobs.store("j")
    busy = [{"slot": "n0.gpu1", "status": "gpu_busy", "device_foreign_bytes": 20 * GiB}]
    assert requeue_for_busy_gpu(cluster.slots, store, finish, busy) is True
    assert cluster.lease("n0.gpu0") is None and cluster.lease("n0.gpu1") is None
    assert store.running_names() == set() and store.queued_names() == {"a"} and store.attempts_of("a") == 0
    cluster.hold("n0.gpu0", "newer#1")
    assert requeue_for_busy_gpu(cluster.slots, store, finish, busy) is False  # stale: queued already
    assert cluster.lease("n0.gpu0") == "newer#1" and store.queued_names() == {"a"}
