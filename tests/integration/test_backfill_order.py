"""Backfill ordering on real workers: two slots, three experiments submitted at once as one job:
e1 (1 slot, 4 s), e2 (both slots, 1 s), e3 (1 slot, 1 s). e2 is the blocked head. With EASY
backfill e3 starts at once in the idle slot: its time limit ends no later than the head's estimated
start (e1's time limit), so it cannot delay e2. With strict FIFO (DeepSpeed's rule) e3 waits for e2.
Both orders are read from the slot workers' own start times."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from integration_helpers import ROOT, SCRIPTS

pytestmark = pytest.mark.integration

#: Runs in its own interpreter, because the Celery app reads AUTOTUNE_REDIS_URL when imported.
JOB = r"""
import json, sys, uuid
from pathlib import Path
from scheduler.cluster.jobs import JobSpec, run_fixed
from scheduler.search.space import Experiment, experiment_config
from tasks import app
from tasks.work import CeleryWork
from workers.state.connection import connect
import os

policy, results, fake = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
shapes = {"e1": (1, 1), "e2": (2, 2), "e3": (3, 1)}
experiments = []
for name, (mbs, gang) in shapes.items():
    exp = Experiment(name, 0, mbs, 1, experiment_config({"autotuning": {"enabled": True}}, 0, mbs, 1, gang, 1, 1),
                     1, gang)
    argv = [fake, "--behaviour", "1=slow4,2=slow1,3=slow1", "--deepspeed_config", str(results / name / "ds_config.json")]
    experiments.append({**exp.to_json(), "argv": argv})
spec = JobSpec(job=uuid.uuid4().hex, results_root=str(results), cwd=os.getcwd(), timeout_s=30.0,
               experiments=experiments, policy=policy)
records = run_fixed(connect(os.environ["AUTOTUNE_REDIS_URL"]), CeleryWork(app), spec)
print(json.dumps({r["name"]: [r["status"], r["started_at"], r["ended_at"]] for r in records}))
"""


def _run(hand_cluster, tmp_path, policy: str) -> dict[str, list]:
    results = tmp_path / policy
    env = {**os.environ, "AUTOTUNE_REDIS_URL": hand_cluster["url"]}
    done = subprocess.run([sys.executable, "-c", JOB, policy, str(results), str(SCRIPTS / "fake_train.py")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    runs = json.loads(done.stdout.strip().splitlines()[-1])
    assert {status for status, _, _ in runs.values()} == {"ok"}, runs
    return {name: [start, end] for name, (_, start, end) in runs.items()}


def test_backfill_starts_the_short_one_beside_the_running_one(hand_cluster, tmp_path):
    runs = _run(hand_cluster, tmp_path, "backfill")
    assert runs["e3"][0] < runs["e1"][1]  # e3 ran while e1 still ran, in the idle slot
    assert runs["e2"][0] >= runs["e1"][1] and runs["e2"][0] >= runs["e3"][1]  # the head, when both freed


def test_strict_fifo_keeps_the_short_one_behind_the_head(hand_cluster, tmp_path):
    runs = _run(hand_cluster, tmp_path, "strict_fifo")
    assert runs["e2"][0] >= runs["e1"][1]
    assert runs["e3"][0] >= runs["e2"][1]  # head-of-line blocking: it waited for e2 to finish
