"""Decisions over the slots' state, on the in-memory twins of both stores (`workers.state.memory_store`,
`scheduler.cluster.memory_store`) with one clock, no redis-server: a whole sweep pass
(`sweep.sweep_jobs`) as registrations lapse, slots are withdrawn and leases lapse or are kept the way
the slot workers keep them, and what `--status` shows of the slots (`status.collect_from`).

tests/redis/test_slot_store_contract.py holds the slot twin to the Redis store's contract (TTLs,
index and epoch, lease renewals); tests/unit/test_sweep_decisions.py holds `_why_lost`'s answers one
by one. Every expectation is worked out by hand.
"""
from __future__ import annotations

from pathlib import Path

from scheduler.cluster.jobs import JobSpec
from scheduler.cluster.launches import RunningLaunch
from scheduler.cluster.memory_store import MemoryJobs
from scheduler.search.space import Experiment
from scheduler.cluster.sweep import SLOT_GONE_S, sweep_jobs
from scheduler.status import collect_from
from workers.device.slot import Slot
from workers.state.memory_store import InMemorySlotStore, MemorySlots
from workers.state.registry import HEARTBEAT_S, TTL_S

START, LEASE = 1000.0, 30.0
QUEUES = ["n0.gpu0", "n0.gpu1"]


class Clock:
    def __init__(self) -> None:
        self.now = START

    def __call__(self) -> float:
        return self.now


class Reported:
    """The message layer as the sweep uses it: revokes kept, and which rank tasks have reported."""

    def __init__(self) -> None:
        self.reported: set[str] = set()
        self.revoked: list[str] = []

    def finished(self, task_id: str) -> bool:
        return task_id in self.reported

    def revoke(self, task_ids: list[str]) -> None:
        self.revoked.extend(task_ids)


def make_slot(device: int, instance: str = "") -> Slot:
    return Slot("n0", device, "cuda", 8 * 2**30, "10.0.0.1", 1, (device,), worker=f"gpu{device}@n0",
                instance=instance or f"i{device}", cuda_index=device)


class Cluster:
    """One job's launch on n0.gpu0 + n0.gpu1 over both twins, and the slot workers' beats."""

    def __init__(self, tmp_path: Path, max_attempts: int = 2) -> None:
        self.clock = Clock()
        self.slots = InMemorySlotStore(MemorySlots(self.clock))
        self.jobs = MemoryJobs(self.clock)
        self.work = Reported()
        self.spec = JobSpec(job="j", results_root=str(tmp_path / "j"), cwd=str(tmp_path), timeout_s=100.0,
                            experiments=[], lease_s=LEASE, lost_grace_s=20.0, max_attempts=max_attempts)
        self.store = self.jobs.store("j")
        self.store.activate(self.spec.to_json())
        self.beating = {0, 1}  #: the slots whose workers still announce them
        self.renewing: set[int] = set()  #: the slots whose ranks still renew their leases
        self.beat()
        token = self.slots.reserve(QUEUES, LEASE, owner="j/a")
        assert token is not None
        exp = Experiment("a", 0, 1, 1, {"train_micro_batch_size_per_gpu": 1}, num_nodes=1, num_gpus=2).to_json()
        self.renewing = {0, 1}
        self.launch = RunningLaunch(seq=1, exp=exp, argv=["t.py"], attempt="att",
                                    queues=QUEUES, token=token, rank_tasks={"n0.gpu0": "t0", "n0.gpu1": "t1"},
                                    started=START, deadline=START + 200,
                                    instances={"n0.gpu0": "i0", "n0.gpu1": "i1"})
        self.store.start(self.launch.queued(), self.launch)

    def beat(self) -> None:
        for device in sorted(self.beating):
            self.slots.announce_slot(make_slot(device), TTL_S)
        for device in sorted(self.renewing):
            self.slots.keep(f"n0.gpu{device}", self.launch.token, LEASE)

    def run_for(self, seconds: float) -> None:
        """Time passes, the live workers and ranks beating every `HEARTBEAT_S`."""
        end = self.clock.now + seconds
        while self.clock.now + HEARTBEAT_S <= end:
            self.clock.now += HEARTBEAT_S
            self.beat()
        self.clock.now = end

    def stop(self, launch: RunningLaunch) -> None:
        """`jobs.stop_launch` on the twins: revoke the ranks, free the slots, token-checked."""
        self.work.revoke(list(launch.rank_tasks.values()))
        self.slots.release(launch.queues, launch.token)

    def sweep(self) -> set[str]:
        return sweep_jobs(self.slots, [self.spec], self.jobs.store, self.work, self.stop, self.clock.now)

    def record(self) -> dict:
        events = list(iter(lambda: self.store.next_event(0), None))
        assert [event["kind"] for event in events] == ["record"]
        return events[0]["record"]


def test_a_healthy_launch_stays_through_many_sweeps(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path)
    for _ in range(5):
        cluster.run_for(2 * LEASE / 5)
        assert cluster.sweep() == set()
    assert cluster.store.running_names() == {"a"} and cluster.work.revoked == []
    assert cluster.slots.holds(QUEUES, cluster.launch.token)


def test_a_withdrawn_slot_loses_its_launch_at_the_next_sweep(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path)
    cluster.run_for(5.0)
    cluster.beating.discard(1)
    cluster.slots.unregister("n0.gpu1", why="its consumer stopped taking messages")
    assert cluster.sweep() == set()  # queued again: the job has work, nothing to step
    assert cluster.store.running_names() == set() and cluster.store.queued_names() == {"a"}
    assert cluster.work.revoked == ["t0", "t1"] and cluster.slots.held(QUEUES) == set()


def test_a_slot_that_stops_beating_loses_its_launch_once_gone_for_good(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path, max_attempts=1)
    cluster.run_for(5.0)
    cluster.beating.discard(1)  # its node is gone: no registration, no renewal
    cluster.renewing.discard(1)
    cluster.run_for(TTL_S)  # its registration lapsed: seen gone, not yet lost (a blip)
    assert cluster.sweep() == set() and cluster.store.running()["a"].missing_since == cluster.clock.now
    cluster.run_for(SLOT_GONE_S)
    assert cluster.sweep() == set() and cluster.store.running_names() == {"a"}
    cluster.run_for(1.0)
    assert cluster.sweep() == {"j"}  # out of attempts: recorded lost, the job's step is due
    record = cluster.record()
    assert record["status"] == "lost" and record["slots"] == QUEUES
    assert record["cause"]["error"] == "the worker of n0.gpu1 stopped sending heartbeats; gave up after 1 attempts"
    assert (tmp_path / "j" / "a" / "result.json").is_file() and cluster.slots.held(QUEUES) == set()


def test_a_lease_that_lapses_under_a_silent_rank_loses_the_launch(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path, max_attempts=1)
    cluster.renewing.discard(1)  # its rank hangs: its worker still beats, the lease is not renewed
    cluster.run_for(LEASE - 1.0)
    assert cluster.sweep() == set()
    cluster.run_for(2.0)
    assert not cluster.slots.holds(["n0.gpu1"], cluster.launch.token)
    assert cluster.sweep() == {"j"}
    assert cluster.record()["cause"]["error"].startswith("the lease of n0.gpu0, n0.gpu1 expired")


def test_a_reported_rank_may_let_its_lease_lapse(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path)
    cluster.work.reported.add("t1")  # rank 1 reported and stopped renewing; rank 0 still runs
    cluster.renewing.discard(1)
    cluster.run_for(LEASE + 5.0)
    assert cluster.sweep() == set() and cluster.store.running_names() == {"a"}
    cluster.renewing.discard(0)  # now rank 0 stops renewing without reporting
    cluster.run_for(LEASE + 1.0)
    assert cluster.sweep() == set() and cluster.store.queued_names() == {"a"}  # lost: queued again


def test_a_job_with_nothing_running_or_queued_is_due(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path)
    assert cluster.store.finish("a", "att") is not None
    assert cluster.sweep() == {"j"} and cluster.work.revoked == []


def test_status_shows_who_holds_each_slot_and_which_are_out_of_tuning(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path)
    cluster.beating.add(2)
    cluster.beat()
    cluster.slots.mark_unhealthy("n0.gpu2", 3 * 2**30, "others' memory")
    shown = collect_from(cluster.slots, [{"job": "j", "phase": "p"}])
    assert [(s["queue"], s["held_by"], s["unhealthy"]) for s in shown["slots"]] == [
        ("n0.gpu0", "j/a", ""), ("n0.gpu1", "j/a", ""),
        ("n0.gpu2", "", "n0.gpu2 (3.0 GiB used by other processes)")]
    assert shown["jobs"] == [{"job": "j", "phase": "p"}]
