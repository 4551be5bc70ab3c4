"""What only the Redis slot store has (`workers.state.store.RedisSlotStore`), as the callers outside
`workers.state` use it: a release queued in a caller's pipeline, a rank's lease, the heartbeat and
health threads a worker starts, and whether a control worker is registered. The interface's methods,
shared with the in-memory twin, are checked by test_slot_store_contract.py."""
from __future__ import annotations

import threading
import time

import redis

from workers.device.slot import Slot
from workers.state import keys, registry, slot_health
from workers.state.store import RedisSlotStore

GiB = 2**30
SLOT = Slot("n0", 1, "cuda", 80 * GiB, "10.0.0.9", 8, (), "gpu1@n0", cuda_index=1, host="m1", gpu_uuid="GPU-1")


def until(condition, timeout_s: float = 3.0) -> bool:
    """Whether `condition` held within `timeout_s`, polled."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        threading.Event().wait(0.02)
    return condition()


def test_a_release_queued_in_a_pipeline_frees_the_slots_when_it_runs(client: redis.Redis) -> None:
    store = RedisSlotStore(client)
    token = store.reserve(["n0.gpu0", "n0.gpu1"], 30, owner="j/a")
    pipe = client.pipeline(transaction=False)
    store.release_in(pipe, ["n0.gpu0", "n0.gpu1"], token)
    assert store.held(["n0.gpu0", "n0.gpu1"]) == {"n0.gpu0", "n0.gpu1"}  # queued, not yet run
    assert pipe.execute() == [2]
    assert store.held(["n0.gpu0", "n0.gpu1"]) == set()


def test_a_ranks_lease_holds_its_slot_until_the_slot_is_freed(client: redis.Redis) -> None:
    store = RedisSlotStore(client)
    token = store.reserve([SLOT.queue], 30)
    assert store.lease(SLOT.queue, token, 30).renew() is False  # still held
    store.release([SLOT.queue], token)
    assert store.lease(SLOT.queue, token, 30).renew() is True  # freed on this server: taken


def test_the_slot_and_control_heartbeats_announce_until_stopped(client: redis.Redis, monkeypatch) -> None:
    monkeypatch.setattr(registry, "HEARTBEAT_S", 0.05)
    store = RedisSlotStore(client)
    assert store.control_alive() is False
    control, slot = store.register_control("n0", "control@n0"), store.register_slot(SLOT)
    try:
        assert store.control_alive() is True
        assert [s.queue for s in store.live_slots()] == [SLOT.queue]
    finally:
        control.stop()
        slot.stop()
    assert store.control_alive() is False and store.live_slots() == []


def test_a_slot_its_worker_withholds_is_withdrawn_with_why(client: redis.Redis, monkeypatch) -> None:
    monkeypatch.setattr(registry, "HEARTBEAT_S", 0.05)
    store = RedisSlotStore(client)
    beat = store.register_slot(SLOT, withheld=lambda: "its consumer is stuck")
    try:
        assert until(lambda: store.withdrawn([SLOT.queue]) == {SLOT.queue: "its consumer is stuck"})
        assert store.live_slots() == []
    finally:
        beat.stop()


def test_the_health_watch_lifts_the_mark_once_the_gpu_is_free(client: redis.Redis, monkeypatch) -> None:
    monkeypatch.setattr(slot_health, "POLL_S", 0.02)
    store = RedisSlotStore(client)
    store.mark_unhealthy(SLOT.queue, 20 * GiB, "after a run")
    watch = store.watch_health(SLOT.queue, SLOT.nvidia_smi_id, lambda gpu: 0)
    try:
        assert until(lambda: not client.exists(keys.unhealthy(SLOT.queue)))
    finally:
        watch.stop()
