"""The control worker's sweep: the fallback for what no event announces.

Dispatch and the job steps are driven by events (a submission, an experiment's chord callback), so
nothing polls while work flows. But some changes announce themselves to nobody: a launch lost with
its worker or node, a lease that lapsed, a slot worker that came back. Every SWEEP_S the control
worker finds lost launches (`scheduler.cluster.sweep`), takes the step of each job that recorded
one or has nothing running or queued (it waits only for launches Redis forgot, whose record may never
come), and dispatches again, all under the cluster lock.
"""
from __future__ import annotations

import logging
import threading

import redis

from scheduler.cluster.dispatch import cluster_lock, dispatch
from scheduler.cluster.sweep import SWEEP_S, sweep
from scheduler.cluster.job_store import any_active
from scheduler.cluster.progress import advance
from scheduler.cluster.work import Work

log = logging.getLogger(__name__)


def sweep_forever(client: redis.Redis, work: Work, stop: threading.Event) -> None:
    """Sweep every SWEEP_S until `stop` is set; a failed sweep (Redis restarting, a lock timeout)
    is logged and the next one tries again."""
    while not stop.wait(SWEEP_S):
        try:
            if not any_active(client):
                continue
            with cluster_lock(client):
                for job in sweep(client, work):
                    advance(client, job)
                dispatch(client, work)
        except Exception:
            log.warning("control sweep failed; retrying in %.0fs", SWEEP_S, exc_info=True)
