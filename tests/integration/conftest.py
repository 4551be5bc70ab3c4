"""Fixtures that start real servers: a password-protected redis-server on a free port and slot
workers started by hand, exactly as the README and docs/cluster.md tell a cluster operator to. Everything is
stopped by PID (process group) at the end, and the tests check nothing of theirs is left.
"""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
from urllib.parse import urlparse

import pytest
import redis

from deploy.redis_user import create_cluster_user
from integration_helpers import ROOT, processes_with_marker, stop_group, wait_for
from scheduler.embedded.local_cluster import free_tcp_port
from scheduler.embedded.worker_command import worker_argv
from workers.state.registry import control_alive, live_slots

# Every process the tests start inherits this: where setproctitle is installed (mutmut pulls it in),
# Celery retitles its workers and, without SPT_NOENV, overwrites /proc/<pid>/environ, where the tests
# find their processes by marker (and a check for leftovers would then pass without looking).
os.environ["SPT_NOENV"] = "1"


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
    """Two CPU slot workers (1 GiB cap each) and a control worker, started with plain celery commands,
    connected as the cluster's least-privilege Redis user (`python -m deploy redis-user`'s), as the
    recipe in docs/cluster.md has them."""
    logs = tmp_path_factory.mktemp("worker-logs")
    marker = secrets.token_hex(8)
    admin = urlparse(redis_url)
    # a user of its own: the session's Redis serves other fixtures' cluster users (test_deploy's)
    url = f"redis://autotune-hand:{secrets.token_hex(8)}@{admin.hostname}:{admin.port}/0"
    create_cluster_user(url, redis_url)
    env = {**os.environ, "AUTOTUNE_REDIS_URL": url, "AUTOTUNE_NODE": "testnode",
           "AUTOTUNE_SLOT_MEMORY": "1GiB", "AUTOTUNE_SLOTS_PER_NODE": "2",
           "AUTOTUNE_TEST_MARKER": marker}
    procs = []
    for queue, name in (("gpu0", "gpu0@testnode"), ("gpu1", "gpu1@testnode"), ("control", "control@testnode")):
        with open(logs / f"{queue}.log", "wb") as log:
            procs.append(subprocess.Popen(
                worker_argv(queue, name),
                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    client = redis.Redis.from_url(url)
    wait_for(lambda: len(live_slots(client)) == 2 and control_alive(client), 90, "workers to register")
    yield {"url": url, "client": client, "marker": marker, "logs": logs}
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
