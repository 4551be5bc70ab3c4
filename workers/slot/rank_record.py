"""The record of a rank whose script ran: how it ended (`Outcome`: the failure class, with what
the metrics file and an out-of-memory trace say) and the record the `run_rank` task returns
(`workers.slot.records.RankRecord`).

Apart from running the rank (`workers.slot.rank`) because this is pure reading and shaping: what the
run left (`RankRun`) in, the record out, with the metric fields taken from the profiled window
(`timed_metrics`, `workers.in_rank.step_clock`).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workers.device.device_idle import Wait
from workers.in_rank.failure import KillReason, Status, classify, describe_exit
from workers.process.launch import LaunchResult, tail
from workers.slot.metric_check import asked_metric, metrics_problem
from workers.in_rank.metrics import AutotuningSettings
from workers.in_rank.oom import aborted_out_of_memory, stderr_out_of_memory
from workers.files.paths import read_json
from workers.slot.rank_spec import RankSpec
from workers.slot.records import RankRecord
from workers.device.slot import Slot
from workers.in_rank.step_clock import wall_clock_metrics, window_seconds
from workers.slot.timeline import launch_timeline
from workers.warm.rank_start import Start

#: How much of a crashed rank's stderr is read for an out-of-memory traceback: a deep model's
#: traceback through DeepSpeed's hooks runs to a few kB, the allocator's message to 600 bytes.
STDERR_OOM_BYTES = 32_000


@dataclass(frozen=True)
class RankRun:
    """What a rank's run left for its record."""

    launch: LaunchResult
    report: dict[str, Any]  #: the exit report (`workers.in_rank.device_memory.read_exit_report`)
    start: Start  #: warm or cold, and why
    master: tuple[str, int]  #: the rendezvous address
    env: dict[str, str]  #: the rank's environment
    device_wait: Wait | None  #: the wait for a free GPU before the run (None: not on a GPU)
    device_after: Wait | None  #: and after it
    metric_path: Path  #: this launch's own metrics file
    stderr_path: Path
    prebuild_failed: str | None  #: ops that failed to build (`workers.slot.op_prebuild`)


@dataclass(frozen=True)
class Outcome:
    """How the rank ended: its failure class and what it was told by its files."""

    status: Status
    metrics: Any  #: the metrics file's content (rank 0 expecting one), else None
    has_metrics: bool
    problem: str | None  #: what is wrong with the metrics (`workers.slot.metric_check`)
    oom_in_stderr: str | None
    oom_in_counts: str | None
    probable_oom: str | None


def outcome(spec: RankSpec, run: RankRun) -> Outcome:
    """The failure class of a rank whose script ran (`workers.in_rank.failure.classify`), an out-of-memory
    crash told by its stderr or the allocator's counts (`workers.in_rank.oom`), and the metrics' checks."""
    launch, metric_path, stderr_path = run.launch, run.metric_path, run.stderr_path
    expects_metrics = spec.rank == 0 and bool(spec.metric_file)
    metrics = read_json(metric_path) if expects_metrics else None
    has_metrics = isinstance(metrics, dict)
    # A warm rank whose warm process died under it ended unseen: the launch is lost, not the config's.
    status = Status.LOST if run.start.lost else classify(launch.exit_code, launch.killed_for, expects_metrics, has_metrics)
    oom_in_stderr = stderr_out_of_memory(tail(stderr_path, STDERR_OOM_BYTES)) if status is Status.CRASHED else None
    oom_in_counts, probable_oom = aborted_out_of_memory(launch.exit_code, run.report) \
        if status is Status.CRASHED and not oom_in_stderr else (None, None)
    if oom_in_stderr or oom_in_counts:  # a wrapper's script, or an abort: no exception reached us (workers.in_rank.oom)
        status = Status.OOM
    problem = metrics_problem(metrics, spec.metric_file, asked_metric(spec.ds_config)) if has_metrics else None
    if status is Status.OK and problem:
        status = Status.BAD_METRICS
    return Outcome(status, metrics, has_metrics, problem, oom_in_stderr, oom_in_counts, probable_oom)


def rank_record(spec: RankSpec, slot: Slot, run: RankRun, ended: Outcome) -> RankRecord:
    """The rank's record: how it ran (times, memory, start path, exit report, timeline), its
    metrics or why it has none, and what its stderr says when it failed."""
    launch, start, master, report = run.launch, run.start, run.master, run.report
    status, metrics, problem = ended.status, ended.metrics, ended.problem
    record = {
        "status": status.value, "exit": describe_exit(launch.exit_code),
        "exit_code": launch.exit_code, "started_at": launch.started_at,
        "ended_at": launch.ended_at, "wall_s": round(launch.wall_s, 3),
        "peak_rss_bytes": launch.peak_rss_bytes,
        "memory_cap_bytes": slot.host_memory_cap,
        "master": f"{master[0]}:{master[1]}", "start_path": start.path,
        **({"cold_because": start.why_cold} if start.why_cold else {}),
        **report,
    }
    step_ends = record.pop("step_ends", None)
    record.pop("imported", None)  # the warm process's business (workers.warm.warm_start), not the record's
    record.pop("imported_count", None)
    record["timeline"] = launch_timeline(launch.started_at, launch.ended_at, record.pop("moments", None), step_ends,
                                         spec.ds_config)
    if slot.kind == "cuda":
        record["cuda_index"] = slot.cuda_index
        if run.env.get("NCCL_SOCKET_IFNAME"):
            record["nccl_socket_ifname"] = run.env["NCCL_SOCKET_IFNAME"]  # cmd_optimal.txt sets it alike
    if run.device_wait is not None and run.device_wait.foreign_bytes is not None:
        record.update(device_foreign_bytes=run.device_wait.foreign_bytes, device_wait_s=run.device_wait.waited_s)
    if run.device_after is not None and run.device_after.busy:  # may have been there during the run too
        record["device_foreign_after_bytes"] = run.device_after.used_bytes
    if problem:
        record["error"] = problem
    elif status is Status.NO_METRICS:
        record["error"] = f"exited 0 without writing its metrics file {run.metric_path}"
    elif ended.has_metrics:
        record.update(timed_metrics(metrics, step_ends, spec.ds_config))
        record["metrics_at"] = run.metric_path.stat().st_mtime  # a later failure did not spoil them
    if launch.start_error:
        record["error"] = launch.start_error
    if run.prebuild_failed:  # advisory: the script may not need the op (workers.slot.op_prebuild)
        record["op_prebuild_failed"] = run.prebuild_failed
    if launch.killed_for is KillReason.MEASURED:  # hung at exit: stopped, its measurement kept
        record["stopped_after_measuring"] = True
    if ended.oom_in_stderr:
        record["oom"] = ended.oom_in_stderr[:500]
        record["oom_from"] = "stderr"
    elif ended.oom_in_counts:
        record.update(oom=ended.oom_in_counts, oom_from="allocator counts")
    elif ended.probable_oom:
        record["probable_oom"] = ended.probable_oom
    if status is not Status.OK:
        record["stderr_tail"] = tail(run.stderr_path, 2000)
    return RankRecord.from_json(record)  # the exit report's keys, whatever they are, land where they belong


def timed_metrics(metrics: dict[str, Any], step_ends: list[list[float]] | None,
                  ds_config: dict[str, Any]) -> dict[str, Any]:
    """The record's metric fields. Where the rank noted when its optimizer steps ended, the metrics
    are the profiled window's mean step time (`workers.in_rank.step_clock`: the engine's own file times the
    last step only), with the engine's figures and the window's step times kept beside them."""
    settings = AutotuningSettings.from_ds_config(ds_config)
    durations = window_seconds(step_ends or [], settings.start_profile_step, settings.end_profile_step)
    if not durations:
        return {"metrics": metrics}
    return {"metrics": wall_clock_metrics(metrics, durations), "engine_metrics": metrics,
            "step_seconds": [round(duration, 4) for duration in durations]}
