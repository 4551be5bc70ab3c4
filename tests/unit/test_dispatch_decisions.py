"""Dispatch's decisions over the in-memory job store (`scheduler.cluster.memory_store`), with no
redis-server: a shape's refusal and its grace periods (`dispatch._fits_or_refused`, `dispatch.refusal`)
and when busy slots free (`dispatch._estimated_frees_at`).

tests/redis/test_job_store_contract.py runs the store's contract against the twin and Redis alike;
whole dispatch passes (the slot registry, the gang leases' Lua, a pass's round trips) stay in
tests/redis/test_dispatch.py. Every expectation is worked out by hand.
"""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from scheduler.cluster import dispatch as dispatch_module
from scheduler.cluster.dispatch import HELD_GRACE_S, REFUSE_GRACE_S, _estimated_frees_at, _fits_or_refused, refusal
from scheduler.cluster.jobs import JobSpec
from scheduler.cluster.launches import QueuedLaunch, RunningLaunch
from scheduler.cluster.memory_store import InMemoryJobStore, MemoryJobs
from scheduler.search.space import Experiment
from workers.device.slot import Slot

GiB = 2**30
LEASE = 30.0


def make_slot(node: str, device: int, kind: str = "cpu", memory: int = GiB, address: str = "10.0.0.1") -> Slot:
    return Slot(node, device, kind, memory, address, 1, (device,), worker=f"gpu{device}@{node}",
                instance=f"inst-{node}-{device}")


def exp(name: str, stage: int = 0, mbs: int = 1, nodes: int = 1, gpus: int = 1, memory: int = 0) -> dict:
    return Experiment(name, stage, mbs, 1, {"train_micro_batch_size_per_gpu": mbs, "zero_optimization": {"stage": stage}},
                      num_nodes=nodes, num_gpus=gpus, min_memory=memory, metric_file="metrics.json").to_json()


def make_spec(tmp_path: Path, job: str = "j", **overrides) -> JobSpec:
    fields = {"results_root": str(tmp_path / job), "cwd": str(tmp_path), "timeout_s": 100.0, "experiments": [],
              "lease_s": LEASE, "lost_grace_s": 20.0, "max_attempts": 2, **overrides}
    return JobSpec(job=job, **fields)


def events(store: InMemoryJobStore) -> list[dict]:
    return list(iter(lambda: store.next_event(0), None))


# ---------------------------------------------------------------- shapes the cluster cannot run

NOW = 5000.04


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dispatch's clock, fixed at NOW."""
    monkeypatch.setattr(dispatch_module, "time", SimpleNamespace(time=lambda: NOW))


def _job(tmp_path: Path, *exps: dict, job: str = "j", launched: bool = False, **overrides) -> tuple:
    """An active job with `exps` queued; `launched`: counted as a job that has launched."""
    spec = make_spec(tmp_path, job, **overrides)
    store = MemoryJobs().store(job)
    store.activate(spec.to_json(), launched_before=launched)
    launches = [QueuedLaunch(seq, e, ["t.py"]) for seq, e in enumerate(exps, 1)]
    store.queue(launches)
    return spec, store, launches


def _misfit_since(store: InMemoryJobStore, since: float) -> None:
    store.clear_misfit()
    store.misfit_since(since)


def decide(store: InMemoryJobStore, spec: JobSpec, launch: QueuedLaunch, slots: list[Slot],
           sick: dict | None = None, cleared: dict | None = None) -> bool:
    return _fits_or_refused(store, spec, launch, slots, {}, {} if cleared is None else cleared, sick or {})


def test_a_job_that_launched_gets_a_grace_period(tmp_path: Path, clock: None) -> None:
    slots = [make_slot("n0", 0)]
    spec, store, (wide, wider) = _job(tmp_path, exp("wide", gpus=2), exp("wider", gpus=3), launched=True)
    assert decide(store, spec, wide, slots) is False and decide(store, spec, wider, slots) is False
    assert store.shown()["misfit_since"] == str(NOW) and events(store) == []
    _misfit_since(store, NOW - REFUSE_GRACE_S + 30)
    assert decide(store, spec, wide, slots) is False
    assert events(store) == [] and store.spec_json() is not None
    _misfit_since(store, NOW - REFUSE_GRACE_S - 1)
    assert decide(store, spec, wide, slots) is False
    [failed] = events(store)
    assert failed["kind"] == "failed" and failed["usage"] is True and store.spec_json() is None
    assert failed["error"].startswith("wide needs 1 node(s) x 2 slot(s)")


def test_a_job_that_never_launched_is_refused_at_once(tmp_path: Path, clock: None) -> None:
    spec, store, (fits, wide) = _job(tmp_path, exp("fits"), exp("wide", gpus=3))
    slots = [make_slot("n0", 0), make_slot("n0", 1)]
    assert decide(store, spec, fits, slots) is True and events(store) == []
    assert decide(store, spec, wide, slots) is False and store.spec_json() is None
    assert events(store) == [{"kind": "failed", "usage": True, "error": (
        "wide needs 1 node(s) x 3 slot(s) but the cluster has 1 node(s) with at most 2 slot(s) each; "
        "use --num_nodes 1 --num_gpus 2 or fewer")}]


def test_a_kind_the_cluster_lacks_is_refused_with_the_kinds_it_has(tmp_path: Path, clock: None) -> None:
    slots = [make_slot("n0", 0), make_slot("n0", 1)]
    spec, store, [a] = _job(tmp_path, exp("a"), slot_kind="cuda")
    big_spec, big, [b] = _job(tmp_path, exp("b", memory=2 * GiB), job="big")
    assert decide(store, spec, a, slots) is False and decide(big, big_spec, b, slots) is False
    assert events(store) == [{"kind": "failed", "usage": True, "error":
                              "a was sized for CUDA slots but the cluster has only CPU slots; start CUDA slot "
                              "workers or run the command again to size the search for these"}]
    assert events(big) == [{"kind": "failed", "usage": True, "error":
                            "b needs slots with 2.0 GiB but the largest slot has 1.0 GiB; ask for at most "
                            "that (--min-slot-memory)"}]
    assert store.spec_json() is None and big.spec_json() is None


def test_a_shape_its_pool_cannot_hold_is_refused_naming_the_pool(tmp_path: Path, clock: None) -> None:
    spec, store, [a] = _job(tmp_path, exp("a", gpus=2), allowed=["n0.gpu1"])
    assert decide(store, spec, a, [make_slot("n0", 0), make_slot("n0", 1)]) is False
    assert events(store) == [{"kind": "failed", "usage": True, "error":
                              "within the job's resource pool (n0.gpu1): a needs 1 node(s) x 2 slot(s) but the "
                              "cluster has 1 node(s) with at most 1 slot(s) each; use --num_nodes 1 --num_gpus 1 "
                              "or fewer"}]


def test_a_shape_only_slots_out_of_tuning_could_run_waits_while_anything_runs(tmp_path: Path, clock: None) -> None:
    """A job that never launched is not refused for slots out of tuning: it waits HELD_GRACE_S, and
    past it stops only when none of its experiments runs."""
    slots = [make_slot("n0", 0, "cuda", 80 * GiB), make_slot("n0", 1, "cuda", 80 * GiB)]
    sick = {"n0.gpu1": {"used_bytes": 20 * GiB}}
    spec, store, (pair, one) = _job(tmp_path, exp("pair", gpus=2), exp("one"))
    assert decide(store, spec, one, slots, sick) is True  # fits beside the sick slot
    assert decide(store, spec, pair, slots, sick) is False and events(store) == []
    _misfit_since(store, NOW - HELD_GRACE_S - 1)
    running = RunningLaunch(2, one.exp, one.argv, "att", ["n0.gpu0"], "tok", {"n0.gpu0": "t"}, NOW, NOW + 100)
    store.start(one, running)
    assert decide(store, spec, pair, slots, sick) is False and events(store) == [] and store.spec_json() is not None
    store.finish("one", "att")
    assert decide(store, spec, pair, slots, sick) is False and store.spec_json() is None
    [failed] = events(store)
    assert failed["error"].startswith("pair needs 1 node(s) x 2 slot(s), which for 10 minutes only slots out of "
                                      "tuning could give: n0.gpu1 (20.0 GiB used by other processes)")


def test_a_fit_clears_the_misfit_before_a_later_misfit_of_the_same_pass(tmp_path: Path, clock: None) -> None:
    """A fitting launch marks its job's misfit cleared (written with the states at the pass's end); a
    misfit later in the same pass clears it at once and starts its clock afresh."""
    spec, store, (fits, wide) = _job(tmp_path, exp("fits"), exp("wide", gpus=2), launched=True)
    _misfit_since(store, 5.0)
    cleared: dict[str, bool] = {}
    assert decide(store, spec, fits, [make_slot("n0", 0)], cleared=cleared) is True
    assert cleared == {"j": True} and store.shown()["misfit_since"] == "5.0"
    assert decide(store, spec, wide, [make_slot("n0", 0)], cleared=cleared) is False
    assert cleared == {"j": False} and store.shown()["misfit_since"] == str(NOW) and events(store) == []


def test_refusal_messages() -> None:
    cpu = [make_slot("n0", 0, memory=2 * GiB), make_slot("n0", 1, memory=GiB), make_slot("n1", 0, memory=GiB)]
    big_gpu = make_slot("g", 0, "cuda", memory=80 * GiB)
    assert refusal(exp("e"), []) == ("no live slot workers: start them with `celery -A tasks worker -Q gpu0 "
                                     "-n gpu0@%h` (one per device)")
    assert refusal(exp("e"), cpu, "cuda") == (
        "e was sized for CUDA slots but the cluster has only CPU slots; start CUDA slot workers or run the "
        "command again to size the search for these")
    assert refusal(exp("e"), [*cpu, big_gpu, make_slot("h", 0, "other")], "rocm").endswith(
        "cluster has only CPU, CUDA, OTHER slots; start ROCM slot workers or run the command again to size "
        "the search for these")
    assert refusal(exp("e", memory=3 * GiB), [*cpu, big_gpu], "cpu") == (
        "e needs slots with 3.0 GiB but the largest slot has 2.0 GiB; ask for at most that (--min-slot-memory)")
    assert refusal(exp("e", nodes=2, memory=3 * GiB), [*cpu, big_gpu]) == (
        "e needs 2 node(s) x 1 slot(s) but the cluster has 1 node(s) with at most 1 slot(s) each of 3.0 GiB; "
        "use --num_nodes 1 --num_gpus 1 or fewer")
    assert refusal(exp("e", nodes=3, gpus=2, memory=GiB), cpu, "cpu") == (
        "e needs 3 node(s) x 2 slot(s) but the cluster has 2 node(s) with at most 2 slot(s) each of 1.0 GiB; "
        "use --num_nodes 2 --num_gpus 2 or fewer")
    assert refusal(exp("e", nodes=2, gpus=3), cpu) == (
        "e needs 2 node(s) x 3 slot(s) but the cluster has 2 node(s) with at most 2 slot(s) each; "
        "use --num_nodes 2 --num_gpus 2 or fewer")


def test_refusal_names_loopback_nodes_of_a_multi_node_shape() -> None:
    slots = [make_slot("b", 0, address="127.0.0.1"), make_slot("a", 0, address="localhost"),
             make_slot("a", 1, address="localhost"), make_slot("c", 0), make_slot("d", 0, memory=GiB // 2)]
    assert refusal(exp("e", nodes=2), slots) == (
        "e spans 2 nodes but node(s) a, b advertise a loopback address their peers cannot reach (they reach Redis "
        "over loopback); start their workers with AUTOTUNE_ADDRESS=<an address the other nodes reach>")
    assert refusal(exp("e", nodes=3, memory=GiB), slots).startswith("e spans 3 nodes but node(s) a, b")
    # too few nodes of the memory asked for: the shape, not the addresses, is the reason
    assert refusal(exp("e", nodes=4, memory=GiB), slots).startswith("e needs 4 node(s) x 1 slot(s) but the cluster has 3")
    assert refusal(exp("e", nodes=1, gpus=3), slots).startswith("e needs 1 node(s) x 3 slot(s)")
    routable = [make_slot("c", 0), make_slot("c", 1)]
    assert refusal(exp("e", nodes=2), routable).startswith("e needs 2 node(s) x 1 slot(s) but the cluster has 1 node(s)")


# ---------------------------------------------------------------- when busy slots free


def test_estimated_frees_at(tmp_path: Path) -> None:
    """A running launch frees its slots at its start plus the mean wall time of its shape (never
    above the time limit), or at start + time limit; a slot held by anyone else: never known."""
    spec = make_spec(tmp_path, timeout_s=100.0)
    store = MemoryJobs().store("j")

    def run(name: str, stage: int, mbs: int, queues: list[str], started: float) -> None:
        store.update_running(RunningLaunch(1, exp(name, stage, mbs), ["t.py"], "att", queues, "tok",
                                           {q: "t" for q in queues}, started, started + 200))
    run("measured", 1, 2, ["n0.gpu0", "n0.gpu5"], 1000.0)
    run("unmeasured", 2, 4, ["n0.gpu1"], 2000.0)
    run("slow", 3, 8, ["n0.gpu2"], 3000.0)
    store.add_wall("1/2", 10.0)
    store.add_wall("1/2", 20.0)
    store.add_wall("3/8", 500.0)
    store.add_wall("2/2", 1.0)  # another shape's walls do not count
    busy = {"n0.gpu0", "n0.gpu1", "n0.gpu2", "x.gpu9"}
    running, walls = {"j": list(store.running().values())}, {"j": store.walls(["1/2", "2/2", "2/4", "3/8"])}
    assert _estimated_frees_at({"j": spec}, running, walls, busy, []) == {
        "n0.gpu0": 1015.0, "n0.gpu1": 2100.0, "n0.gpu2": 3100.0, "x.gpu9": float("inf")}
    assert _estimated_frees_at({}, {}, {}, {"n0.gpu0"}, []) == {"n0.gpu0": float("inf")}


def test_an_exclusive_launch_holds_every_slot_of_its_nodes_until_its_end(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, timeout_s=100.0)
    store = MemoryJobs().store("j")
    store.update_running(RunningLaunch(1, {**exp("fin"), "exclusive": True}, ["t.py"], "att", ["n1.gpu0"], "tok",
                                       {"n1.gpu0": "t"}, 1000.0, 1200.0))
    slots = [make_slot("n0", 0), make_slot("n1", 0), make_slot("n1", 1)]
    assert _estimated_frees_at({"j": spec}, {"j": list(store.running().values())}, {"j": {}}, {"n1.gpu0"}, slots) == {
        "n1.gpu0": 1100.0, "n1.gpu1": 1100.0}
