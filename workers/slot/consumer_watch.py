"""A slot worker whose consumer stopped taking messages from its queue withdraws its slot.

Why: after a broker reconnect (Redis restarted while a rank ran), a Celery worker can come back
"Connected" and never take another message from its queue (celery#8030, #9054, #10205; kombu#2007),
while its heartbeat thread keeps its slot registered as live. Dispatch then sends experiment after
experiment to a slot that never starts them: each waits out its lease, is queued again, and may land
on the same slot, so a job stalls for minutes. A reserved
slot is idle by construction, so a message waiting in its queue while its worker runs nothing is
taken within milliseconds by a worker that consumes; one still waiting `STUCK_S` later means the
consumer is stuck. The slot is then withdrawn (`workers.state.registry.Heartbeat` stops announcing it,
deletes its registration and says why in `keys.withdrawn`): the sweep finds its launch lost at its
next pass and queues it again, and dispatch places nothing more there. It is announced again as soon
as the queue is taken from again (the consumer recovered, or was restarted by `celery control
add_consumer`); the worker's log says what happened and that restarting the worker is the fix.

`ConsumerWatch` is the decision, pure apart from the two readings it is given (the queue's length
in Redis, whether the worker holds a task); `tasks.worker_hooks` gives it Celery's view.
"""
from __future__ import annotations

import time
from collections.abc import Callable

#: How long a message may wait in an idle slot worker's queue before its consumer counts as stuck:
#: far above a consuming worker's pick-up (milliseconds) and its reconnect after a broker restart
#: (seconds), well below a launch's lease.
STUCK_S = 20.0
STUCK_ENV = "AUTOTUNE_CONSUMER_STUCK_S"  #: a worker's own STUCK_S (the tests' faults use a few seconds)


class ConsumerWatch:
    """Asked before each heartbeat: None while the worker takes what its queue holds, else why
    its slot must not be announced."""

    def __init__(self, waiting: Callable[[], int], busy: Callable[[], bool], stuck_s: float = STUCK_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._waiting, self._busy, self._stuck_s, self._clock = waiting, busy, stuck_s, clock
        self._since: float | None = None

    def __call__(self) -> str | None:
        count = 0 if self._busy() else self._waiting()
        if not count:
            self._since = None
            return None
        now = self._clock()
        if self._since is None:
            self._since = now
        if now - self._since < self._stuck_s:
            return None
        return (f"{count} message(s) have waited in its queue for {now - self._since:.0f}s while it ran nothing: "
                "its consumer stopped taking them (a known Celery/kombu fault after a broker reconnect); "
                "the slot is withdrawn until it takes them again: restart this worker")
