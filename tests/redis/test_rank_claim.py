"""A rank task's claim (`workers.slot.rank_claim`) against a real redis-server: a redelivered message whose
first delivery's process died kills the training group that process left, and one whose first
delivery still runs touches nothing."""
from __future__ import annotations

import json
import subprocess
import time

import psutil
import redis

from workers.state import keys
from workers.slot import rank_claim

QUEUE, TASK = "n.gpu0", "task-1"


def _claimed_by(client: redis.Redis, proc: subprocess.Popen, group: subprocess.Popen | None = None) -> None:
    """The claim as the process `proc` left it, with `group` its training group's leader."""
    claim = {"pid": proc.pid, "started": psutil.Process(proc.pid).create_time()}
    if group is not None:
        claim["group"] = {"pid": group.pid, "started": psutil.Process(group.pid).create_time()}
    client.set(keys.rank_claim(QUEUE, TASK), json.dumps(claim))


def _gone(proc: subprocess.Popen) -> bool:
    try:
        proc.wait(timeout=15)
        return True
    except subprocess.TimeoutExpired:
        return False


def test_the_first_delivery_claims_and_releases(client: redis.Redis) -> None:
    assert rank_claim.claim(client, QUEUE, TASK) is None
    assert rank_claim.claim(client, QUEUE, TASK) is None  # this process's own claim
    assert json.loads(client.get(keys.rank_claim(QUEUE, TASK)))["pid"] == psutil.Process().pid
    rank_claim.release(client, QUEUE, TASK)
    assert not client.exists(keys.rank_claim(QUEUE, TASK))


def test_a_redelivery_after_its_process_died_kills_the_group_it_left(client: redis.Redis) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    orphan = subprocess.Popen(["sleep", "60"], start_new_session=True)  # a training group of its own
    try:
        claim = {"pid": dead.pid, "started": time.time() - 5,
                 "group": {"pid": orphan.pid, "started": psutil.Process(orphan.pid).create_time()}}
        client.set(keys.rank_claim(QUEUE, TASK), json.dumps(claim))
        client.set(keys.pgid(QUEUE, TASK), orphan.pid)
        assert rank_claim.claim(client, QUEUE, TASK) == "lost"
        assert _gone(orphan)
        assert json.loads(client.get(keys.rank_claim(QUEUE, TASK)))["pid"] == psutil.Process().pid  # ours now
        assert not client.exists(keys.pgid(QUEUE, TASK))
    finally:
        orphan.kill()


def test_a_group_whose_leader_pid_was_reused_is_spared(client: redis.Redis) -> None:
    stranger = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        claim = {"pid": 2**22 + 7, "started": 1.0, "group": {"pid": stranger.pid, "started": 1.0}}
        client.set(keys.rank_claim(QUEUE, TASK), json.dumps(claim))
        assert rank_claim.claim(client, QUEUE, TASK) == "lost"
        assert stranger.poll() is None  # another process under the noted PID: not the orphan
    finally:
        stranger.kill()
        stranger.wait()


def test_a_redelivery_while_the_first_delivery_runs_touches_nothing(client: redis.Redis) -> None:
    first = subprocess.Popen(["sleep", "60"])
    group = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        _claimed_by(client, first, group)
        before = client.get(keys.rank_claim(QUEUE, TASK))
        assert rank_claim.claim(client, QUEUE, TASK) == "running"
        assert group.poll() is None and client.get(keys.rank_claim(QUEUE, TASK)) == before
    finally:
        for proc in (first, group):
            proc.kill()
            proc.wait()


def test_note_group_records_the_leader_and_its_start(client: redis.Redis) -> None:
    group = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        assert rank_claim.claim(client, QUEUE, TASK) is None
        rank_claim.note_group(client, QUEUE, TASK, group.pid)
        noted = json.loads(client.get(keys.rank_claim(QUEUE, TASK)))
        assert noted["pid"] == psutil.Process().pid
        assert noted["group"] == {"pid": group.pid, "started": psutil.Process(group.pid).create_time()}
    finally:
        group.kill()
        group.wait()
