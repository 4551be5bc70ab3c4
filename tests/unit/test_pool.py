"""The resource pool bounds a tuning job: `scheduler.launch.pool` picks the live
slots a --hostfile/--include/--exclude names, placement and dispatch's fit check keep every
experiment inside them, and a cluster still starting is waited for (`preflight.wait_for_cluster`)."""
from __future__ import annotations

import itertools

import pytest

from scheduler import preflight
from scheduler.cluster.backfill import Waiting, backfill
from scheduler.cluster.placement import fits_ever, place
from scheduler.errors import ClusterError, ResourceFilterError, UsageError
from scheduler.launch.pool import PoolRequest, check_counts, registered, select_slots
from workers.device.slot import Slot

GiB = 2**30


def _slots(layout: dict[str, int]) -> list[Slot]:
    return [Slot(node, device, "cuda", 16 * GiB, f"10.0.0.{index}", 1, ())
            for index, (node, count) in enumerate(layout.items(), 1) for device in range(count)]


CLUSTER = _slots({"node-a": 4, "node-b": 4, "node-c": 2})


def test_no_pool_asked_means_every_slot() -> None:
    assert select_slots(CLUSTER, PoolRequest(), "node-a") is None


@pytest.mark.parametrize("request_, expected", [
    (PoolRequest(include="node-b:1,3"), {"node-b": [1, 3]}),
    (PoolRequest(include="node-a@node-c:1"), {"node-a": [0, 1, 2, 3], "node-c": [1]}),
    (PoolRequest(exclude="node-a@node-b:0"), {"node-b": [1, 2, 3], "node-c": [0, 1]}),
    (PoolRequest(include="localhost:2"), {"node-a": [2]}),  # localhost is this machine's node
    (PoolRequest({"node-c": 2, "node-b": 1}, "hosts"), {"node-b": [0], "node-c": [0, 1]}),
    (PoolRequest({"localhost": 2, "node-b": 4}, "hosts", exclude="node-b:0,1"),
     {"node-a": [0, 1], "node-b": [2, 3]}),
])
def test_the_pool_selects_exactly_the_named_live_slots(request_: PoolRequest, expected: dict) -> None:
    pool = select_slots(CLUSTER, request_, "node-a")
    assert pool is not None
    assert registered(pool.slots) == expected
    assert sorted(pool.queues) == sorted(s.queue for s in pool.slots)


def test_hostfile_devices_not_yet_registered_stay_in_the_pool() -> None:
    """A slot of the pool whose worker registers later may still be used: its queue is in the pool."""
    pool = select_slots(CLUSTER, PoolRequest({"node-c": 4}, "hosts"), "node-a")
    assert pool is not None and registered(pool.slots) == {"node-c": [0, 1]}
    assert pool.queues == ["node-c.gpu0", "node-c.gpu1", "node-c.gpu2", "node-c.gpu3"]


def test_a_pool_matching_no_live_slot_names_what_is_registered() -> None:
    with pytest.raises(ClusterError) as caught:
        select_slots(CLUSTER, PoolRequest({"node-z": 2}, "hosts"), "node-a")
    message = str(caught.value)
    assert "--hostfile hosts selects node-z:0,1, which matches no live slot" in message
    assert "registered: node-a:0,1,2,3 node-b:0,1,2,3 node-c:0,1" in message


def test_unknown_hosts_and_ids_in_a_filter_are_refused() -> None:
    with pytest.raises(ResourceFilterError, match="node-z"):
        select_slots(CLUSTER, PoolRequest(include="node-z:0"), "node-a")
    with pytest.raises(ResourceFilterError, match="7"):
        select_slots(CLUSTER, PoolRequest(include="node-c:7"), "node-a")


def test_sizes_do_not_mix_with_a_filter() -> None:
    with pytest.raises(UsageError, match="cannot be combined"):
        check_counts(PoolRequest(exclude="node-a"), None, 2)
    check_counts(PoolRequest({"node-a": 4}, "hosts"), 2, 2)  # with a hostfile alone they size experiments


def test_placement_keeps_experiments_inside_the_pool() -> None:
    pool = frozenset({"node-b.gpu2", "node-b.gpu3", "node-c.gpu1"})
    placement = place(CLUSTER, set(), 1, 2, allowed=pool)
    assert placement is not None and {s.queue for s in placement[0]} == {"node-b.gpu2", "node-b.gpu3"}
    assert place(CLUSTER, {"node-b.gpu2"}, 1, 2, allowed=pool) is None  # never outside it, even when busy
    assert fits_ever(CLUSTER, 1, 1, allowed=pool) and not fits_ever(CLUSTER, 1, 3, allowed=pool)
    assert not fits_ever(CLUSTER, 2, 2, allowed=pool)


def test_backfill_starts_nothing_outside_a_jobs_pool() -> None:
    pool = frozenset({"node-c.gpu0"})
    queue = [Waiting(f"e{i}", 1, 1, 60.0, allowed=pool) for i in range(3)] + [Waiting("free", 1, 1, 60.0)]
    starts = backfill(queue, CLUSTER, {}, 0.0)
    used = {start.name: [s.queue for node in start.placement for s in node] for start in starts}
    assert used["e0"] == ["node-c.gpu0"] and "e1" not in used and "e2" not in used
    assert used["free"] != ["node-c.gpu0"]


def test_a_starting_cluster_is_waited_for(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(preflight, "CLUSTER_POLL_S", 0.01)
    answers = itertools.chain(["no control worker is running; start one with ..."] * 3, [None])
    preflight.wait_for_cluster(lambda: next(answers), wait_s=5)
    assert capsys.readouterr().err == ("waiting up to 5s (AUTOTUNE_CLUSTER_WAIT_S) for the cluster to start: "
                                       "no control worker is running\n")


def test_the_wait_is_bounded_and_ends_in_the_last_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(preflight, "CLUSTER_POLL_S", 0.01)
    monkeypatch.setenv("AUTOTUNE_CLUSTER_WAIT_S", "0.2")
    calls = []
    with pytest.raises(ClusterError, match="no slot workers"):
        preflight.wait_for_cluster(lambda: calls.append(1) or "no slot workers are registered")
    assert 5 <= len(calls) <= 40


def test_a_ready_cluster_is_not_waited_for(capsys: pytest.CaptureFixture[str]) -> None:
    preflight.wait_for_cluster(lambda: None, wait_s=30)
    assert capsys.readouterr().err == ""
