"""One contract for both slot stores (`workers.state.store.BaseSlotStore`): the Redis `RedisSlotStore`
on the session's redis-server and its in-memory twin (`workers.state.memory_store.InMemorySlotStore`),
every interface method, run against each. The twin is what tests/unit tests the slot decisions
with (tests/unit/test_slot_decisions.py), so what passes here for both is what makes those tests
say something about Redis.

TTLs are short (passed, or monkeypatched on their modules) so Redis's own expiry runs within the
test; `later` sleeps for Redis and moves the twin's clock, `lose_data` empties Redis or the twin.
What only Redis has (the heartbeat thread, scripts in a caller's pipeline) stays in
tests/redis/test_registry.py, test_gang.py and test_slot_view.py.
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable

import pytest

from test_job_store_contract import Clock
from workers.device.slot import Slot
from workers.state import keys, registry, slot_health
from workers.state.memory_store import MemorySlots
from workers.state.store import BaseSlotStore, RedisSlotStore

SHORT = 0.3  #: a TTL that lapses within a test
PAST = 0.45  #: waited for it to lapse


class Backend:
    """The slot store on one backend, how time passes for it, and how it loses its data."""

    def __init__(self, store: BaseSlotStore, later: Callable[[float], None], lose_data: Callable[[], None]) -> None:
        self.store, self.later, self.lose_data = store, later, lose_data


@pytest.fixture(params=["redis", "memory"])
def backend(request: pytest.FixtureRequest) -> Backend:
    if request.param == "redis":
        client = request.getfixturevalue("client")  # the session's redis-server (conftest), emptied
        return Backend(RedisSlotStore(client), time.sleep, client.flushall)
    clock = Clock()
    db = MemorySlots(clock)

    def later(seconds: float) -> None:
        clock.now += seconds
    return Backend(db.store(), later, db.flush)


def slot(node: str, device: int, memory: int = 2**30, instance: str = "i", gpu: str = "") -> Slot:
    return Slot(node, device, "cuda", memory, "10.0.0.1", 1, (device,), worker=f"gpu{device}@{node}",
                instance=instance, cuda_index=device, host="machine", gpu_uuid=gpu)


def register(store: BaseSlotStore, *slots: Slot, ttl_s: float | None = None) -> None:
    for one in slots:
        store.announce_slot(one, ttl_s)


class TestRegistrations:
    def test_live_slots_are_the_announced_ones_by_node_then_device(self, backend: Backend) -> None:
        store = backend.store
        assert store.live_slots() == []
        b1, a0, a1 = slot("b", 1), slot("a", 0), slot("a", 1)
        register(store, b1, a1)
        store.announce(a0.queue, json.dumps(a0.to_redis()), None, {"autotune:extra": "x"})
        assert store.live_slots() == [a0, a1, b1]
        register(store, slot("a", 1, instance="restarted"))  # the same queue: replaced
        assert [s.instance for s in store.live_slots()] == ["i", "restarted", "i"]

    def test_a_registration_lapses_without_its_heartbeat(self, backend: Backend) -> None:
        store = backend.store
        register(store, slot("n", 0), ttl_s=SHORT)
        register(store, slot("n", 1))
        backend.later(PAST)
        assert [s.queue for s in store.live_slots()] == ["n.gpu1"]

    def test_unregister_withdraws_for_a_while_or_leaves_cleanly(self, backend: Backend,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(registry, "TTL_S", SHORT)
        store = backend.store
        register(store, slot("n", 0), slot("n", 1), slot("n", 2))
        store.unregister("n.gpu0", why="consumer stuck")
        store.unregister("n.gpu1")
        assert [s.queue for s in store.live_slots()] == ["n.gpu2"]
        assert store.withdrawn(["n.gpu0", "n.gpu1", "n.gpu2"]) == {"n.gpu0": "consumer stuck"}
        assert store.withdrawn([]) == {}
        store.unregister("n.gpu2", why="stuck")
        store.unregister("n.gpu2")  # a clean leave forgets the withdrawal
        assert store.withdrawn(["n.gpu2"]) == {}
        backend.later(PAST)
        assert store.withdrawn(["n.gpu0"]) == {}

    def test_unregister_deletes_the_claims_with_the_registration(self, backend: Backend) -> None:
        store = backend.store
        mine, twin = slot("a", 0, gpu="GPU-1"), slot("b", 0, gpu="GPU-1")
        claims = registry._gpu_claim(mine)
        store.announce(mine.queue, json.dumps(mine.to_redis()), None, claims)
        assert store.claim_gpu(twin) == {"queue": "a.gpu0", "worker": "gpu0@a"}
        store.unregister(mine.queue, list(claims))
        assert store.claim_gpu(twin) is None

    def test_one_gpu_is_claimed_by_one_queue_until_its_claim_lapses(self, backend: Backend,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(registry, "TTL_S", SHORT)
        store = backend.store
        first, again, other = slot("a", 0, gpu="GPU-1"), slot("a", 0, instance="i2", gpu="GPU-1"), slot("b", 3, gpu="GPU-1")
        assert store.claim_gpu(first) is None
        assert store.claim_gpu(again) is None  # its restarted worker takes over
        assert store.claim_gpu(other) == {"queue": "a.gpu0", "worker": "gpu0@a"}
        assert store.claim_gpu(slot("b", 4, gpu="GPU-2")) is None and store.claim_gpu(slot("c", 0)) is None
        backend.later(PAST)
        assert store.claim_gpu(other) is None
        assert store.claim_gpu(first) == {"queue": "b.gpu3", "worker": "gpu3@b"}


class TestView:
    def test_free_sick_and_reserved_slots(self, backend: Backend) -> None:
        store = backend.store
        slots = [slot("n", i) for i in range(4)]
        register(store, *slots)
        store.mark_unhealthy("n.gpu1", 5 * 2**30, "others' memory")
        store.mark_unhealthy("n.gpu2", 2**30, "others' memory")
        assert store.reserve(["n.gpu2", "n.gpu3"], 60.0, owner="j/e") is not None
        view = store.read_view()
        assert view.free == frozenset({"n.gpu0"}) and view.slots == slots
        assert set(view.sick) == {"n.gpu1"} and view.sick["n.gpu1"]["used_bytes"] == 5 * 2**30
        assert view.busy() == {"n.gpu1", "n.gpu2", "n.gpu3"}

    def test_the_epoch_and_the_memo_change_only_when_a_registration_does(self, backend: Backend) -> None:
        store = backend.store
        register(store, slot("n", 0))
        first = store.read_view()
        first.memo["fits"] = True
        register(store, slot("n", 0))  # the same registration: nothing changed
        store.reserve(["n.gpu0"], 60.0)
        same = store.read_view()
        assert same.epoch == first.epoch and same.memo == {"fits": True} and same.free == frozenset()
        register(store, slot("n", 0, instance="restarted"))
        changed = store.read_view()
        assert changed.epoch != first.epoch and changed.memo == {} and changed.slots[0].instance == "restarted"
        register(store, slot("n", 1))
        assert store.read_view().epoch != changed.epoch
        store.unregister("n.gpu1")
        assert [s.queue for s in store.read_view().slots] == ["n.gpu0"]

    def test_a_lapsed_registration_leaves_the_view_once_unreserved(self, backend: Backend) -> None:
        store = backend.store
        register(store, slot("n", 0), slot("n", 1), ttl_s=SHORT)
        register(store, slot("n", 2))
        token = store.reserve(["n.gpu1"], 60.0)
        before = store.read_view()
        backend.later(PAST)
        after = store.read_view()  # n.gpu0 lapsed unreserved: pruned, a new epoch
        assert after.epoch != before.epoch and after.free == frozenset({"n.gpu2"})
        assert [s.queue for s in store.live_slots()] == ["n.gpu2"]
        assert store.read_view().epoch == after.epoch  # n.gpu1 is reserved: it stays indexed
        assert token is not None and store.release(["n.gpu1"], token) == 1
        assert store.read_view().epoch != after.epoch and store.read_view().free == frozenset({"n.gpu2"})


class TestHealth:
    def test_a_mark_keeps_its_first_since_and_lapses(self, backend: Backend,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(slot_health, "MARK_TTL_S", SHORT)
        store = backend.store
        assert store.unhealthy(["n.gpu0"]) == {} and store.unhealthy([]) == {}
        store.mark_unhealthy("n.gpu0", 100, "before")
        since = store.unhealthy(["n.gpu0"])["n.gpu0"]["since"]
        backend.later(0.1)
        store.mark_unhealthy("n.gpu0", 200, "after")
        assert store.unhealthy(iter(["n.gpu0", "n.gpu1"])) == {
            "n.gpu0": {"used_bytes": 200, "since": since, "why": "after"}}
        backend.later(PAST)
        assert store.unhealthy(["n.gpu0"]) == {}


class TestGangLeases:
    def test_reserve_takes_all_or_nothing(self, backend: Backend) -> None:
        store = backend.store
        token = store.reserve(["a", "b"], 60.0, owner="j/e1")
        assert token is not None and token.startswith("j/e1#")
        assert store.reserve(["b", "c"], 60.0) is None and store.held(["a", "b", "c"]) == {"a", "b"}
        bare = store.reserve(["c"], 60.0)
        assert bare is not None and "#" not in bare and store.reserve([], 60.0) is not None
        assert store.holds(["a", "b"], token) and not store.holds(["a", "c"], token) and store.holds(["c"], bare)
        assert store.holders(["a", "b", "c", "d"]) == {"a": "j/e1", "b": "j/e1", "c": bare}
        assert store.owners(["a", "c", "d"]) == {"a": "j/e1"}

    def test_release_frees_only_what_the_token_holds(self, backend: Backend) -> None:
        store = backend.store
        mine, theirs = store.reserve(["a", "b"], 60.0), store.reserve(["c"], 60.0)
        assert mine is not None and theirs is not None
        assert store.release(["a", "b", "c"], mine) == 2
        assert store.held(["a", "b", "c"]) == {"c"} and store.release(["a"], mine) == 0

    def test_a_lease_lapses_unless_kept(self, backend: Backend) -> None:
        store = backend.store
        token = store.reserve(["a", "b"], SHORT)
        assert token is not None
        backend.later(0.2)
        assert store.keep("a", token, SHORT).held and not store.keep("a", "other", SHORT).held
        backend.later(0.2)
        assert store.held(["a", "b"]) == {"a"} and not store.holds(["a", "b"], token)
        backend.later(PAST)
        assert store.held(["a"]) == set()

    def test_keep_takes_a_slot_back_only_after_the_data_was_lost(self, backend: Backend) -> None:
        store = backend.store
        token = store.reserve(["a", "b"], 60.0)
        assert token is not None
        renewal = store.keep("a", token, 60.0)
        assert renewal.held and renewal.server and store.keep("a", token, 60.0, renewal.server).server == renewal.server
        store.release(["b"], token)  # freed in the same data: given up
        assert not store.keep("b", token, 60.0, renewal.server).held and store.held(["b"]) == set()
        backend.lose_data()
        assert not store.keep("a", token, 60.0).held  # no data token of its own: nothing to compare
        assert store.held(["a"]) == set()
        back = store.keep("a", token, 60.0, renewal.server)
        assert back.held and back.server != renewal.server and store.holds(["a"], token)


class TestRankGroups:
    def test_a_ranks_record_and_group_are_read_for_the_ranks_asked_only(self, backend: Backend) -> None:
        store = backend.store
        assert store.read_rank_groups([]) == {} and store.read_rank_groups([("n.gpu0", "t1")]) == {}
        store.write_rank_group("n.gpu0", "t1", '{"pgid": 41}', 41, 600)
        store.write_rank_group("n.gpu1", "t2", '{"pgid": 42}', 42, 600)
        assert store.read_rank_groups(iter([("n.gpu0", "t1"), ("n.gpu0", "t2")])) == {
            keys.rank_process("n.gpu0", "t1"): '{"pgid": 41}', keys.pgid("n.gpu0", "t1"): "41"}
        store.write_rank_group("n.gpu0", "t1", '{"pgid": 43}', 43, 600)  # written again: replaced
        store.write_rank_group("n.gpu1", "t3", "", 44, 600)  # no record: the pgid alone is read
        assert store.read_rank_groups([("n.gpu0", "t1"), ("n.gpu1", "t3")]) == {
            keys.rank_process("n.gpu0", "t1"): '{"pgid": 43}', keys.pgid("n.gpu0", "t1"): "43",
            keys.pgid("n.gpu1", "t3"): "44"}

    def test_they_lapse_with_their_ttl_and_go_with_the_data(self, backend: Backend) -> None:
        store = backend.store
        store.write_rank_group("n.gpu0", "short", "{}", 7, 1)  # whole seconds: Redis's EX
        store.write_rank_group("n.gpu0", "long", "{}", 8, 600)
        backend.later(1.2)
        assert store.read_rank_groups([("n.gpu0", "short"), ("n.gpu0", "long")]) == {
            keys.rank_process("n.gpu0", "long"): "{}", keys.pgid("n.gpu0", "long"): "8"}
        backend.lose_data()
        assert store.read_rank_groups([("n.gpu0", "long")]) == {}
