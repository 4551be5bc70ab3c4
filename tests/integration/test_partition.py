"""A node cut off from Redis for twice its lease while its rank runs, then reconnected.

Two network namespaces (netns.py): node 1 runs redis-server, a slot worker and the control worker;
node 2 runs a slot worker that reaches Redis only across the veth link, which the test takes down
while node 2's rank runs. The rank runs on by design (a Redis outage is no reason to stop), its
lease lapses, and the control worker launches the experiment again. When the link comes back the
cut-off launch is stopped or has finished, and the relaunch is the launch counted: its own metrics
are the experiment's (rank 0 writes its MASTER address into them, so a metrics file read across
launches shows the other launch's master), each experiment has one record, and no slot stays
reserved. The cut-off launch writes its metrics while the cut lasts and the relaunch runs (each
launch under its own file names, `workers.files.layout.LAUNCH_FILES`), and its record reaches the
control worker once the link is back, where the fence (`scheduler.cluster.fencing`) keeps it out.
Slow (about a minute and a half): a cluster of its own, a lease to lapse and a relaunch to finish.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from integration_helpers import ROOT, stop_group, wait_for, write_config
from netns import NamespacesUnavailable, create_two_hosts, delete_hosts, inside
from test_two_nodes import NODES, PYTHON, _kill_leftovers, _log_tails, _probe, _start_redis, _worker_command

pytestmark = pytest.mark.integration

#: The cut lasts 2 x LEASE_S from about 1 s into node 2's run; the relaunch starts on node 1 about
#: LEASE_S + 2 s in and runs NODE1_S, so the cut-off launch writes its metrics (NODE2_S) while both run.
NODE1_S, NODE2_S = 12.0, 22.0
#: Longer than a registration lives unrenewed (`workers.state.registry.TTL_S` + HEARTBEAT_S), as by default:
#: the cut-off slot has left the cluster's view when its launch is taken back, so the relaunch goes to node 1.
LEASE_S = 15.0


@pytest.fixture
def cluster(request, tmp_path):
    """(node 1, node 2, Redis URL, logs folder, marker): Redis, gpu0 and control on node 1, gpu0 on node 2."""
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is required for integration tests (apt-get install -y redis-server)")
    try:
        hosts = create_two_hosts("fen")
    except NamespacesUnavailable as exc:
        pytest.skip(f"the partition test needs network namespaces: {exc}")
    request.addfinalizer(lambda: delete_hosts(hosts))
    node1, node2 = hosts
    password, marker = secrets.token_hex(12), secrets.token_hex(8)
    logs = tmp_path / "logs"
    logs.mkdir()
    url = f"redis://:{password}@{node1.address}:6379/0"
    env = {key: value for key, value in os.environ.items()
           if key not in ("AUTOTUNE_NODE", "AUTOTUNE_ADDRESS", "AUTOTUNE_REDIS_URL")}
    env.update({"AUTOTUNE_REDIS_URL": url, "AUTOTUNE_SLOT_MEMORY": "1GiB", "AUTOTUNE_SLOTS_PER_NODE": "1",
                "AUTOTUNE_TEST_MARKER": marker, "NODE2_ADDRESS": node2.address,
                "SLEEP_NODE1_S": str(NODE1_S), "SLEEP_NODE2_S": str(NODE2_S),
                # a rank whose metrics file appeared is stopped a second later: one that read another
                # launch's metrics would show it at once
                "AUTOTUNE_MEASURED_GRACE_S": "1"})
    request.addfinalizer(lambda: _kill_leftovers(marker))
    redis_proc = _start_redis(node1, password, tmp_path)
    request.addfinalizer(lambda: stop_group(redis_proc, signal.SIGTERM, 10))
    up, state = _probe(env, node1, 15)
    assert up, f"redis-server did not answer: {state}"
    for host, node, queue, concurrency in ((node1, NODES[0], "gpu0", 1), (node2, NODES[1], "gpu0", 1),
                                           (node1, NODES[0], "control", 2)):
        with open(logs / f"{queue}@{node}.log", "ab") as log:
            proc = subprocess.Popen(_worker_command(host, node, queue, concurrency), cwd=ROOT, env=env,
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        request.addfinalizer(lambda proc=proc: stop_group(proc, signal.SIGQUIT, 10))
    ready, state = _probe(env, node1, 60, slots=2, control=True)
    assert ready, f"workers did not register: {state}\n{_log_tails(logs)}"
    return node1, node2, url, logs, marker


def _started_on(results: Path, node: str) -> Path | None:
    """The experiment folder whose rank 0 started on `node`'s slot (its description shown), if any."""
    for marker in results.glob("*/started.rank0"):
        try:
            if json.loads((marker.parent / "exp.json").read_text())["slots"] == [f"{node}.gpu0"]:
                return marker.parent
        except (OSError, ValueError, KeyError):
            continue  # its description not shown yet
    return None


def _link(host, state: str) -> None:
    subprocess.run(["ip", "-n", host.namespace, "link", "set", host.link, state], check=True, timeout=15)


#: The experiments' script: its rank 0 writes its MASTER address into the metrics, sleeping first
#: NODE2_S on node 2 (the launch cut off there writes its metrics while the cut lasts, and while
#: the relaunch runs on node 1) or NODE1_S on node 1.
SCRIPT = r"""
import argparse, json, os, time
from pathlib import Path

parser = argparse.ArgumentParser()
parser.add_argument("--deepspeed_config", required=True)
parser.add_argument("--local_rank", type=int)
args = parser.parse_args()
config_path = Path(args.deepspeed_config)
config = json.loads(config_path.read_text())
config_path.parent.joinpath("started.rank0").write_text(str(os.getpid()))
master = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
time.sleep(float(os.environ["SLEEP_NODE2_S"] if os.environ["MASTER_ADDR"] == os.environ["NODE2_ADDRESS"]
                 else os.environ["SLEEP_NODE1_S"]))
Path(config["autotuning"]["metric_path"]).write_text(json.dumps(
    {"throughput": 100.0, "latency": 10.0, "master": master, "config": str(config_path)}))
"""


def test_a_node_cut_off_for_twice_its_lease_is_not_counted_and_its_relaunch_is(cluster, tmp_path: Path) -> None:
    node1, node2, url, logs, marker = cluster
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    cfg = write_config(tmp_path / "cfg.json", train_micro_batch_size_per_gpu=[1, 2])
    data = json.loads(cfg.read_text())
    data["autotuning"]["user_script"] = str(script)
    data["autotuning"]["model_info"] = {"num_params": 1000, "trainable_num_params": 1000,
                                        "activation_mem_per_gpu": 2**20}
    cfg.write_text(json.dumps(data))
    env = {**os.environ, "AUTOTUNE_REDIS_URL": url, "AUTOTUNE_TEST_MARKER": marker,
           "AUTOTUNE_LEASE_S": str(LEASE_S), "AUTOTUNE_LOST_GRACE_S": "5"}
    job = subprocess.Popen(inside(node1, [PYTHON, "-m", "scheduler.autotune", str(cfg), "--num_gpus", "1",
                                          "--exp-timeout", "90"]),
                           cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           start_new_session=True)
    results = tmp_path / "autotuning_results"
    try:
        # node 2's experiment, not both: node 1's may start late (a rank rebuilding an op first), and
        # the cut must come while node 2's rank runs
        wait_for(lambda: _started_on(results, NODES[1]) is not None, 90, "node 2's experiment to start")
        victim = _started_on(results, NODES[1])
        cut_off = int((victim / "started.rank0").read_text())
        _link(node2, "down")
        time.sleep(2 * LEASE_S)
        _link(node2, "up")
        out, err = job.communicate(timeout=180)
    finally:
        if job.poll() is None:
            stop_group(job, signal.SIGTERM, 20)
    assert job.returncode == 0, out + err + _log_tails(logs)

    record = json.loads((victim / "result.json").read_text())
    assert record["status"] == "ok", record
    assert [rank["slot"] for rank in record["ranks"]] == [f"{NODES[0]}.gpu0"], record  # the relaunch, on node 1
    assert record["metrics"]["master"] == record["ranks"][0]["master"], record  # its own metrics, no other's
    assert json.loads((victim / "metrics.json").read_text()) == record["metrics"]
    written = [json.loads(path.read_text()) for path in victim.glob("metrics.*.json") if path.name != "metrics.json"]
    assert any(m["master"].startswith(node2.address) for m in written), written  # the cut-off launch measured too
    names = [json.loads(line)["name"] for line in (results / "results.jsonl").read_text().splitlines()]
    assert len(names) == len(set(names)) and victim.name in names, names  # one record per experiment
    wait_for(lambda: not psutil.pid_exists(cut_off) or psutil.Process(cut_off).status() == psutil.STATUS_ZOMBIE,
             30, "the cut-off launch's rank to end")
    _, state = _probe({**os.environ, "AUTOTUNE_REDIS_URL": url}, node1, 0)
    assert state.get("gangs") == [], state
