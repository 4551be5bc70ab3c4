"""Containment: a process an experiment starts never outlives it, even one that left the process
group with setsid after a double fork (the group kill alone misses it)."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import psutil

from workers.process.launch import run_watched

ESCAPER = '''
import os, sys, time
pid_file = sys.argv[1]
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        with open(pid_file + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.rename(pid_file + ".tmp", pid_file)
        time.sleep(300)
    os._exit(0)
while not os.path.exists(pid_file):
    time.sleep(0.02)
'''


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_setsid_grandchild_is_stopped_with_the_experiment(tmp_path: Path) -> None:
    script = tmp_path / "escape.py"
    script.write_text(ESCAPER)
    pid_file = tmp_path / "grandchild.pid"
    result = run_watched([sys.executable, str(script), str(pid_file)], env={"PATH": "/usr/bin:/bin"},
                         cwd=str(tmp_path), stdout_path=tmp_path / "out.log", stderr_path=tmp_path / "err.log",
                         timeout_s=60, memory_cap_bytes=None)
    grandchild = int(pid_file.read_text())
    try:
        assert result.exit_code == 0, (tmp_path / "err.log").read_text()
        deadline = time.monotonic() + 5
        while _alive(grandchild) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(grandchild), "the setsid grandchild outlived its experiment"
    finally:
        if _alive(grandchild):
            psutil.Process(grandchild).kill()
