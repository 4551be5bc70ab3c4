"""Waiting for others' memory on a GPU to go before and after a rank (workers.device.device_idle), and reading
the usage from nvidia-smi (workers.device.gpus.parse_memory_used). The clock and the usage are scripted."""
from __future__ import annotations

import pytest

from workers.device.device_idle import FREE_BYTES, POLL_S, WAIT_S, FreeMemoryWaiter, gpu_wait_s
from workers.device.gpus import parse_memory_used

GiB = 1 << 30


class Clock:
    """A clock that moves only when slept on, and the usage it shows at each moment."""

    def __init__(self, usage: list[tuple[float, int | None]]) -> None:
        self.now, self.usage, self.reads = 0.0, usage, 0

    def sleep(self, seconds: float) -> None:
        self.now += seconds

    def read(self, index: int) -> int | None:
        self.reads += 1
        return [used for since, used in self.usage if since <= self.now][-1]


def waiter(clock: Clock) -> FreeMemoryWaiter:
    return FreeMemoryWaiter(clock.read, sleep=clock.sleep, clock=lambda: clock.now)


def test_a_free_gpu_is_not_waited_for() -> None:
    clock = Clock([(0.0, 3 << 20)])
    wait = waiter(clock).wait("GPU-0")
    assert (wait.waited_s, wait.foreign_bytes) == (0.0, 0)


def test_a_context_being_torn_down_is_waited_for_until_it_is_gone() -> None:
    """The last experiment's 70 GiB context goes 4 s after its process: the rank starts then."""
    clock = Clock([(0.0, 70 * GiB), (4.0, 2 << 20)])
    wait = waiter(clock).wait("GPU-0")
    assert wait.waited_s == 4.0 and wait.foreign_bytes == 0


def test_memory_that_stays_is_waited_for_at_most_wait_s_and_reported_busy() -> None:
    """A notebook holds 20 GiB: the wait runs the whole WAIT_S and says the GPU is busy, every time
    (the rank then takes its slot out of tuning, workers.state.slot_health, rather than start beside it)."""
    clock = Clock([(0.0, 20 * GiB)])
    gpus = waiter(clock)
    for _ in range(2):
        wait = gpus.wait("GPU-0")
        assert wait.waited_s == pytest.approx(WAIT_S, abs=POLL_S) and wait.busy
        assert wait.foreign_bytes == wait.used_bytes == 20 * GiB


def test_memory_that_goes_late_in_the_wait_is_not_busy() -> None:
    clock = Clock([(0.0, 20 * GiB), (WAIT_S - 1, 0)])
    wait = waiter(clock).wait("GPU-0")
    assert not wait.busy and wait.foreign_bytes == 0 and wait.waited_s == WAIT_S - 1


def test_an_aborted_launch_stops_waiting() -> None:
    clock = Clock([(0.0, 20 * GiB)])
    calls = []
    wait = waiter(clock).wait("GPU-0", keep_alive=lambda: calls.append(clock.now) or len(calls) >= 3)
    assert len(calls) == 3 and wait.waited_s == 2 * POLL_S
    assert wait.stopped and not wait.busy  # an aborted launch says nothing of the GPU's health


def test_usage_nvidia_smi_cannot_tell_is_not_waited_for() -> None:
    clock = Clock([(0.0, None)])
    wait = waiter(clock).wait("GPU-0")
    assert (wait.waited_s, wait.used_bytes, wait.foreign_bytes, clock.reads) == (0.0, None, None, 1)
    assert not wait.busy


def test_just_under_and_over_the_free_line() -> None:
    assert not waiter(Clock([(0.0, FREE_BYTES)])).wait("GPU-0").busy
    over = waiter(Clock([(0.0, FREE_BYTES + (1 << 20))])).wait("GPU-0")
    assert over.busy and over.foreign_bytes == FREE_BYTES + (1 << 20)


@pytest.mark.parametrize(("text", "gpu", "expected"), [
    ("0, GPU-a, 20480\n1, GPU-b, 3\n", "GPU-a", 20480 * 2**20),
    ("0, GPU-a, 20480\n1, GPU-b, 3\n", "GPU-b", 3 * 2**20),
    ("0, GPU-a, 20480\n1, GPU-b, 3\n", "1", 3 * 2**20),  # a slot registered without a UUID: its index
    ("0, GPU-a, 20480\n", "GPU-c", None),  # not listed
    ("0, GPU-a, [N/A]\n", "GPU-a", None),
    ("0, GPU-a, 16384, Disabled\n", "GPU-a", None),  # another query's answer
    ("", "GPU-a", None),
])
def test_parse_memory_used(text: str, gpu: str, expected: int | None) -> None:
    assert parse_memory_used(text, gpu) == expected


@pytest.mark.parametrize(("text", "seconds"), [("5", 5.0), ("0", 0.0), (None, WAIT_S), ("", WAIT_S), ("x", WAIT_S),
                                              ("-1", WAIT_S), ("inf", WAIT_S), ("nan", WAIT_S)])
def test_the_wait_a_worker_reads_from_its_environment(text: str | None, seconds: float) -> None:
    assert gpu_wait_s(text) == seconds
