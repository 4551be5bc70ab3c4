"""Kills what a test run left behind once the run's pytest process is gone, however it ended.

Why: tests start redis-servers, Celery workers and training ranks in sessions of their own, so
neither a signal to pytest nor its exit reaches them; a run stopped by a time limit (SIGTERM, then
SIGKILL) once left a redis-server and six workers running for 40 minutes. tests/conftest.py starts
this beside the run's first pytest process with the run's token; every process a test starts
inherits the token in its environment (`AUTOTUNE_TEST_RUN`), and while the pytest process lives this
also notes every process descended from it (redis-server rewrites its process title over the
environment that /proc shows, so the token alone cannot find it). When the pytest process ends, this
kills every live process it noted or that carries the token, until none is left.

    python tests/run_watchdog.py PYTEST_PID TOKEN
"""
from __future__ import annotations

import os
import sys
import time

import psutil

VARIABLE = "AUTOTUNE_TEST_RUN"
POLL_S = 0.5
#: Rounds with nothing found before the watchdog trusts that nothing is left (a dying worker may
#: still be starting a child).
QUIET_ROUNDS = 3


def carrying(token: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.pid != os.getpid() and proc.environ().get(VARIABLE) == token:
                found.append(proc)
        except psutil.Error:
            continue
    return found


def sweep(token: str, noted: dict[int, psutil.Process]) -> int:
    """SIGKILL every process carrying `token` or `noted` (still the same process: psutil compares
    start times) until QUIET_ROUNDS rounds find none; how many died."""
    killed, quiet = 0, 0
    while quiet < QUIET_ROUNDS:
        left = [proc for proc in noted.values() if proc.is_running() and proc.pid != os.getpid()]
        left += carrying(token)
        quiet = 0 if left else quiet + 1
        for proc in left:
            try:
                proc.kill()
                killed += 1
            except psutil.Error:
                pass
        noted = {}
        time.sleep(POLL_S)
    return killed


def main(pytest_pid: int, token: str) -> None:
    noted: dict[int, psutil.Process] = {}
    try:
        watched = psutil.Process(pytest_pid)
        while watched.is_running() and watched.status() != psutil.STATUS_ZOMBIE:
            for proc in watched.children(recursive=True):
                noted.setdefault(proc.pid, proc)
            time.sleep(POLL_S)
    except psutil.NoSuchProcess:
        pass
    sweep(token, noted)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
