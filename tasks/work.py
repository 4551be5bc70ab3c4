"""`scheduler.cluster.work.Work` on Celery: the one place the control path's messages become Celery
calls (and its clean-up of lost launches' hosts becomes `deploy.cleanup`'s)."""
from __future__ import annotations

from typing import Any

from celery import Celery, chord

from deploy.cleanup import clean_launch_in_background, wait_for_background_cleanups

from scheduler.cluster.launches import FinishSpec
from scheduler.cluster.work import RankLaunch
from scheduler.embedded.worker_command import CONTROL_QUEUE
from workers.state.store import BaseSlotStore


class CeleryWork:
    """An experiment is a chord: header = one `autotune.run_rank` per rank on its slot's queue, body =
    `autotune.finish_experiment` on the control queue (rank tasks never raise, so the body runs)."""

    def __init__(self, app: Celery) -> None:
        self.app = app

    def launch(self, ranks: list[RankLaunch], finish: FinishSpec, time_limit_s: int, shown: str) -> None:
        header = [self.app.signature("autotune.run_rank", args=(rank.spec.to_json(),), queue=rank.queue,
                                     time_limit=time_limit_s, task_id=rank.task_id, argsrepr=rank.shown,
                                     kwargsrepr="{}")
                  for rank in ranks]
        body = self.app.signature("autotune.finish_experiment", args=(finish.to_json(),), queue=CONTROL_QUEUE,
                                  argsrepr=shown, kwargsrepr="{}")
        chord(header, body).apply_async()

    def revoke(self, task_ids: list[str]) -> None:
        self.app.control.revoke(task_ids, terminate=True, signal="SIGTERM")

    def clean_up(self, slots: BaseSlotStore, name: str, launch: dict[str, Any]) -> None:
        clean_launch_in_background(slots, name, launch)

    def wait_for_clean_ups(self, timeout_s: float) -> bool:
        return wait_for_background_cleanups(timeout_s)

    def advance(self, job: str) -> None:
        self.app.send_task("autotune.advance_job", args=[job], queue=CONTROL_QUEUE)

    def finished(self, task_id: str) -> bool:
        return bool(self.app.AsyncResult(task_id).ready())
