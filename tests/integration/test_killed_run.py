"""A test run killed midway leaves nothing behind (tests/conftest.py, tests/run_watchdog.py).

Why: tests start redis-servers, workers and ranks in sessions of their own, which neither a signal to
pytest nor its exit reaches; a CI run stopped by its time limit once left a redis-server and six
workers running for 40 minutes, slowing the next run."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from integration_helpers import ROOT, SCRIPTS, wait_for
from run_watchdog import carrying

pytestmark = pytest.mark.integration


def _alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    alive = []
    for proc in processes:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc)
        except psutil.NoSuchProcess:
            continue
    return alive


def test_a_pytest_run_killed_with_sigkill_leaves_no_process(tmp_path: Path) -> None:
    ready = tmp_path / "ready.json"
    # a run of its own (no outer token), as CI's is: its conftest starts its own watchdog
    env = {key: value for key, value in os.environ.items() if key != "AUTOTUNE_TEST_RUN"}
    env["KILLED_RUN_READY"] = str(ready)
    inner = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
                              str(SCRIPTS / "killed_run_inner.py")], cwd=ROOT, env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for(lambda: ready.exists() or inner.poll() is not None, 180, "the inner run's cluster")
        assert inner.poll() is None, "the inner run ended before its cluster was up"
        started = json.loads(ready.read_text())
        # what a kill would leave: the run's redis-server, its three workers and their pool, the loner
        started_by_run = psutil.Process(inner.pid).children(recursive=True)
        names = " ".join(" ".join(proc.cmdline()) for proc in started_by_run)
        assert "redis-server" in names and names.count("-A tasks worker") >= 3, names
        assert started["loner"] in {proc.pid for proc in started_by_run}
        inner.send_signal(signal.SIGKILL)
        inner.wait()
        wait_for(lambda: not _alive(started_by_run) and not carrying(started["token"]), 30,
                 "every process of the killed run to be gone")
    finally:
        if inner.poll() is None:
            inner.kill()
            inner.wait()


def test_a_run_started_with_sigint_ignored_still_gives_its_commands_ctrl_c(tmp_path: Path) -> None:
    """A shell starts a background job (`bash .ci/run &`, `(pytest ...) &`) with SIGINT ignored, and a
    Python started so never raises KeyboardInterrupt: every test that interrupts a command with
    SIGINT would wait out its limit. tests/conftest.py gives the run
    Python's own handler back, so the commands the tests start take Ctrl-C as from a terminal."""
    out = tmp_path / "sigign"
    env = {**os.environ, "SIGINT_INNER_OUT": str(out)}
    inner = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
                            str(SCRIPTS / "sigint_inner.py")], cwd=ROOT, env=env, capture_output=True, text=True,
                           preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN), timeout=120)
    assert inner.returncode == 0, inner.stdout + inner.stderr
    assert not int(out.read_text(), 16) & (1 << (signal.SIGINT - 1)), out.read_text()
