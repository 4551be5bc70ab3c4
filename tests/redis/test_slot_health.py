"""A slot whose GPU holds others' memory is out of tuning until that memory is gone (workers.state.slot_health),
against a real redis-server: the mark, its renewal by the worker's
heartbeat while the memory stays, and its lifting only after FREE_BEATS free readings in a row."""
from __future__ import annotations

import json
import threading
from io import StringIO

import redis
from rich.console import Console

from scheduler.status import collect, render

from workers.state import keys
from workers.device.device_idle import FREE_BYTES
from workers.state.registry import announce_slot
from workers.device.slot import Slot
from workers.state import slot_health
from workers.state.slot_health import FREE_BEATS, MARK_TTL_S, HealthWatch, describe, mark_unhealthy, unhealthy

GiB = 2**30
SLOT = Slot("n0", 1, "cuda", 80 * GiB, "10.0.0.9", 8, (), "gpu1@n0", cuda_index=1, host="m1", gpu_uuid="GPU-1")


class Usage:
    """What nvidia-smi shows for the GPU at each reading, in turn (the last one repeats)."""

    def __init__(self, *readings: int | None) -> None:
        self.readings, self.asked = list(readings), []

    def __call__(self, gpu: str) -> int | None:
        self.asked.append(gpu)
        return self.readings.pop(0) if len(self.readings) > 1 else self.readings[0]


def test_a_mark_says_what_was_seen_and_keeps_its_first_since(client: redis.Redis) -> None:
    assert unhealthy(client, ["n0.gpu1", "n0.gpu2"]) == {} and unhealthy(client, []) == {}
    mark_unhealthy(client, "n0.gpu1", 20 * GiB, "before a launch")
    first = unhealthy(client, ["n0.gpu1", "n0.gpu2"])["n0.gpu1"]
    assert (first["used_bytes"], first["why"]) == (20 * GiB, "before a launch")
    assert 0 < client.pttl(keys.unhealthy("n0.gpu1")) <= MARK_TTL_S * 1000  # lapses with a dead worker
    mark_unhealthy(client, "n0.gpu1", 30 * GiB, "after a run")
    again = unhealthy(client, ["n0.gpu1"])["n0.gpu1"]
    assert again["since"] == first["since"] and again["used_bytes"] == 30 * GiB
    assert describe("n0.gpu1", again) == "n0.gpu1 (30.0 GiB used by other processes)"


def test_an_unmarked_slot_reads_nothing(client: redis.Redis) -> None:
    usage = Usage(20 * GiB)
    HealthWatch(client, "n0.gpu1", "GPU-1", usage).check()
    assert usage.asked == [] and not client.exists(keys.unhealthy("n0.gpu1"))


def test_the_mark_is_lifted_only_after_free_beats_in_a_row(client: redis.Redis) -> None:
    """Busy, free, free, busy (the holder flickered back), then free FREE_BEATS times: the mark stays
    renewed (TTL refreshed, the usage now shown) until the last of those, and only then goes."""
    assert FREE_BEATS == 3
    mark_unhealthy(client, "n0.gpu1", 20 * GiB, "after a run")
    usage = Usage(25 * GiB, 0, FREE_BYTES, 40 * GiB, None, 0, 0, 0)
    watch = HealthWatch(client, "n0.gpu1", "GPU-1", usage)
    seen = []
    for _ in range(8):
        client.pexpire(keys.unhealthy("n0.gpu1"), 2000)  # the watch must renew it at each beat
        watch.check()
        raw = client.get(keys.unhealthy("n0.gpu1"))
        seen.append(json.loads(raw)["used_bytes"] if raw else None)
        if raw:
            assert client.pttl(keys.unhealthy("n0.gpu1")) > 5000
    assert seen == [25 * GiB, 25 * GiB, 25 * GiB, 40 * GiB, 40 * GiB, 40 * GiB, 40 * GiB, None]
    assert usage.asked == ["GPU-1"] * 8


def test_a_slot_marked_again_must_stay_free_longer_until_it_is_calm(client: redis.Redis) -> None:
    """A holder that keeps coming back: the second mark needs twice the free readings, the third
    four times; a slot unmarked for CALM_S starts again from FREE_BEATS."""
    now = [0.0]
    watch = HealthWatch(client, "n0.gpu1", "GPU-1", lambda gpu: 0)
    watch.clock = lambda: now[0]

    def readings_to_lift() -> int:
        mark_unhealthy(client, "n0.gpu1", 20 * GiB, "after a run")
        count = 0
        while client.exists(keys.unhealthy("n0.gpu1")):
            watch.check()
            count += 1
        return count

    assert [readings_to_lift() for _ in range(3)] == [FREE_BEATS, 2 * FREE_BEATS, 4 * FREE_BEATS]
    now[0] += slot_health.CALM_S + 1
    watch.check()  # unmarked, calm
    assert readings_to_lift() == FREE_BEATS


def test_the_watch_thread_keeps_the_mark_while_busy_and_lifts_it_when_free(client: redis.Redis,
                                                                          monkeypatch) -> None:
    """As tasks.worker_hooks starts it: the mark outlives its own TTL while the GPU stays busy, and
    goes once it is free; a reading that raises does not end the thread."""
    monkeypatch.setattr(slot_health, "POLL_S", 0.05)
    monkeypatch.setattr(slot_health, "MARK_TTL_S", 1.0)
    state = {"busy": True, "raised": 0}

    def read(gpu: str) -> int:
        if state["raised"] == 0:
            state["raised"] = 1
            raise OSError("nvidia-smi: not found")
        return 20 * GiB if state["busy"] else 0

    mark_unhealthy(client, SLOT.queue, 20 * GiB, "after a run")
    watch = HealthWatch(client, SLOT.queue, SLOT.nvidia_smi_id, read).start()
    try:
        threading.Event().wait(2.2)  # past two TTLs
        assert client.exists(keys.unhealthy(SLOT.queue)) and state["raised"] == 1
        state["busy"] = False
        threading.Event().wait(1.5)
        assert not client.exists(keys.unhealthy(SLOT.queue))
    finally:
        watch.stop()


def test_status_shows_a_slot_out_of_tuning_and_why(client: redis.Redis) -> None:
    """`python -m scheduler.autotune --status`: the marked slot, the memory held; the others free."""
    other = Slot("n0", 0, "cuda", 80 * GiB, "10.0.0.9", 8, (), "gpu0@n0", cuda_index=0, host="m1", gpu_uuid="GPU-0")
    for slot in (SLOT, other):
        announce_slot(client, slot)
    mark_unhealthy(client, SLOT.queue, 20 * GiB, "before a launch")
    shown = {slot["queue"]: slot["unhealthy"] for slot in collect(client)["slots"]}
    assert shown == {"n0.gpu0": "", "n0.gpu1": "n0.gpu1 (20.0 GiB used by other processes)"}
    out = StringIO()
    render(Console(file=out, width=200), collect(client))
    rows = {line.split()[1]: line for line in out.getvalue().splitlines() if "n0.gpu" in line}
    assert "out of tuning: n0.gpu1 (20.0 GiB used by other processes)" in rows["n0.gpu1"]
    assert "free" in rows["n0.gpu0"] and "out of tuning" not in rows["n0.gpu0"]
