"""One experiment record from its ranks' records: the pure part of the chord callback.

The experiment takes its root cause's status (see `workers.in_rank.failure.experiment_status`), rank 0's
metrics, and the sum of what it cost. The record is what `result.json` holds and what the tuner
reads; `metrics.json` keeps DeepSpeed's metric dict (its keys and units), so tools that read
DeepSpeed's layout keep working and rank as the tuner did: where rank 0 timed its steps, the
figures are the profiled window's mean step time, and the engine's own (its last step) are kept in
the record as `engine_metrics` beside the window's `step_seconds` (see `workers.in_rank.step_clock`).
"""
from __future__ import annotations

from typing import Any

from workers.in_rank.failure import Status, experiment_status


def aggregate(exp: dict[str, Any], rank_records: list[dict[str, Any]]) -> dict[str, Any]:
    """The experiment record for `exp` (its description) from one record per rank."""
    ranks = sorted(rank_records, key=lambda r: r.get("rank", 0))
    by_end = sorted(ranks, key=lambda r: r.get("ended_at", 0.0))
    status = experiment_status([Status(r.get("status", Status.LOST.value)) for r in by_end])
    if len(ranks) < exp.get("world_size", len(ranks)):
        status = Status.LOST if status is Status.OK else status
    rank0 = next((r for r in ranks if r.get("rank") == 0), {})
    started = min((r.get("started_at", 0.0) for r in ranks), default=0.0)
    ended = max((r.get("ended_at", 0.0) for r in ranks), default=0.0)
    record = {
        "name": exp["name"],
        "exp_id": exp.get("exp_id"),
        "status": status.value,
        "metrics": rank0.get("metrics") if status is Status.OK else None,
        "ds_config": exp.get("ds_config"),
        "slots": [r.get("slot") for r in ranks],
        "started_at": started,
        "ended_at": ended,
        "wall_s": round(ended - started, 3) if ranks else 0.0,
        "peak_rss_bytes": max((r.get("peak_rss_bytes", 0) for r in ranks), default=0),
        "ranks": ranks,
    }
    for key in ("peak_device_bytes", "peak_device_allocated_bytes", "device_alloc_retries", "device_total_bytes",
                "device_untracked_bytes", "device_foreign_bytes", "device_foreign_after_bytes", "peak_device_init_bytes",
                "peak_device_init_allocated_bytes"):
        values = [r[key] for r in ranks if isinstance(r.get(key), int)]
        if values:  # the busiest rank's figure; the total: the smallest GPU, which bounds the gang
            record[key] = min(values) if key == "device_total_bytes" else max(values)
    own = [max(0, r["device_untracked_bytes"] - _count(r.get("device_foreign_bytes"))) for r in ranks
           if isinstance(r.get("device_untracked_bytes"), int)]
    if own:  # per rank, then the busiest: one rank's foreign memory says nothing of another's GPU
        record["device_own_untracked_bytes"] = max(own)
    cause = next((r for r in by_end if r.get("status") == status.value), None)
    if status is not Status.OK and cause is not None:
        record["cause"] = {key: cause[key] for key in ("rank", "slot", "exit", "error", "oom", "oom_from", "probable_oom",
                                                       "stderr_tail")
                           if key in cause}
        if _failed_after_measuring(status, rank0, cause):
            record.update(status=Status.OK.value, metrics=rank0["metrics"],
                          exit_after_metrics=record.pop("cause"))
    op_build = next((r["op_build_failed"] for r in by_end if r.get("op_build_failed")), None)
    if record["status"] != Status.OK.value and op_build:  # any rank's: the others may only have waited for it
        record["op_build_failed"] = op_build
    if exp.get("gpu_link"):  # the gang's slowest GPU link (scheduler.cluster.dispatch, workers.device.topology)
        record["gpu_link"] = exp["gpu_link"]
    if record["status"] == Status.OK.value:
        record.update({key: rank0[key] for key in ("engine_metrics", "step_seconds") if key in rank0})
    paths = sorted({r["start_path"] for r in ranks if r.get("start_path")})
    if paths:  # how the ranks' interpreters started (workers.warm.warm_start): "warm", "cold" or both
        record["start_path"] = "+".join(paths)
    return record


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
