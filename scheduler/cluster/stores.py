"""The job store's interface: every operation the control path performs on one job's state.

Why an interface: the decisions of the control path (a misfit's grace, a lost launch's retry or
give-up, which finished launch counts, a launch queued again for a busy GPU, when busy slots free)
read and write a job's state, and they are tested without a redis-server through the in-memory twin
(`scheduler.cluster.memory_store.InMemoryJobStore`); the Redis store (`scheduler.cluster.job_store.JobStore`)
keeps the same contract, checked against both by tests/redis/test_job_store_contract.py. The slots'
state (registrations, leases, health) has its own store beside this one, `workers.state.store.BaseSlotStore`.
What a dispatch pass reads and writes across every active job at once is `BaseActiveJobs`, with the
Redis `scheduler.cluster.dispatch_reads.RedisActiveJobs` and the twin
`scheduler.cluster.memory_store.InMemoryActiveJobs`.

What each implementation promises is written once, on the methods below. Every method is atomic: no
other reader sees half of it (Redis: one command, a MULTI transaction or one Lua script; in memory:
one uninterrupted call). What only Redis has (pipelines shared across jobs and with the gang
leases, blocking pops) stays on `JobStore`, as optional `pipe` arguments and its `*_in` methods.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple, Protocol

from scheduler.cluster.launches import FinishSpec, QueuedLaunch, RunningLaunch


class StepReads(NamedTuple):
    """What a job step reads before its search (`BaseJobStore.step_reads`)."""

    spec: bytes | None  #: the job's spec (JSON); None: the job is not active
    recorded: set[str]  #: `BaseJobStore.recorded`
    attempts: dict[str, int]  #: `BaseJobStore.attempts`
    order: float | None  #: `BaseJobStore.order`
    queued: set[str]  #: `BaseJobStore.queued_names`
    running: set[str]  #: `BaseJobStore.running_names`


class Heads(NamedTuple):
    """What a dispatch pass reads of one job's queue (`BaseActiveJobs.heads`)."""

    launches: list[QueuedLaunch]  #: the waiting launches that can matter, in submission order
    depth: int  #: how many wait in all
    running: set[str]  #: the names of its running launches


class BaseJobStore(Protocol):
    """One job's state: spec, events, queue, running launches, attempts, wall times, recorded names
    and the state `--status` shows."""

    job: str

    # ------------------------------------------------------------ the job itself

    def spec_json(self) -> bytes | None:
        """The stored spec; None: the job is not active."""

    def order(self) -> float | None:
        """The job's submission number among the active jobs; None: not active."""

    def activate(self, spec_json: str, launched_before: bool = False) -> None:
        """Forget the job's earlier life (queue, running, recorded, walls, state, attempts, events),
        store the spec and take the next submission number; `launched_before`: counted as launched
        (`misfit_since`) and `settling` for `job_store.RESUME_SETTLE_S`."""

    def end(self, event: dict[str, Any]) -> None:
        """Push the last event and forget the job (every key but the events and the attempts)."""

    # ------------------------------------------------------------ events for the submitter

    def publish(self, event: dict[str, Any]) -> None:
        """Append an event; events are kept `job_store.EVENTS_TTL_S` after the last one."""

    def next_event(self, timeout_s: float) -> dict[str, Any] | None:
        """Pop the oldest event, waiting up to `timeout_s` for one; None: none came."""

    def vanished(self) -> bool:
        """No spec and no pending event."""

    # ------------------------------------------------------------ the queue

    def queue(self, launches: Iterable[QueuedLaunch]) -> None:
        """Queue launches, replacing those of the same name."""

    def unqueue(self, launch: QueuedLaunch) -> None:
        """Take a launch out of the queue."""

    def queued_names(self) -> set[str]:
        """The names waiting."""

    def queued(self, names: list[str]) -> list[QueuedLaunch]:
        """The waiting launches among `names`, in the order asked."""

    def depth(self) -> int:
        """How many launches wait."""

    # ------------------------------------------------------------ running launches

    def running(self) -> dict[str, RunningLaunch]:
        """Every running launch by name."""

    def running_of(self, names: list[str]) -> dict[str, RunningLaunch]:
        """The running launches among `names`."""

    def running_names(self) -> set[str]:
        """The names running."""

    def update_running(self, launch: RunningLaunch) -> None:
        """Store (or rewrite) a running launch."""

    def next_exp_id(self) -> int:
        """The next DeepSpeed exp_id of the job (1, 2, ...; shared with `start`)."""

    def start(self, queued: QueuedLaunch, launch: RunningLaunch) -> int:
        """Count an attempt of the name, move the launch from the queue to running and mark the job
        dispatched; returns its exp_id (`next_exp_id`)."""

    def finish(self, name: str, attempt: str) -> RunningLaunch | None:
        """Close the running launch `attempt` of `name` and mark the name recorded; None, changing
        nothing, when that attempt is not the running one."""

    def mark_recorded(self, name: str) -> None:
        """`name` has its record on disk."""

    def add_wall(self, shape: str, seconds: float) -> None:
        """One more finished launch's wall time for `shape`."""

    def recorded_event(self, event: dict[str, Any] | None, wall: tuple[str, float] | None = None) -> None:
        """`add_wall(*wall)` when given, then `publish(event)` when given."""

    def requeue(self, launch: RunningLaunch, counted: bool = True) -> None:
        """A running launch waits again at its old place; `counted=False` takes back its attempt."""

    def give_up(self, launch: RunningLaunch) -> None:
        """A launch out of attempts: no longer running, its name recorded."""

    def step_reads(self) -> StepReads:
        """What a job step reads before its search."""

    def announce_phases(self, phases: list[str], current: str | None = None) -> list[bool]:
        """`announce` of each phase, then `set_phase(current)` when given."""

    def attempts(self) -> dict[str, int]:
        """Launches counted per name (kept `job_store.ATTEMPTS_TTL_S` after the last start)."""

    def attempts_of(self, name: str) -> int:
        """`attempts()` of one name, 0 when none."""

    def recorded(self) -> set[str]:
        """The names recorded during this job."""

    def walls(self, shapes: list[str]) -> dict[str, list[float]]:
        """shape -> wall times, for the asked shapes that have any."""

    # ------------------------------------------------------------ state for --status and refusals

    def announce(self, phase: str) -> bool:
        """True the first time the job reaches `phase`."""

    def set_phase(self, phase: str) -> None:
        """The phase `--status` shows."""

    def misfit_since(self, now: float) -> tuple[float, bool]:
        """(since when the job's shape has not fit: `now` unless already set, whether it ever launched)."""

    def settling(self) -> bool:
        """Whether `activate(..., launched_before=True)` was less than RESUME_SETTLE_S ago."""

    def clear_misfit(self) -> None:
        """Forget `misfit_since`."""

    def show(self, fields: dict[str, Any]) -> None:
        """Fields `--status` shows (values kept as their str)."""

    def shown(self) -> dict[str, str]:
        """The job's state fields: what `show`, `set_phase`, `announce`, `start` and the misfit clock wrote."""


class BaseActiveJobs(Protocol):
    """Every active job at once: what a dispatch pass reads and writes across jobs, each in one
    round trip over Redis (`scheduler.cluster.dispatch_reads`), each job's own store, and the close of
    a finished launch with its slots (`scheduler.cluster.finish`)."""

    def store(self, job: str) -> BaseJobStore:
        """The job's store."""

    def active_spec_jsons(self) -> list[bytes]:
        """The active jobs' specs (JSON), in submission order."""

    def heads(self, jobs: list[str], free_slots: int) -> dict[str, Heads]:
        """Per job: the waiting launches that can matter to a pass with `free_slots` free slots (of
        each shape, the first `free_slots // slots per launch + 1` by submission order), in
        submission order; its queue's depth; its running names."""

    def running_by_job(self, jobs: list[str]) -> dict[str, list[RunningLaunch]]:
        """Each job's running launches."""

    def walls_by_job(self, shapes: dict[str, list[str]]) -> dict[str, dict[str, list[float]]]:
        """job -> shape -> wall times, for the asked shapes that have any (a job asking none: absent)."""

    def show_all(self, shown: dict[str, dict[str, Any]], misfits_cleared: Iterable[str] = ()) -> None:
        """`clear_misfit` of each job in `misfits_cleared`, then `show` of each job's fields."""

    def lease_owners(self, queues: list[str]) -> list[tuple[str, RunningLaunch | None]]:
        """The owners ("job/experiment", named at `BaseSlotStore.reserve`) of the leases on `queues`,
        once each in the order of `queues`, each with its job's running launch of that name (None:
        none, or an owner that names no job)."""

    def start_beside(self, job: str, queued: QueuedLaunch, launch: RunningLaunch,
                     beside: list[tuple[str, RunningLaunch]]) -> int:
        """`update_running` of each (job, launch) in `beside`, then `store(job).start(queued, launch)`,
        as one atomic step; returns the exp_id."""

    def finish_launch(self, finish: FinishSpec, event: dict[str, Any],
                      wall: tuple[str, float] | None) -> StepReads | None:
        """Free `finish`'s slots (`BaseSlotStore.release`, token-checked), then `store(finish.job).finish`
        of its attempt and, only when that closed it, `recorded_event(event, wall)`; returns the job's
        `step_reads` after them, or None when that attempt was not the running one (its slots freed all
        the same). One round trip over Redis: between a rank's end and the next experiment's start."""
