"""What a running tuning job is doing, as the submitter sees it.

Why: a search takes minutes to hours, and a line per finished experiment says nothing about what is
running now, what waits, which slots are idle or when it may end. In a terminal this draws a live
panel under the experiment lines (rich's Live): per phase how many experiments are done, running and
queued, the best so far, busy slots, elapsed time and an estimate for the current phase. When stdout
is not a terminal (a log, CI, a pipe) it prints only the plain lines, never cursor movements.

The panel reads the job's running launches and queue depth from Redis at most once a second; the
events (`scheduler.cluster.jobs.watch`) give the phases and the finished experiments. The estimate is the
current phase only: later phases depend on results not yet measured. It is the mean wall time of
this job's experiments so far, times the queued experiments per free gang, plus what the running
ones still need.
"""
from __future__ import annotations

import datetime
import math
import time
from dataclasses import dataclass, field
from typing import Any

import redis
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from scheduler.cluster.job_store import JobStore
from scheduler.search.ranking import best, metric_value
from workers.slot.records import ExperimentRecord

POLL_S = 1.0  #: Redis is read at most this often for the panel


@dataclass
class PhaseCount:
    """One phase of the search as the panel shows it."""

    name: str
    total: int
    done: int


@dataclass
class LiveView:
    """Prints the job's events and, on a terminal, keeps the live panel up to date. Use it as the
    `on_event` callback of `scheduler.cluster.jobs.watch`, inside `with view:`."""

    console: Console
    client: redis.Redis
    job: str
    metric: str
    maximize: bool
    total_slots: int
    concurrency: int
    started: float = field(default_factory=time.time)
    phases: list[PhaseCount] = field(default_factory=list)
    records: list[ExperimentRecord] = field(default_factory=list)  #: the job's, typed as their events arrive
    _live: Live | None = None
    _polled_at: float = 0.0
    _running: list[dict[str, Any]] = field(default_factory=list)
    _queued: int = 0

    def __enter__(self) -> LiveView:
        if self.console.is_terminal:
            self._live = Live(self, console=self.console, refresh_per_second=2, transient=True)
            self._live.__enter__()
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._live is not None:
            self._live.__exit__(None, None, None)
            self._live = None

    def __call__(self, event: dict[str, Any]) -> None:
        if event["kind"] == "phase":
            total = int(event["todo"]) + int(event["reused"])
            self.phases.append(PhaseCount(event["name"], total, int(event["reused"])))
            self.console.print(f"phase {event['name']}: {event['todo']} to run"
                               + (f", {event['reused']} already measured" if event["reused"] else ""),
                               markup=False)
        elif event["kind"] == "gpu_busy":  # scheduler.cluster.finish.requeue_for_busy_gpu
            self.console.print(f"  {event['name']:<28} not started: other processes hold memory on "
                               f"{', '.join(event['slots'])}; out of tuning until it frees, queued again",
                               markup=False, soft_wrap=True)
        elif event["kind"] == "record":
            record = ExperimentRecord.from_json(event["record"])
            self.records.append(record)
            if self.phases:
                self.phases[-1].done += 1
            self._polled_at = 0.0  # a slot just freed: show it at the next refresh
            value = metric_value(event["record"], self.metric)  # the search's reading of the record's JSON
            shown = f"{self.metric}={value:,.2f}" if value is not None else record.status.value
            self.console.print(f"  {record.name:<28} {record.status.value:<10} {shown}  "
                               f"{record.wall_s or 0:.1f}s on {','.join(str(slot) for slot in record.slots)}",
                               markup=False, soft_wrap=True)
            # each rank's JSON: what its GPU still held after the run is a rank's own figure
            left = [f"{rank.get('slot')} ({rank['device_foreign_after_bytes'] / 2**30:.1f} GiB)"
                    for rank in record.ranks if rank.get("device_foreign_after_bytes")]
            if left:  # workers.state.slot_health: the slot is out of tuning until that memory goes
                self.console.print(f"  {'':<28} still used a wait after the run: {', '.join(left)}; "
                                   "out of tuning until it frees", markup=False, soft_wrap=True)

    def _poll(self) -> None:
        now = time.monotonic()
        if now - self._polled_at < POLL_S:
            return
        self._polled_at = now
        try:
            store = JobStore(self.client, self.job)
            self._running = [launch.to_json() for launch in store.running().values()]
            self._queued = store.depth()
        except redis.RedisError:
            pass  # the watcher itself reports an outage; the panel keeps its last view

    def estimate_s(self, now: float) -> float | None:
        """Seconds the current phase still needs, or None before any experiment finished."""
        walls = [float(r.wall_s) for r in self.records if r.wall_s]
        if not walls:
            return None
        mean = sum(walls) / len(walls)
        left_running = [max(mean - (now - float(r.get("started") or now)), 0.0) for r in self._running]
        gangs = max(self.concurrency, 1)
        return max(left_running, default=0.0) + math.ceil(self._queued / gangs) * mean

    def __rich__(self) -> Group:
        self._poll()
        now = time.time()
        table = Table(box=None, pad_edge=False, show_edge=False)
        for column in ("phase", "done", "running", "queued", "of"):
            table.add_column(column, justify="left" if column == "phase" else "right")
        for index, phase in enumerate(self.phases):
            current = index == len(self.phases) - 1
            table.add_row(phase.name, str(phase.done), str(len(self._running)) if current else "0",
                          str(self._queued) if current else "0", str(phase.total))
        busy = sum(len(r.get("queues") or []) for r in self._running)
        estimate = self.estimate_s(now)
        lines = [
            self._best_so_far(),
            f"slots busy {busy}/{self.total_slots}   elapsed {_duration(now - self.started)}   "
            + (f"this phase ~{_duration(estimate)} left" if estimate is not None else "estimate after the first result"),
        ]
        return Group(table, *(Text(line, overflow="ellipsis", no_wrap=True) for line in lines))

    def _best_so_far(self) -> str:
        """The panel's best line: the search's ranking (`scheduler.search.ranking`), which reads records
        as their JSON."""
        written = best([record.to_json() for record in self.records], self.metric, self.maximize)
        if written is None:
            return "best so far: none yet"
        winner = ExperimentRecord.from_json(written)
        return f"best so far: {winner.name} {self.metric}={metric_value(written, self.metric):,.2f}"


def _duration(seconds: float) -> str:
    return str(datetime.timedelta(seconds=round(max(seconds, 0.0))))
