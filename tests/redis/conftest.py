"""A real redis-server for the tests of the Redis logic (dispatch, job store, gang leases), with no
Celery: the code under test runs in this process and `RecordedWork` stands in for the message layer.

One redis-server per session, on a unix socket in the session's temporary folder (no port to race
for when several sessions, or mutmut's workers, run at once), stopped by PID at the end. It is
started with PR_SET_PDEATHSIG, so a test process killed from outside (mutmut's timeout, Ctrl-C
twice) takes its server with it. Each test gets the database emptied first.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from typing import Any

import pytest
import redis

from scheduler.embedded.local_cluster import die_with_parent

@pytest.fixture(scope="session")
def redis_socket(tmp_path_factory) -> str:
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is required for tests/redis (apt-get install -y redis-server)")
    workdir = tmp_path_factory.mktemp("redis-logic")
    socket = str(workdir / "redis.sock")
    proc = subprocess.Popen(["redis-server", "-"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            preexec_fn=die_with_parent(signal.SIGTERM))
    proc.stdin.write(f"port 0\nunixsocket {socket}\nunixsocketperm 700\nsave \"\"\nappendonly no\n"
                     f"dir {workdir}\n".encode())
    proc.stdin.close()
    probe = redis.Redis(unix_socket_path=socket)
    deadline = time.monotonic() + 20
    while True:
        try:
            probe.ping()
            break
        except redis.ConnectionError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"redis-server did not start (exit status {proc.poll()})")
            time.sleep(0.02)
    probe.close()
    yield socket
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.fixture
def client(redis_socket: str) -> redis.Redis:
    """The session's redis-server, emptied before the test."""
    db = redis.Redis(unix_socket_path=redis_socket)
    db.flushall()
    yield db
    db.close()


class RecordedWork:
    """The message layer (`scheduler.cluster.work.Work`) as a recorder: launches, revokes and clean-ups
    are kept, not sent; `finished` answers from the set of task ids the test says have reported."""

    def __init__(self, finished: set[str] | None = None) -> None:
        self.launched: list[tuple[list[Any], Any, int, str]] = []
        self.revoked: list[str] = []
        self.cleaned: list[str] = []
        self.waited_for_clean_ups: list[list[str]] = []  #: what had been cleaned up at each wait
        self.advanced: list[str] = []
        self.reported = set(finished or ())

    def launch(self, ranks: list[Any], finish: Any, time_limit_s: int, shown: str) -> None:
        self.launched.append((ranks, finish, time_limit_s, shown))

    def revoke(self, task_ids: list[str]) -> None:
        self.revoked.extend(task_ids)

    def clean_up(self, slots: Any, name: str, launch: dict[str, Any]) -> None:
        self.cleaned.append(name)

    def wait_for_clean_ups(self, timeout_s: float) -> bool:
        self.waited_for_clean_ups.append(list(self.cleaned))
        return True

    def advance(self, job: str) -> None:
        self.advanced.append(job)

    def finished(self, task_id: str) -> bool:
        return task_id in self.reported


@pytest.fixture
def work() -> RecordedWork:
    return RecordedWork()
