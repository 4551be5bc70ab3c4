"""The results files' rows: results.jsonl and results.csv, one row per experiment listed.

A row is an experiment's record (`workers.slot.records.ExperimentRecord`) or, in an interrupted search,
the row of an experiment that was running or queued when the interrupt came (`CancelledRecord`): it never
ran to a record, and its status, `cancelled`, is none a launch can end with (`workers.in_rank.failure.Status`),
so the record's type does not describe it. Both are read by field (`Row`), as the ranking reads them
(`scheduler.search.ranking.Ranked`), and written through their own `to_json`.
"""
from __future__ import annotations

import csv
import io
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Union

from scheduler.search.ranking import metric_value, status_word
from scheduler.search.space import Experiment
from workers.slot.records import ExperimentRecord

#: The results.jsonl key (true) of a line an earlier run of the job measured off this run's path.
OFF_PATH = "off_path"
#: An experiment that was running or queued when the search was interrupted: not a measurement.
CANCELLED = "cancelled"
#: results.jsonl's columns: fields of the experiment's record (`workers.slot.records.ExperimentRecord`).
RECORD_KEYS = ("name", "status", "metrics", "ds_config", "wall_s", "started_at", "ended_at",
               "peak_rss_bytes", "slots", "cause", "exit_after_metrics")
#: A cancelled row's cause: its experiment had been launched, or was still queued.
WHILE_RUNNING, WHILE_QUEUED = "cancelled while running", "cancelled while queued"


@dataclass(frozen=True)
class CancelledRecord:
    """The row of an experiment an interrupt cut off: its config, and where and since when it ran
    (`running`: it had been launched; a queued one has no slots and no times). It measured nothing:
    no metrics, no cost, and the ranking never counts it (its status is not ok)."""

    name: str
    ds_config: dict[str, Any] | None
    running: bool = False
    slots: list[str] = field(default_factory=list)
    started_at: float | None = None
    ended_at: float | None = None
    wall_s: float | None = None

    @property
    def status(self) -> str:
        return CANCELLED

    @property
    def metrics(self) -> None:
        return None

    @property
    def peak_rss_bytes(self) -> None:
        return None

    @property
    def cause(self) -> dict[str, str]:
        return {"error": WHILE_RUNNING if self.running else WHILE_QUEUED}

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "status": CANCELLED, "metrics": None, "ds_config": self.ds_config,
                "slots": list(self.slots), "started_at": self.started_at, "ended_at": self.ended_at,
                "wall_s": self.wall_s, "cause": self.cause}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CancelledRecord:
        """The row `to_json` wrote; a `cause` it does not know reads as cancelled while queued."""
        cause = data.get("cause")
        return cls(name=data["name"], ds_config=data.get("ds_config"),
                   running=isinstance(cause, Mapping) and cause.get("error") == WHILE_RUNNING,
                   slots=list(data.get("slots") or []), started_at=data.get("started_at"),
                   ended_at=data.get("ended_at"), wall_s=data.get("wall_s"))


#: What the report lists: a record, or the row of an experiment cut off.
Row = Union[ExperimentRecord, CancelledRecord]


def row_of(row: Mapping[str, Any] | Row) -> Row:
    """`row` typed: its JSON read as the kind its status names; a typed row as it is."""
    if isinstance(row, (ExperimentRecord, CancelledRecord)):
        return row
    if row.get("status") == CANCELLED:
        return CancelledRecord.from_json(row)
    return ExperimentRecord.from_json(dict(row))


def cancelled_record(exp: Experiment, running: Mapping[str, Any] | None, now: float) -> CancelledRecord:
    """The row of an experiment cut off by an interrupt: where and since when it ran (`running`: its
    launch as dispatch recorded it), or only its config when it was still queued."""
    started = float(running["started"]) if running and running.get("started") else None
    return CancelledRecord(name=exp.name, ds_config=exp.ds_config, running=bool(running),
                           slots=list(running.get("queues") or []) if running else [],
                           started_at=started, ended_at=now if started is not None else None,
                           wall_s=round(now - started, 3) if started is not None else None)


def results_jsonl(listed: Sequence[Row], off_path: set[str]) -> str:
    """One line per listed row (RECORD_KEYS), those of `off_path` marked `"off_path": true`."""
    lines = []
    for row in listed:
        written = row.to_json()
        lines.append(json.dumps({key: written.get(key) for key in RECORD_KEYS}
                                | ({OFF_PATH: True} if row.name in off_path else {})) + "\n")
    return "".join(lines)


def results_csv(rows: Sequence[tuple[Experiment, Row]], metric: str) -> str:
    """results.jsonl flattened to one row per experiment: the tuned knobs, the outcome, every metric."""
    metric_keys = sorted({key for _, row in rows for key, value in (row.metrics or {}).items()
                          if isinstance(value, (int, float)) and not isinstance(value, bool)})
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["name", "space", "zero_stage", "micro_batch_size", "gradient_accumulation_steps",
                     "num_nodes", "num_gpus", "status", metric, "wall_s", "started_at", "ended_at",
                     "peak_rss_mib", "slots", *(f"metrics.{key}" for key in metric_keys)])
    for exp, row in rows:
        value = metric_value(row, metric)
        metrics = row.metrics or {}
        writer.writerow([exp.name, exp.space, exp.stage, exp.micro_batch_size, exp.gradient_accumulation_steps,
                         exp.num_nodes, exp.num_gpus, status_word(row), "" if value is None else value,
                         row.wall_s if row.wall_s is not None else "",
                         row.started_at or "", row.ended_at or "", round((row.peak_rss_bytes or 0) / 2**20, 1),
                         " ".join(row.slots or []), *(metrics.get(key, "") for key in metric_keys)])
    return out.getvalue()
