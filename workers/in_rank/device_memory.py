"""Peak device memory of a training process, read inside that process, and its exit report.

Why inside the process: on a GPU slot the memory that limits the micro-batch is device memory, and
only the process that owns the CUDA context can read its allocator's peaks (the worker never
initialises CUDA, and nvidia-smi sees neither peaks nor which process held what). So `workers.in_rank.entry`
reads them when the script ends, also after an out-of-memory, and writes them with what it knows
about the ending into the rank's exit report (a small JSON file named by AUTOTUNE_EXIT_REPORT). The
rank reads that file into its record: `peak_device_bytes` (`torch.cuda.max_memory_reserved`, what
the allocator held: the figure that hits the device's limit), `peak_device_allocated_bytes`
(`max_memory_allocated`, live tensors only), the allocator's retry and OOM counts, the device's
usable total and what on it the allocator does not hold (`device_total_bytes`, and
`device_untracked_bytes` = total - free - reserved at the end: the CUDA context, NCCL's buffers,
other processes; what the memory model's reserve guesses), and when each
optimizer step ended (`step_ends`, from `workers.in_rank.step_clock`).

Building a DeepSpeed engine can hold more than training does (without `zero.Init` the whole model
goes to the GPU before ZeRO-3 partitions it), and that transient does not grow with the micro-batch:
counted in the training peak it would inflate the overhead the memory model takes from the profile
run. So when an engine is built (`workers.in_rank.step_clock` calls `start_training_peak`)
the peaks so far are kept apart as `peak_device_init_bytes` / `peak_device_init_allocated_bytes`,
and the allocator's peak counters restart: `peak_device_bytes` and `peak_device_allocated_bytes`
are then training's. (Memory the allocator keeps cached after init still counts as reserved, as it
does in the real run.)

A script that has no CUDA (a stand-in for a GPU model on a machine without one, a simulator) can
report what it would hold with `report_peak`; the largest of reported and measured values wins.

A process that aborts (torch's NCCL watchdog ends a rank with SIGABRT; a C++ exception thrown on a
thread of its own calls terminate) writes no report at its end. So while the script runs,
`InterimReports` writes the figures so far every `INTERIM_S`, marked `interim`: the rank then still
knows whether the allocator had run out of memory, or had to retry allocations, before the abort
(`workers.slot.rank` reads it).
"""
from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path
from typing import Any

#: Environment variable naming the file `workers.in_rank.entry` writes the exit report to.
EXIT_REPORT_ENV = "AUTOTUNE_EXIT_REPORT"

#: How often a running script's figures so far are written (`InterimReports`): reading the
#: allocator's counters takes microseconds, and an abort loses at most this much of the story.
INTERIM_S = 2.0
#: The longest the end of a script waits for an interim reading under way (a hung device's call).
STOP_WAIT_S = 10.0

#: The device figures an exit report may carry, each a count of bytes or events.
DEVICE_KEYS = ("peak_device_bytes", "peak_device_allocated_bytes", "device_alloc_retries", "device_ooms",
               "device_total_bytes", "device_untracked_bytes", "peak_device_init_bytes",
               "peak_device_init_allocated_bytes")

_reported: dict[str, int] = {}
_init_peaks: dict[str, int] = {}


def report_peak(reserved_bytes: int, allocated_bytes: int | None = None) -> None:
    """Declare this process's peak device memory (for scripts that model a device they do not have)."""
    _reported["peak_device_bytes"] = max(_reported.get("peak_device_bytes", 0), int(reserved_bytes))
    allocated = int(reserved_bytes if allocated_bytes is None else allocated_bytes)
    _reported["peak_device_allocated_bytes"] = max(_reported.get("peak_device_allocated_bytes", 0), allocated)


def _initialised_cuda() -> Any:
    """torch.cuda when this process initialised CUDA, else None (nothing is imported here)."""
    cuda = getattr(sys.modules.get("torch"), "cuda", None)
    try:
        return cuda if cuda is not None and cuda.is_initialized() else None
    except Exception:  # a broken driver must not turn a finished run into a crash
        return None


def start_training_peak() -> None:
    """Keep the peaks so far (building the engine) apart and restart the allocator's peak counters,
    so the peaks read at the end are training's. Never raises."""
    cuda = _initialised_cuda()
    if cuda is None:
        return
    try:
        for device in range(cuda.device_count()):
            _raise(_init_peaks, "peak_device_init_bytes", cuda.max_memory_reserved(device))
            _raise(_init_peaks, "peak_device_init_allocated_bytes", cuda.max_memory_allocated(device))
            cuda.reset_peak_memory_stats(device)
    except Exception:
        pass


def measured_peaks() -> dict[str, int]:
    """The CUDA allocator's peaks over the devices this process used (the busiest device's) since
    the engine was built (`start_training_peak`; since the start without one), the build's own
    peaks, and what `report_peak` declared; {} when the process never initialised CUDA and reported
    nothing. A rank sees every GPU of its gang on the node (CUDA_VISIBLE_DEVICES) and uses one: a
    device where its allocator never held memory is left alone, since `mem_get_info` there would
    open a CUDA context on a peer's GPU (hundreds of MiB, while the peer may be at its limit) and
    count the peer's whole usage as this rank's untracked memory, inflating the job's reserve."""
    peaks = {**_reported, **_init_peaks}
    cuda = _initialised_cuda()
    if cuda is not None:
        try:
            for device in range(cuda.device_count()):
                if not (cuda.max_memory_reserved(device) or cuda.memory_reserved(device)):
                    continue  # not this process's device (a gang sees its peers' GPUs): see below
                stats = cuda.memory_stats(device)
                _raise(peaks, "peak_device_bytes", cuda.max_memory_reserved(device))
                _raise(peaks, "peak_device_allocated_bytes", cuda.max_memory_allocated(device))
                _raise(peaks, "device_alloc_retries", stats.get("num_alloc_retries", 0))
                _raise(peaks, "device_ooms", stats.get("num_ooms", 0))
                free, total = cuda.mem_get_info(device)
                _raise(peaks, "device_total_bytes", total)
                _raise(peaks, "device_untracked_bytes", max(0, total - free - cuda.memory_reserved(device)))
        except Exception:
            pass
    return peaks


def _raise(peaks: dict[str, int], key: str, value: Any) -> None:
    if isinstance(value, int) and value > peaks.get(key, -1):
        peaks[key] = value


class InterimReports:
    """Writes the exit report with the figures so far, marked `interim`, every `interval_s` while
    the script runs (only once CUDA is in use or a peak was reported: a CPU rank writes nothing),
    until stopped; `stop` returns once no write is under way, so the final report is the last."""

    def __init__(self, interval_s: float = INTERIM_S) -> None:
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="autotune interim report", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=STOP_WAIT_S)  # a reading stuck on a hung device must not hold the exit

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            peaks = measured_peaks()
            if peaks and not self._stop.is_set():
                write_exit_report({**peaks, "interim": True})


def write_exit_report(report: dict[str, Any]) -> None:
    """Write the report to AUTOTUNE_EXIT_REPORT (no-op without it; ``{rank}`` in it becomes RANK,
    for launchers that give every rank the same environment); never raises."""
    path = os.environ.get(EXIT_REPORT_ENV)
    if not path:
        return
    path = path.replace("{rank}", os.environ.get("RANK", "0"))
    try:  # whole or not at all: the rank may read it while an interim report is being replaced
        partial = Path(f"{path}.{os.getpid()}.tmp")
        partial.write_text(json.dumps(report))
        os.replace(partial, path)
    except OSError:
        pass


def read_exit_report(path: Path) -> dict[str, Any]:
    """The report a rank's process wrote, keeping only well-typed fields ({} if none was written)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    kept: dict[str, Any] = {}
    for key in DEVICE_KEYS:
        value = data.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            kept[key] = value
    for key in ("profiling_exit", "interim"):
        if isinstance(data.get(key), bool):
            kept[key] = data[key]
    for key in ("oom", "op_build_failed"):
        if isinstance(data.get(key), str):
            kept[key] = data[key][:500]
    ends = data.get("step_ends")
    if isinstance(ends, list) and all(
            isinstance(end, list) and len(end) == 2 and isinstance(end[0], int) and not isinstance(end[0], bool)
            and isinstance(end[1], (int, float)) and not isinstance(end[1], bool) for end in ends):
        kept["step_ends"] = ends
    imported = data.get("imported")
    if isinstance(imported, list) and all(isinstance(name, str) for name in imported):
        kept["imported"] = imported[:300]  # workers.in_rank.entry.imports_since
    count = data.get("imported_count")
    if isinstance(count, int) and not isinstance(count, bool) and count >= 0:
        kept["imported_count"] = count  # all the modules it imported: whether to start the warm process again
    moments = data.get("moments")
    if isinstance(moments, dict):  # workers.in_rank.step_clock.moments: wall-clock seconds by name
        kept["moments"] = {str(name): float(at) for name, at in moments.items()
                           if isinstance(at, (int, float)) and not isinstance(at, bool)}
    return kept
