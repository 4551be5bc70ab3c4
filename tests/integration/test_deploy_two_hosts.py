"""`python -m deploy` across two hosts, each with its own sshd, network and process space.

Two network namespaces joined by a veth pair (netns.py) stand for two machines. Each also gets its
own PID namespace, whose init is that host's sshd: a process on node 2 is invisible to node 1 and
its PID means something else there, as on real machines. Without that, every "host" shares this
machine's PID space and a clean-up that wrongly ran `kill` on node 1 would pass unnoticed.

Redis runs in node 1's network namespace with a password. `python -m deploy` runs on node 1 (inside
its namespaces) with a hostfile naming `node1` and `node2`, SSH aliases for the two namespace
addresses. The tests check that:

- `up` starts the slot workers on both hosts, each in its own host's process space, and the control
  worker on node 1; `status` shows every slot with the PID its own host knows it by;
- `cleanup EXPERIMENT` reaches node 2 over SSH and kills the recorded training group there, which
  ignores SIGTERM (TERM, grace, KILL), while an unrelated group on node 2 survives;
- `down` stops node 1's idle workers warm and node 2's worker, busy with a SIGTERM-ignoring rank,
  cold (its rank's group killed), after which each host runs nothing but its sshd;
- when node 2's slot worker is SIGKILLed mid-experiment while its training group lives on (it
  ignores SIGTERM too), the control worker's sweep declares the launch lost, the scheduler hook
  kills that group on node 2 over SSH, and the job completes with the experiment re-run on node 1.

RULE (netns.py): no namespace address is contacted from the root namespace; every client of them
(deploy, Redis probes, the autotuner) runs on node 1 through `nsenter` or `ip netns exec`.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from integration_helpers import ROOT, SCRIPTS, stop_group, wait_for, write_config
from netns import (Host, NamespacesUnavailable, create_two_hosts, delete_hosts, init_of, namespace_exists,
                   on_host, own_processes, processes_of)
from sshd import TestSshd, start_sshd
from workers.state import keys
from workers.process.process_identity import RankIdentity
from workers.warm.warm_plan import SWITCH_ENV

pytestmark = pytest.mark.integration

PYTHON = sys.executable
NODES = ("node1", "node2")
SSH_PORT = 22  #: each namespace has its own port space
REDIS_PORT = 6379
LEASE_S = 15.0  #: AUTOTUNE_LEASE_S: long enough that a loaded 2-core machine loses nothing falsely
CLEANUP_GRACE_S = 5.0  #: deploy.cleanup.DEFAULT_GRACE_S, what the scheduler hook gives a group

#: A training process group that ignores SIGTERM: a leader and a child (`sleep` inherits SIG_IGN),
#: in a session of its own like a rank's group. Prints the leader's PID as its own host sees it.
STUBBORN_GROUP = r"""
import os, signal, subprocess, sys, time
import setproctitle
os.setsid()
setproctitle.setproctitle(os.environ["STUBBORN_TITLE"])  # as a rank titles itself (workers.process.process_identity)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen(["sleep", "600"])
print(os.getpid(), flush=True)
time.sleep(600)
"""

#: The user script of the node-lost test: on node 2's slot a rank that ignores SIGTERM and never
#: ends (its PID, as node 2 knows it, in `hung.node2`); anywhere else the ordinary stand-in.
HANGS_ON_NODE2 = r"""
import os, runpy, signal, subprocess, sys, time
from pathlib import Path

FAKE_TRAIN = FAKE_TRAIN_PATH
if os.environ.get("AUTOTUNE_SLOT") == "node2.gpu0":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = subprocess.Popen(["sleep", "600"])
    config = Path(sys.argv[sys.argv.index("--deepspeed_config") + 1])
    (config.parent / "hung.node2").write_text(str(os.getpid()))
    time.sleep(600)
sys.argv[0] = FAKE_TRAIN
runpy.run_path(FAKE_TRAIN, run_name="__main__")
"""

#: What a host sees of one process group: the live members' PIDs (its own numbering) and argv.
GROUP_ON_HOST = r"""
import json, os, sys
import psutil
pgid = int(sys.argv[1])
members = {}
for proc in psutil.process_iter(["cmdline", "status"]):
    try:
        if os.getpgid(proc.pid) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
            members[proc.pid] = " ".join(proc.info["cmdline"] or [])
    except (ProcessLookupError, psutil.Error):
        pass
print(json.dumps(members))
"""

#: Redis, read or written from node 1: `python -c REDIS_ON_NODE1 '<json of calls>'` runs each
#: [method, *args] on a client of AUTOTUNE_REDIS_URL and prints the decoded replies.
REDIS_ON_NODE1 = r"""
import json, os, sys
import redis
client = redis.Redis.from_url(os.environ["AUTOTUNE_REDIS_URL"], decode_responses=True)
print(json.dumps([getattr(client, call[0])(*call[1:]) for call in json.loads(sys.argv[1])], default=list))
"""


@dataclass
class TwoHosts:
    hosts: dict[str, Host]
    inits: dict[str, int]  #: node -> root-namespace PID of its init (its sshd)
    sshds: dict[str, TestSshd]
    url: str  #: Redis on node 1's address; usable only inside a namespace
    ssh_config: Path
    hostfile: Path
    run_dir: Path

    def on(self, node: str, argv: list[str], cwd: Path = ROOT) -> list[str]:
        """`argv` run as a process of `node`, in `cwd` (nsenter's --wd: a Popen cwd is lost there)."""
        return on_host(self.inits[node], argv, str(cwd))

    def env(self, **extra: str) -> dict[str, str]:
        base = {k: v for k, v in os.environ.items() if not k.startswith("AUTOTUNE_") or k == SWITCH_ENV}
        return {**base, "AUTOTUNE_REDIS_URL": self.url, **extra}

    def deploy(self, *args: str) -> subprocess.CompletedProcess:
        """`python -m deploy ARGS` run on node 1, with the test's hostfile, SSH config and run folder."""
        argv = self.on("node1", [PYTHON, "-m", "deploy", *args, "--hostfile", str(self.hostfile),
                                 "--ssh-config", str(self.ssh_config), "--run-dir", str(self.run_dir)])
        done = subprocess.run(argv, env=self.env(), capture_output=True, text=True, timeout=180)
        print(f"$ python -m deploy {' '.join(args)}  (exit {done.returncode})\n{done.stdout}{done.stderr}")
        return done

    def redis(self, *calls: list) -> list:
        done = subprocess.run(self.on("node1", [PYTHON, "-c", REDIS_ON_NODE1, json.dumps(calls)]),
                              env=self.env(), capture_output=True, text=True, timeout=60, check=True)
        return json.loads(done.stdout)

    def group(self, node: str, pgid: int) -> dict[str, str]:
        """The live members of process group `pgid` as seen from inside `node` (its own PIDs)."""
        done = subprocess.run(self.on(node, [PYTHON, "-c", GROUP_ON_HOST, str(pgid)]), capture_output=True,
                              text=True, timeout=60, check=True)
        return json.loads(done.stdout)

    def accepted_logins(self, node: str) -> int:
        """SSH logins `node`'s sshd accepted so far (from its log)."""
        return (self.sshds[node].folder / "sshd.log").read_text(errors="replace").count("Accepted publickey")

    def residents(self, node: str) -> list[str]:
        """The argv of every process on `node` besides its init."""
        found = []
        for pid in processes_of(self.inits[node]):
            if pid != self.inits[node]:
                try:
                    found.append(f"{pid}: " + Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " "))
                except OSError:
                    pass
        return found


def lines_of(output: str) -> dict[str, str]:
    return {line.split(":", 1)[0]: line for line in output.splitlines() if ":" in line}


def _local_pid(root_pid: int) -> int:
    """The PID a process has inside its own PID namespace (the last NSpid field); -1 once gone."""
    try:
        status = Path(f"/proc/{root_pid}/status").read_text()
    except OSError:
        return -1
    return int(next(line for line in status.splitlines() if line.startswith("NSpid:")).split()[-1])


def _workers_of(cluster: TwoHosts, node: str) -> dict[str, int]:
    """Celery worker name (-n) -> root PID, for each worker `deploy up` recorded for `node` (its
    pidfiles hold PIDs as `node` numbers them) that runs in `node`'s own process space. Matched
    by the name anywhere in the command line: with setproctitle installed, Celery rewrites it to
    `[celeryd: gpu0@node2:MainProcess] ...` (and overwrites /proc/PID/environ with it)."""
    by_local = {_local_pid(pid): pid for pid in processes_of(cluster.inits[node])}
    found = {}
    for pidfile in cluster.run_dir.glob(f"{node}.*.pid"):
        name = {"gpu0": f"gpu0@{node}", "control": f"control@{node}"}[pidfile.stem.rsplit(".", 1)[1]]
        root = by_local.get(int(json.loads(pidfile.read_text())["pid"]))
        try:
            if root is not None and name in Path(f"/proc/{root}/cmdline").read_text().replace("\0", " "):
                found[name] = root
        except OSError:
            continue
    return found


@pytest.fixture(scope="module")
def cluster(request, tmp_path_factory) -> TwoHosts:
    """node1 and node2: namespaces, each host's sshd as init of its own process space, one client
    key both accept, and Redis (password) on node 1's address. Finalizers are added as things start,
    so a failure half-way still removes them: Redis by PID, each host by killing its init (the
    kernel then kills every process of that host), the namespaces last."""
    for tool in ("redis-server", "nsenter", "unshare"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} is required (deploy/setup_tests.sh installs it)")
    if not Path("/usr/sbin/sshd").exists():
        pytest.fail("openssh-server is required (deploy/setup_tests.sh installs it)")
    try:
        pair = create_two_hosts("cad")
    except NamespacesUnavailable as exc:
        if sys.platform == "linux" and os.geteuid() == 0:  # root on Linux can: something is broken
            pytest.fail(f"root on Linux, yet no network namespaces: {exc}")
        pytest.skip(f"two-host deploy tests need network namespaces (root on Linux): {exc}")

    def delete() -> None:
        left = delete_hosts(pair)
        assert not left and not any(namespace_exists(h.namespace) for h in pair), f"namespaces left: {left}"

    request.addfinalizer(delete)
    hosts = dict(zip(NODES, pair))
    folder = tmp_path_factory.mktemp("deploy-two-hosts")
    sshds: dict[str, TestSshd] = {}
    inits: dict[str, int] = {}
    for node, host in hosts.items():
        sshd = start_sshd(folder / node, SSH_PORT, listen=host.address, wrap=own_processes(host),
                          authorize=folder / "node1" / "id_ed25519.pub" if node != "node1" else None)
        request.addfinalizer(lambda sshd=sshd: _stop_host(sshd))
        sshds[node], inits[node] = sshd, init_of(sshd.proc.pid)

    password = secrets.token_hex(12)
    redis_proc = subprocess.Popen(["ip", "netns", "exec", hosts["node1"].namespace, "redis-server", "-"],
                                  stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, start_new_session=True)
    redis_proc.stdin.write(f"port {REDIS_PORT}\nbind {hosts['node1'].address}\nrequirepass {password}\n"
                           f"save \"\"\nappendonly no\ndir {folder}\n".encode())
    redis_proc.stdin.close()
    request.addfinalizer(lambda: stop_group(redis_proc, signal.SIGTERM, 10))

    config = sshds["node1"].ssh_config({node: (host.address, SSH_PORT) for node, host in hosts.items()},
                                       folder / "known_hosts")
    hostfile = folder / "hostfile"
    hostfile.write_text("node1 slots=1\nnode2 slots=1\n")
    cluster = TwoHosts(hosts, inits, sshds, f"redis://:{password}@{hosts['node1'].address}:{REDIS_PORT}/0",
                       config, hostfile, folder / "run")
    wait_for(lambda: cluster.redis(["ping"]) == [True], 30, "Redis on node 1")
    return cluster


def _stop_host(sshd: TestSshd) -> None:
    """SIGKILL the host's init: the kernel kills every process of its PID namespace with it."""
    for pid in processes_of(init_of(sshd.proc.pid)) if sshd.proc.poll() is None else []:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    sshd.stop()


def _up(cluster: TwoHosts) -> dict[str, str]:
    done = cluster.deploy("up", "--control", "node1", "--accept-new-host-keys", "--timeout", "90")
    shown = lines_of(done.stdout)
    assert done.returncode == 0, done.stdout + done.stderr + _logs(cluster)
    assert shown["node1"] == "node1: ok: 1 slot(s) registered (node1.gpu0); control started", shown
    assert shown["node2"] == "node2: ok: 1 slot(s) registered (node2.gpu0)", shown
    return shown


def _logs(cluster: TwoHosts, limit: int = 1500) -> str:
    return "\n".join(f"--- {log.name}\n{log.read_text(errors='replace')[-limit:]}"
                     for log in sorted(cluster.run_dir.glob("*.log")))


def _stubborn_group(cluster: TwoHosts, node: str, slot: str) -> tuple[subprocess.Popen, int]:
    """A SIGTERM-ignoring group started on `node` for `slot`: (the nsenter holding it, the leader's
    PID as `node` knows it)."""
    proc = subprocess.Popen(cluster.on(node, [PYTHON, "-c", STUBBORN_GROUP]),
                            env={**cluster.env(), "AUTOTUNE_SLOT": slot, "STUBBORN_TITLE": RankIdentity(
                                slot, "twohostjob", "z1_two", 0, 1, "a-two").title()}, stdout=subprocess.PIPE,
                            text=True, start_new_session=True)
    return proc, int(proc.stdout.readline())


def _kill_nsentered(proc: subprocess.Popen) -> None:
    """Kill what `nsenter` started (its child leads its own group) and nsenter itself, by PID."""
    try:
        for child in psutil.Process(proc.pid).children():
            os.killpg(child.pid, signal.SIGKILL)
    except (psutil.Error, ProcessLookupError):
        pass
    stop_group(proc, signal.SIGKILL, 10)


def _tune_with_node2_hanging(cluster: TwoHosts, folder: Path, behaviour: str) -> tuple[subprocess.Popen, Path]:
    """`python -m scheduler.autotune` started on node 1 for two one-slot experiments whose rank
    hangs (ignoring SIGTERM) wherever it runs on node2.gpu0 and behaves as `behaviour` says
    (fake_train's --behaviour) elsewhere; returns once an experiment hangs on node 2, with its
    folder. Leases are LEASE_S, so only a really dead worker loses its launch."""
    script = folder / "hangs_on_node2.py"
    script.write_text(HANGS_ON_NODE2.replace("FAKE_TRAIN_PATH", repr(str(SCRIPTS / "fake_train.py"))))
    cfg = write_config(folder / "cfg.json", train_micro_batch_size_per_gpu=[1, 2])
    config = json.loads(cfg.read_text())
    config["autotuning"]["user_args"] = ["--behaviour", behaviour]
    config["autotuning"]["model_info"] = {"num_params": 1000, "trainable_num_params": 1000,
                                          "activation_mem_per_gpu": 2**20}
    cfg.write_text(json.dumps(config))
    results = folder / "autotuning_results"
    argv = cluster.on("node1", [PYTHON, "-m", "scheduler.autotune", str(cfg), "--num_gpus", "1",
                                "--exp-timeout", "120", "--", str(script)], cwd=folder)
    env = cluster.env(AUTOTUNE_LEASE_S=f"{LEASE_S:g}", AUTOTUNE_SSH_CONFIG=str(cluster.ssh_config))
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        wait_for(lambda: any(results.glob("*/hung.node2")) or proc.poll() is not None, 60,
                 "an experiment to start on node 2")
        assert proc.poll() is None, "the autotuner ended before an experiment hung on node 2"
    except BaseException:
        _stop_tuner(proc, cluster)
        raise
    return proc, next(results.glob("*/hung.node2")).parent


def _stop_tuner(proc: subprocess.Popen, cluster: TwoHosts) -> tuple[str, str]:
    """SIGTERM (the CLI cancels its running experiments), then its output, shown with the logs."""
    if proc.poll() is None:
        stop_group(proc, signal.SIGTERM, 20)
    out, err = proc.communicate()
    print(f"autotune (exit {proc.returncode}):\n{out}\n{err}\n{_logs(cluster)}")
    return out, err


def _down(cluster: TwoHosts, expected: dict[str, str], deadline_s: float = 20) -> None:
    done = cluster.deploy("down", "--control", "node1", "--deadline", f"{deadline_s:g}")
    assert done.returncode == 0, done.stdout + done.stderr
    assert lines_of(done.stdout) == expected, done.stdout + _logs(cluster)


def _nothing_left(cluster: TwoHosts) -> None:
    for node in NODES:
        wait_for(lambda node=node: not cluster.residents(node), 15, f"{node} to run nothing but its sshd")


def test_up_status_cleanup_down_across_two_hosts(cluster, tmp_path):
    logins = {node: cluster.accepted_logins(node) for node in NODES}
    _up(cluster)
    # Each worker runs on the host that owns its slot, in that host's process space (a worker
    # started on the wrong host, or locally instead of over SSH, would not be found there).
    workers = {node: _workers_of(cluster, node) for node in NODES}
    assert set(workers["node1"]) == {"gpu0@node1", "control@node1"}, workers
    assert set(workers["node2"]) == {"gpu0@node2"}, workers
    assert all(cluster.accepted_logins(node) > logins[node] for node in NODES)

    done = cluster.deploy("status")
    shown = lines_of(done.stdout)
    assert done.returncode == 0
    for node in NODES:  # the PID each host itself knows its worker by: status asked that host
        pid = _local_pid(workers[node][f"gpu0@{node}"])
        assert shown[f"{node}.gpu0"] == f"{node}.gpu0: idle (worker gpu0@{node}, pid {pid})", shown

    # A launch running on node 2 whose rank group ignores SIGTERM; another group on node 2 runs the
    # same slot but belongs to no recorded launch.
    rank, rank_pgid = _stubborn_group(cluster, "node2", "node2.gpu0")
    stranger, stranger_pgid = _stubborn_group(cluster, "node2", "node2.gpu0")
    try:
        launch = {"seq": 1, "exp": {"name": "z1_two"}, "argv": [], "attempt": "a-two", "queues": ["node2.gpu0"],
                  "token": "tok", "rank_tasks": {"node2.gpu0": "t-rank"}, "started": time.time(),
                  "deadline": time.time() + 3600}
        cluster.redis(["zadd", keys.JOBS, {"twohostjob": 1}],
                      ["hset", keys.job_running("twohostjob"), "z1_two", json.dumps(launch)],
                      ["set", keys.pgid("node2.gpu0", "t-rank"), rank_pgid])
        assert len(cluster.group("node2", rank_pgid)) == 2 and len(cluster.group("node2", stranger_pgid)) == 2
        before = cluster.accepted_logins("node2")

        done = cluster.deploy("cleanup", "twohostjob:z1_two", "--grace", "1")
        shown = lines_of(done.stdout)
        assert done.returncode == 0, done.stdout + done.stderr
        assert shown["node2"] == (f"node2: node2.gpu0={rank_pgid} killed with SIGKILL after 1s "
                                  "(ignored SIGTERM)"), done.stdout
        assert cluster.accepted_logins("node2") > before, "the kill must go to node 2 over SSH"
        assert cluster.group("node2", rank_pgid) == {}, "the recorded group is still running on node 2"
        assert len(cluster.group("node2", stranger_pgid)) == 2, "an unrecorded group must never be killed"
        assert rank.wait(timeout=10) != 0
    finally:
        for proc in (rank, stranger):
            _kill_nsentered(proc)
        cluster.redis(["delete", keys.job_running("twohostjob"), keys.pgid("node2.gpu0", "t-rank")],
                      ["zrem", keys.JOBS, "twohostjob"])

    # `down` while node 2 runs a rank that ignores SIGTERM: node 1's idle workers stop warm; node 2's
    # worker waits for its experiment until the deadline, then stops cold, killing the rank's group.
    # The deadline is what an idle worker's warm shutdown needs with 3 test processes on 2 cores
    # (3 s was once too short there: node 1 reported cold though its workers had begun a warm one).
    tuner, hung = _tune_with_node2_hanging(cluster, tmp_path, "1=ok,2=ok")
    try:
        hung_pid = int((hung / "hung.node2").read_text())
        wait_for(lambda: len(list(tmp_path.glob("autotuning_results/*/result.json"))) == 1, 30,
                 "the other experiment to finish on node 1")
        _down(cluster, {"node1": "node1: node1.control warm shutdown; node1.gpu0 warm shutdown",
                        "node2": "node2: node2.gpu0 cold shutdown"}, deadline_s=12)
        assert cluster.group("node2", hung_pid) == {}, "a cold shutdown must kill the running rank's group"
    finally:
        _stop_tuner(tuner, cluster)
    _nothing_left(cluster)
    done = cluster.deploy("status")
    assert lines_of(done.stdout)["node2.gpu0"] == "node2.gpu0: down" and done.returncode == 1


def test_node_lost_its_training_group_is_killed_over_ssh_and_the_experiment_reruns_on_node1(cluster, tmp_path):
    """Node 2's slot worker is SIGKILLed while its rank runs (and ignores SIGTERM), as when a node's
    worker dies but the training lives on: the sweep declares the launch lost once the worker's
    heartbeat is gone, the scheduler hook kills the group on node 2 over SSH (the control worker
    on node 1 cannot even see it), and the experiment is measured again on node 1."""
    _up(cluster)
    proc, victim = _tune_with_node2_hanging(cluster, tmp_path, "1=slow2,2=slow2")
    out = err = ""
    try:
        hung_pid = int((victim / "hung.node2").read_text())
        assert len(cluster.group("node2", hung_pid)) == 2

        worker = _local_pid(_workers_of(cluster, "node2")["gpu0@node2"])
        subprocess.run(cluster.on("node2", ["kill", "-KILL", str(worker)]), check=True, timeout=30)
        killed_at = time.monotonic()
        assert len(cluster.group("node2", hung_pid)) == 2, "the training group outlives its worker"

        # Bounded by the work: heartbeat gone + a sweep, TERM grace, a 2 s re-run, interpreter starts.
        out, err = proc.communicate(timeout=LEASE_S + CLEANUP_GRACE_S + 60)
    finally:
        if not out and not err:
            out, err = _stop_tuner(proc, cluster)
    assert proc.returncode == 0, out + err + _logs(cluster)
    record = json.loads((victim / "result.json").read_text())
    assert record["status"] == "ok" and record["slots"] == ["node1.gpu0"], record

    control_log = cluster.run_dir / "node1.control.log"
    wait_for(lambda: f"cleanup of {victim.name} on node2:" in control_log.read_text(errors="replace"),
             CLEANUP_GRACE_S + 30, "the scheduler's clean-up of node 2 to finish")
    line = next(line for line in control_log.read_text().splitlines() if f"cleanup of {victim.name} on node2:" in line)
    assert re.search(rf"node2\.gpu0={hung_pid}@\d+.: .killed with SIGKILL after 5s \(ignored SIGTERM\)", line), line
    assert cluster.group("node2", hung_pid) == {}, "the lost launch's group still runs on node 2"
    print(f"\nnode 2's worker killed -> job complete, its group killed over SSH: "
          f"{time.monotonic() - killed_at:.1f}s\n{line}")

    _down(cluster, {"node1": "node1: node1.control warm shutdown; node1.gpu0 warm shutdown",
                    "node2": "node2: node2.gpu0 not running"})
    _nothing_left(cluster)
