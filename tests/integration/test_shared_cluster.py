"""Sharing a cluster (the reservation rules themselves are in test_leases.py): two tuning jobs run on
one 4-slot cluster at the same time without double booking or deadlock, `--status` shows who holds
what, and a job asking for a shape no node has is refused with the largest shape that fits."""
from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from integration_helpers import ROOT, SCRIPTS, processes_with_marker, run_autotune, wait_for, write_config
from scheduler.embedded.worker_command import worker_argv
from workers.state.registry import control_alive, live_slots

pytestmark = pytest.mark.integration


def _overlap_s(intervals: list[tuple[float, float]]) -> float:
    """Seconds during which two of the intervals overlap (0 when none ever do)."""
    ordered = sorted(intervals)
    overlap, latest_end = 0.0, float("-inf")
    for start, end in ordered:
        overlap += max(0.0, min(end, latest_end) - start)
        latest_end = max(latest_end, end)
    return overlap


def test_overlap_helper_counts_overlap():
    assert _overlap_s([(0, 2), (1, 3)]) == 1.0 and _overlap_s([(0, 1), (1, 2)]) == 0.0


@pytest.fixture(scope="module")
def four_slots(redis_url, tmp_path_factory):
    """Two nodes with two CPU slots each (node names from `-n gpuX@node`), on a Redis db of their own."""
    url = redis_url.rsplit("/", 1)[0] + "/3"
    logs = tmp_path_factory.mktemp("four-slot-logs")
    marker = os.urandom(8).hex()
    env = {**os.environ, "AUTOTUNE_REDIS_URL": url, "AUTOTUNE_SLOT_MEMORY": "1GiB",
           "AUTOTUNE_SLOTS_PER_NODE": "2", "AUTOTUNE_TEST_MARKER": marker}
    env.pop("AUTOTUNE_NODE", None)
    procs = []
    for queue, name in [("gpu0", "gpu0@nodea"), ("gpu1", "gpu1@nodea"), ("gpu0", "gpu0@nodeb"),
                        ("gpu1", "gpu1@nodeb"), ("control", "control@nodea")]:
        with open(logs / f"{name}.log", "wb") as log:
            procs.append(subprocess.Popen(
                worker_argv(queue, name), cwd=ROOT,
                env={**env, "AUTOTUNE_SLOT_MEMORY": "2GiB" if name.endswith("nodeb") else "1GiB"}, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True))
    client = redis.Redis.from_url(url)
    try:
        wait_for(lambda: len(live_slots(client)) == 4 and control_alive(client), 90, "four slots")
        yield {"url": url, "client": client}
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGQUIT)
        for proc in procs:
            proc.wait(timeout=30)
        wait_for(lambda: not processes_with_marker(marker), 20, "the four-slot cluster to exit")


def _job_config(tmp_path: Path, sizes: list[int]) -> Path:
    cfg = write_config(tmp_path / "cfg.json", train_micro_batch_size_per_gpu=sizes,
                       zero_optimization={"stage": [0, 1]})
    data = json.loads(cfg.read_text())
    data["autotuning"]["user_args"] = ["--behaviour", ",".join(f"{m}=slow1" for m in sizes)]
    data["autotuning"]["model_info"] = {"num_params": 1000, "trainable_num_params": 1000,
                                        "activation_mem_per_gpu": 2**20}
    cfg.write_text(json.dumps(data))
    return cfg


def test_two_jobs_share_four_slots(four_slots, tmp_path):
    env = {key: value for key, value in os.environ.items() if key != "AUTOTUNE_REDIS_URL"}
    env["AUTOTUNE_REDIS_URL"] = four_slots["url"]
    jobs = []
    for name, shape, sizes in (("a", ["--num_nodes", "2", "--num_gpus", "1"], [1, 2]), ("b", ["--num_gpus", "1"], [4, 5])):
        workdir = tmp_path / name
        workdir.mkdir()
        cfg = _job_config(workdir, sizes)
        jobs.append((workdir, subprocess.Popen([sys.executable, "-m", "scheduler.autotune", str(cfg), *shape],
                                               cwd=workdir, env=env, stdout=subprocess.PIPE,
                                               stderr=subprocess.PIPE, text=True)))
    seen_status = ""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and "2 running" not in seen_status:
        seen_status = subprocess.run([sys.executable, "-m", "scheduler.autotune", "--status"], cwd=ROOT,
                                     env={**env, "COLUMNS": "200"}, capture_output=True, text=True).stdout
        time.sleep(0.5)
    outputs = [proc.communicate(timeout=180) for _, proc in jobs]
    for (workdir, proc), (out, err) in zip(jobs, outputs):
        assert proc.returncode == 0, out + err
    assert "tuning jobs (2 running)" in seen_status, seen_status
    occupancy: dict[str, list[tuple[float, float]]] = {}
    for workdir, _ in jobs:
        for line in (workdir / "autotuning_results" / "results.jsonl").read_text().splitlines():
            record = json.loads(line)
            for slot in record["slots"]:
                occupancy.setdefault(slot, []).append((record["started_at"], record["ended_at"]))
    assert sum(_overlap_s(v) for v in occupancy.values()) == 0.0
    assert {slot.split(".")[0] for slot in occupancy} == {"nodea", "nodeb"}  # both nodes were used
    assert list(four_slots["client"].scan_iter(match="autotune:gang:*")) == []


def test_shape_no_node_has_is_refused_with_the_largest_that_fits(four_slots, tmp_path):
    cfg = _job_config(tmp_path, [1])
    proc = run_autotune([str(cfg), "--num_gpus", "3"], tmp_path, {"AUTOTUNE_REDIS_URL": four_slots["url"]})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "--num_nodes 1 --num_gpus 2" in proc.stderr and proc.stderr.count("\n") == 1


def test_min_slot_memory_keeps_a_job_on_the_bigger_node(four_slots, tmp_path):
    """nodea's slots have 1 GiB, nodeb's 2 GiB: a job asking for 1.5 GiB per slot runs only on nodeb,
    and one asking for more than any slot has is refused at submission with the largest there is."""
    cfg = _job_config(tmp_path, [1, 2, 3])
    env = {"AUTOTUNE_REDIS_URL": four_slots["url"]}
    proc = run_autotune([str(cfg), "--num_gpus", "1", "--min-slot-memory", "1.5GiB"], tmp_path, env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "slot memory 2.0 GiB" in proc.stdout  # the search is sized for the slots it may use
    lines = (tmp_path / "autotuning_results" / "results.jsonl").read_text().splitlines()
    slots = {slot for line in lines for slot in json.loads(line)["slots"]}
    assert slots == {"nodeb.gpu0", "nodeb.gpu1"}, slots

    refused = run_autotune([str(cfg), "--min-slot-memory", "4GiB"], tmp_path, env)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "the largest has 2.00 GiB" in refused.stderr and refused.stderr.count("\n") == 1
