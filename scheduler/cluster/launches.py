"""The three records of an experiment's life on the control path, typed and JSON-round-tripped.

    QueuedLaunch   waiting in its job's queue (scheduler.cluster.job_store), in submission order
    RunningLaunch  sent to its reserved slots: which attempt, which slots under which gang token,
                   the rank tasks to revoke, when it is due, the workers' instances it started on
    FinishSpec     what the chord callback (tasks.experiment.finish_experiment) is told about the
                   launch it records

Why types: as plain dicts indexed by string in dispatch, jobs and the tasks, a misspelt key would
be a KeyError at 3 a.m. on a control worker. Each record here is frozen, names its
fields once, and `from_json(x.to_json()) == x`.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

from workers.files.layout import METRICS


class _Json:
    """JSON round trip for flat frozen dataclasses of JSON values."""

    def to_json(self) -> dict[str, Any]:
        """The fields as a dict, their values the same objects: `asdict` deep-copied every nested
        config, a few ms of each dispatch pass that starts experiments (bench/scale.py)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}  # type: ignore[arg-type]

    @classmethod
    def from_json(cls, data: dict[str, Any]):  # noqa: ANN206 - returns cls
        known = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        return cls(**{key: value for key, value in data.items() if key in known})


@dataclass(frozen=True)
class QueuedLaunch(_Json):
    """An experiment waiting for slots."""

    seq: int  #: cluster-wide submission order (keys.SEQUENCE): FIFO across jobs
    exp: dict[str, Any]  #: the Experiment's JSON, min_memory included
    argv: list[str]  #: the script and its arguments, config path set

    @property
    def name(self) -> str:
        return self.exp["name"]

    @property
    def shape(self) -> str:
        """'<nodes>x<slots per node>:<min memory>': launches of one shape place the same way."""
        return f"{self.exp['num_nodes']}x{self.exp['num_gpus']}:{self.exp.get('min_memory', 0)}"


@dataclass(frozen=True)
class RunningLaunch(_Json):
    """An experiment sent to its reserved slots."""

    seq: int
    exp: dict[str, Any]
    argv: list[str]
    attempt: str  #: fresh per launch: keys its rendezvous and abort flag
    queues: list[str]  #: the reserved slots, rank order
    token: str  #: the gang reservation's owner token
    rank_tasks: dict[str, str]  #: slot queue -> Celery task id of its rank
    started: float
    deadline: float  #: past it with no record, the launch is lost
    instances: dict[str, str] = field(default_factory=dict)  #: slot queue -> worker instance at launch
    missing_since: float | None = None  #: when a slot's registration was first seen gone
    #: "job/experiment" of every launch that held a slot on one of its nodes while it ran
    co_runners: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.exp["name"]

    def queued(self) -> QueuedLaunch:
        """The launch as it waits again when it is retried, at its old place."""
        return QueuedLaunch(self.seq, self.exp, self.argv)

    def missing_from(self, now: float) -> RunningLaunch:
        return replace(self, missing_since=now)


@dataclass(frozen=True)
class FinishSpec(_Json):
    """What the chord callback needs to record a launch."""

    job: str
    name: str
    exp_id: int
    attempt: str
    slots: list[str]
    gang_token: str
    results_root: str
    world_size: int
    ds_config: dict[str, Any]
    timeout_s: float
    metric_file: str = METRICS
    gpu_link: str = ""  #: the slowest link between the GPUs of one node of its gang (workers.device.topology)
    shape: str = ""  #: "stage/micro-batch" of its experiment, whose wall times estimate the next (dispatch)
