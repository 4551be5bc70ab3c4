"""How ranks and experiments end (`workers.in_rank.failure`) and the experiment record (`workers.slot.records`)."""
from __future__ import annotations

import signal
from typing import Any

import pytest

from workers.in_rank.failure import OOM_EXIT_CODE, KillReason, Status, classify, describe_exit, experiment_status
from workers.slot.records import aggregate

OK, OOM, TIMEOUT, CRASHED = Status.OK, Status.OOM, Status.TIMEOUT, Status.CRASHED
NO_METRICS, RDZV, ABORTED, LOST = Status.NO_METRICS, Status.RENDEZVOUS_FAILED, Status.ABORTED, Status.LOST

# ---------------------------------------------------------------- classify


@pytest.mark.parametrize(
    ("exit_code", "killed_for", "expects_metrics", "has_metrics", "expected"),
    [
        (0, None, True, True, OK),
        (0, None, True, False, NO_METRICS),
        (0, None, False, False, OK),
        (0, None, False, True, OK),
        (1, None, True, True, CRASHED),
        (1, None, False, False, CRASHED),
        (2, None, False, False, CRASHED),
        (-9, None, True, False, CRASHED),
        (-11, None, False, False, CRASHED),
        (None, None, True, False, CRASHED),
        (OOM_EXIT_CODE, None, True, False, OOM),
        (OOM_EXIT_CODE, None, False, False, OOM),
        (-9, KillReason.MEMORY, True, False, OOM),
        (0, KillReason.MEMORY, True, True, OOM),
        (-9, KillReason.TIMEOUT, True, False, TIMEOUT),
        (0, KillReason.TIMEOUT, True, True, TIMEOUT),
        (1, KillReason.TIMEOUT, False, False, TIMEOUT),
        (-15, KillReason.PEER_FAILED, False, False, ABORTED),
        (0, KillReason.PEER_FAILED, True, True, ABORTED),
        (None, KillReason.PEER_FAILED, False, False, ABORTED),
        (OOM_EXIT_CODE, KillReason.TIMEOUT, True, False, OOM),
        (OOM_EXIT_CODE, KillReason.PEER_FAILED, False, False, OOM),
        (-15, KillReason.MEASURED, True, True, OK),  # rank 0 hung at exit after its metrics
        (-9, KillReason.MEASURED, False, False, OK),  # another rank hung at exit after rank 0 measured
        (-15, KillReason.MEASURED, True, False, NO_METRICS),  # its metrics unreadable after all
    ],
    ids=["ok-rank0", "rank0-no-metrics", "ok-other-rank", "other-rank-with-metrics", "exit1-with-metrics",
         "exit1", "exit2", "sigkill", "sigsegv", "never-started", "oom-exit-rank0", "oom-exit-other",
         "killed-memory", "killed-memory-exit0", "killed-timeout", "killed-timeout-exit0", "killed-timeout-exit1",
         "peer-failed", "peer-failed-exit0", "peer-failed-not-started", "oom-exit-beats-timeout",
         "oom-exit-beats-peer", "measured-rank0", "measured-other-rank", "measured-unreadable"],
)
def test_classify(exit_code: int | None, killed_for: KillReason | None, expects_metrics: bool,
                  has_metrics: bool, expected: Status) -> None:
    assert classify(exit_code, killed_for, expects_metrics, has_metrics) is expected


def test_oom_exit_code_outside_shell_and_python_codes() -> None:
    assert OOM_EXIT_CODE == 86
    assert OOM_EXIT_CODE not in (0, 1, 2, 126, 127, 130, 137, 143)


@pytest.mark.parametrize(
    ("status", "value"),
    [(OK, "ok"), (OOM, "oom"), (TIMEOUT, "timeout"), (CRASHED, "crashed"), (NO_METRICS, "no_metrics"),
     (RDZV, "rendezvous_failed"), (ABORTED, "aborted"), (LOST, "lost")],
)
def test_status_values(status: Status, value: str) -> None:
    assert status.value == value
    assert Status(value) is status


# ---------------------------------------------------------------- describe_exit


@pytest.mark.parametrize(
    ("exit_code", "text"),
    [
        (None, "not started"),
        (0, "exit 0"),
        (1, "exit 1"),
        (OOM_EXIT_CODE, "exit 86"),
        (255, "exit 255"),
        (-signal.SIGKILL, "signal SIGKILL"),
        (-signal.SIGTERM, "signal SIGTERM"),
        (-signal.SIGSEGV, "signal SIGSEGV"),
        (-9, "signal SIGKILL"),
        (-999, "signal 999"),
    ],
)
def test_describe_exit(exit_code: int | None, text: str) -> None:
    assert describe_exit(exit_code) == text


# ---------------------------------------------------------------- experiment_status


@pytest.mark.parametrize(
    ("statuses", "expected"),
    [
        ([], LOST),
        ([OK], OK),
        ([OK, OK, OK], OK),
        ([CRASHED], CRASHED),
        ([OK, CRASHED], CRASHED),
        ([CRASHED, OOM], OOM),
        ([TIMEOUT, CRASHED, OOM, ABORTED], OOM),
        ([ABORTED, OOM], OOM),
        ([CRASHED, TIMEOUT], CRASHED),
        ([TIMEOUT, CRASHED], TIMEOUT),
        ([ABORTED, CRASHED], CRASHED),
        ([ABORTED, ABORTED, TIMEOUT], TIMEOUT),
        ([OK, NO_METRICS], NO_METRICS),
        ([RDZV, CRASHED], RDZV),
        ([LOST, CRASHED], LOST),
        ([OK, ABORTED, LOST], LOST),
        ([ABORTED], LOST),
        ([OK, ABORTED], LOST),
    ],
    ids=["empty", "one-ok", "all-ok", "one-crash", "ok-then-crash", "oom-wins-late", "oom-wins-among-many",
         "oom-after-aborted", "earliest-crash", "earliest-timeout", "aborted-ignored", "aborted-ignored-2",
         "no-metrics", "rendezvous-first", "lost-first", "lost-after-aborted", "only-aborted", "ok-and-aborted"],
)
def test_experiment_status(statuses: list[Status], expected: Status) -> None:
    assert experiment_status(statuses) is expected


# ---------------------------------------------------------------- aggregate

EXP: dict[str, Any] = {"name": "z1_gas1_tmbspg4", "exp_id": "e-42", "world_size": 2,
                       "ds_config": {"train_micro_batch_size_per_gpu": 4}}


def rank(rank_id: int, status: str, started: float, ended: float, peak: int = 0, **extra: Any) -> dict[str, Any]:
    return {"rank": rank_id, "status": status, "started_at": started, "ended_at": ended,
            "peak_rss_bytes": peak, "slot": f"node1.gpu{rank_id}", **extra}


def test_aggregate_all_ok() -> None:
    r0 = rank(0, "ok", 10.0, 20.5, 100, metrics={"throughput": 5.0, "latency": 0.2})
    r1 = rank(1, "ok", 9.5, 21.0, 300)
    record = aggregate(EXP, [r1, r0])
    assert record == {
        "name": "z1_gas1_tmbspg4",
        "exp_id": "e-42",
        "status": "ok",
        "metrics": {"throughput": 5.0, "latency": 0.2},
        "ds_config": {"train_micro_batch_size_per_gpu": 4},
        "slots": ["node1.gpu0", "node1.gpu1"],
        "started_at": 9.5,
        "ended_at": 21.0,
        "wall_s": 11.5,
        "peak_rss_bytes": 300,
        "ranks": [r0, r1],
    }


def test_aggregate_metrics_from_rank0_only() -> None:
    r0 = rank(0, "ok", 0.0, 1.0, metrics={"throughput": 7})
    r1 = rank(1, "ok", 0.0, 1.0, metrics={"throughput": 999})
    assert aggregate(EXP, [r1, r0])["metrics"] == {"throughput": 7}


@pytest.mark.parametrize(
    ("ranks", "status", "cause_rank"),
    [
        # rank 1 crashed first, rank 0 was aborted by us afterwards
        ([rank(0, "aborted", 0, 16.0), rank(1, "crashed", 0, 15.0)], "crashed", 1),
        # rank 0 crashed first, but the OOM on rank 1 explains it
        ([rank(0, "crashed", 0, 12.0), rank(1, "oom", 0, 14.0)], "oom", 1),
        # the earliest failure by end time, not by rank
        ([rank(0, "timeout", 0, 30.0), rank(1, "crashed", 0, 25.0)], "crashed", 1),
        ([rank(0, "timeout", 0, 20.0), rank(1, "crashed", 0, 25.0)], "timeout", 0),
        ([rank(0, "no_metrics", 0, 5.0), rank(1, "ok", 0, 4.0)], "no_metrics", 0),
        ([rank(0, "rendezvous_failed", 0, 3.0), rank(1, "aborted", 0, 4.0)], "rendezvous_failed", 0),
    ],
    ids=["crash-then-abort", "oom-wins", "earliest-end", "earliest-end-rank0", "no-metrics", "rendezvous"],
)
def test_aggregate_failure_status_and_cause(ranks: list[dict], status: str, cause_rank: int) -> None:
    record = aggregate(EXP, ranks)
    assert record["status"] == status
    assert record["metrics"] is None
    assert record["cause"]["rank"] == cause_rank
    assert record["cause"]["slot"] == f"node1.gpu{cause_rank}"


def test_aggregate_cause_fields() -> None:
    r0 = rank(0, "aborted", 1.0, 9.0, exit=-15, error="stopped: peer failed")
    r1 = rank(1, "crashed", 2.0, 8.0, 50, exit=1, error="RuntimeError: boom", stderr_tail="Traceback...\nboom",
              metrics={"ignored": 1}, unrelated="x")
    record = aggregate(EXP, [r0, r1])
    assert record["status"] == "crashed"
    assert record["cause"] == {"rank": 1, "slot": "node1.gpu1", "exit": 1, "error": "RuntimeError: boom",
                               "stderr_tail": "Traceback...\nboom"}
    assert record["wall_s"] == 8.0
    assert record["peak_rss_bytes"] == 50


def test_aggregate_metrics_dropped_when_not_ok() -> None:
    r0 = rank(0, "ok", 0, 1.0, metrics={"throughput": 5})
    r1 = rank(1, "crashed", 0, 2.0, exit=1)
    record = aggregate(EXP, [r0, r1])
    assert record["status"] == "crashed"
    assert record["metrics"] is None
    assert record["cause"] == {"rank": 1, "slot": "node1.gpu1", "exit": 1}


def test_a_crash_after_rank0_wrote_its_metrics_keeps_the_measurement() -> None:
    """DeepSpeed's profiling exit on CPU: rank 1 aborts at interpreter exit after rank 0 wrote the
    metrics; rank 0 is then stopped by us. The experiment is ok, the exit is kept on record."""
    r0 = rank(0, "aborted", 0, 10.0, metrics={"throughput": 5}, metrics_at=9.0, exit=-15)
    r1 = rank(1, "crashed", 0, 9.5, exit=-6, profiling_exit=True)
    record = aggregate(EXP, [r0, r1])
    assert record["status"] == "ok" and record["metrics"] == {"throughput": 5}
    assert record["exit_after_metrics"] == {"rank": 1, "slot": "node1.gpu1", "exit": -6} and "cause" not in record


@pytest.mark.parametrize("late", [
    rank(1, "crashed", 0, 8.0, exit=-6, profiling_exit=True),  # crashed before the metrics were written
    rank(1, "oom", 0, 9.5, profiling_exit=True),  # memory is never excused
    # a crash after the metrics, but not in DeepSpeed's profiling exit: e.g. a rank whose LOCAL_RANK
    # named a device it could not see failed in set_device while rank 0 measured alone
    rank(1, "crashed", 0, 9.5, exit=1, error="RuntimeError: CUDA error: invalid device ordinal"),
    rank(1, "crashed", 0, 9.5, exit=-6, profiling_exit=False),
])
def test_failures_that_spoil_the_measurement(late: dict) -> None:
    r0 = rank(0, "aborted", 0, 10.0, metrics={"throughput": 5}, metrics_at=9.0)
    record = aggregate(EXP, [r0, late])
    assert record["status"] == late["status"] and record["metrics"] is None


def test_device_peaks_are_the_busiest_ranks() -> None:
    r0 = rank(0, "ok", 0, 1.0, metrics={"throughput": 5}, peak_device_bytes=7 * 2**30,
              peak_device_allocated_bytes=5 * 2**30)
    r1 = rank(1, "ok", 0, 1.0, peak_device_bytes=9 * 2**30, peak_device_allocated_bytes=4 * 2**30,
              device_alloc_retries=2)
    record = aggregate(EXP, [r0, r1])
    assert (record["peak_device_bytes"], record["peak_device_allocated_bytes"], record["device_alloc_retries"]) \
        == (9 * 2**30, 5 * 2**30, 2)
    assert "peak_device_bytes" not in aggregate(EXP, [rank(0, "ok", 0, 1.0), rank(1, "ok", 0, 1.0)])
    r0["device_untracked_bytes"], r1["device_untracked_bytes"] = 2 * 2**30, 3 * 2**30
    r0["device_total_bytes"] = r1["device_total_bytes"] = 80 * 2**30
    record = aggregate(EXP, [r0, r1])
    assert (record["device_untracked_bytes"], record["device_total_bytes"]) == (3 * 2**30, 80 * 2**30)
    r1["device_total_bytes"] = 40 * 2**30  # a smaller GPU in the gang bounds it
    assert aggregate(EXP, [r0, r1])["device_total_bytes"] == 40 * 2**30


def test_each_ranks_untracked_memory_is_net_of_its_own_gpus_foreign_memory() -> None:
    """A notebook's 20 GiB on rank 0's GPU that left during the run, NCCL's 6 GiB on rank 1's: the
    job's own untracked memory is 6 GiB, not max(untracked) - max(foreign) = 0."""
    gib = 2**30
    r0 = rank(0, "ok", 0, 1.0, metrics={"throughput": 5}, device_untracked_bytes=2 * gib,
              device_foreign_bytes=20 * gib)
    r1 = rank(1, "ok", 0, 1.0, device_untracked_bytes=6 * gib, device_foreign_bytes=0)
    record = aggregate(EXP, [r0, r1])
    assert record["device_own_untracked_bytes"] == 6 * gib
    r1["device_foreign_bytes"] = 5 * gib
    assert aggregate(EXP, [r0, r1])["device_own_untracked_bytes"] == gib
    assert "device_own_untracked_bytes" not in aggregate(EXP, [rank(0, "ok", 0, 1.0), rank(1, "ok", 0, 1.0)])


def test_aggregate_missing_rank_is_lost() -> None:
    r0 = rank(0, "ok", 1.0, 3.0, 10, metrics={"throughput": 5})
    record = aggregate(EXP, [r0])  # world_size 2, rank 1 never reported
    assert record["status"] == "lost"
    assert record["metrics"] is None
    assert "cause" not in record
    assert record["slots"] == ["node1.gpu0"]
    assert record["wall_s"] == 2.0


def test_aggregate_missing_rank_keeps_a_real_failure() -> None:
    r0 = rank(0, "oom", 1.0, 3.0)
    record = aggregate({**EXP, "world_size": 4}, [r0])
    assert record["status"] == "oom"
    assert record["cause"]["rank"] == 0


def test_aggregate_no_ranks() -> None:
    record = aggregate(EXP, [])
    assert record["status"] == "lost"
    assert record["metrics"] is None
    assert (record["started_at"], record["ended_at"], record["wall_s"]) == (0.0, 0.0, 0.0)
    assert record["peak_rss_bytes"] == 0
    assert record["slots"] == []
    assert record["ranks"] == []
    assert "cause" not in record


def test_aggregate_without_world_size_counts_given_ranks() -> None:
    exp = {"name": "z0_gas1_tmbspg1"}
    record = aggregate(exp, [rank(0, "ok", 0.0, 0.25, metrics={"latency": 0.1})])
    assert record["status"] == "ok"
    assert record["metrics"] == {"latency": 0.1}
    assert record["exp_id"] is None
    assert record["ds_config"] is None
    assert record["wall_s"] == 0.25


def test_aggregate_rank_without_status_is_lost() -> None:
    r0 = {"rank": 0, "started_at": 0.0, "ended_at": 1.0}
    record = aggregate({"name": "x", "world_size": 1}, [r0])
    assert record["status"] == "lost"


def test_aggregate_wall_rounded_to_ms() -> None:
    r0 = rank(0, "ok", 100.0, 101.23456, metrics={})
    assert aggregate({"name": "x", "world_size": 1}, [r0])["wall_s"] == 1.235


def test_aggregate_peak_is_the_max_over_ranks() -> None:
    ranks = [rank(i, "ok", 0.0, 1.0, peak) for i, peak in enumerate([5, 700, 30, 699])]
    ranks[0]["metrics"] = {}
    record = aggregate({**EXP, "world_size": 4}, list(reversed(ranks)))
    assert record["peak_rss_bytes"] == 700
    assert [r["rank"] for r in record["ranks"]] == [0, 1, 2, 3]
    assert record["slots"] == ["node1.gpu0", "node1.gpu1", "node1.gpu2", "node1.gpu3"]


# ---------------------------------------------------------------- found by mutation testing (bench/mutation.sh)


def test_a_profiling_exit_at_the_instant_the_metrics_were_written_keeps_the_measurement() -> None:
    """"Rank 0 had written the metrics" includes the same clock reading: a rank ending at the very
    timestamp of the write did not end before it (both come from time.time(), which can repeat)."""
    r0 = rank(0, "aborted", 0, 10.0, metrics={"throughput": 5}, metrics_at=9.5)
    r1 = rank(1, "crashed", 0, 9.5, exit=-6, profiling_exit=True)
    assert aggregate(EXP, [r0, r1])["status"] == "ok"


def test_a_profiling_exit_without_rank0s_record_is_not_excused() -> None:
    """With rank 0's record missing there are no metrics to keep: the crash stands (and the
    missing rank does not make aggregation itself fail)."""
    r1 = rank(1, "crashed", 0, 9.5, exit=-6, profiling_exit=True)
    record = aggregate(EXP, [r1])
    assert record["status"] == "crashed" and record["metrics"] is None
    assert record["cause"]["rank"] == 1


def test_the_gangs_slowest_gpu_link_is_in_the_record() -> None:
    ranks = [{"rank": 0, "status": "ok", "metrics": {"throughput": 1.0}, "ended_at": 1.0},
             {"rank": 1, "status": "ok", "ended_at": 1.0}]
    assert aggregate({"name": "e", "world_size": 2, "gpu_link": "NV12"}, ranks)["gpu_link"] == "NV12"
    assert "gpu_link" not in aggregate({"name": "e", "world_size": 2, "gpu_link": ""}, ranks)
