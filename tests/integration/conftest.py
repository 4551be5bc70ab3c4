"""Fixtures that start real servers: a password-protected redis-server on a free port and slot
workers started by hand, exactly as the README tells a cluster operator to. Everything is
stopped by PID (process group) at the end, and the tests check nothing of theirs is left.
"""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import redis

from workers.local_cluster import free_tcp_port
from workers.registry import control_alive, live_slots

# Every process the tests start inherits this: where setproctitle is installed (mutmut pulls it in),
# Celery retitles its workers and, without SPT_NOENV, overwrites /proc/<pid>/environ, where the tests
# find their processes by marker (and a check for leftovers would then pass without looking).
os.environ["SPT_NOENV"] = "1"

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
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if condition():
                return
        except redis.RedisError:
            pass
        time.sleep(0.2)
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


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is required for integration tests (apt-get install -y redis-server)")
    port, password = free_tcp_port(), secrets.token_hex(8)
    workdir = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen(["redis-server", "-"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            start_new_session=True)
    proc.stdin.write(f"port {port}\nbind 127.0.0.1\nrequirepass {password}\nsave \"\"\n"
                     f"appendonly no\ndir {workdir}\n".encode())
    proc.stdin.close()
    url = f"redis://:{password}@127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    wait_for(client.ping, 10, "redis-server")
    yield url
    stop_group(proc)


@pytest.fixture(scope="session")
def hand_cluster(redis_url, tmp_path_factory):
    """Two CPU slot workers (1 GiB cap each) and a control worker, started with plain celery commands."""
    logs = tmp_path_factory.mktemp("worker-logs")
    marker = secrets.token_hex(8)
    env = {**os.environ, "AUTOTUNE_REDIS_URL": redis_url, "AUTOTUNE_NODE": "testnode",
           "AUTOTUNE_SLOT_MEMORY": "1GiB", "AUTOTUNE_SLOTS_PER_NODE": "2",
           "AUTOTUNE_TEST_MARKER": marker}
    procs = []
    for queue, name in (("gpu0", "gpu0@testnode"), ("gpu1", "gpu1@testnode"), ("control", "control@testnode")):
        with open(logs / f"{queue}.log", "wb") as log:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "tasks", "worker", "-Q", queue, "-n", name,
                 "--without-gossip", "--without-mingle", "-l", "INFO"],
                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    client = redis.Redis.from_url(redis_url)
    wait_for(lambda: len(live_slots(client)) == 2 and control_alive(client), 90, "workers to register")
    yield {"url": redis_url, "client": client, "marker": marker, "logs": logs}
    for proc in procs:
        stop_group(proc, signal.SIGQUIT)
    wait_for(lambda: not processes_with_marker(marker), 20, "worker processes to exit")


@pytest.fixture
def empty_redis(redis_url):
    """A database of the session's redis-server of its own, empty before and after the test
    (for tests of Redis logic that start no workers)."""
    db = redis.Redis.from_url(redis_url.rsplit("/", 1)[0] + "/7")
    db.flushdb()
    yield db
    db.flushdb()


def write_config(path: Path, **overrides) -> Path:
    import json

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
