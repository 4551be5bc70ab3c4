"""Runs a list of experiments on the cluster: reserve slots, send chords, collect records.

Event-driven: it dispatches on start and whenever an experiment finishes (the chord callback
pushes an event that this loop pops with a blocking wait), never on a polling tick. While
experiments run it renews their gang leases (re-taking them if they lapsed, e.g. after a Redis
restart). An experiment whose record never arrives within its time limit plus a grace (a worker or
node died, Redis lost the message) is revoked and launched again, up to MAX_ATTEMPTS launches
counted in Redis before each launch, then recorded `lost`: a dead worker cannot stall the job.
While Redis is unreachable the loop waits for it instead of failing.
Dispatch is FIFO by submission with EASY backfill (`scheduler.backfill`): a later experiment starts
in free slots only when it cannot delay the waiting head past its estimated start.
"""
from __future__ import annotations

import json
import logging
import math
import os
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from scheduler.backfill import Policy, Waiting, backfill, estimate_run_s
from scheduler.errors import ClusterError
from workers.gang import GangReservations
from scheduler.placement import fits_ever, largest_shape, pinned_placement
from scheduler.space import Experiment
from tasks.experiment import experiment_signature
from workers import keys
from workers.paths import safe_child, write_json
from workers.registry import BLOCK_S, HEARTBEAT_S, TTL_S, live_slots
from workers.slot import Slot

LEASE_S = float(os.environ.get("AUTOTUNE_LEASE_S", 60.0))  #: how long a dead scheduler can hold slots
LOST_GRACE_S = float(os.environ.get("AUTOTUNE_LOST_GRACE_S", 120.0))
MAX_ATTEMPTS = int(os.environ.get("AUTOTUNE_MAX_ATTEMPTS", 3))  #: launches of one experiment, counted in Redis
ATTEMPTS_TTL_S = 7 * 24 * 3600
REDIS_OUTAGE_S = 300.0  #: how long to wait for a restarting Redis before giving up
REFUSE_GRACE_S = 60.0  #: after the first launch, how long the cluster may lack a fitting shape
SLOT_GONE_S = TTL_S + HEARTBEAT_S  #: a slot unregistered this long has lost its worker (not a blip)
WAIT_FOR_SLOTS_S = 1.0


log = logging.getLogger(__name__)


@dataclass
class _Running:
    exp: Experiment
    attempt: str
    queues: list[str]
    token: str
    rank_task_ids: list[str]
    deadline: float
    attempts: int
    instances: dict[str, str]  #: slot queue -> worker instance that took the launch
    started: float
    slots_missing_since: float | None = None


class Driver:
    """Runs experiments for one tuning job and returns one record per experiment."""

    def __init__(self, client: redis.Redis, app, *, job: str, results_root: Path,
                 script_argv: Callable[[Experiment, Path], list[str]], cwd: str,
                 timeout_s: float, on_record: Callable[[dict[str, Any]], None] = lambda r: None,
                 lease_s: float = LEASE_S, pinned: list[list[str]] | None = None,
                 policy: Policy = backfill) -> None:
        """`pinned`: run every experiment on exactly these slot queues (one list per node), as a
        launch with a hostfile and filters asks; otherwise any free slots of the right shape.
        `policy`: `scheduler.backfill.backfill` (default) or `strict_fifo` (DeepSpeed's, for benchmarks)."""
        self._client, self._app = client, app
        self._gangs = GangReservations(client)
        self._job, self._root, self._cwd = job, results_root.resolve(), cwd
        self._script_argv, self._timeout_s, self._on_record = script_argv, timeout_s, on_record
        self._lease_s = lease_s
        self._pinned = pinned
        self._policy = policy
        self._running: dict[str, _Running] = {}
        self._walls: dict[tuple[int, int], list[float]] = {}  #: (stage, mbs) -> wall s of finished runs
        self._dispatched_any = False
        self._misfit_since: float | None = None
        self._exp_ids = iter(range(1, 1 << 30))

    def run(self, experiments: list[Experiment]) -> list[dict[str, Any]]:
        self._pending = deque(experiments)
        self._records: list[dict[str, Any]] = []
        next_renew = time.monotonic() + self._lease_s / 3
        outage_since: float | None = None
        while self._pending or self._running:
            try:
                self._step()
                if time.monotonic() >= next_renew:
                    self._renew_leases()
                    next_renew = time.monotonic() + self._lease_s / 3
                self._expire_lost()
                outage_since = None
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                # Redis restarting: slots re-register by heartbeat, records are on disk; wait for it.
                outage_since = outage_since or time.monotonic()
                if time.monotonic() - outage_since > REDIS_OUTAGE_S:
                    raise
                log.warning("Redis unreachable (%s); retrying", exc)
                time.sleep(1.0)
        self._client.delete(keys.job_state(self._job))
        return self._records

    def _step(self) -> None:
        self._dispatch(self._pending)
        self._publish_state()
        idle = self._pending and not self._running
        wait_s = WAIT_FOR_SLOTS_S if idle else min(BLOCK_S, self._lease_s / 3)
        popped = self._client.blpop([keys.job_events(self._job)], timeout=max(1, int(wait_s)))
        if popped is not None:
            record = self._finished(json.loads(popped[1]))
            if record is not None:
                self._record(record)

    def _publish_state(self) -> None:
        """What `python -m scheduler.autotune --status` shows for this job; expires with the driver."""
        head = self._pending[0] if self._pending else None
        waiting = ""
        if head is not None:
            waiting = (f"needs {head.num_nodes} node(s) x {head.num_gpus} free slot(s) at once; "
                       "the slots that fit are reserved")
        pipe = self._client.pipeline()
        pipe.hset(keys.job_state(self._job), mapping={
            "results_dir": str(self._root), "pending": len(self._pending),
            "running": ",".join(sorted(self._running)) or "-",
            "head": head.name if head else "-", "head_waits": waiting or "-",
            "updated": round(time.time(), 1)})
        pipe.expire(keys.job_state(self._job), int(self._lease_s * 2))
        pipe.execute()

    def _record(self, record: dict[str, Any]) -> None:
        self._records.append(record)
        self._on_record(record)

    def cancel(self) -> None:
        """Stop every running experiment of this job now (revoke + group kill) and free its slots."""
        for running in list(self._running.values()):
            self._app.control.revoke(running.rank_task_ids, terminate=True, signal="SIGTERM")
            self._gangs.release(running.queues, running.token)
        self._running.clear()

    def _dispatch(self, pending: deque[Experiment]) -> None:
        if not pending:
            return
        slots = live_slots(self._client)
        busy = self._gangs.held([s.queue for s in slots])
        if self._pinned is not None:
            self._dispatch_pinned(pending, slots, busy)
            return
        misfit = next((e for e in pending if not fits_ever(slots, e.num_nodes, e.num_gpus)), None)
        if misfit is not None:
            # Refused at once at submission; later, slots may only be re-registering (a worker or
            # Redis restarting), so the cluster gets a grace period to come back first.
            self._misfit_since = self._misfit_since or time.monotonic()
            if not self._dispatched_any or time.monotonic() - self._misfit_since > REFUSE_GRACE_S:
                self._refuse(misfit, slots)
            return
        self._misfit_since = None
        by_name = {exp.name: exp for exp in pending}
        waiting = [Waiting(e.name, e.num_nodes, e.num_gpus, self._timeout_s) for e in pending]
        for name, placement in self._policy(waiting, slots, self._frees_at(busy), time.monotonic()):
            queues = [slot.queue for node in placement for slot in node]
            token = self._gangs.reserve(queues, self._lease_s, owner=f"{self._job}/{name}")
            if token is None:
                return  # another job took a slot meanwhile: plan again at the next event
            pending.remove(by_name[name])
            self._start(by_name[name], placement, queues, token)
            self._dispatched_any = True

    def _dispatch_pinned(self, pending: deque[Experiment], slots: list[Slot], busy: set[str]) -> None:
        """Every experiment wants the same named slots, so they simply run one after another."""
        placement = pinned_placement(slots, busy, self._pinned)
        if placement is None:
            return
        queues = [slot.queue for node in placement for slot in node]
        token = self._gangs.reserve(queues, self._lease_s, owner=f"{self._job}/{pending[0].name}")
        if token is not None:
            self._start(pending.popleft(), placement, queues, token)

    def _frees_at(self, busy: set[str]) -> dict[str, float]:
        """When each busy slot should free: ours from start + the shape's mean wall time (or the time
        limit), slots held by other jobs unknown (infinite)."""
        frees_at = dict.fromkeys(busy, math.inf)
        for running in self._running.values():
            shape = (running.exp.stage, running.exp.micro_batch_size)
            end = running.started + estimate_run_s(self._timeout_s, self._walls.get(shape, ()))
            frees_at.update({q: end for q in running.queues if q in frees_at})
        return frees_at

    def _refuse(self, exp: Experiment, slots: list[Slot]) -> None:
        nodes, per_node = largest_shape(slots)
        if not slots:
            raise ClusterError("no live slot workers: start them with "
                               "`celery -A tasks worker -Q gpu0 -n gpu0@%h` (one per device)")
        raise ClusterError(f"{exp.name} needs {exp.num_nodes} node(s) x {exp.num_gpus} slot(s) but the "
                           f"cluster has {nodes} node(s) with at most {per_node} slot(s) each; "
                           f"use --num_nodes {min(nodes, exp.num_nodes)} --num_gpus {per_node} or fewer")

    def _start(self, exp: Experiment, placement: list[list[Slot]], queues: list[str], token: str) -> None:
        attempt = uuid.uuid4().hex
        exp_id = next(self._exp_ids)
        result_dir = safe_child(self._root, exp.name)
        argv = self._script_argv(exp, result_dir / "ds_config.json")
        description = {
            "name": exp.name, "exp_id": exp_id, "ds_config": exp.ds_config,
            "num_gpus": exp.num_gpus, "num_nodes": exp.num_nodes, "result_dir": str(result_dir),
            "slots": queues, "user_script": argv[0], "user_args": argv[1:],
        }
        finish = {"job": self._job, "name": exp.name, "exp_id": exp_id, "attempt": attempt,
                  "slots": queues, "gang_token": token,
                  "results_root": str(self._root), "world_size": len(queues),
                  "ds_config": exp.ds_config, "timeout_s": self._timeout_s,
                  "metric_file": exp.metric_file}
        rank_specs = []
        for node_rank, node_slots in enumerate(placement):
            for local_rank, slot in enumerate(node_slots):
                rank_specs.append((slot.queue, {
                    "job": self._job, "name": exp.name, "attempt": attempt,
                    "results_root": str(self._root), "script_argv": argv, "ds_config": exp.ds_config,
                    "rank": sum(len(n) for n in placement[:node_rank]) + local_rank,
                    "world_size": len(queues), "local_rank": local_rank,
                    "local_world_size": len(node_slots),
                    "node_rank": node_rank, "timeout_s": self._timeout_s, "cwd": self._cwd,
                    "metric_file": exp.metric_file, "exp": description, "gang_token": token,
                }))
        attempts = int(self._client.hincrby(keys.job_attempts(self._job), exp.name, 1))
        self._client.expire(keys.job_attempts(self._job), ATTEMPTS_TTL_S)
        result = experiment_signature(finish, rank_specs).apply_async()
        header = result.parent.results if result.parent else []
        header_ids = [child.id for child in header]
        consumer = self._app.backend.result_consumer
        for task_id in (result.id, *header_ids):
            # Records arrive as job events, not through Celery results: unsubscribe now, while
            # Redis is up, instead of from AsyncResult.__del__ at interpreter exit.
            consumer.cancel_for(task_id)
        self._running[exp.name] = _Running(exp, attempt, queues, token, header_ids,
                                           time.monotonic() + self._timeout_s + LOST_GRACE_S, attempts,
                                           {slot.queue: slot.instance for node in placement for slot in node},
                                           time.monotonic())

    def _finished(self, event: dict[str, Any]) -> dict[str, Any] | None:
        running = self._running.get(event.get("name", ""))
        if running is None or running.attempt != event.get("attempt"):
            return None  # a stale event from an earlier launch or another driver of this job
        del self._running[running.exp.name]
        # The callback released the slots; release again in case a lease renewal re-took them since.
        self._gangs.release(running.queues, running.token)
        record = event["record"]
        if record.get("status") == "ok" and record.get("wall_s"):
            shape = (running.exp.stage, running.exp.micro_batch_size)
            self._walls.setdefault(shape, []).append(record["wall_s"])
        return record

    def _renew_leases(self) -> None:
        for running in list(self._running.values()):
            if self._gangs.renew(running.queues, running.token, self._lease_s):
                continue
            token = self._gangs.reserve(running.queues, self._lease_s,  # lapsed (e.g. Redis restarted)
                                        owner=f"{self._job}/{running.exp.name}")
            if token is not None:
                running.token = token
            else:
                self._lose(running, "its slots were taken by another job after its lease lapsed")

    def _expire_lost(self) -> None:
        now = time.monotonic()
        live = {slot.queue: slot.instance for slot in live_slots(self._client)} if self._running else {}
        for running in list(self._running.values()):
            gone = [q for q in running.queues if q not in live]
            restarted = [q for q in running.queues if q in live and live[q] != running.instances.get(q)]
            running.slots_missing_since = (running.slots_missing_since or now) if gone else None
            if now > running.deadline:
                self._lose(running, "no record from the slot workers within the time limit plus "
                           f"{LOST_GRACE_S:.0f}s (a worker or node died, or Redis lost the task)")
            elif restarted:
                self._lose(running, f"the worker of {', '.join(restarted)} restarted during the run")
            elif gone and now - running.slots_missing_since > SLOT_GONE_S:
                self._lose(running, f"the worker of {', '.join(gone)} stopped sending heartbeats")

    def _lose(self, running: _Running, why: str) -> None:
        """Stop a launch that went missing; retry it while attempts remain, else record it `lost`."""
        self._app.control.revoke(running.rank_task_ids, terminate=True, signal="SIGTERM")
        self._gangs.release(running.queues, running.token)
        del self._running[running.exp.name]
        if running.attempts < MAX_ATTEMPTS:
            log.warning("%s lost (%s); retrying, attempt %d of %d", running.exp.name, why,
                        running.attempts + 1, MAX_ATTEMPTS)
            self._pending.appendleft(running.exp)
            return
        record = {"name": running.exp.name, "status": "lost", "metrics": None,
                  "ds_config": running.exp.ds_config, "slots": running.queues,
                  "cause": {"error": f"{why}; gave up after {running.attempts} attempts"}}
        write_json(safe_child(self._root, running.exp.name) / "result.json", record)
        self._record(record)
