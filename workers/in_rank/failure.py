"""How an experiment ended, decided from facts only.

The class comes from the exit code, the signal, what our own monitor did (killed for memory, for
time, because a peer rank failed, or because it still ran well after the experiment had measured)
and whether the metrics file exists. Never from searching
stderr for words: a script that logs "error" and exits 0 with metrics is fine, and one that
crashes silently is still a crash. The one reading of stderr is `workers.in_rank.oom.stderr_out_of_memory`,
done by the rank on a crash: a traceback that ends in an allocator's out-of-memory (a script
started through a wrapper, whose exception the rank's interpreter never holds), or NCCL's watchdog
aborting the process over one (SIGABRT, no traceback), makes it `oom`.
"""
from __future__ import annotations

import signal
from enum import Enum

#: Exit status of `workers.in_rank.entry` when the script raised an out-of-memory exception
#: (torch.cuda.OutOfMemoryError or MemoryError). Chosen outside the range shells and Python use.
OOM_EXIT_CODE = 86


class Status(str, Enum):
    """The outcome of one rank or of a whole experiment."""

    OK = "ok"  #: exited 0 and (rank 0) wrote its metrics
    OOM = "oom"  #: exceeded the slot's memory cap, or the script ran out of (device) memory
    TIMEOUT = "timeout"  #: ran past the experiment's wall-clock limit
    CRASHED = "crashed"  #: exited non-zero or was killed by a signal we did not send
    NO_METRICS = "no_metrics"  #: exited 0 but rank 0 wrote no metrics file
    BAD_METRICS = "bad_metrics"  #: rank 0's metrics are not usable numbers (NaN, inf, negative, text)
    RENDEZVOUS_FAILED = "rendezvous_failed"  #: rank 0's address never arrived before the deadline
    ABORTED = "aborted"  #: stopped by us because another rank of the experiment failed
    LOST = "lost"  #: the rank never reported (worker or node died)
    #: not started: other processes held memory on the slot's GPU past the wait (workers.device.device_idle);
    #: the slot is out of tuning until it frees and the experiment is queued again, never recorded
    GPU_BUSY = "gpu_busy"


class KillReason(str, Enum):
    """Why our monitor killed the process group, if it did."""

    MEMORY = "memory"
    TIMEOUT = "timeout"
    PEER_FAILED = "peer_failed"
    #: the experiment had measured (rank 0's metrics written) and this rank had not left a grace
    #: period later: hung in its teardown (NCCL's communicators after DeepSpeed's profiling exit).
    MEASURED = "measured"


def classify(
    exit_code: int | None,
    killed_for: KillReason | None,
    expects_metrics: bool,
    has_metrics: bool,
) -> Status:
    """The status of one rank from how its process ended (exit_code < 0: killed by signal -code)."""
    if killed_for is KillReason.MEMORY or exit_code == OOM_EXIT_CODE:
        return Status.OOM
    if killed_for is KillReason.MEASURED:
        return Status.NO_METRICS if expects_metrics and not has_metrics else Status.OK
    if killed_for is KillReason.TIMEOUT:
        return Status.TIMEOUT
    if killed_for is KillReason.PEER_FAILED:
        return Status.ABORTED
    if exit_code != 0:
        return Status.CRASHED
    if expects_metrics and not has_metrics:
        return Status.NO_METRICS
    return Status.OK


def describe_exit(exit_code: int | None) -> str:
    """'exit 1', 'signal SIGKILL': what a person reading the summary wants to see."""
    if exit_code is None:
        return "not started"
    if exit_code < 0:
        try:
            return f"signal {signal.Signals(-exit_code).name}"
        except ValueError:
            return f"signal {-exit_code}"
    return f"exit {exit_code}"


#: When ranks disagree, the experiment takes the status of its root cause. An OOM anywhere explains
#: the others' crashes (a peer's collective breaks); otherwise the earliest failure is the cause.
_ROOT_CAUSE_FIRST = (Status.OOM,)


def experiment_status(rank_statuses_by_end: list[Status]) -> Status:
    """One status for an experiment from its ranks' statuses, ordered by the time each rank ended."""
    if not rank_statuses_by_end:
        return Status.LOST
    for status in _ROOT_CAUSE_FIRST:
        if status in rank_statuses_by_end:
            return status
    failures = [s for s in rank_statuses_by_end if s not in (Status.OK, Status.ABORTED)]
    if failures:
        return failures[0]
    if all(s is Status.OK for s in rank_statuses_by_end):
        return Status.OK
    return Status.LOST
