"""Which process runs a rank task: a claim in Redis, so a redelivered message never starts a second copy.

The rank tasks are acknowledged late and rejected back to their queue when the pool process dies
(`task_reject_on_worker_lost`, celeryconfig.py): a pool process the OOM killer or a segfault ends
mid-rank leaves its training group running, without the process that watched its time and memory,
and Celery sends the same message (the same task id) to the slot's next pool process without any
failure signal. The first thing a rank task does is claim its task id for its own process
(`claim`); finding a claim already there, it is the redelivery:

- the claiming process is gone: its training group (noted in the claim by `note_group`, the leader's
  PID and start time) is killed before anything else, and the task answers `lost` without running (its peers are told to stop;
  the launch is recorded lost and runs again while attempts remain), so one group, never two, and
  the orphan lives only until the redelivery arrives (seconds: the same slot's next pool process);
- the claiming process is alive (a message redelivered while its first copy still runs): the task
  answers a stale record and touches nothing.

The claim is deleted when the task ends (`release`); it expires on its own after a week at most.

A rank of *another* launch still on the slot when a rank starts (a frozen node thawed after its
lease went, a pool process killed while the sweep relaunched the experiment) is fenced: the launch
starting holds the slot's reservation. `end_older_launches` ends it first, so two launches never
share the slot's device and the new one measures alone.
"""
from __future__ import annotations

import json
import os

import psutil
import redis

from workers.state import keys
from workers.in_rank.failure import Status
from workers.slot.records import RankRecord, not_started
from workers.process.launch import group_runs_slot, kill_group, kill_groups
from workers.process.process_identity import forget_rank, kill_titled, owns_group, recorded_ranks

CLAIM_TTL_S = 7 * 24 * 3600


def _me() -> dict[str, float]:
    """This process as the claim names it: its PID and start time (a reused PID is another process)."""
    return {"pid": os.getpid(), "started": psutil.Process().create_time()}


def _alive(claimant: dict[str, float]) -> bool:
    try:
        return abs(psutil.Process(int(claimant["pid"])).create_time() - float(claimant["started"])) < 0.01
    except (psutil.NoSuchProcess, KeyError, TypeError, ValueError):
        return False


def claim(client: redis.Redis, queue: str, task_id: str) -> str | None:
    """Claim `task_id` on slot `queue` for this process; None when it was free (the first delivery,
    or this process's own earlier claim). Else why the task must not run (module docstring): "lost"
    after killing a dead claimant's training group, "running" while the claimant lives."""
    mine = _me()
    key = keys.rank_claim(queue, task_id)
    if client.set(key, json.dumps(mine), nx=True, ex=CLAIM_TTL_S):
        return None
    raw = client.get(key)
    earlier = json.loads(raw) if raw else {}
    if earlier == mine:
        return None
    if _alive(earlier):
        return "running"
    group = earlier.get("group")
    if isinstance(group, dict) and _alive(group):  # its leader, as the claimant noted it: not a reused PID
        kill_group(int(group["pid"]))
    else:
        pgid = client.get(keys.pgid(queue, task_id))
        if pgid and group_runs_slot(int(pgid), queue):
            kill_group(int(pgid))
    forget_rank(client, queue, task_id)  # the group it left is gone: its pgid key and rank record too
    client.set(key, json.dumps(mine), ex=CLAIM_TTL_S)
    return "lost"


def note_group(client: redis.Redis, queue: str, task_id: str, pgid: int) -> None:
    """The claimant started its training group `pgid` (its leader's PID): noted in the claim with the
    leader's start time, so a redelivery kills exactly that group, whatever it shows in `ps`."""
    try:
        group = {"pid": pgid, "started": psutil.Process(pgid).create_time()}
    except psutil.Error:
        return  # already gone: nothing to kill later
    client.set(keys.rank_claim(queue, task_id), json.dumps({**_me(), "group": group}), ex=CLAIM_TTL_S)


def release(client: redis.Redis, queue: str, task_id: str) -> None:
    """The task ended in this process: its claim goes (a Redis outage leaves it to expire)."""
    try:
        client.delete(keys.rank_claim(queue, task_id))
    except redis.RedisError:
        pass


def refused_record(why: str) -> RankRecord:
    """The record of a rank task `claim` refused: `lost` once the dead claimant's training group was
    killed (the launch is recorded lost and runs again), stale while the first delivery runs."""
    if why == "running":
        return not_started(Status.LOST, "delivered again while its first delivery still runs", stale=True)
    return not_started(Status.LOST, "the pool process running this rank died (the OOM killer, a signal): its "
                                    "training group was killed, and the launch runs again")


def end_older_launches(client: redis.Redis, slot: str, launch: str, grace_s: float) -> list[int]:
    """End what other launches left running on `slot` before a rank of `launch` starts there (module
    docstring): the groups their records name that are still theirs (`owns_group`, by start time),
    and any process carrying their titles elsewhere, SIGTERM then SIGKILL after `grace_s`. Returns
    the groups and pids ended; the records stay for whoever reaps those ranks (their own task, or
    the leftover scan)."""
    others = [record for record in recorded_ranks(client, slot) if record.identity.launch != launch]
    if not others:
        return []
    groups = sorted({record.pgid for record in others if owns_group(record.pgid, slot, record.started or None)})
    if groups:
        kill_groups(groups, grace_s)
    return groups + kill_titled(others, grace_s)
