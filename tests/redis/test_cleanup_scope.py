"""`python -m deploy cleanup` kills exactly the ranks of the job it names: two jobs run an experiment of
the same name (names like z1_gas1_tmbspg4 repeat across jobs and users), and cleaning one up leaves
the other's rank running. Real processes, titled as ranks are (`workers.process.process_identity`), recorded
in a real Redis as slots record them; the host side (`deploy.remote kill-groups`) runs in this process
in place of SSH."""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from deploy import remote
from deploy.cleanup import cleanup
from deploy.fabric_hosts import Answer
from scheduler.cluster.launches import RunningLaunch
from workers.state import keys
from workers.process.process_identity import RankIdentity, record_rank, start_time

TITLED = ("import signal, sys, time, setproctitle; setproctitle.setproctitle(sys.argv[1]); "
          "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0)); print('up', flush=True); time.sleep(120)")


class LocalHosts:
    """`deploy.fabric_hosts.Hosts` for processes on this machine: each node's command runs here."""

    def __init__(self) -> None:
        self.asked: dict[str, list[str]] = {}

    def run_many(self, commands: dict[str, tuple[str, list[str], object]], timeout: float) -> dict[str, Answer]:
        answers = {}
        for node, (action, options, _) in commands.items():
            assert action == "kill-groups"
            self.asked[node] = options
            args = argparse.Namespace(grace=float(options[1]), groups=options[2:])
            answers[node] = Answer(node, data=remote.kill_groups(args))
        return answers


def _titled_rank(identity: RankIdentity) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", TITLED, identity.title()], stdout=subprocess.PIPE,
                            start_new_session=True)
    assert proc.stdout.readline() == b"up\n"
    return proc


def _running(client, job: str, name: str, queue: str, task: str, seq: int) -> None:
    client.zadd(keys.JOBS, {job: seq})
    client.hset(keys.job_running(job), name, json.dumps(RunningLaunch(
        seq=seq, exp={"name": name}, argv=[], attempt=f"attempt-{job}", queues=[queue], token="tok",
        rank_tasks={queue: task}, started=0.0, deadline=0.0).to_json()))


@pytest.fixture
def two_jobs_one_name(client):
    """jobA and jobB each run z1_gas1_tmbspg4, one rank each, on two slots of node n1."""
    ranks = {}
    try:
        for seq, (job, queue) in enumerate([("jobA", "n1.gpu0"), ("jobB", "n1.gpu1")], start=1):
            identity = RankIdentity(queue, job, "z1_gas1_tmbspg4", 0, 1, f"attempt-{job}".ljust(32, "0"))
            ranks[job] = _titled_rank(identity)
            record_rank(client, f"task-{job}", identity, ranks[job].pid, 600)
            client.set(keys.pgid(queue, f"task-{job}"), ranks[job].pid)
            _running(client, job, "z1_gas1_tmbspg4", queue, f"task-{job}", seq)
        yield ranks
    finally:
        for proc in ranks.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def test_cleanup_of_one_job_leaves_another_jobs_rank_of_the_same_experiment_name(client, two_jobs_one_name):
    hosts = LocalHosts()
    job_a, job_b = two_jobs_one_name["jobA"], two_jobs_one_name["jobB"]
    started = start_time(job_a.pid)
    result = cleanup(client, hosts, "jobA:z1_gas1_tmbspg4", grace_s=2.0)
    assert job_a.wait(timeout=10) == 0, "jobA's rank is stopped by SIGTERM"
    assert hosts.asked["n1"][2:] == [f"n1.gpu0={job_a.pid}@{started}"]
    assert result == {"n1": {hosts.asked["n1"][2]: "terminated by SIGTERM"}}
    time.sleep(0.5)
    assert job_b.poll() is None, "jobB's rank of the same experiment name must survive jobA's cleanup"


def test_a_whole_job_is_cleaned_up_by_its_id_and_the_other_job_survives(client, two_jobs_one_name):
    cleanup(client, LocalHosts(), "jobB", grace_s=2.0)
    assert two_jobs_one_name["jobB"].wait(timeout=10) == 0
    assert two_jobs_one_name["jobA"].poll() is None


def test_a_recorded_pid_now_held_by_another_process_is_not_killed(client, two_jobs_one_name):
    """The record's start time is the rank's: a group whose leader started at another time (the PID
    was given to someone else) is reported gone and left alone."""
    job_a = two_jobs_one_name["jobA"]
    identity = RankIdentity("n1.gpu0", "jobA", "z1_gas1_tmbspg4", 0, 1, "attempt-jobA".ljust(32, "0"))
    stale = json.loads(client.get(keys.rank_process("n1.gpu0", "task-jobA")))
    client.set(keys.rank_process("n1.gpu0", "task-jobA"), json.dumps({**stale, "started": stale["started"] - 60}))
    result = cleanup(client, LocalHosts(), "jobA", grace_s=1.0)
    assert list(result["n1"].values()) == ["gone (no process of this group runs that slot)"], identity
    assert job_a.poll() is None
