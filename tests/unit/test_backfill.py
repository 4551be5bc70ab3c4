"""Dispatch decisions (`scheduler.cluster.backfill`): hand-computed EASY-backfill cases, DeepSpeed's strict
FIFO beside them, and a seeded check that backfill never moves the head's reservation later."""
from __future__ import annotations

import math
import random

import pytest

from scheduler.cluster.backfill import Reservation, Start, Waiting, backfill, estimate_run_s, reservation, strict_fifo
from scheduler.cluster.dispatch import refusal
from workers.device.slot import Slot

GiB = 1024**3
NOW = 100.0


def cluster(**nodes: int | tuple[int, int]) -> list[Slot]:
    """`a=2` is node a with 2 slots of 16 GiB; `b=(2, 40)` is node b with 2 slots of 40 GiB."""
    slots = []
    for node, spec in nodes.items():
        count, gib = spec if isinstance(spec, tuple) else (spec, 16)
        slots += [Slot(node, d, "cuda", gib * GiB, f"10.0.0.{ord(node)}", 4, ()) for d in range(count)]
    return slots


def w(name: str, nodes: int, gpus: int, est: float, mem_gib: int = 0) -> Waiting:
    return Waiting(name, nodes, gpus, est, mem_gib * GiB)


def named(starts: list[Start]) -> list[tuple[str, list[str]]]:
    return [(start.name, start.queues) for start in starts]


C4 = cluster(a=2, b=2)
C6 = cluster(a=2, b=2, c=2)

# (slots, busy queue -> estimated free time, queue, expected backfill starts); now = 100.
CASES = {
    "head-fits": (C4, {}, [w("A", 1, 1, 10)], [("A", ["a.gpu0"])]),
    "all-fit-in-order": (C4, {}, [w("A", 1, 2, 10), w("B", 1, 1, 10), w("C", 1, 1, 10)],
                         [("A", ["a.gpu0", "a.gpu1"]), ("B", ["b.gpu0"]), ("C", ["b.gpu1"])]),
    # a 2-slot gang holds node a until 200, b.gpu0 frees at 150: the 1x2 head is promised b at 150.
    "short-backfills": (C4, {"a.gpu0": 200, "a.gpu1": 200, "b.gpu0": 150},
                        [w("H", 1, 2, 100), w("S", 1, 1, 40)], [("S", ["b.gpu1"])]),
    "ends-at-shadow-backfills": (C4, {"a.gpu0": 200, "a.gpu1": 200, "b.gpu0": 150},
                                 [w("H", 1, 2, 100), w("S", 1, 1, 50)], [("S", ["b.gpu1"])]),
    "long-would-delay-head": (C4, {"a.gpu0": 200, "a.gpu1": 200, "b.gpu0": 150},
                              [w("H", 1, 2, 100), w("L", 1, 1, 60)], []),
    # the head is promised node a at 150; b.gpu1 is outside the reservation, so any length fits there.
    "long-on-unreserved-slot": (C4, {"a.gpu0": 150, "a.gpu1": 150, "b.gpu0": 300},
                                [w("H", 1, 2, 100), w("L", 1, 1, 1000)], [("L", ["b.gpu1"])]),
    # 2x2 head: at 180 only c has two free slots; at 200 b and c do -> reserved b+c at 200.
    "multi-node-head": (C6, {"a.gpu0": 120, "a.gpu1": 300, "b.gpu0": 200, "c.gpu0": 180},
                        [w("H", 2, 2, 100), w("X", 1, 1, 50), w("Y", 1, 1, 500), w("Z", 1, 1, 90)],
                        [("X", ["b.gpu1"]), ("Z", ["c.gpu1"])]),
    # 2x1 head: node a's two free slots are one node; it is promised a.gpu0 + b.gpu0 at 150.
    "distinct-nodes": (C4, {"b.gpu0": 150, "b.gpu1": 200}, [w("H", 2, 1, 100), w("L", 1, 1, 1000)],
                       [("L", ["a.gpu1"])]),
    # the head needs 32 GiB: only node b's slots, promised b.gpu0 at 150; small slots stay open.
    "memory": (cluster(a=2, b=(2, 40)), {"b.gpu0": 150, "b.gpu1": 300},
               [w("H", 1, 1, 100, 32), w("L", 1, 1, 1000), w("M", 1, 1, 10, 32), w("N", 1, 1, 1000)],
               [("L", ["a.gpu0"]), ("N", ["a.gpu1"])]),
    # node a has 4 slots, b has 2: the 1x4 head can only ever run on a, all of it free at 170.
    "heterogeneous-nodes": (cluster(a=4, b=2), {"a.gpu0": 130, "a.gpu1": 170, "b.gpu0": 110},
                            [w("H", 1, 4, 100), w("L", 1, 2, 1000), w("S", 1, 1, 60), w("T", 1, 1, 1000)],
                            [("S", ["a.gpu2"]), ("T", ["b.gpu1"])]),
    # the whole cluster is reserved at 200: short items start in queue order until slots run out.
    "fifo-among-backfilled": (C4, {"a.gpu0": 200, "a.gpu1": 200},
                              [w("H", 2, 2, 100), w("P", 1, 1, 50), w("Q", 1, 1, 500), w("R", 1, 1, 80),
                               w("S", 1, 1, 10)],
                              [("P", ["b.gpu0"]), ("R", ["b.gpu1"])]),
    # A starts now on b.gpu0 (ends 150 by its estimate), so the head is promised node b at 150.
    "started-head-counts": (C4, {"a.gpu0": 300, "a.gpu1": 300},
                            [w("A", 1, 1, 50), w("H", 1, 2, 10), w("L", 1, 1, 100), w("S", 1, 1, 40)],
                            [("A", ["b.gpu0"]), ("S", ["b.gpu1"])]),
    "nothing-free": (C4, dict.fromkeys(["a.gpu0", "a.gpu1", "b.gpu0", "b.gpu1"], 150.0),
                     [w("H", 1, 1, 10), w("S", 1, 1, 1)], []),
    "nothing-fits": (C4, {"a.gpu0": 150, "b.gpu0": 150}, [w("H", 1, 2, 10), w("G", 2, 2, 1)], []),
    "empty-queue": (C4, {}, [], []),
    # another job holds node a with no known end: nothing can be promised to the head.
    "unknown-end": (C4, {"a.gpu0": math.inf, "a.gpu1": math.inf, "b.gpu0": 150},
                    [w("H", 2, 2, 100), w("L", 1, 1, 1000)], [("L", ["b.gpu1"])]),
    # a.gpu0 overran its estimate: it frees "any moment", so not even a 1 s item may take a.gpu1.
    "overdue-estimate": (C4, {"a.gpu0": 50, "b.gpu0": 300, "b.gpu1": 300}, [w("H", 1, 2, 100), w("S", 1, 1, 1)],
                         []),
    "head-never-fits": (C4, {"a.gpu0": 150}, [w("H", 3, 1, 10), w("L", 1, 1, 1000)], [("L", ["a.gpu1"])]),
}


@pytest.mark.parametrize(("slots", "frees_at", "queue", "expected"), CASES.values(), ids=CASES.keys())
def test_backfill(slots: list[Slot], frees_at: dict[str, float], queue: list[Waiting],
                  expected: list[tuple[str, list[str]]]) -> None:
    assert named(backfill(queue, slots, frees_at, NOW)) == expected


@pytest.mark.parametrize(("slots", "frees_at", "queue", "expected"), CASES.values(), ids=CASES.keys())
def test_strict_fifo_never_passes_a_blocked_head(slots: list[Slot], frees_at: dict[str, float],
                                                 queue: list[Waiting], expected: list) -> None:
    starts = strict_fifo(queue, slots, frees_at, NOW)
    assert [s.name for s in starts] == [item.name for item in queue[:len(starts)]]
    assert named(starts) == named(backfill(queue, slots, frees_at, NOW))[:len(starts)]


@pytest.mark.parametrize(
    ("slots", "frees_at", "head", "expected"),
    [
        (C4, {"a.gpu0": 200, "a.gpu1": 200, "b.gpu0": 150}, w("H", 1, 2, 1),
         Reservation(150, frozenset({"b.gpu0", "b.gpu1"}))),
        (C6, {"a.gpu0": 120, "a.gpu1": 300, "b.gpu0": 200, "c.gpu0": 180}, w("H", 2, 2, 1),
         Reservation(200, frozenset({"b.gpu0", "b.gpu1", "c.gpu0", "c.gpu1"}))),
        (C4, {"b.gpu0": 150, "b.gpu1": 200}, w("H", 2, 1, 1), Reservation(150, frozenset({"a.gpu0", "b.gpu0"}))),
        (C4, {"a.gpu0": 50, "a.gpu1": 50}, w("H", 2, 2, 1),
         Reservation(NOW, frozenset({"a.gpu0", "a.gpu1", "b.gpu0", "b.gpu1"}))),
        (C4, {"a.gpu0": math.inf}, w("H", 2, 2, 1),
         Reservation(math.inf, frozenset({"a.gpu0", "a.gpu1", "b.gpu0", "b.gpu1"}))),
        (C4, {}, w("H", 1, 3, 1), None),
        (C4, {}, w("H", 1, 1, 1, 17), None),
    ],
    ids=["one-node", "two-nodes", "distinct-nodes", "overdue-is-now", "unknown-end", "too-wide", "too-big"],
)
def test_reservation(slots: list[Slot], frees_at: dict[str, float], head: Waiting,
                     expected: Reservation | None) -> None:
    assert reservation(head, slots, frees_at, NOW) == expected


@pytest.mark.parametrize(
    ("limit", "walls", "expected"),
    [(600, (), 600), (600, (100, 200), 150), (600, (500, 900), 600), (600, [0.5], 0.5)],
    ids=["no-history", "mean", "capped-by-limit", "list"],
)
def test_estimate_run_s(limit: float, walls: tuple[float, ...], expected: float) -> None:
    assert estimate_run_s(limit, walls) == expected


@pytest.mark.parametrize(("nodes", "gpus", "est"), [(0, 1, 1), (1, 0, 1), (1, 1, -1), (1, 1, math.nan)],
                         ids=["no-nodes", "no-slots", "negative", "nan"])
def test_waiting_rejects_nonsense(nodes: int, gpus: int, est: float) -> None:
    with pytest.raises(ValueError, match="X"):
        Waiting("X", nodes, gpus, est)


def random_state(rng: random.Random) -> tuple[list[Slot], dict[str, float], list[Waiting]]:
    slots = cluster(**{node: (rng.randint(1, 4), rng.choice([16, 40])) for node in "abc"[:rng.randint(1, 3)]})
    frees_at = {s.queue: NOW + rng.choice([0, 10, 50, 200, 400]) for s in slots if rng.random() < 0.6}
    queue = [w(f"e{i}", rng.choice([1, 1, 2]), rng.randint(1, 3), rng.choice([5, 60, 150, 1000]),
               rng.choice([0, 0, 32])) for i in range(rng.randint(1, 8))]
    return slots, frees_at, queue


@pytest.mark.parametrize("seed", range(300))
def test_backfill_never_delays_the_head(seed: int) -> None:
    """Invariants on random states: free slots only, no slot twice, submission order kept, and with
    every started item ending at now + its estimate, the head's promised start does not move later."""
    slots, frees_at, queue = random_state(random.Random(seed))
    starts = backfill(queue, slots, frees_at, NOW)
    used = [q for start in starts for q in start.queues]
    assert len(used) == len(set(used)) and not set(used) & set(frees_at)
    order = [item.name for item in queue]
    assert [s.name for s in starts] == sorted((s.name for s in starts), key=order.index)
    fifo = strict_fifo(queue, slots, frees_at, NOW)
    blocked = queue[len(fifo):]
    if not blocked:
        return
    estimate = {item.name: item.estimate_s for item in queue}
    before = dict(frees_at)
    for start in fifo:
        before.update(dict.fromkeys(start.queues, NOW + estimate[start.name]))
    after = dict(frees_at)
    for start in starts:
        after.update(dict.fromkeys(start.queues, NOW + estimate[start.name]))
    promised = reservation(blocked[0], slots, before, NOW)
    if promised is not None:
        kept = reservation(blocked[0], slots, after, NOW)
        assert kept is not None and kept.start_at <= promised.start_at


# ---------------------------------------------------------------- found by mutation testing (bench/mutation.sh)


@pytest.mark.parametrize("estimate", [0.0, 0.5, 1.0])
def test_a_zero_or_sub_second_estimate_is_valid(estimate: float) -> None:
    """A waiting item may be estimated to take no time or under a second (a dry run, a tiny time
    limit); only a negative or NaN estimate is refused."""
    assert Waiting("X", 1, 1, estimate).estimate_s == estimate
    for bad in (-0.1, math.nan):
        with pytest.raises(ValueError):
            Waiting("X", 1, 1, bad)


def test_an_item_ending_exactly_at_the_shadow_time_may_use_the_reserved_slots() -> None:
    """EASY backfill's bound is inclusive: ending at the shadow time cannot delay the head. That
    holds even after a longer item of the same shape was refused those slots earlier in the pass
    (its refusal must not be remembered as "no room" for items that end in time)."""
    slots = cluster(a=2)
    frees_at = {"a.gpu1": NOW + 50}  # head H (1x2) is reserved both slots at 150
    queue = [w("H", 1, 2, 10), w("B", 1, 1, 100), w("A", 1, 1, 50)]
    assert named(backfill(queue, slots, frees_at, NOW)) == [("A", ["a.gpu0"])]


def test_an_unplaceable_shape_does_not_stop_the_pass() -> None:
    """Items of a shape that found no room are skipped; a later item of another shape still starts."""
    queue = [w("H", 1, 2, 10), w("B", 1, 2, 10), w("B2", 1, 2, 10), w("C", 1, 1, 10)]
    assert named(backfill(queue, cluster(a=1), {}, NOW)) == [("C", ["a.gpu0"])]


def test_backfill_honours_the_slot_kind() -> None:
    """An item that asks for CPU slots never starts on free CUDA slots, in order or backfilled."""
    cpu_item = Waiting("X", 1, 1, 10, kind="cpu")
    assert backfill([cpu_item], C4, {}, NOW) == []
    assert strict_fifo([cpu_item], C4, {}, NOW) == []
    mixed = C4 + [Slot("c", 0, "cpu", GiB, "10.0.0.99", 4, ())]
    assert named(backfill([w("H", 3, 1, 10), cpu_item], mixed, {}, NOW)) == [("X", ["c.gpu0"])]


def test_an_exclusive_item_takes_only_a_node_where_nothing_else_runs() -> None:
    """A finalist's re-measurement (`exclusive`) starts on b, idle, not beside a.gpu0's run on a; with
    every node in use it waits, and as the blocked head it is promised the first node to be idle:
    b, at 150, when b.gpu1's run ends (a's ends at 200). A 100 s item may not take b.gpu0 meanwhile
    (a.gpu1 is free), a 20 s one may (it ends by 150)."""
    finalist = Waiting("F", 1, 1, 10, exclusive=True)
    assert named(backfill([finalist], C4, {"a.gpu0": 150.0}, NOW)) == [("F", ["b.gpu0"])]
    assert named(backfill([w("F", 1, 1, 10)], C4, {"a.gpu0": 150.0}, NOW)) == [("F", ["a.gpu1"])]
    assert backfill([finalist], C4, {"a.gpu0": 150.0, "b.gpu1": 150.0}, NOW) == []
    head = reservation(finalist, C4, {"a.gpu0": 200.0, "b.gpu1": 150.0}, NOW)
    assert head == Reservation(150.0, frozenset({"b.gpu0"}))
    queue = [finalist, w("Long", 1, 1, 100), w("Short", 1, 1, 20)]
    assert named(backfill(queue, C4, {"a.gpu0": 200.0, "b.gpu1": 150.0}, NOW)) == [
        ("Long", ["a.gpu1"]), ("Short", ["b.gpu0"])]


# ---------------------------------------------------------------- dispatch.refusal (found by mutation testing)


def _exp(nodes: int, gpus: int, **extra: object) -> dict:
    return {"name": "e", "num_nodes": nodes, "num_gpus": gpus, **extra}


def test_a_slot_of_exactly_the_asked_memory_is_big_enough() -> None:
    """min_memory is a lower bound on each slot: a slot of exactly that size fits, so the refusal
    is about the shape (one node where two are asked), not about memory."""
    message = refusal(_exp(2, 1, min_memory=16 * GiB), cluster(a=1))
    assert "largest slot" not in message
    assert "needs 2 node(s) x 1 slot(s)" in message and "--num_nodes 1 --num_gpus 1" in message


def test_a_shape_refusal_without_a_memory_ask_names_no_size() -> None:
    """The suggestion is the largest shape of the cluster; it mentions a slot size only when the
    experiment asked for one."""
    message = refusal(_exp(1, 4), cluster(a=2, b=1))
    assert message.endswith("; use --num_nodes 1 --num_gpus 2 or fewer")
    assert "GiB" not in message


def test_a_one_node_experiment_is_never_refused_for_loopback() -> None:
    """Loopback only matters between nodes: a one-node gang too large for its node gets the shape
    refusal, even on a node that advertises 127.0.0.1."""
    local = [Slot("a", d, "cuda", 16 * GiB, "127.0.0.1", 4, ()) for d in range(2)]
    message = refusal(_exp(1, 4), local)
    assert "loopback" not in message and "at most 2 slot(s)" in message


def test_a_multi_node_refusal_blames_loopback_only_when_a_node_uses_it() -> None:
    """Two routable nodes of 2 slots cannot run 2 x 4: that is the shape, not an address problem;
    with one node on loopback, the address is what to fix."""
    message = refusal(_exp(2, 4), C4)
    assert "loopback" not in message and "at most 2 slot(s)" in message
    with_loopback = C4[:2] + [Slot("b", d, "cuda", 16 * GiB, "127.0.0.1", 4, ()) for d in range(2)]
    assert "node(s) b advertise a loopback address" in refusal(_exp(2, 1), with_loopback)
