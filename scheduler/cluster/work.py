"""What the control path asks of the world outside it: launch an experiment, revoke ranks, kill
what a stopped launch left on its hosts, ask for a job's step, tell whether a rank's task finished.
Nothing more.

Why a seam: dispatch and the job functions decide, and building Celery chords and calling
`app.control.revoke` and `app.AsyncResult` themselves would pass an untyped `app` through a dozen
functions and tie them to a broker. So they talk to this small protocol; `tasks.work.CeleryWork`
implements it with Celery (a chord per experiment: one task per rank on its slot's queue, the
callback on the control queue) and with `deploy.cleanup` for the hosts (SSH), and tests give them a
recorder instead of a broker. The control path itself imports neither Celery nor deploy
(tests/unit/test_architecture.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from scheduler.cluster.launches import FinishSpec
from workers.slot.rank_spec import RankSpec
from workers.state.store import BaseSlotStore


@dataclass(frozen=True)
class RankLaunch:
    """One rank of an experiment, addressed to its slot."""

    queue: str  #: the reserved slot's queue
    spec: RankSpec
    task_id: str  #: chosen by dispatch, so the launch can be revoked before it reports
    shown: str  #: what monitors show instead of the spec (no gang token, no script argv)


class Work(Protocol):
    """The message layer as the control path sees it."""

    def launch(self, ranks: list[RankLaunch], finish: FinishSpec, time_limit_s: int, shown: str) -> None:
        """Send an experiment: every rank to its slot, then `finish` to a control worker once all
        ranks have reported."""

    def revoke(self, task_ids: list[str]) -> None:
        """Stop these rank tasks (their workers kill the training groups)."""

    def clean_up(self, slots: BaseSlotStore, name: str, launch: dict[str, Any]) -> None:
        """Kill, on their hosts and without blocking, the training groups a stopped launch's ranks
        recorded (read from `slots` before returning): a worker that died for good kills nothing itself."""

    def wait_for_clean_ups(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for the clean-ups this process started; whether all ended (a
        command ending after Ctrl-C must not leave one half done)."""

    def advance(self, job: str) -> None:
        """Ask a control worker to take the job's next step."""

    def finished(self, task_id: str) -> bool:
        """Whether a rank task has reported (its record is in)."""
