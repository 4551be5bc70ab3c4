"""The embedded cluster: `python -m scheduler.autotune` with no AUTOTUNE_REDIS_URL starts its own
redis-server and workers, and leaves no process behind, whether it finishes or is interrupted."""
from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time

import psutil
import pytest

from integration_helpers import ROOT, processes_with_marker, wait_for, write_config

pytestmark = pytest.mark.integration


def _env(marker: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key != "AUTOTUNE_REDIS_URL"}
    env["AUTOTUNE_TEST_MARKER"] = marker
    return env


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupt_tears_everything_down(tmp_path, sig):
    marker = secrets.token_hex(8)
    cfg = write_config(tmp_path / "cfg.json", train_micro_batch_size_per_gpu=[1, 2])
    cfg_data = json.loads(cfg.read_text())
    cfg_data["autotuning"]["user_args"] = ["--behaviour", "2=hang"]
    cfg.write_text(json.dumps(cfg_data))
    proc = subprocess.Popen([sys.executable, "-m", "scheduler.autotune", str(cfg), "--slots", "2",
                             "--num_gpus", "2"], cwd=tmp_path, env=_env(marker),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    hung = tmp_path / "autotuning_results" / "z0_gas1_tmbspg2"  # gas = max(list) 2 // mbs 2
    try:
        wait_for(lambda: (hung / "started.rank0").exists() and (hung / "started.rank1").exists(),
                 120, "the hanging experiment to start on both slots")
        pids = json.loads((tmp_path / "autotuning_results" / "cluster" / "pids.json").read_text())
        cluster_pids = [pids["redis-server"], *pids["workers"]]
        assert all(psutil.pid_exists(pid) for pid in cluster_pids)  # the cluster really is running
        assert len(processes_with_marker(marker)) >= 4  # 3 workers (+ pool children) and 2 ranks
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
    finally:
        _stop_politely(proc)
    assert proc.returncode == 130, out + err
    assert "interrupted" in err and "Traceback" not in err
    assert processes_with_marker(marker) == []
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
                   for pid in cluster_pids)
    # what was measured before the interrupt is kept and reported
    first = json.loads((tmp_path / "autotuning_results" / "z0_gas2_tmbspg1" / "result.json").read_text())
    assert first["status"] == "ok"
    assert "z0_gas2_tmbspg1" in (tmp_path / "autotuning_results" / "summary.txt").read_text()


def test_autotuner_killed_with_sigkill_leaves_nothing(tmp_path):
    """Even `kill -9` of the autotuner: the kernel's parent-death signal stops its cluster."""
    marker = secrets.token_hex(8)
    cfg = write_config(tmp_path / "cfg.json", train_micro_batch_size_per_gpu=[5])
    cfg_data = json.loads(cfg.read_text())
    cfg_data["autotuning"]["user_args"] = ["--behaviour", "5=hang"]
    cfg.write_text(json.dumps(cfg_data))
    proc = subprocess.Popen([sys.executable, "-m", "scheduler.autotune", str(cfg), "--slots", "2",
                             "--num_gpus", "2"], cwd=tmp_path, env=_env(marker),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    hung = tmp_path / "autotuning_results" / "z0_gas1_tmbspg5"
    try:
        wait_for(lambda: (hung / "started.rank1").exists(), 120, "the experiment to start")
        pids = json.loads((tmp_path / "autotuning_results" / "cluster" / "pids.json").read_text())
        proc.kill()
        proc.wait()
        wait_for(lambda: not processes_with_marker(marker), 30, "workers and training to exit")
        wait_for(lambda: not psutil.pid_exists(pids["redis-server"])
                 or psutil.Process(pids["redis-server"]).status() == psutil.STATUS_ZOMBIE,
                 15, "redis-server to exit")
    finally:
        _stop_politely(proc)


def _stop_politely(proc: subprocess.Popen) -> None:
    """Test clean-up: interrupt (so the autotuner tears its cluster down), kill only if it hangs."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


def test_the_cluster_user_cannot_take_over_redis(tmp_path):
    """The embedded cluster's workers and commands connect as a Redis user that has
    every key and every command Celery and this project use, and none of Redis's @dangerous ones:
    CONFIG SET dir (write files anywhere as Redis), MODULE LOAD, DEBUG, FLUSHALL are refused; the
    default user is off. Every other embedded-cluster test runs its jobs as this user."""
    import redis

    from scheduler.embedded.local_cluster import CLUSTER_USER, LocalCluster
    from workers.state.connection import connect
    from workers.state.registry import live_slots

    with LocalCluster(1, tmp_path / "cluster") as cluster:
        assert cluster.url.startswith(f"redis://{CLUSTER_USER}:")
        client = connect(cluster.url)
        wait_for(lambda: len(live_slots(client)) == 1, 90, "the slot worker to register as the cluster user")
        assert client.acl_whoami() == CLUSTER_USER
        client.set("autotune-test-key", "1")  # keys: allowed
        for refused in (lambda: client.config_set("dir", "/tmp"),
                        client.flushall, lambda: client.execute_command("SHUTDOWN", "NOSAVE"),
                        lambda: client.execute_command("ACL", "SETUSER", "default", "on")):
            with pytest.raises(redis.exceptions.NoPermissionError):  # the ACL says no
                refused()
        for refused_anyway in (("MODULE", "LOAD", "/x.so"), ("DEBUG", "SLEEP", "0")):  # also off by Redis 7's default
            with pytest.raises(redis.exceptions.ResponseError):
                client.execute_command(*refused_anyway)
        host, port = client.connection_pool.connection_kwargs["host"], client.connection_pool.connection_kwargs["port"]
        with pytest.raises((redis.exceptions.AuthenticationError, redis.exceptions.ResponseError)):
            redis.Redis(host=host, port=port, socket_timeout=3).set("x", "1")  # the default user is off
        assert client.ping()


@pytest.mark.parametrize("settled,rank_running", [(True, False), (True, True), (False, True)])
def test_stop_kills_every_worker_and_a_rank_recorded_as_running(tmp_path, settled, rank_running):
    """The stop after a normal end with nothing running kills the idle workers at once (no cold
    shutdown to wait for); after an interrupt, or with a rank recorded as running, it shuts them
    down cold. Either way the recorded rank group (one that ignores SIGTERM) and every process of the
    cluster are gone when stop returns."""
    from workers.state import keys
    from scheduler.embedded.local_cluster import LocalCluster
    from workers.state.connection import connect

    from workers.process.process_identity import RankIdentity, record_rank

    cluster = LocalCluster(1, tmp_path / "cluster")
    cluster.start()
    identity = RankIdentity("gpu0", "job", "z1_mbs2", 0, 1, secrets.token_hex(16))
    ignores_term = ("import setproctitle, signal, sys, time; setproctitle.setproctitle(sys.argv[1]); signal.signal("
                    "signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(300)")
    # The rank, and a process it forked that left its group (setsid): only its title says whose it is.
    rank, escaped = (subprocess.Popen([sys.executable, "-c", ignores_term, identity.title()], stdout=subprocess.PIPE,
                                      start_new_session=True) for _ in range(2))
    try:
        assert rank.stdout.readline() == b"up\n" and escaped.stdout.readline() == b"up\n"
        if rank_running:
            connect(cluster.url).set(keys.pgid("gpu0", "t-rank"), rank.pid)
            record_rank(connect(cluster.url), "t-rank", identity, rank.pid, 600)
        pids = cluster.pids
        cluster.stop(settled=settled)
        if rank_running:
            assert rank.wait(timeout=10) == -signal.SIGKILL, "the recorded rank's group must be killed"
            assert escaped.wait(timeout=10) == -signal.SIGKILL, "a process titled as the recorded rank's must be killed"
        assert not [pid for pid in pids if psutil.pid_exists(pid) and
                    psutil.Process(pid).status() != psutil.STATUS_ZOMBIE], "a cluster process outlived stop"
    finally:
        for proc in (rank, escaped):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        cluster.stop()
