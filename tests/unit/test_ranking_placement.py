"""Picking the best experiment (`scheduler.search.ranking`) and slots for an experiment (`scheduler.cluster.placement`)."""
from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Any

import pytest

from scheduler.errors import ClusterError
from scheduler.cluster.placement import fits_ever, gang_link, is_loopback, largest_shape, pinned_placement, place
from scheduler.search.ranking import best, metric_value, status_counts
from workers.device.slot import Slot

GiB = 1024**3

# ---------------------------------------------------------------- ranking


def rec(name: str, status: str = "ok", **metrics: Any) -> dict[str, Any]:
    return {"name": name, "status": status, "metrics": metrics}


@pytest.mark.parametrize(
    ("record", "metric", "expected"),
    [
        (rec("a", throughput=12), "throughput", 12.0),
        (rec("a", throughput=12.5), "throughput", 12.5),
        (rec("a", latency=0), "latency", 0.0),
        (rec("a", "crashed", throughput=12), "throughput", None),
        (rec("a", "oom", throughput=12), "throughput", None),
        (rec("a", latency=0.1), "throughput", None),
        (rec("a", throughput="12"), "throughput", None),
        (rec("a", throughput=True), "throughput", None),
        (rec("a", throughput=None), "throughput", None),
        ({"name": "a", "status": "ok", "metrics": None}, "throughput", None),
        ({"name": "a", "status": "ok"}, "throughput", None),
        ({"name": "a", "metrics": {"throughput": 3}}, "throughput", None),
    ],
    ids=["int", "float", "zero", "crashed", "oom", "other-metric", "string", "bool", "null", "metrics-null",
         "no-metrics", "no-status"],
)
def test_metric_value(record: dict, metric: str, expected: float | None) -> None:
    value = metric_value(record, metric)
    assert value == expected
    if expected is not None:
        assert isinstance(value, float)


@pytest.mark.parametrize(
    ("records", "metric", "maximize", "winner"),
    [
        ([rec("a", throughput=5), rec("b", throughput=9), rec("c", throughput=7)], "throughput", True, "b"),
        ([rec("a", latency=0.3), rec("b", latency=0.1), rec("c", latency=0.2)], "latency", False, "b"),
        ([rec("a", latency=0.3), rec("b", latency=0.1), rec("c", latency=0.2)], "latency", True, "a"),
        ([rec("a", throughput=5), rec("b", "crashed", throughput=500), rec("c", throughput=6)], "throughput", True,
         "c"),
        ([rec("a", "oom", latency=0.001), rec("b", latency=0.5)], "latency", False, "b"),
        ([rec("a"), rec("b", throughput=1), rec("c", latency=9)], "throughput", True, "b"),
        ([rec("a", throughput=7), rec("b", throughput=9), rec("c", throughput=9)], "throughput", True, "b"),
        ([rec("a", latency=2), rec("b", latency=1), rec("c", latency=1.0)], "latency", False, "b"),
        ([rec("a", FLOPS_per_gpu=1e12), rec("b", FLOPS_per_gpu=2e12)], "FLOPS_per_gpu", True, "b"),
        ([rec("a", throughput=-1), rec("b", throughput=0)], "throughput", True, "b"),
    ],
    ids=["throughput-max", "latency-min", "latency-maximised-if-asked", "failed-ignored", "oom-ignored",
         "missing-metric-ignored", "tie-keeps-earlier-max", "tie-keeps-earlier-min", "flops", "zero-beats-negative"],
)
def test_best(records: list[dict], metric: str, maximize: bool, winner: str) -> None:
    chosen = best(records, metric, maximize)
    assert chosen is not None
    assert chosen["name"] == winner
    assert any(chosen is r for r in records)


@pytest.mark.parametrize(
    "records",
    [[], [rec("a", "crashed", throughput=1)], [rec("a", latency=1)], [rec("a", "timeout"), rec("b", "lost")]],
    ids=["empty", "all-failed", "metric-missing", "no-metrics"],
)
def test_best_none(records: list[dict]) -> None:
    assert best(records, "throughput", True) is None


def test_best_nan_never_wins() -> None:
    records = [rec("a", throughput=float("nan")), rec("b", throughput=5.0)]
    assert best(records, "throughput", True)["name"] == "b"


def test_status_counts() -> None:
    records = [rec("a"), rec("b", "oom"), rec("c", "oom"), {"name": "d"}, rec("e", "crashed")]
    assert status_counts(records) == Counter({"ok": 1, "oom": 2, "lost": 1, "crashed": 1})
    assert status_counts([]) == Counter()


# ---------------------------------------------------------------- placement


def slot(node: str, device: int, memory: int = 16 * GiB, kind: str = "cuda") -> Slot:
    return Slot(node=node, device=device, kind=kind, memory_bytes=memory, address=f"10.0.0.{len(node)}",
                threads=4, cpus=(), worker=f"w{device}@{node}")


def queues(placement: list[list[Slot]] | None) -> list[list[str]] | None:
    return None if placement is None else [[s.queue for s in node] for node in placement]


NODE_A = [slot("a", d) for d in (3, 1, 0, 2)]  # given out of order on purpose


@pytest.mark.parametrize(
    ("busy", "num_gpus", "expected"),
    [
        (set(), 1, [["a.gpu0"]]),
        (set(), 2, [["a.gpu0", "a.gpu1"]]),
        (set(), 4, [["a.gpu0", "a.gpu1", "a.gpu2", "a.gpu3"]]),
        ({"a.gpu0"}, 1, [["a.gpu1"]]),
        ({"a.gpu0"}, 2, [["a.gpu1", "a.gpu2"]]),
        ({"a.gpu1"}, 2, [["a.gpu0", "a.gpu2"]]),
        ({"a.gpu0", "a.gpu2"}, 2, [["a.gpu1", "a.gpu3"]]),
        ({"a.gpu0", "a.gpu1", "a.gpu2"}, 1, [["a.gpu3"]]),
        ({"a.gpu0", "a.gpu1", "a.gpu2"}, 2, None),
        ({"a.gpu0", "a.gpu1", "a.gpu2", "a.gpu3"}, 1, None),
        (set(), 5, None),
        ({"b.gpu0", "other"}, 4, [["a.gpu0", "a.gpu1", "a.gpu2", "a.gpu3"]]),
    ],
    ids=["one", "two", "all", "skip-busy", "skip-busy-two", "hole", "holes", "last", "not-now", "all-busy",
         "too-big", "unrelated-busy"],
)
def test_place_single_node(busy: set[str], num_gpus: int, expected: list[list[str]] | None) -> None:
    assert queues(place(NODE_A, busy, 1, num_gpus)) == expected


#: A two-socket node: GPUs 0, 2, 4, 6 on NUMA node 0, GPUs 1, 3, 5, 7 on node 1 (interleaved, as
#: some boards number them), and a node whose NUMA nodes are unknown.
TWO_SOCKETS = [replace(slot("s", d), numa_node=d % 2) for d in range(8)]


@pytest.mark.parametrize(
    ("busy", "num_gpus", "expected"),
    [
        (set(), 2, ["s.gpu0", "s.gpu2"]),  # one socket, not gpu0 + gpu1 across the sockets
        (set(), 4, ["s.gpu0", "s.gpu2", "s.gpu4", "s.gpu6"]),
        ({"s.gpu0", "s.gpu2", "s.gpu4"}, 2, ["s.gpu1", "s.gpu3"]),  # node 0 has one left: node 1
        ({"s.gpu1"}, 4, ["s.gpu0", "s.gpu2", "s.gpu4", "s.gpu6"]),
        ({"s.gpu0"}, 4, ["s.gpu1", "s.gpu3", "s.gpu5", "s.gpu7"]),
        (set(), 8, [f"s.gpu{d}" for d in range(8)]),  # larger than a socket: across, in device order
        ({"s.gpu0"}, 6, ["s.gpu1", "s.gpu2", "s.gpu3", "s.gpu4", "s.gpu5", "s.gpu6"]),
    ],
    ids=["pair", "socket", "other-socket", "socket-0", "socket-1", "whole-node", "larger-than-a-socket"],
)
def test_a_gang_stays_on_one_numa_node_when_it_can(busy: set[str], num_gpus: int, expected: list[str]) -> None:
    """Across the sockets of a node GPUs have no PCIe peer-to-peer."""
    assert queues(place(TWO_SOCKETS, busy, 1, num_gpus)) == [expected]
    unknown = [replace(s, numa_node=-1) for s in TWO_SOCKETS]  # unknown NUMA: device order, as before
    assert queues(place(unknown, set(), 1, 2)) == [["s.gpu0", "s.gpu1"]]


def _linked(pairs: dict[tuple[int, int], str], count: int = 4) -> list[Slot]:
    """One node's `count` GPUs (cuda index = device), every pair PHB unless `pairs` names its link."""
    def link(a: int, b: int) -> str:
        return pairs.get((a, b)) or pairs.get((b, a)) or "PHB"
    return [replace(slot("l", d), cuda_index=d, links=tuple((o, link(d, o)) for o in range(count) if o != d))
            for d in range(count)]


@pytest.mark.parametrize(
    ("pairs", "busy", "num_gpus", "expected"),
    [
        ({(1, 2): "NV4"}, set(), 2, ["l.gpu1", "l.gpu2"]),  # the NVLink pair, not gpu0 + gpu1 over PCIe
        ({(0, 3): "NV4", (1, 2): "NV12"}, set(), 2, ["l.gpu1", "l.gpu2"]),  # more bonded links
        ({(1, 2): "NV4"}, {"l.gpu1"}, 2, ["l.gpu0", "l.gpu2"]),  # its pair is busy: device order
        ({(0, 1): "NV4", (2, 3): "NV4", (0, 2): "PIX", (1, 3): "PIX"}, set(), 3, ["l.gpu0", "l.gpu1", "l.gpu2"]),
        ({(2, 3): "NV4", (0, 1): "SYS"}, set(), 2, ["l.gpu2", "l.gpu3"]),
        ({}, set(), 2, ["l.gpu0", "l.gpu1"]),  # all alike: device order
    ],
    ids=["nvlink-pair", "faster-pair", "pair-busy", "three-of-two-pairs", "avoid-sys", "uniform"],
)
def test_a_gang_takes_the_gpus_whose_slowest_link_is_fastest(pairs: dict, busy: set[str], num_gpus: int,
                                                             expected: list[str]) -> None:
    assert queues(place(_linked(pairs), busy, 1, num_gpus)) == [expected]
    unknown = [replace(s, links=()) for s in _linked(pairs)]  # links unknown: device order
    assert queues(place(unknown, set(), 1, 2)) == [["l.gpu0", "l.gpu1"]]


def test_gang_link_is_the_slowest_pair() -> None:
    node = _linked({(0, 1): "NV12", (1, 2): "PIX"})
    assert gang_link(node[:2]) == "NV12" and gang_link(node[:3]) == "PHB" and gang_link(node[:1]) == ""
    assert gang_link([replace(s, links=()) for s in node[:2]]) == ""


@pytest.mark.parametrize(
    ("busy", "num_gpus", "expected"),
    [
        (set(), 1, [["n.gpu2"]]),
        (set(), 2, [["n.gpu2", "n.gpu5"]]),
        ({"n.gpu2"}, 1, [["n.gpu5"]]),
        ({"n.gpu0", "n.gpu1"}, 2, [["n.gpu2", "n.gpu5"]]),
        (set(), 3, None),
    ],
)
def test_place_keeps_real_device_ids(busy: set[str], num_gpus: int, expected: list[list[str]] | None) -> None:
    slots = [slot("n", 5), slot("n", 2)]
    placement = place(slots, busy, 1, num_gpus)
    assert queues(placement) == expected
    if placement:
        assert [s.device for s in placement[0]] == [int(q.rsplit("gpu", 1)[1]) for q in expected[0]]


def test_place_orders_devices_numerically() -> None:
    slots = [slot("n", 10), slot("n", 9), slot("n", 2)]
    assert queues(place(slots, set(), 1, 3)) == [["n.gpu2", "n.gpu9", "n.gpu10"]]


def test_place_returns_the_slot_objects() -> None:
    slots = [slot("n", 1, 8 * GiB), slot("n", 0, 8 * GiB)]
    placement = place(slots, set(), 1, 1)
    assert placement is not None
    assert placement[0][0] is slots[1]


MIXED = [slot("m", 0, 8 * GiB), slot("m", 1, 24 * GiB), slot("m", 2, 16 * GiB), slot("m", 3, 24 * GiB)]


@pytest.mark.parametrize(
    ("min_memory", "num_gpus", "expected"),
    [
        (0, 2, [["m.gpu0", "m.gpu1"]]),
        (8 * GiB, 2, [["m.gpu0", "m.gpu1"]]),
        (8 * GiB + 1, 2, [["m.gpu1", "m.gpu2"]]),
        (16 * GiB, 3, [["m.gpu1", "m.gpu2", "m.gpu3"]]),
        (20 * GiB, 2, [["m.gpu1", "m.gpu3"]]),
        (20 * GiB, 3, None),
        (24 * GiB + 1, 1, None),
    ],
)
def test_place_min_memory(min_memory: int, num_gpus: int, expected: list[list[str]] | None) -> None:
    assert queues(place(MIXED, set(), 1, num_gpus, min_memory)) == expected


CLUSTER = [slot(node, d) for node in ("c", "a", "b") for d in (1, 0)] + [slot("d", 0)]


@pytest.mark.parametrize(
    ("busy", "num_nodes", "num_gpus", "expected"),
    [
        (set(), 2, 1, [["a.gpu0"], ["b.gpu0"]]),
        (set(), 3, 2, [["a.gpu0", "a.gpu1"], ["b.gpu0", "b.gpu1"], ["c.gpu0", "c.gpu1"]]),
        (set(), 4, 1, [["a.gpu0"], ["b.gpu0"], ["c.gpu0"], ["d.gpu0"]]),
        (set(), 4, 2, None),
        (set(), 5, 1, None),
        ({"a.gpu0"}, 2, 2, [["b.gpu0", "b.gpu1"], ["c.gpu0", "c.gpu1"]]),
        ({"a.gpu0"}, 2, 1, [["a.gpu1"], ["b.gpu0"]]),
        ({"a.gpu0", "b.gpu1"}, 3, 2, None),
        ({"a.gpu0", "b.gpu1"}, 2, 1, [["a.gpu1"], ["b.gpu0"]]),
        ({"a.gpu0", "a.gpu1", "b.gpu0", "b.gpu1"}, 2, 1, [["c.gpu0"], ["d.gpu0"]]),
        ({"a.gpu0", "a.gpu1", "b.gpu0", "b.gpu1", "c.gpu1"}, 3, 1, None),
    ],
    ids=["2x1", "3x2", "4x1", "4x2-too-big", "5x1-too-many", "skip-half-busy-node", "busy-device-skipped",
         "not-now", "two-partial-nodes", "skip-busy-nodes", "not-enough-free-nodes"],
)
def test_place_multi_node(busy: set[str], num_nodes: int, num_gpus: int, expected: list[list[str]] | None) -> None:
    placement = place(CLUSTER, busy, num_nodes, num_gpus)
    assert queues(placement) == expected
    if placement:
        nodes = [group[0].node for group in placement]
        assert len(set(nodes)) == num_nodes
        assert all(len({s.node for s in group}) == 1 for group in placement)


def test_place_is_deterministic_whatever_the_input_order() -> None:
    forward = place(CLUSTER, {"c.gpu0"}, 2, 1)
    backward = place(list(reversed(CLUSTER)), {"c.gpu0"}, 2, 1)
    assert queues(forward) == queues(backward) == [["a.gpu0"], ["b.gpu0"]]


def test_place_empty_cluster() -> None:
    assert place([], set(), 1, 1) is None


HETERO = [slot("big", d) for d in range(4)] + [slot("small", d, 8 * GiB) for d in range(2)]


@pytest.mark.parametrize(
    ("num_nodes", "num_gpus", "min_memory", "expected"),
    [
        (1, 1, 0, True),
        (1, 4, 0, True),
        (1, 5, 0, False),
        (2, 2, 0, True),
        (2, 3, 0, False),
        (3, 1, 0, False),
        (2, 1, 16 * GiB, False),
        (1, 4, 16 * GiB, True),
        (1, 1, 32 * GiB, False),
    ],
)
def test_fits_ever(num_nodes: int, num_gpus: int, min_memory: int, expected: bool) -> None:
    assert fits_ever(HETERO, num_nodes, num_gpus, min_memory) is expected


def test_fits_ever_ignores_what_is_busy_now() -> None:
    busy = {s.queue for s in HETERO}
    assert place(HETERO, busy, 1, 1) is None
    assert fits_ever(HETERO, 1, 4) is True


@pytest.mark.parametrize(
    ("slots", "shape"),
    [
        ([], (0, 0)),
        ([slot("a", 0)], (1, 1)),
        (NODE_A, (1, 4)),
        (HETERO, (2, 4)),
        (CLUSTER, (4, 2)),
        ([slot("n", 5), slot("n", 2)], (1, 2)),
    ],
    ids=["empty", "one", "one-node", "hetero", "cluster", "sparse-ids"],
)
def test_largest_shape(slots: list[Slot], shape: tuple[int, int]) -> None:
    assert largest_shape(slots) == shape


def _mixed_node() -> list[Slot]:
    """One node whose 2 GPUs are CUDA slots and whose spare cores were started as 2 CPU slots."""
    return [slot("n", 0), slot("n", 1), slot("n", 2, kind="cpu"), slot("n", 3, kind="cpu")]


@pytest.mark.parametrize(
    ("busy", "num_gpus", "kind", "expected"),
    [
        (set(), 2, "", [["n.gpu0", "n.gpu1"]]),  # CUDA first
        ({"n.gpu0"}, 2, "", [["n.gpu2", "n.gpu3"]]),  # never gpu1 + a CPU slot
        ({"n.gpu0"}, 2, "cuda", None),
        ({"n.gpu2"}, 2, "cpu", None),
        (set(), 3, "", None),  # 4 slots, but no 3 of one kind
        (set(), 2, "cpu", [["n.gpu2", "n.gpu3"]]),
    ],
)
def test_an_experiment_never_mixes_slot_kinds(busy: set[str], num_gpus: int, kind: str,
                                               expected: list[list[str]] | None) -> None:
    assert queues(place(_mixed_node(), busy, 1, num_gpus, kind=kind)) == expected
    assert fits_ever(_mixed_node(), 1, num_gpus, kind=kind) is (num_gpus <= 2)


def test_a_multi_node_gang_never_uses_a_loopback_address() -> None:
    def at(node: str, device: int, address: str) -> Slot:
        return Slot(node, device, "cuda", 16 * GiB, address, 1, ())
    slots = [at("a", 0, "127.0.0.1"), at("b", 0, "10.0.0.2"), at("c", 0, "10.0.0.3"), at("d", 0, "::1")]
    assert queues(place(slots, set(), 2, 1)) == [["b.gpu0"], ["c.gpu0"]]
    assert place(slots, {"c.gpu0"}, 2, 1) is None
    assert queues(place(slots, set(), 1, 1)) == [["a.gpu0"]]  # alone on its node, loopback is fine


def test_nodes_of_one_machine_meet_over_loopback() -> None:
    """Two "nodes" that are one machine (test clusters, a node per socket) reach each other over
    loopback; nodes of two machines that both reach Redis over loopback do not."""
    def at(node: str, address: str, host: str) -> Slot:
        return Slot(node, 0, "cpu", GiB, address, 1, (), host=host)
    same = [at("a", "127.0.0.1", "m1"), at("b", "127.0.0.1", "m1")]
    assert queues(place(same, set(), 2, 1)) == [["a.gpu0"], ["b.gpu0"]]
    assert place([at("a", "127.0.0.1", "m1"), at("b", "127.0.0.1", "m2")], set(), 2, 1) is None
    assert place([at("a", "127.0.0.1", ""), at("b", "127.0.0.1", "")], set(), 2, 1) is None  # unknown machine
    mixed = [at("a", "127.0.0.1", "m1"), at("b", "10.0.0.2", "m1"), at("c", "10.0.0.3", "m2")]
    assert queues(place(mixed, set(), 2, 1)) == [["b.gpu0"], ["c.gpu0"]]


# ---------------------------------------------------------------- found by mutation testing (bench/mutation.sh)


@pytest.mark.parametrize(
    ("address", "loopback"),
    [("localhost", True), ("127.0.0.1", True), ("127.5.6.7", True), ("::1", True),
     ("10.0.0.2", False), ("node7", False), ("", False)],
)
def test_is_loopback(address: str, loopback: bool) -> None:
    """"localhost" is loopback although it is no IP literal (ipaddress rejects it); a host name
    that is not an IP literal is not assumed loopback (it may well route between nodes)."""
    assert is_loopback(address) is loopback


def test_a_multi_node_gang_never_uses_a_localhost_slot() -> None:
    """A slot advertising "localhost" is as unreachable from another node as one advertising 127.0.0.1."""
    slots = [Slot("a", 0, "cuda", 16 * GiB, "localhost", 1, ()), Slot("b", 0, "cuda", 16 * GiB, "10.0.0.2", 1, ())]
    assert place(slots, set(), 2, 1) is None
    assert fits_ever(slots, 2, 1) is False


def test_fits_ever_honours_the_slot_kind() -> None:
    """A shape asking for CPU slots never fits a CUDA-only cluster, however free it is."""
    cuda_only = [slot("n", 0), slot("n", 1)]
    assert fits_ever(cuda_only, 1, 2, kind="cuda") is True
    assert fits_ever(cuda_only, 1, 1, kind="cpu") is False


def test_pinned_placement_takes_exactly_the_named_slots() -> None:
    """The user's selection is taken as named, per node and in the named order, never rearranged."""
    slots = [slot("a", 0), slot("a", 1), slot("b", 0), slot("b", 1)]
    chosen = pinned_placement(slots, set(), [["b.gpu1", "b.gpu0"], ["a.gpu1"]])
    assert queues(chosen) == [["b.gpu1", "b.gpu0"], ["a.gpu1"]]
    assert chosen[0][0] is slots[3]


def test_pinned_placement_waits_while_any_named_slot_is_busy() -> None:
    """One busy slot of the selection means not now (None), not a different slot instead."""
    slots = [slot("a", 0), slot("a", 1)]
    assert pinned_placement(slots, {"a.gpu1"}, [["a.gpu0", "a.gpu1"]]) is None
    assert pinned_placement(slots, {"a.gpu1"}, [["a.gpu0"]]) is not None


def test_pinned_placement_refuses_a_slot_with_no_worker() -> None:
    """A named slot no worker serves would be waited for forever: an error naming it instead."""
    with pytest.raises(ClusterError, match="c.gpu0"):
        pinned_placement([slot("a", 0)], set(), [["a.gpu0"], ["c.gpu0"]])


# ---------------------------------------------------------------- ranking: re-measured configs are judged on their mean

from scheduler.search.ranking import pooled_best  # noqa: E402


def measured(name: str, config: dict[str, Any] | None, value: float, status: str = "ok") -> dict[str, Any]:
    record = {"name": name, "status": status, "metrics": {"throughput": value}}
    if config is not None:
        record["ds_config"] = config
    return record


def test_pooled_best_judges_a_remeasured_config_on_its_mean_and_names_its_first_run() -> None:
    a, b = {"train_micro_batch_size_per_gpu": 4}, {"train_micro_batch_size_per_gpu": 8}
    records = [measured("a", a, 10.0), measured("b", b, 13.0), measured("a_r2", a, 14.0), measured("b_r2", b, 9.0)]
    # a: (10 + 14) / 2 = 12; b: (13 + 9) / 2 = 11
    winner, mean, count = pooled_best(records, "throughput", True)
    assert (winner["name"], mean, count) == ("a", 12.0, 2)
    assert winner is records[0]
    winner, mean, count = pooled_best(records, "throughput", False)
    assert (winner["name"], mean, count) == ("b", 11.0, 2)


def test_pooled_best_pools_equal_configs_whatever_their_key_order() -> None:
    records = [measured("x", {"a": 1, "b": {"c": 2, "d": 3}}, 6.0), measured("y", {"z": 0}, 7.0),
               measured("x_r2", {"b": {"d": 3, "c": 2}, "a": 1}, 10.0)]
    assert pooled_best(records, "throughput", True) == (records[0], 8.0, 2)


def test_pooled_best_without_configs_pools_by_name_only() -> None:
    records = [measured("x", None, 6.0), measured("y", None, 7.0), measured("x", None, 10.0),
               measured("z", {"a": 1}, 7.5)]
    assert pooled_best(records, "throughput", True) == (records[0], 8.0, 2)
    assert pooled_best(records[1:2], "throughput", True) == (records[1], 7.0, 1)


def test_pooled_best_skips_failed_measurements_of_a_config() -> None:
    a = {"k": 1}
    records = [measured("a", a, 10.0, "crashed"), measured("b", {"k": 2}, 5.0), measured("a_r2", a, 4.0),
               measured("a_r3", a, 5.0)]
    # the crashed 10.0 is no measurement: a is (4 + 5) / 2 = 4.5, named by its first successful run
    assert pooled_best(records, "throughput", True) == (records[1], 5.0, 1)
    assert pooled_best(records, "throughput", False) == (records[2], 4.5, 2)


def test_pooled_best_of_nothing() -> None:
    assert pooled_best([], "throughput", True) == (None, None, 0)
    assert pooled_best([measured("a", None, 1.0, "oom")], "throughput", True) == (None, None, 0)


def test_a_config_holding_a_non_json_value_is_still_ranked() -> None:
    from pathlib import Path

    records = [measured("a", {"path": Path("/x")}, 1.0), measured("b", {"path": Path("/y")}, 2.0),
               measured("a_r2", {"path": Path("/x")}, 5.0)]
    assert pooled_best(records, "throughput", True) == (records[0], 3.0, 2)


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_metric_value_refuses_non_finite_numbers(value: float) -> None:
    assert metric_value(rec("a", throughput=value), "throughput") is None
    records = [rec("a", throughput=value), rec("b", throughput=1.0)]
    assert best(records, "throughput", True)["name"] == "b"
    assert best(records, "throughput", False)["name"] == "b"


def test_a_negative_value_can_win_a_minimisation() -> None:
    records = [rec("a", latency=0.5), rec("b", latency=-1), rec("c", latency=0)]
    assert best(records, "latency", False)["name"] == "b"
    assert best(records, "latency", True)["name"] == "a"


def test_pinned_placement_names_every_slot_with_no_worker() -> None:
    with pytest.raises(ClusterError) as caught:
        pinned_placement([slot("a", 0)], set(), [["a.gpu0", "a.gpu1"], ["c.gpu0"]])
    assert str(caught.value) == ("no live slot worker for a.gpu1, c.gpu0: start `celery -A tasks worker -Q gpu<i> "
                                 "-n gpu<i>@<host>` there, or change the selection")


# ---------------------------------------------------------------- ranking: typed records read as their JSON

from workers.slot.records import ExperimentRecord  # noqa: E402
from scheduler.search.ranking import config_key, status_word  # noqa: E402

TYPED_CASES = [
    measured("a", {"k": 1}, 10.0), measured("b", {"k": 2}, 13.0), measured("a_r2", {"k": 1}, 14.0),
    measured("c", {"k": 3}, 99.0, "crashed"), measured("b_r2", {"k": 2}, 9.0), measured("d", None, 12.0),
    {"name": "e", "status": "ok", "metrics": {"throughput": float("nan")}}, {"name": "f", "status": "timeout"},
    {"name": "g", "status": "ok", "metrics": {"throughput": True}}, measured("a_r3", {"k": 1}, 11.0, "oom"),
]


@pytest.mark.parametrize("maximize", [True, False])
@pytest.mark.parametrize("cut", [len(TYPED_CASES), 4, 1, 0])
def test_the_ranking_reads_a_typed_record_as_its_json(maximize: bool, cut: int) -> None:
    """The report ranks `ExperimentRecord`s, the searches the JSON: the same pick (the same position),
    pooled value and readings, and the same value, config and status word per record."""
    written = TYPED_CASES[:cut]
    typed = [ExperimentRecord.from_json(record) for record in written]
    winner, value, count = pooled_best(written, "throughput", maximize)
    typed_winner, typed_value, typed_count = pooled_best(typed, "throughput", maximize)
    assert (typed_value, typed_count) == (value, count)
    assert (winner is None and typed_winner is None) or typed_winner is typed[written.index(winner)]
    assert best(typed, "throughput", maximize) is typed_winner
    for record, typed_record in zip(written, typed):
        assert metric_value(typed_record, "throughput") == metric_value(record, "throughput")
        assert config_key(typed_record) == config_key(record)
        assert str(status_word(typed_record)) == record["status"]
    assert {str(key): n for key, n in status_counts(typed).items()} == status_counts(written)
