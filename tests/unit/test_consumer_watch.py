"""workers.slot.consumer_watch: when a slot worker's consumer counts as stuck (its slot withdrawn)."""
from __future__ import annotations

from workers.slot.consumer_watch import ConsumerWatch


class Readings:
    def __init__(self) -> None:
        self.now, self.waiting, self.busy = 0.0, 0, False


def _watch(readings: Readings) -> ConsumerWatch:
    return ConsumerWatch(lambda: readings.waiting, lambda: readings.busy, stuck_s=20.0, clock=lambda: readings.now)


def test_a_message_waiting_while_the_worker_is_idle_for_the_whole_limit_withdraws_the_slot() -> None:
    readings = Readings()
    watch = _watch(readings)
    assert watch() is None
    readings.waiting = 1
    assert watch() is None  # just sent: a consuming worker takes it within milliseconds
    readings.now = 19.0
    assert watch() is None
    readings.now = 20.0
    why = watch()
    assert why is not None and "1 message(s) have waited in its queue for 20s" in why and "restart" in why
    readings.waiting = 0  # taken after all (the consumer came back, or add_consumer)
    assert watch() is None


def test_a_busy_worker_or_an_empty_queue_is_never_stuck_and_restarts_the_count() -> None:
    readings = Readings()
    watch = _watch(readings)
    readings.waiting, readings.busy = 1, True  # the next experiment queued behind the running one
    for readings.now in (0.0, 30.0, 60.0):
        assert watch() is None
    readings.busy = False
    assert watch() is None  # its count starts now, not when the message arrived
    readings.now = 79.0
    assert watch() is None
    readings.waiting = 0
    readings.now = 80.0
    assert watch() is None
    readings.waiting = 1
    readings.now = 95.0
    assert watch() is None  # a new wait: 0 s old
    readings.now = 115.0
    assert watch() is not None
