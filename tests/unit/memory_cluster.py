"""A cluster in memory for whole dispatch passes without a redis-server: the slots' store and the
active jobs' store as their in-memory twins (`workers.state.memory_store`,
`scheduler.cluster.memory_store`), a recorder in place of the message layer, and readers of the
twins' state as the Redis tests read raw keys.

The twins keep the Redis stores' contract (tests/redis/test_slot_store_contract.py,
test_job_store_contract.py, test_active_jobs_contract.py), so a pass decided here decides the same
over Redis; what only Redis has (Lua, a pass's round trips, the cluster lock) stays in
tests/redis/test_dispatch.py.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from scheduler.cluster.backfill import POLICIES, Policy
from scheduler.cluster.dispatch import dispatch_in
from scheduler.cluster.jobs import JobSpec
from scheduler.cluster.launches import QueuedLaunch, RunningLaunch
from scheduler.cluster.memory_store import InMemoryActiveJobs, MemoryJobs
from scheduler.search.space import Experiment
from workers.device.slot import Slot
from workers.state.memory_store import InMemorySlotStore, MemorySlots

GiB = 2**30
SLOT_CLOCK = 1000.0  #: the slots' store's clock: a lease taken in a pass lapses at SLOT_CLOCK + its lease


def make_slot(node: str, device: int, kind: str = "cpu", memory: int = GiB, address: str = "10.0.0.1",
              cuda_index: int = -1, host: str = "") -> Slot:
    return Slot(node, device, kind, memory, address, 1, (device,), worker=f"gpu{device}@{node}",
                instance=f"inst-{node}-{device}", cuda_index=cuda_index, host=host,
                gpu_uuid=f"GPU-{node}-{cuda_index}" if kind == "cuda" else "")


def exp(name: str, stage: int = 0, mbs: int = 1, nodes: int = 1, gpus: int = 1, memory: int = 0,
        metric_file: str = "metrics.json") -> dict:
    return Experiment(name, stage, mbs, 1, {"train_micro_batch_size_per_gpu": mbs, "zero_optimization": {"stage": stage}},
                      num_nodes=nodes, num_gpus=gpus, min_memory=memory, metric_file=metric_file).to_json()


def make_spec(tmp_path: Path, job: str = "j", **overrides) -> JobSpec:
    fields = {"results_root": str(tmp_path / job), "cwd": str(tmp_path), "timeout_s": 100.0, "experiments": [],
              "lease_s": 30.0, "lost_grace_s": 20.0, "max_attempts": 2, **overrides}
    return JobSpec(job=job, **fields)


class Recorder:
    """The message layer (`scheduler.cluster.work.Work`) as dispatch uses it: each launch is kept, with
    the names its job had running when it was sent (a launch is recorded before it is sent)."""

    def __init__(self, jobs: InMemoryActiveJobs) -> None:
        self.jobs = jobs
        self.launched: list[tuple[list[Any], Any, int, str]] = []
        self.running_at_send: list[set[str]] = []

    def launch(self, ranks: list[Any], finish: Any, time_limit_s: int, shown: str) -> None:
        self.launched.append((ranks, finish, time_limit_s, shown))
        self.running_at_send.append(self.jobs.store(finish.job).running_names())


class Cluster:
    """The stores of one cluster in memory, and the steps the Redis tests take on raw keys."""

    def __init__(self, slot_store: type[InMemorySlotStore] = InMemorySlotStore) -> None:
        self.slot_db = MemorySlots(lambda: SLOT_CLOCK)
        self.slots = slot_store(self.slot_db)
        self.job_db = MemoryJobs()
        self.jobs = InMemoryActiveJobs(self.job_db, self.slots)
        self.work = Recorder(self.jobs)

    def register(self, *slots: Slot) -> list[Slot]:
        for slot in slots:
            self.slots.announce_slot(slot)  # as a slot's heartbeat writes it (indexed)
        return list(slots)

    def hold(self, queue: str, token: str) -> None:
        """A lease taken by someone else, with no lapse (Redis: a gang key set without a TTL)."""
        self.slot_db.leases.set(queue, token)

    def submit(self, spec: JobSpec, launched_before: bool = False) -> None:
        self.jobs.store(spec.job).activate(spec.to_json(), launched_before)

    def enqueue(self, spec: JobSpec, *exps: dict) -> list[QueuedLaunch]:
        first = self.job_db.reserve_seqs(len(exps))
        launches = [QueuedLaunch(first + i, e, ["train.py", "--flag", e["name"]]) for i, e in enumerate(exps)]
        self.jobs.store(spec.job).queue(launches)
        return launches

    def active(self, spec: JobSpec, *exps: dict) -> list[QueuedLaunch]:
        self.submit(spec)
        return self.enqueue(spec, *exps)

    def dispatch(self, policies: Mapping[str, Policy] = POLICIES) -> None:
        dispatch_in(self.slots, self.jobs, self.work, policies)

    def started(self) -> list[tuple[str, list[str]]]:
        return [(finish.name, finish.slots) for _, finish, _, _ in self.work.launched]

    def running(self, job: str) -> dict[str, RunningLaunch]:
        return self.jobs.store(job).running()

    def state(self, job: str) -> dict[str, str]:
        return self.jobs.store(job).shown()

    def events(self, job: str) -> list[dict]:
        """The job's events, left in place (Redis: LRANGE)."""
        found = self.job_db.jobs.get(job)
        return [json.loads(raw) for raw in found.events] if found else []

    def lease(self, queue: str) -> str | None:
        return self.slot_db.leases.get(queue)

    def lapses_at(self, queue: str) -> float | None:
        return self.slot_db.leases.values[queue][1]
