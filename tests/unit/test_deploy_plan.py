"""The pure decisions of `python -m deploy`: which workers where, the argv a host runs, the Redis
URL check, which recorded groups a cleanup targets, and the per-host registration report."""
from __future__ import annotations

import shlex

import pytest

from deploy.plan import (check_redis_url, cleanup_scope, kill_options, launches_matching, plan_workers,
                         recorded_groups, registration_report, remote_command, up_request)
from scheduler.errors import UsageError
from workers.state import keys
from workers.process.process_identity import RankIdentity, RankProcess
from workers.state.redis_url import masked_url


def test_one_slot_worker_per_device_and_control_with_flower():
    plans = plan_workers({"a": [0, 1], "b": [3]}, control_host="a", flower=True)
    assert [(p.host, p.role, p.queue, p.name, p.slot) for p in plans] == [
        ("a", "slot", "gpu0", "gpu0@a", "a.gpu0"), ("a", "slot", "gpu1", "gpu1@a", "a.gpu1"),
        ("b", "slot", "gpu3", "gpu3@b", "b.gpu3"), ("a", "control", "control", "control@a", ""),
        ("a", "flower", "", "", "")]
    assert len({p.label for p in plans}) == len(plans), "labels never collide on a shared home"


def test_flower_needs_a_control_host():
    with pytest.raises(UsageError, match="--control"):
        plan_workers({"a": [0]}, flower=True)


@pytest.mark.parametrize("url, problem", [
    (None, "not set"), ("", "not set"), ("http://x:1/0", "not a Redis URL"),
    ("redis://:@host:6379/0", "empty password"), ("redis://host:70000/0", "port"),
])
def test_bad_redis_urls_are_refused(url, problem):
    with pytest.raises(UsageError, match=problem):
        check_redis_url(url)


def test_good_url_and_masking():
    url = "redis://:s3cret@host:6390/0"
    assert check_redis_url(url) == url
    assert masked_url(url) == "redis://:***@host:6390/0" and "s3cret" not in masked_url(url)


def test_remote_command_quotes_every_word_and_carries_no_secret():
    line = remote_command("/opt/py env/bin/python", "/srv/my repo", "up", ["--run-dir", "~/x; rm -rf /"])
    assert shlex.split(line) == ["cd", "/srv/my repo", "&&", "/opt/py env/bin/python", "-m", "deploy.remote",
                                 "up", "--run-dir", "~/x; rm -rf /"]
    request = up_request(plan_workers({"a": [0]}, "a"), {"AUTOTUNE_REDIS_URL": "redis://:pw@h:1/0"})
    assert request["env"] == {"AUTOTUNE_REDIS_URL": "redis://:pw@h:1/0"}
    assert "pw" not in line


def test_cleanup_targets_exactly_the_named_job_or_one_experiment_of_it():
    running = {"job1": {"e1": {"rank_tasks": {"n1.gpu0": "t1", "n2.gpu0": "t2"}}, "e3": {"rank_tasks": {}}},
               "job2": {"e2": {"rank_tasks": {"n1.gpu1": "t3"}}}}
    assert [name for name, _ in launches_matching(running, "job1")] == ["e1", "e3"]
    assert [name for name, _ in launches_matching(running, "job2:e2")] == ["e2"]
    assert launches_matching(running, "job1:e2") == [], "job1 runs no e2: job2's is not its"
    launches = launches_matching(running, "job1:e1")
    record = RankProcess(RankIdentity("n1.gpu0", "job1", "e1", 0, 2, "a" * 32), 4141, 4141, 123456).to_json()
    groups = recorded_groups(launches, {keys.rank_process("n1.gpu0", "t1"): record, keys.pgid("n2.gpu0", "t2"): b"4242"})
    assert [(g.node, g.queue, g.pgid, g.started) for g in groups] == [("n1", "n1.gpu0", 4141, 123456),
                                                                     ("n2", "n2.gpu0", 4242, None)]
    assert kill_options(groups, 2) == ["--grace", "2", "n1.gpu0=4141@123456", "n2.gpu0=4242"]


def test_an_experiment_name_alone_is_refused_because_names_repeat_across_jobs(tmp_path):
    running = {"jobA": {"z1_gas1": {}}, "jobB": {"z1_gas1": {}}}
    with pytest.raises(UsageError, match=r"JOB:z1_gas1 \(it runs in job\(s\) jobA, jobB\)"):
        cleanup_scope("z1_gas1", running)
    assert cleanup_scope("jobB:z1_gas1", running) == ("jobB", "z1_gas1")
    folder = tmp_path / "autotuning_results"
    folder.mkdir()
    assert cleanup_scope(f"{folder}:z1_gas1", running, job_of_folder=lambda path: "jobA") == ("jobA", "z1_gas1")
    assert cleanup_scope(str(folder), running, job_of_folder=lambda path: "jobB") == ("jobB", None)


def test_registration_report_names_each_host_and_why():
    plans = plan_workers({"a": [0, 1], "b": [0], "c": [0]}, control_host="a")
    lines = registration_report(plans, {"a.gpu0", "a.gpu1"}, {"c": "cannot connect over SSH"},
                                {"b.gpu0": "worker exited: error: bad password"})
    assert lines == ["a: ok: 2 slot(s) registered (a.gpu0, a.gpu1); control started",
                     "b: FAILED: 1 of 1 slot(s) not registered: b.gpu0: worker exited: error: bad password",
                     "c: FAILED: cannot connect over SSH"]
