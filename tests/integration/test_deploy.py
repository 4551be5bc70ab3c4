"""`python -m deploy` against real SSH: a private sshd on a loopback port, reached through fabric.

Three "hosts" in the hostfile, all aliases in a test SSH config: nodeA and nodeB lead to the test
sshd, nodeC to a port where nothing listens. `up` must start the slot workers of nodeA and nodeB
(processes that outlive the SSH session), name nodeC's failure on one line, and keep the Redis
password off every command line; `status` shows each slot; `cleanup` kills exactly a recorded
training group that ignores SIGTERM (and not a group whose pgid is recorded but that runs another
slot); `down` stops everything. Unknown host keys are refused unless accepted explicitly.
"""
from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse

import psutil
import pytest
import redis

from integration_helpers import ROOT, wait_for
from sshd import start_sshd
from scheduler.cluster.launches import RunningLaunch
from workers.state import keys
from scheduler.embedded.local_cluster import free_tcp_port
from workers.process.process_identity import RankIdentity, record_rank, start_time
from workers.state.registry import live_slots

pytestmark = pytest.mark.integration

IGNORES_TERM = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"


@pytest.fixture(scope="module")
def hosts(tmp_path_factory, redis_url):
    if not Path("/usr/sbin/sshd").exists():
        pytest.fail("openssh-server is required (deploy/setup_tests.sh installs it)")
    folder = tmp_path_factory.mktemp("deploy")
    port = free_tcp_port()
    sshd = start_sshd(folder / "sshd", port)
    config = sshd.ssh_config({"nodeA": ("127.0.0.1", port), "nodeB": ("127.0.0.1", port),
                              "nodeC": ("127.0.0.1", free_tcp_port())}, folder / "known_hosts")
    hostfile = folder / "hostfile"
    hostfile.write_text("nodeA slots=2\nnodeB slots=1\nnodeC slots=1\n")
    run_dir = folder / "run"
    # The workers connect as the cluster's least-privilege user, created as docs/cluster.md says
    admin = urlparse(redis_url)
    # a user of its own: resetting another fixture's (the hand cluster's) would lock its workers out
    url = f"redis://autotune-deploy:{secrets.token_hex(8)}@{admin.hostname}:{admin.port}/0"
    made = subprocess.run([sys.executable, "-m", "deploy", "redis-user"], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "AUTOTUNE_REDIS_URL": url, "AUTOTUNE_REDIS_ADMIN_URL": redis_url},
                          timeout=60)
    assert made.returncode == 0, made.stderr
    yield {"config": config, "hostfile": hostfile, "run_dir": run_dir, "url": url, "admin_url": redis_url,
           "known_hosts": folder / "known_hosts"}
    for pidfile in run_dir.glob("*.pid"):  # whatever a failed test left running, by PID
        try:
            os.killpg(json.loads(pidfile.read_text())["pid"], signal.SIGKILL)
        except (ProcessLookupError, ValueError, KeyError):
            pass
    sshd.stop()


def deploy(hosts, *args: str, url: str | None = None, **env_extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "AUTOTUNE_REDIS_URL": url or hosts["url"], **env_extra}
    argv = [sys.executable, "-m", "deploy", *args, "--hostfile", str(hosts["hostfile"]),
            "--ssh-config", str(hosts["config"]), "--run-dir", str(hosts["run_dir"])]
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    print(f"$ python -m deploy {' '.join(args)}\n{done.stdout}{done.stderr}")
    return done


def ignores_term(pid: int) -> bool:
    """Whether the process has installed SIG_IGN for SIGTERM (bit 15 of SigIgn in /proc)."""
    status = Path(f"/proc/{pid}/status").read_text()
    mask = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigIgn:")), 16)
    return bool(mask & (1 << (signal.SIGTERM - 1)))


def lines_of(output: str) -> dict[str, str]:
    return {line.split(":", 1)[0]: line for line in output.splitlines() if ":" in line}


def test_unknown_host_keys_are_refused(hosts):
    done = deploy(hosts, "status")
    shown = lines_of(done.stdout)
    assert "not in known_hosts" in shown["nodeA.gpu0"] and "not in known_hosts" in shown["nodeB.gpu0"]
    assert not hosts["known_hosts"].exists() or hosts["known_hosts"].read_text() == ""
    # `up` as Redis's default user (it may run CONFIG) warns before anything starts; nothing starts
    # here either: the host keys are still unknown
    done = deploy(hosts, "up", "--timeout", "5", url=hosts["admin_url"])
    assert "warning: the user in AUTOTUNE_REDIS_URL may run CONFIG" in done.stderr, done.stderr
    assert "python -m deploy redis-user" in done.stderr


def test_up_status_cleanup_down(hosts):
    client = redis.Redis.from_url(hosts["url"])
    password = urlparse(hosts["url"]).password
    # the warm-start switch as the deployer has it reaches the workers (here: every rank cold)
    done = deploy(hosts, "up", "--control", "nodeA", "--accept-new-host-keys", "--timeout", "90",
                  AUTOTUNE_WARM_START="0")
    assert "warning" not in done.stderr, done.stderr  # the cluster's own user cannot reconfigure Redis
    shown = lines_of(done.stdout)
    assert done.returncode == 1, "nodeC cannot come up"
    assert shown["nodeA"].startswith("nodeA: ok: 2 slot(s) registered") and "control started" in shown["nodeA"]
    assert shown["nodeB"].startswith("nodeB: ok: 1 slot(s)")
    assert shown["nodeC"].startswith("nodeC: FAILED: cannot connect over SSH")
    assert "[127.0.0.1]" in hosts["known_hosts"].read_text(), "accepted keys are recorded"

    # The SSH sessions ended; the workers live on, registered, in sessions of their own.
    live = {slot.queue for slot in live_slots(client)}
    assert {"nodeA.gpu0", "nodeA.gpu1", "nodeB.gpu0"} <= live
    pids = [json.loads(p.read_text())["pid"] for p in hosts["run_dir"].glob("*.pid")]
    assert len(pids) == 4 and all(psutil.Process(pid).ppid() == 1 for pid in pids)
    assert {psutil.Process(pid).environ().get("AUTOTUNE_WARM_START") for pid in pids} == {"0"}
    assert oct((hosts["run_dir"] / "env.json").stat().st_mode & 0o777) == "0o600"
    for proc in psutil.process_iter(["cmdline"]):
        assert password not in " ".join(proc.info["cmdline"] or []), f"password on a command line: {proc.pid}"

    done = deploy(hosts, "status")
    shown = lines_of(done.stdout)
    assert shown["nodeA.gpu0"].startswith("nodeA.gpu0: idle (worker gpu0@nodeA")
    assert shown["nodeB.gpu0"].startswith("nodeB.gpu0: idle")
    assert "unknown: cannot connect" in shown["nodeC.gpu0"]

    # A running launch on nodeB whose rank ignores SIGTERM, and a recorded pgid that is not ours.
    env = {k: v for k, v in os.environ.items() if k != "AUTOTUNE_REDIS_URL"}
    rank = subprocess.Popen([sys.executable, "-c", IGNORES_TERM], env={**env, "AUTOTUNE_SLOT": "nodeB.gpu0"},
                            start_new_session=True)
    stranger = subprocess.Popen([sys.executable, "-c", IGNORES_TERM], env={**env, "AUTOTUNE_SLOT": "other.gpu0"},
                                start_new_session=True)
    try:
        client.zadd(keys.JOBS, {"deployjob": 1})
        client.hset(keys.job_running("deployjob"), "z1_mbs2", json.dumps(RunningLaunch(
            seq=1, exp={"name": "z1_mbs2"}, argv=[], attempt="a", queues=["nodeB.gpu0", "nodeA.gpu1"],
            token="tok", rank_tasks={"nodeB.gpu0": "t-rank", "nodeA.gpu1": "t-stranger"},
            started=0.0, deadline=0.0).to_json()))
        # As a slot records its rank (workers.process.process_identity): the rank's record holds its start;
        # the stranger's bare pgid names a group that no rank title of that slot is in.
        client.set(keys.pgid("nodeB.gpu0", "t-rank"), rank.pid)
        record_rank(client, "t-rank", RankIdentity("nodeB.gpu0", "deployjob", "z1_mbs2", 0, 2, "a"), rank.pid, 600)
        client.set(keys.pgid("nodeA.gpu1", "t-stranger"), stranger.pid)
        wait_for(lambda: ignores_term(rank.pid) and ignores_term(stranger.pid), 10, "ranks to ignore SIGTERM")

        refused = deploy(hosts, "cleanup", "z1_mbs2", "--grace", "1")
        assert refused.returncode == 2 and "JOB:z1_mbs2 (it runs in job(s) deployjob)" in refused.stderr
        done = deploy(hosts, "cleanup", "deployjob:z1_mbs2", "--grace", "1")
        shown = lines_of(done.stdout)
        assert done.returncode == 0
        assert f"nodeB.gpu0={rank.pid}@{start_time(rank.pid)} killed with SIGKILL after 1s (ignored SIGTERM)" \
            in shown["nodeB"]
        assert "gone (no process of this group runs that slot)" in shown["nodeA"]
        assert rank.wait(timeout=10) == -signal.SIGKILL
        assert stranger.poll() is None, "a group that does not run the slot must never be killed"
    finally:
        for proc in (rank, stranger):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        client.delete(keys.job_running("deployjob"), keys.pgid("nodeB.gpu0", "t-rank"),
                      keys.rank_process("nodeB.gpu0", "t-rank"), keys.pgid("nodeA.gpu1", "t-stranger"))
        client.zrem(keys.JOBS, "deployjob")

    for log in hosts["run_dir"].glob("*.log"):
        assert password not in log.read_text(errors="replace"), f"password in {log}"

    done = deploy(hosts, "down", "--control", "nodeA", "--deadline", "20")
    shown = lines_of(done.stdout)
    assert "nodeA.gpu0 warm shutdown" in shown["nodeA"] and "nodeA.control warm shutdown" in shown["nodeA"]
    assert shown["nodeB"] == "nodeB: nodeB.gpu0 warm shutdown"
    assert all(not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE for pid in pids)
    wait_for(lambda: not ({"nodeA.gpu0", "nodeA.gpu1", "nodeB.gpu0"} & {s.queue for s in live_slots(client)}),
             15, "slots to unregister")
    done = deploy(hosts, "status")
    assert lines_of(done.stdout)["nodeB.gpu0"] == "nodeB.gpu0: down"


def test_a_stopped_launch_has_its_recorded_groups_killed_on_this_host_without_ssh(redis_url):
    """What the scheduler does when a launch is lost with its worker or a job is cancelled: the
    revoke reaches no worker (it is dead), yet the rank's group, which ignores SIGTERM, is gone."""
    import socket
    from types import SimpleNamespace

    from scheduler.cluster.jobs import stop_launch
    from scheduler.cluster.launches import RunningLaunch
    from deploy.cleanup import clean_launch_in_background

    client = redis.Redis.from_url(redis_url)
    node = socket.gethostname()
    queue = f"{node}.gpu7"
    env = {k: v for k, v in os.environ.items() if k != "AUTOTUNE_REDIS_URL"}
    rank = subprocess.Popen([sys.executable, "-c", IGNORES_TERM], env={**env, "AUTOTUNE_SLOT": queue},
                            start_new_session=True)
    revoked = []
    app = SimpleNamespace(revoke=revoked.extend,  # the Work protocol's revoke, recorded; its clean-up, CeleryWork's
                          clean_up=clean_launch_in_background)
    try:
        wait_for(lambda: ignores_term(rank.pid), 10, "rank to ignore SIGTERM")
        client.set(keys.pgid(queue, "t-lost"), rank.pid)
        record_rank(client, "t-lost", RankIdentity(queue, "job", "lost_exp", 0, 1, "a"), rank.pid, 600)
        stop_launch(client, app, RunningLaunch(seq=1, exp={"name": "lost_exp"}, argv=[], attempt="a",
                                               queues=[queue], token="tok", rank_tasks={queue: "t-lost"},
                                               started=0.0, deadline=0.0))
        assert revoked == ["t-lost"]
        assert rank.wait(timeout=20) == -signal.SIGKILL
    finally:
        if rank.poll() is None:
            os.killpg(rank.pid, signal.SIGKILL)
            rank.wait()
        client.delete(keys.pgid(queue, "t-lost"), keys.rank_process(queue, "t-lost"))
