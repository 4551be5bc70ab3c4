"""An experiment's record and its ranks' records: their types, their JSON, and the pure part of the
chord callback that makes the one from the others.

The records travel as JSON (a Celery result, result.json, the job's stream, the search's lookups);
`ExperimentRecord` and `RankRecord` are their typed form, with `to_json`/`from_json` at those
boundaries. `from_json` reads any record a release of the tool wrote: a key it lacks takes its
default, and a key the type does not name is kept in `extra`, so a round trip loses nothing.
`not_started` is the record of a rank whose script never ran, `ExperimentRecord.lost` the record of an
experiment no launch measured.

The experiment takes its root cause's status (see `workers.in_rank.failure.experiment_status`), rank 0's
metrics, and the sum of what it cost. The record is what `result.json` holds and what the tuner
reads; `metrics.json` keeps DeepSpeed's metric dict (its keys and units), so tools that read
DeepSpeed's layout keep working and rank as the tuner did: where rank 0 timed its steps, the
figures are the profiled window's mean step time, and the engine's own (its last step) are kept in
the record as `engine_metrics` beside the window's `step_seconds` (see `workers.in_rank.step_clock`).
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, TypeVar

from workers.in_rank.failure import Status, experiment_status

#: The device memory figures an experiment takes from its ranks: the busiest rank's, and for the
#: total, the smallest GPU's (it bounds the gang).
DEVICE_KEYS = ("peak_device_bytes", "peak_device_allocated_bytes", "device_alloc_retries", "device_total_bytes",
               "device_untracked_bytes", "device_foreign_bytes", "device_foreign_after_bytes", "peak_device_init_bytes",
               "peak_device_init_allocated_bytes")
#: What a failed experiment's `cause` keeps of the rank that failed first.
CAUSE_KEYS = ("rank", "slot", "exit", "error", "oom", "oom_from", "probable_oom", "stderr_tail")

_Record = TypeVar("_Record", "RankRecord", "ExperimentRecord")
#: A record's fields that are no key of its JSON: what it holds beyond its fields, which keys it writes.
_NOT_JSON = frozenset({"extra", "written"})


def _to_json(record: ExperimentRecord | RankRecord, always: frozenset[str], only_set: bool = False) -> dict[str, Any]:
    """The fields in order: those in `always` written even when None, the others only when set (not
    None; with `only_set`, not their default either: an empty list is then left out too)."""
    out: dict[str, Any] = {}
    for spec in dataclasses.fields(record):
        value = getattr(record, spec.name)
        unset = value is None or (only_set and _default(spec, value))
        if spec.name in _NOT_JSON or (unset and spec.name not in always):
            continue
        out[spec.name] = value.value if isinstance(value, Status) else value
    out.update(record.extra)
    return out


def _default(spec: dataclasses.Field, value: Any) -> bool:
    """Whether `value` is the field's default."""
    if spec.default_factory is not dataclasses.MISSING:
        return bool(value == spec.default_factory())
    return spec.default is not dataclasses.MISSING and bool(value == spec.default)


def _from_json(kind: type[_Record], data: dict[str, Any]) -> _Record:
    """`kind` from its JSON: a missing key takes its default, an unnamed one goes to `extra`."""
    named = {spec.name for spec in dataclasses.fields(kind)} - _NOT_JSON
    values = {key: value for key, value in data.items() if key in named}
    extra = {key: value for key, value in data.items() if key not in named}
    status = data.get("status")
    values["status"] = Status(status) if status is not None else Status.LOST  # never reported
    return kind(**values, extra=extra)


@dataclass(frozen=True)
class RankRecord:
    """One rank's record: what the `run_rank` task returns and its experiment keeps under `ranks`.

    Typed: who ran it (set by `workers.slot.rank.run_rank`), how it ended and what it cost, which every
    rank's record has; what its exit report, its timeline and its metrics add is in `extra`."""

    name: str | None = None
    rank: int | None = None
    slot: str | None = None
    node: str | None = None
    device: int | None = None  #: the device index the slot names
    worker: str | None = None
    threads: int | None = None
    status: Status = Status.LOST
    exit: str = "not started"  #: how the process ended, in words (`workers.in_rank.failure.describe_exit`)
    exit_code: int | None = None
    started_at: float = 0.0
    ended_at: float = 0.0
    wall_s: float = 0.0
    peak_rss_bytes: int = 0
    error: str | None = None  #: why it failed, where the exit code does not say
    stale: bool | None = None  #: True: another delivery or a newer launch owns this rank's work
    extra: dict[str, Any] = field(default_factory=dict)

    #: Written even when None.
    ALWAYS = frozenset({"status", "exit", "started_at", "ended_at", "wall_s", "peak_rss_bytes"})

    def to_json(self) -> dict[str, Any]:
        return _to_json(self, self.ALWAYS)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RankRecord:
        return _from_json(cls, data)


def not_started(status: Status, error: str, *, started_at: float | None = None, stale: bool = False,
                **extra: Any) -> RankRecord:
    """The record of a rank whose script never ran: `status` says why, `error` in words, `started_at`
    when the rank's task began (else now); `extra` adds what the stage that stopped it saw (the GPU's
    foreign memory, the wait)."""
    now = time.time()
    started = now if started_at is None else started_at
    return RankRecord(status=status, exit="not started", started_at=started, ended_at=now,
                      wall_s=round(now - started, 3), peak_rss_bytes=0, error=error,
                      stale=True if stale else None, extra=extra)


@dataclass(frozen=True)
class ExperimentRecord:
    """One experiment's record: what result.json holds, the job's stream carries and the search reads.

    The fields up to `ranks` are in every record `experiment_record` makes (None included); the others only
    where they say something. A record of an experiment no launch measured (`lost`) or an older one
    may lack any but `name`: they read as their defaults."""

    name: str
    exp_id: int | None = None
    status: Status = Status.LOST
    metrics: dict[str, Any] | None = None  #: rank 0's, when the experiment counts (`status` ok)
    ds_config: dict[str, Any] | None = None
    slots: list[str | None] = field(default_factory=list)  #: one per rank, in rank order
    #: The times and the cost: None where the record lacks them (a lost launch's, an older one), so a
    #: reader tells a cost never measured from a zero one (MLflow logs only the figures a record holds)
    started_at: float | None = None
    ended_at: float | None = None
    wall_s: float | None = None
    peak_rss_bytes: int | None = None  #: the busiest rank's
    ranks: list[dict[str, Any]] = field(default_factory=list)  #: each rank's record (`RankRecord.to_json`)
    peak_device_bytes: int | None = None
    peak_device_allocated_bytes: int | None = None
    device_alloc_retries: int | None = None
    device_total_bytes: int | None = None
    device_untracked_bytes: int | None = None
    device_foreign_bytes: int | None = None
    device_foreign_after_bytes: int | None = None
    peak_device_init_bytes: int | None = None
    peak_device_init_allocated_bytes: int | None = None
    device_own_untracked_bytes: int | None = None  #: per rank net of its GPU's foreign memory, the busiest
    cause: dict[str, Any] | None = None  #: the failing rank's `CAUSE_KEYS`
    exit_after_metrics: dict[str, Any] | None = None  #: a tolerated failure after the measurement (its cause)
    op_build_failed: str | None = None
    gpu_link: str | None = None  #: the gang's slowest GPU link (`workers.device.topology`)
    engine_metrics: dict[str, Any] | None = None  #: DeepSpeed's own figures (its last step)
    step_seconds: list[float] | None = None  #: the profiled window's step times
    start_path: str | None = None  #: "warm", "cold" or "cold+warm" (`workers.warm.warm_start`)
    co_runners: list[Any] | None = None  #: launches that held a slot on its nodes while it ran
    #: True: a launch that no longer held the experiment wrote it (`scheduler.cluster.fencing`); it answers
    #: nothing, and the readers of result.json (the replay, the off-path listing) skip it
    stale: bool | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    #: Where `lost` built the record: the fields written even when None (the others only when they
    #: differ from their default); None: `ALWAYS`, the others when not None.
    written: frozenset[str] | None = field(default=None, compare=False, repr=False)

    #: Written even when None.
    ALWAYS = frozenset({"name", "exp_id", "status", "metrics", "ds_config", "slots", "started_at", "ended_at",
                        "wall_s", "peak_rss_bytes", "ranks"})

    @classmethod
    def lost(cls, name: str, error: str | None = None, *, stale: bool = False, **known: Any) -> ExperimentRecord:
        """The record of an experiment no launch measured: its launches were lost (`error` says why), it
        has no result to read, or the launch that answers no longer owns it (`stale`). Its JSON holds
        `name`, `status` and the fields in `known` (its `ds_config`, the `slots` it held; `metrics=None`
        to say outright it has none), each even when None, then `cause` and `stale` where set: never
        the times, cost and ranks it did not have, which every reader takes for None or empty."""
        return cls(name=name, status=Status.LOST, cause={"error": error} if error else None,
                   stale=True if stale else None, written=frozenset({"name", "status", *known}), **known)

    @property
    def ok(self) -> bool:
        return self.status is Status.OK

    @property
    def rank_records(self) -> list[RankRecord]:
        """`ranks` typed, for readers of a rank's who and how (its slot, node, device, threads);
        what only some ranks' records hold (their timeline, how their interpreter started) is in each one's
        `extra`."""
        return [RankRecord.from_json(rank) for rank in self.ranks]

    def to_json(self) -> dict[str, Any]:
        if self.written is None:
            return _to_json(self, self.ALWAYS)
        return _to_json(self, self.written, only_set=True)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ExperimentRecord:
        return _from_json(cls, data)


def experiment_record(exp: dict[str, Any], rank_records: list[dict[str, Any]]) -> ExperimentRecord:
    """The experiment record for `exp` (its description) from one record per rank."""
    ranks = sorted(rank_records, key=lambda r: r.get("rank", 0))
    by_end = sorted(ranks, key=lambda r: r.get("ended_at", 0.0))
    status = experiment_status([Status(r.get("status", Status.LOST.value)) for r in by_end])
    if len(ranks) < exp.get("world_size", len(ranks)):
        status = Status.LOST if status is Status.OK else status
    rank0 = next((r for r in ranks if r.get("rank") == 0), {})
    started = min((r.get("started_at", 0.0) for r in ranks), default=0.0)
    ended = max((r.get("ended_at", 0.0) for r in ranks), default=0.0)
    failed = next((r for r in by_end if r.get("status") == status.value), None)
    cause = {key: failed[key] for key in CAUSE_KEYS if key in failed} \
        if status is not Status.OK and failed is not None else None
    excused = None
    if cause is not None and _failed_after_measuring(status, rank0, failed or {}):
        status, excused, cause = Status.OK, cause, None
    ok = status is Status.OK
    op_build = next((r["op_build_failed"] for r in by_end if r.get("op_build_failed")), None)
    paths = sorted({r["start_path"] for r in ranks if r.get("start_path")})
    return ExperimentRecord(
        name=exp["name"], exp_id=exp.get("exp_id"), status=status, metrics=rank0.get("metrics") if ok else None,
        ds_config=exp.get("ds_config"), slots=[r.get("slot") for r in ranks], started_at=started, ended_at=ended,
        wall_s=round(ended - started, 3) if ranks else 0.0,
        peak_rss_bytes=max((r.get("peak_rss_bytes", 0) for r in ranks), default=0), ranks=ranks,
        **_device_figures(ranks), cause=cause, exit_after_metrics=excused,
        op_build_failed=None if ok else op_build,  # any rank's: the others may only have waited for it
        gpu_link=exp.get("gpu_link") or None,  # the gang's slowest link (scheduler.cluster.dispatch)
        engine_metrics=rank0.get("engine_metrics") if ok else None,
        step_seconds=rank0.get("step_seconds") if ok else None,
        start_path="+".join(paths) or None)  # how the ranks' interpreters started (workers.warm.warm_start)


def aggregate(exp: dict[str, Any], rank_records: list[dict[str, Any]]) -> dict[str, Any]:
    """`experiment_record` as the JSON result.json holds."""
    return experiment_record(exp, rank_records).to_json()


def _device_figures(ranks: list[dict[str, Any]]) -> dict[str, int]:
    """The busiest rank's device memory figures; the total: the smallest GPU, which bounds the gang."""
    figures = {}
    for key in DEVICE_KEYS:
        values = [r[key] for r in ranks if isinstance(r.get(key), int)]
        if values:
            figures[key] = min(values) if key == "device_total_bytes" else max(values)
    own = [max(0, r["device_untracked_bytes"] - _count(r.get("device_foreign_bytes"))) for r in ranks
           if isinstance(r.get("device_untracked_bytes"), int)]
    if own:  # per rank, then the busiest: one rank's foreign memory says nothing of another's GPU
        figures["device_own_untracked_bytes"] = max(own)
    return figures


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _failed_after_measuring(status: Status, rank0: dict[str, Any], cause: dict[str, Any]) -> bool:
    """The one tolerated rank failure: DeepSpeed's profiling exit. After the profiled steps every rank
    calls exit() in DeepSpeed's engine, and on CPU a C++ thread sometimes aborts the interpreter's
    teardown (SIGABRT). The measurement stands when the failing rank provably got there (its exit
    report says it left through the engine's profiling exit, see `workers.in_rank.entry`) and rank 0 had
    written the metrics. Any other failure of any rank, even one after the metrics were written, is
    shown: a rank that could not see its device must not hide behind rank 0's numbers. Memory and
    time failures are never excused: a config at the edge of the cap is not a safe answer."""
    written = rank0.get("metrics_at")
    return (status is Status.CRASHED and cause.get("profiling_exit") is True
            and isinstance(rank0.get("metrics"), dict) and written is not None
            and written <= cause.get("ended_at", 0.0))
