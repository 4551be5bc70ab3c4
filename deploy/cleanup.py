"""Terminate exactly the training process groups that experiments recorded, on their hosts.

Why: a slot worker kills its own ranks' groups, and a restarted worker kills its predecessor's;
but a worker that dies for good (or a node the scheduler gave up on) leaves its training processes
running and holding the GPU. Each rank records its process group in Redis (`keys.pgid`); this
module reads those records for a job or an experiment and asks each node to TERM the groups, wait
a grace period, then KILL, and only groups that still run that slot (a reused PID is never hit).
Never by process name. Used by `python -m deploy cleanup` and by the scheduler when a launch is
lost or a job cancelled.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

import redis

from scheduler.cluster.job_store import JobStore, active_jobs
from deploy.plan import RecordedGroup, kill_options, launches_matching, recorded_groups
from workers.state.store import BaseSlotStore, RedisSlotStore

if TYPE_CHECKING:  # fabric and paramiko: imported where hosts are reached, not by every worker and command
    from deploy.fabric_hosts import Hosts

log = logging.getLogger(__name__)
DEFAULT_GRACE_S = 5.0
_BACKGROUND: list[threading.Thread] = []  #: clean-ups this process started and may still be running
_BACKGROUND_LOCK = threading.Lock()


def running_launches(client: redis.Redis) -> dict[str, dict[str, dict]]:
    """{job: {experiment: launch}} for every active job."""
    return {job: {name: launch.to_json() for name, launch in JobStore(client, job).running().items()}
            for job in active_jobs(client)}


def groups_of(slots: BaseSlotStore, launches: list[tuple[str, dict]]) -> list[RecordedGroup]:
    """The groups these (experiment, launch) pairs' ranks recorded, as their slots' store keeps them."""
    ranks = [rank for _, launch in launches for rank in sorted(launch.get("rank_tasks", {}).items())]
    return recorded_groups(launches, slots.read_rank_groups(ranks))


def kill_recorded(hosts: Hosts, groups: list[RecordedGroup], grace_s: float = DEFAULT_GRACE_S) -> dict[str, object]:
    """{node: its report (or error)} after TERM, grace, KILL of each node's groups."""
    by_node: dict[str, list[RecordedGroup]] = {}
    for group in groups:
        by_node.setdefault(group.node, []).append(group)
    answers = hosts.run_many({node: ("kill-groups", kill_options(node_groups, grace_s), None)
                              for node, node_groups in by_node.items()}, timeout=grace_s + 60)
    return {node: answer.data if answer.ok else answer.error for node, answer in answers.items()}


def cleanup(client: redis.Redis, hosts: Hosts, target: str, grace_s: float = DEFAULT_GRACE_S) -> dict[str, object]:
    """Clean up the groups of one job, or of one experiment of it (`deploy.plan.cleanup_scope`)."""
    launches = launches_matching(running_launches(client), target)
    return kill_recorded(hosts, groups_of(RedisSlotStore(client), launches), grace_s)


def clean_launch_in_background(slots: BaseSlotStore, name: str, launch: dict) -> None:
    """For the scheduler: kill a stopped launch's recorded groups on their hosts (SSH for remote
    nodes, directly for this one) without blocking the caller; problems are logged, not raised.
    The groups are read from `slots` before it returns; only the kills run in the background."""
    groups = groups_of(slots, [(name, launch)])
    if not groups:
        return

    def work() -> None:
        import sys
        from pathlib import Path

        from deploy.fabric_hosts import Hosts

        hosts = Hosts(repo=str(Path(__file__).resolve().parents[1]), python=sys.executable)
        for node, report in kill_recorded(hosts, groups).items():
            log.warning("cleanup of %s on %s: %s", name, node, report)

    thread = threading.Thread(target=work, daemon=True, name=f"cleanup {name}")
    with _BACKGROUND_LOCK:
        _BACKGROUND[:] = [running for running in _BACKGROUND if running.is_alive()]
        _BACKGROUND.append(thread)
    thread.start()


def wait_for_background_cleanups(timeout_s: float) -> bool:
    """Wait up to `timeout_s` for the clean-ups this process started; whether all ended. A command
    that ends after Ctrl-C waits for them: the interpreter's exit stops a daemon thread wherever it
    is, and one stopped inside a compiled extension (the SSH stack's Rust cryptography) aborts the
    whole process (SIGABRT, glibc's "exception not rethrown"), its groups maybe not yet killed."""
    deadline = time.monotonic() + timeout_s
    with _BACKGROUND_LOCK:
        started = list(_BACKGROUND)
    for thread in started:
        thread.join(max(0.0, deadline - time.monotonic()))
    return not any(thread.is_alive() for thread in started)
