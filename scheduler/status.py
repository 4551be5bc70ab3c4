"""`python -m scheduler.autotune --status`: the cluster as the scheduler sees it, for the operator.

Slots (live by heartbeat) with who holds each one (or that others' memory on its GPU keeps it out
of tuning, workers.state.slot_health), and every active tuning job: its current
phase, queue depth, what runs, and why its head experiment waits. Everything comes from Redis, so
it works from any host that can reach the cluster's Redis.
"""
from __future__ import annotations

from typing import Any

import redis
from rich.console import Console
from rich.table import Table

from scheduler.cluster.job_store import shown_states
from workers.state.store import BaseSlotStore, RedisSlotStore, describe


def collect(client: redis.Redis) -> dict[str, Any]:
    """Slots with their holders and the published state of every live job."""
    return collect_from(RedisSlotStore(client), shown_states(client))


def collect_from(store: BaseSlotStore, jobs: list[dict[str, str]]) -> dict[str, Any]:
    """`collect` from the slots' store and the jobs' published states."""
    slots = store.live_slots()
    holders = store.holders([s.queue for s in slots])
    sick = store.unhealthy([s.queue for s in slots])
    return {
        "slots": [{"queue": s.queue, "kind": s.kind, "memory_gib": round(s.memory_bytes / 2**30, 1),
                   "worker": s.worker, "held_by": holders.get(s.queue, ""),
                   "unhealthy": describe(s.queue, sick[s.queue]) if s.queue in sick else ""} for s in slots],
        "jobs": jobs,
    }


def render(console: Console, status: dict[str, Any]) -> None:
    slots = Table(title=f"slots ({len(status['slots'])} live)")
    for column in ("slot", "kind", "memory GiB", "worker", "held by (job/experiment)"):
        slots.add_column(column)
    for slot in status["slots"]:
        held = slot["held_by"] or ("out of tuning: " + slot["unhealthy"] if slot.get("unhealthy") else "free")
        slots.add_row(slot["queue"], slot["kind"], str(slot["memory_gib"]), slot["worker"], held)
    console.print(slots)
    jobs = Table(title=f"tuning jobs ({len(status['jobs'])} running)")
    for column in ("job", "results", "phase", "queued", "running", "head", "head waits because"):
        jobs.add_column(column)
    for job in status["jobs"]:
        jobs.add_row(job["job"][:12], job.get("results_dir", ""), job.get("phase", "-"), job.get("pending", ""),
                     job.get("running", ""), job.get("head", ""), job.get("head_waits", ""))
    console.print(jobs)
