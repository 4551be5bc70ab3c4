"""A real two-node cluster on one machine: two network namespaces joined by a veth pair.

Node 1 runs redis-server, a slot worker and the control worker; node 2 runs a slot worker that
reaches Redis only across the veth link. The autotuner runs on node 1. This is the one place where
a multi-node experiment really crosses a network: rank 0 must publish an address that node 2 can
reach (not 127.0.0.1), and gloo's all-reduce must travel over the link. It also checks that a rank
failing on one node stops its peer on the other node at once.

Every client of the namespace addresses runs inside a namespace (`ip netns exec`), never from the
root namespace, where those addresses would be routed off the machine (see netns.py).
"""
from __future__ import annotations

import json
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from integration_helpers import (ROOT, SCRIPTS, outside_workers, processes_with_marker, stop_group, wait_for,
                                 write_config)
from netns import Host, NamespacesUnavailable, create_two_hosts, delete_hosts, inside, namespace_exists

pytestmark = pytest.mark.integration

PYTHON = sys.executable
NODES = ("node1", "node2")
REDIS_PORT = 6379  #: each namespace has its own port space, so the default port cannot clash
WORKER_GRACE_S = 10.0
REGISTER_TIMEOUT_S = 60.0

#: Runs inside node 1: waits until Redis answers and at least `slots` slots (and, if asked, a
#: control worker) are registered, then prints what it saw as JSON. One process per wait, because
#: each client started through `ip netns exec` costs an interpreter start.
PROBE = r"""
import json, os, sys, time
from workers.state import connection, keys
from workers.state.registry import control_alive, live_slots

timeout, want_slots, want_control = float(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "control"
client = connection.connect(os.environ["AUTOTUNE_REDIS_URL"])
deadline = time.monotonic() + timeout
while True:
    try:
        state = {"slots": {s.queue: {"node": s.node, "address": s.address, "worker": s.worker}
                           for s in live_slots(client)},
                 "control": control_alive(client),
                 "gangs": sorted(k.decode() for k in client.scan_iter(match=keys.gang("*")))}
        ready = len(state["slots"]) >= want_slots and (state["control"] or not want_control)
    except Exception as exc:
        state, ready = {"error": f"{type(exc).__name__}: {exc}"}, False
    if ready or time.monotonic() >= deadline:
        break
    time.sleep(0.2)
print(json.dumps(state))
sys.exit(0 if ready else 1)
"""

#: The failing experiment of test 2: rank 1 (node 2) crashes after a second, rank 0 (node 1) would
#: sleep for ten minutes unless the abort reaches it. Both write their pid first, like fake_train.
CRASH_ON_NODE2 = r"""
import argparse, os, sys, time
from pathlib import Path

parser = argparse.ArgumentParser()
parser.add_argument("--deepspeed_config", required=True)
parser.add_argument("--local_rank", type=int)  # tuned runs get it, as from DeepSpeed's launcher
args = parser.parse_args()
rank = int(os.environ["RANK"])
Path(args.deepspeed_config).parent.joinpath(f"started.rank{rank}").write_text(str(os.getpid()))
if rank == 1:
    time.sleep(1)
    sys.exit(3)
time.sleep(600)
"""


@dataclass(frozen=True)
class Cluster:
    hosts: tuple[Host, Host]
    url: str  #: Redis on node 1's address; only usable from inside a namespace
    marker: str
    logs: Path
    start_node2: Callable[[], None]  #: start node 2's slot worker again (after a test killed it)


def _log_tails(logs: Path, limit: int = 1500) -> str:
    return "\n".join(f"--- {log.name}\n{log.read_text(errors='replace')[-limit:]}"
                     for log in sorted(logs.glob("*.log")))


def _probe(cluster_env: dict[str, str], node1: Host, timeout: float, slots: int = 0,
           control: bool = False) -> tuple[bool, dict]:
    """Redis's view of the cluster (slots, control, gang reservations), read from inside node 1,
    never from the root namespace (see the module docstring); True once the wait was satisfied."""
    argv = inside(node1, [PYTHON, "-c", PROBE, str(timeout), str(slots), "control" if control else "any"])
    done = subprocess.run(argv, env=cluster_env, cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout + 30)
    try:
        state = json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        state = {"error": done.stdout + done.stderr}
    return done.returncode == 0, state


def _start_redis(node1: Host, password: str, workdir: Path) -> subprocess.Popen:
    """redis-server bound to node 1's address; the config comes on stdin to keep the password out
    of argv, and the password is needed because Redis refuses non-loopback clients without one."""
    proc = subprocess.Popen(inside(node1, ["redis-server", "-"]), stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, start_new_session=True)
    proc.stdin.write(f"port {REDIS_PORT}\nbind {node1.address}\nrequirepass {password}\n"
                     f"save \"\"\nappendonly no\ndir {workdir}\n".encode())
    proc.stdin.close()
    return proc


def _worker_command(host: Host, node: str, queue: str, concurrency: int) -> list[str]:
    """A worker started as the README says (`-Q gpu0 -n gpu0@<node>`), on a host named `node`."""
    celery = shlex.join([PYTHON, "-m", "celery", "-A", "tasks", "worker", "-Q", queue, "-n",
                         f"{queue}@{node}", "-c", str(concurrency), "--without-gossip",
                         "--without-mingle", "-l", "INFO"])
    return inside(host, ["unshare", "--uts", "sh", "-c", f"hostname {node} && exec {celery}"])


def _worker_env(base: dict[str, str], host: Host) -> dict[str, str]:
    """The operator's environment on one node. No GLOO_SOCKET_IFNAME: `node1`/`node2` resolve to
    nothing, so gloo would fall back to loopback, unless the rank's environment names the interface
    holding the slot's address, as workers/slot/rank.py does; this test proves it does."""
    return dict(base)


@pytest.fixture(scope="module")
def hosts(request) -> tuple[Host, Host]:
    """node1 and node2 as namespaces; skipped, not failed, where namespaces are not permitted,
    because that is a property of the machine running the tests, not of the code under test."""
    try:
        pair = create_two_hosts()
    except NamespacesUnavailable as exc:
        pytest.skip(f"two-node tests need network namespaces: {exc}")

    def delete() -> None:
        left = delete_hosts(pair)
        assert not left and not any(namespace_exists(h.namespace) for h in pair), \
            f"network namespaces left behind: {left}"

    request.addfinalizer(delete)
    return pair


@pytest.fixture(scope="module")
def cluster(hosts, request, tmp_path_factory) -> Cluster:
    """Redis + slot worker + control worker on node 1, a slot worker on node 2, all registered.

    Finalizers are added as each process starts, so a failure half-way still stops what started:
    workers first (SIGQUIT to their groups, as a node shutdown would), then Redis by PID; and at
    the very end nothing that carries this module's marker may remain.
    """
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is required for integration tests (apt-get install -y redis-server)")
    node1, node2 = hosts
    password, marker = secrets.token_hex(12), secrets.token_hex(8)
    logs = tmp_path_factory.mktemp("two-node-logs")
    url = f"redis://:{password}@{node1.address}:{REDIS_PORT}/0"
    base_env = {key: value for key, value in os.environ.items()
                if key not in ("AUTOTUNE_NODE", "AUTOTUNE_ADDRESS", "AUTOTUNE_REDIS_URL")}
    base_env.update({"AUTOTUNE_REDIS_URL": url, "AUTOTUNE_SLOT_MEMORY": "1GiB",
                     "AUTOTUNE_SLOTS_PER_NODE": "1", "AUTOTUNE_TEST_MARKER": marker})

    request.addfinalizer(lambda: _kill_leftovers(marker))
    redis_proc = _start_redis(node1, password, tmp_path_factory.mktemp("two-node-redis"))
    request.addfinalizer(lambda: stop_group(redis_proc, signal.SIGTERM, WORKER_GRACE_S))
    up, state = _probe(base_env, node1, 15)
    assert up, f"redis-server in {node1.namespace} did not answer: {state}"

    def start(host: Host, node: str, queue: str, concurrency: int) -> None:
        with open(logs / f"{queue}@{node}.log", "ab") as log:
            proc = subprocess.Popen(_worker_command(host, node, queue, concurrency),
                                    cwd=ROOT, env=_worker_env(base_env, host), stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        request.addfinalizer(lambda: stop_group(proc, signal.SIGQUIT, WORKER_GRACE_S))

    for host, node, queue, concurrency in ((node1, NODES[0], "gpu0", 1), (node2, NODES[1], "gpu0", 1),
                                           (node1, NODES[0], "control", 2)):
        start(host, node, queue, concurrency)

    ready, state = _probe(base_env, node1, REGISTER_TIMEOUT_S, slots=2, control=True)
    assert ready, f"workers did not register within {REGISTER_TIMEOUT_S}s: {state}\n{_log_tails(logs)}"
    assert state["slots"] == {
        f"{NODES[0]}.gpu0": {"node": NODES[0], "address": node1.address, "worker": f"gpu0@{NODES[0]}"},
        f"{NODES[1]}.gpu0": {"node": NODES[1], "address": node2.address, "worker": f"gpu0@{NODES[1]}"},
    }, state
    return Cluster(hosts, url, marker, logs, start_node2=lambda: start(node2, NODES[1], "gpu0", 1))


def _bring_node2_back(cluster: Cluster) -> None:
    """Start node 2's slot worker again and wait until both slots are registered."""
    cluster.start_node2()
    ready, state = _probe({**os.environ, "AUTOTUNE_REDIS_URL": cluster.url}, cluster.hosts[0],
                          REGISTER_TIMEOUT_S, slots=2, control=True)
    assert ready, f"node 2's worker did not register again: {state}\n{_log_tails(cluster.logs)}"


def _kill_leftovers(marker: str) -> None:
    """The last finalizer: whatever still carries the marker is a leak; kill it, then fail."""
    deadline = time.monotonic() + 5
    while (left := processes_with_marker(marker)) and time.monotonic() < deadline:
        time.sleep(0.2)
    described = [f"{p.pid} {' '.join(_cmdline(p))}" for p in left]
    for proc in left:
        try:
            proc.kill()
        except psutil.Error:
            pass
    assert not left, f"processes left behind after teardown: {described}"


def _cmdline(proc: psutil.Process) -> list[str]:
    try:
        return proc.cmdline()
    except psutil.Error:
        return ["?"]


def _autotune_on_node1(cluster: Cluster, args: list[str], cwd: Path, timeout: float,
                       module: str = "scheduler.autotune") -> tuple[subprocess.CompletedProcess, float]:
    """`python -m scheduler.autotune` (or `module`: scheduler.cli is `celery-autotune`) run on node 1,
    and its wall time. On a timeout it gets SIGTERM first, which the CLI turns into a cancel of its
    running experiments, so nothing is orphaned."""
    env = {**os.environ, "AUTOTUNE_REDIS_URL": cluster.url, "AUTOTUNE_TEST_MARKER": cluster.marker}
    argv = inside(cluster.hosts[0], [PYTHON, "-m", module, *args])
    started = time.monotonic()
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            stop_group(proc, signal.SIGKILL, 5)
            out, err = proc.communicate()
        raise AssertionError(f"autotune did not finish within {timeout}s:\n{out}\n{err}\n"
                             f"{_log_tails(cluster.logs)}") from None
    wall = time.monotonic() - started
    return subprocess.CompletedProcess(argv, proc.returncode, out, err), wall


def _result(results: Path, name: str) -> dict:
    return json.loads((results / name / "result.json").read_text())


def _only_workers_remain(cluster: Cluster) -> bool:
    """No rank, nor anything a rank started, is left: only the workers and what is their own (their
    pool processes, their warm interpreters)."""
    return not outside_workers(processes_with_marker(cluster.marker))


def test_two_node_experiments_meet_across_the_link(cluster, tmp_path):
    """Every experiment spans node1.gpu0 and node2.gpu0; rank 0 publishes node 1's link address,
    and the two ranks' gloo all-reduce (done by fake_train when WORLD_SIZE > 1) crosses the veth."""
    cfg = write_config(tmp_path / "cfg.json", train_micro_batch_size_per_gpu=[2],
                       zero_optimization={"stage": [0, 1]})
    proc, _ = _autotune_on_node1(cluster, [str(cfg), "--num_nodes", "2", "--num_gpus", "1",
                                           "--exp-timeout", "60"], tmp_path, timeout=75)
    assert proc.returncode == 0, proc.stdout + proc.stderr + _log_tails(cluster.logs)

    node1 = cluster.hosts[0]
    results = tmp_path / "autotuning_results"
    measured = sorted(p.parent.name for p in results.glob("*/result.json"))
    assert {"profile_model_info", "z0_gas1_tmbspg2", "z1_gas1_tmbspg2"} <= set(measured), measured
    for name in measured:
        record = _result(results, name)
        assert record["status"] == "ok", record
        assert [(r["rank"], r["slot"]) for r in record["ranks"]] == [(0, "node1.gpu0"), (1, "node2.gpu0")]
        masters = {r["master"] for r in record["ranks"]}
        assert len(masters) == 1 and next(iter(masters)).rpartition(":")[0] == node1.address, record
        if name != "profile_model_info":
            assert record["metrics"]["world_size"] == 2
            assert record["metrics"]["master"] == record["ranks"][0]["master"]
    winner = json.loads((results / "ds_config_optimal.json").read_text())
    assert winner["zero_optimization"]["stage"] == 0  # fake_train: throughput halves at stage 1
    _, state = _probe({**os.environ, "AUTOTUNE_REDIS_URL": cluster.url}, node1, 0)
    assert state.get("gangs") == [], state
    wait_for(lambda: _only_workers_remain(cluster), 10, "only worker processes to remain")


def test_the_hostfile_pool_keeps_the_tuning_off_an_excluded_node(cluster, tmp_path):
    """`celery-autotune --autotuning tune --hostfile hosts --exclude node1`, run on node 1:
    every experiment runs on node 2's slot, none on node 1's (which is free all along, and which the
    placement would take first), and cmd_optimal.txt trains on one node as tuned."""
    cfg = write_config(tmp_path / "cfg.json", train_micro_batch_size_per_gpu=[1, 2, 3])
    hosts = tmp_path / "hosts"
    hosts.write_text(f"{NODES[0]} slots=1\n{NODES[1]} slots=1\n")
    proc, _ = _autotune_on_node1(cluster, ["--autotuning", "tune", "--hostfile", str(hosts), "--exclude", NODES[0],
                                           "--exp-timeout", "60", str(SCRIPTS / "fake_train.py"),
                                           "--deepspeed_config", str(cfg)],
                                 tmp_path, timeout=120, module="scheduler.cli")
    assert proc.returncode == 0, proc.stdout + proc.stderr + _log_tails(cluster.logs)
    results = tmp_path / "autotuning_results"
    measured = sorted(p.parent.name for p in results.glob("*/result.json"))
    assert len([name for name in measured if name.startswith("z0_")]) >= 3, measured  # confirmations: _r2
    for name in measured:
        assert [r["slot"] for r in _result(results, name)["ranks"]] == [f"{NODES[1]}.gpu0"], name
    command = (results / "cmd_optimal.txt").read_text()
    assert f"--hostfile {results / 'hostfile_optimal'} --num_nodes 1 --num_gpus 1" in command, command
    assert (results / "hostfile_optimal").read_text() == f"{NODES[1]} slots=1\n"
    wait_for(lambda: _only_workers_remain(cluster), 10, "only worker processes to remain")


def test_rank_failure_on_node2_stops_node1_at_once(cluster, tmp_path):
    """Rank 1 exits 3 on node 2 after a second; rank 0 on node 1 would sleep 600 s. The abort flag
    in Redis must reach node 1 within seconds: the experiment is `crashed` with the cause on rank 1,
    rank 0 is `aborted`, and its process is gone. A crash says nothing about the config, so it is
    launched once more as `<name>_r2` (scheduler.search.repeats.relaunch), which fails and is
    stopped the same way; the first launch's record keeps its own crash."""
    script = tmp_path / "crash_on_node2.py"
    script.write_text(CRASH_ON_NODE2)
    cfg = write_config(tmp_path / "cfg.json", train_micro_batch_size_per_gpu=[2],
                       zero_optimization={"stage": [0]})
    config = json.loads(cfg.read_text())
    config["autotuning"]["model_info"] = {"num_params": 1000, "trainable_num_params": 1000,
                                          "activation_mem_per_gpu": 24 * 2**20}
    cfg.write_text(json.dumps(config))

    proc, wall = _autotune_on_node1(cluster, [str(cfg), "--num_nodes", "2", "--num_gpus", "1",
                                              "--exp-timeout", "60", "--", str(script)],
                                    tmp_path, timeout=45)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # no experiment succeeded
    assert wall < 30, f"the autotuner took {wall:.1f}s: rank 0 was not stopped when rank 1 failed"

    results = tmp_path / "autotuning_results"
    launches = ["z0_gas1_tmbspg2", "z0_gas1_tmbspg2_r2"]  # the experiment and its one relaunch
    assert sorted(p.parent.name for p in results.glob("*/result.json")) == launches
    for name in launches:
        record = _result(results, name)
        assert record["name"] == name and record["status"] == "crashed", record
        assert record["cause"]["rank"] == 1 and record["cause"]["slot"] == "node2.gpu0"
        assert record["cause"]["exit"] == "exit 3"
        rank0, rank1 = record["ranks"]
        assert (rank0["slot"], rank0["status"]) == ("node1.gpu0", "aborted"), rank0
        assert (rank1["slot"], rank1["status"]) == ("node2.gpu0", "crashed"), rank1
        assert rank0["ended_at"] - rank1["ended_at"] < 5, (rank0, rank1)
        assert rank0["wall_s"] < 15, rank0
        sleeper = int((results / name / "started.rank0").read_text())
        assert not psutil.pid_exists(sleeper) or psutil.Process(sleeper).status() == psutil.STATUS_ZOMBIE
    assert _result(results, launches[1])["started_at"] >= _result(results, launches[0])["ended_at"]
    wait_for(lambda: _only_workers_remain(cluster), 10, "only worker processes to remain")


def test_node_lost_mid_experiment(cluster, tmp_path, request):
    """Node 2 dies at once (its worker and its training process SIGKILLed, nothing cleaned up) while
    each node runs a one-slot experiment. Node 2's slot stops renewing its lease and heartbeat, the
    control worker's sweep declares that launch lost and runs it again on node 1; the job completes
    with both experiments measured and no slot reserved. Node 2's worker is started again at the
    end, so the tests after this one (in any order) find both nodes."""
    cfg = write_config(tmp_path / "cfg.json", train_micro_batch_size_per_gpu=[1, 2])
    config = json.loads(cfg.read_text())
    config["autotuning"]["user_args"] = ["--behaviour", "1=slow8,2=slow8"]
    config["autotuning"]["model_info"] = {"num_params": 1000, "trainable_num_params": 1000,
                                          "activation_mem_per_gpu": 2**20}
    cfg.write_text(json.dumps(config))
    results = tmp_path / "autotuning_results"
    env = {**os.environ, "AUTOTUNE_REDIS_URL": cluster.url, "AUTOTUNE_TEST_MARKER": cluster.marker,
           "AUTOTUNE_LEASE_S": "15"}
    argv = inside(cluster.hosts[0], [PYTHON, "-m", "scheduler.autotune", str(cfg), "--num_gpus", "1",
                                     "--exp-timeout", "60"])
    proc = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        wait_for(lambda: len(list(results.glob("*/started.rank0"))) == 2, 60, "both experiments to start")
        victim = next(d for d in results.iterdir()
                      if json.loads((d / "exp.json").read_text())["slots"] == ["node2.gpu0"])
        node2 = [p for p in processes_with_marker(cluster.marker) if "gpu0@node2" in " ".join(_cmdline(p))]
        doomed = {p for worker in node2 for p in [worker, *worker.children(recursive=True)]}
        assert any(p.pid == int((victim / "started.rank0").read_text()) for p in doomed)
        for process in doomed:
            process.kill()
        lost_at = time.monotonic()
        request.addfinalizer(lambda: _bring_node2_back(cluster))
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            stop_group(proc, signal.SIGKILL, 5)
    assert proc.returncode == 0, out + err + _log_tails(cluster.logs)
    recovered = time.monotonic() - lost_at
    record = _result(results, victim.name)
    assert record["status"] == "ok" and record["slots"] == ["node1.gpu0"], record
    _, state = _probe({**os.environ, "AUTOTUNE_REDIS_URL": cluster.url}, cluster.hosts[0], 0)
    assert state.get("gangs") == [] and list(state.get("slots", {})) == ["node1.gpu0"], state
    print(f"\nnode lost -> job complete with the experiment re-run on node 1: {recovered:.1f}s")
