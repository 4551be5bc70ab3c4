"""A slot worker of the embedded cluster that refuses to start (a GPU CUDA numbers differently, one
already served: tasks.worker_hooks) leaves one `error:` line in its log; the autotuner says that line,
not "see the logs" (scheduler.embedded.local_cluster)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import redis

from scheduler.embedded.local_cluster import LocalCluster, LocalClusterError, ready_within, refusal_in


def test_the_last_refusal_line_without_its_prefix(tmp_path: Path) -> None:
    log = tmp_path / "gpu0.log"
    log.write_text("celery banner\nerror: slot worker gpu0@n: first\nmore\nerror: slot worker gpu0@n: GPU 0 is GPU-a\n")
    assert refusal_in(log) == "slot worker gpu0@n: GPU 0 is GPU-a"
    log.write_text("Traceback ...\nRuntimeError: boom\n")
    assert refusal_in(log) is None
    assert refusal_in(tmp_path / "missing.log") is None and refusal_in(None) is None
    log.write_text("error: slot worker gpu0@n: an earlier run's refusal\n")
    assert refusal_in(log, log.stat().st_size) is None  # only this worker's own lines count


def test_a_worker_dead_at_start_up_is_reported_by_its_refusal(tmp_path: Path) -> None:
    cluster = LocalCluster(1, tmp_path)
    log = tmp_path / "gpu0.log"
    with log.open("w") as out:
        worker = subprocess.Popen([sys.executable, "-c", "import sys; print('error: slot worker gpu0@n: GPU 0 is "
                                   "GPU-a to nvidia-smi, but CUDA opens GPU-b'); sys.exit(2)"], stdout=out)
    worker.wait()
    cluster._workers.append(worker)
    cluster._logs[worker.pid] = (log, 0)
    with pytest.raises(LocalClusterError) as raised:
        cluster._wait(lambda: False, "1 slot worker", log)
    assert str(raised.value) == "slot worker gpu0@n: GPU 0 is GPU-a to nvidia-smi, but CUDA opens GPU-b"


def test_waiting_counts_a_redis_error_as_not_yet_and_ends_at_its_deadline_or_check() -> None:
    answers: list[bool | Exception] = [redis.ConnectionError("still starting"), False, True]

    def ready() -> bool:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert ready_within(ready, 5.0) and answers == []
    assert not ready_within(lambda: False, 0.3)

    def exited() -> None:
        raise LocalClusterError("a worker exited")

    with pytest.raises(LocalClusterError, match="exited"):
        ready_within(lambda: True, 5.0, check=exited)
