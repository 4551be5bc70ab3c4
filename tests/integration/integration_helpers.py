"""Helpers the integration tests share: paths, waiting, finding our processes by marker, a config
to tune and the autotuner run as a user runs it. A module of its own name, not `conftest`: several
test folders have a conftest.py, and which one `import conftest` finds depends on what pytest loaded
last, so a test importing from `conftest` could get another folder's.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil

from scheduler.embedded.local_cluster import ready_within

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "scripts"


def stop_group(proc: subprocess.Popen, sig: int = signal.SIGTERM, grace_s: float = 20) -> None:
    """Signal the process group `proc` leads, then SIGKILL it if it outlives the grace period."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def wait_for(condition, timeout: float, what: str) -> None:
    """Wait as the embedded cluster waits for its processes (a Redis error counts as not yet)."""
    if not ready_within(condition, timeout):
        raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def processes_with_marker(marker: str) -> list[psutil.Process]:
    """Live processes whose environment carries `marker` (set by the test that started them)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.status() != psutil.STATUS_ZOMBIE and proc.environ().get("AUTOTUNE_TEST_MARKER") == marker:
                found.append(proc)
        except psutil.Error:
            continue
    return found


def outside_workers(found: list[psutil.Process]) -> list[psutil.Process]:
    """Those of `found` (a test's processes) that are not a Celery worker's own: each worker leads a
    session (the tests start it so), where its pool process, its warm interpreter and
    multiprocessing's resource tracker stay while it lives (workers.warm.warm_start); every rank, warm or
    cold, leads a session of its own. A process gone meanwhile counts as outside (callers wait)."""
    workers = set()
    for proc in found:
        try:
            if any("celery" in part for part in proc.cmdline()):
                workers.add(proc.pid)
        except psutil.Error:
            continue
    outside = []
    for proc in found:
        try:
            if os.getsid(proc.pid) not in workers:
                outside.append(proc)
        except ProcessLookupError:
            outside.append(proc)
    return outside


def write_config(path: Path, **overrides) -> Path:
    config = {
        "train_micro_batch_size_per_gpu": [1],
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 0},
        "autotuning": {"enabled": True, "metric": "throughput",
                       "user_script": str(SCRIPTS / "fake_train.py")},
    }
    for key, value in overrides.items():
        config[key] = value
    path.write_text(json.dumps(config))
    return path


def run_autotune(args: list[str], cwd: Path, env_extra: dict[str, str] | None = None,
                 timeout: float = 300) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key != "AUTOTUNE_REDIS_URL"}
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "scheduler.autotune", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)
