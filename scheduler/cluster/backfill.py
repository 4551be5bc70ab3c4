"""Which waiting experiments start now, and where: FIFO by submission with EASY backfill. Pure.

DeepSpeed's ResourceManager is strict FIFO: when the head of the queue does not fit, nothing behind
it starts, even when it would fit in the idle slots (head-of-line blocking). `strict_fifo` keeps
that behaviour for comparison; `backfill` fixes it the way EASY backfilling does:

1. Items start in submission order while they fit the free slots.
2. The first item that does not fit (the head) gets a reservation: the earliest time ("shadow
   time") at which enough slots of its shape, memory and distinct-node constraint are estimated to
   be free, and the slots it would take then (`scheduler.cluster.placement.place`'s choice at that time).
3. A later item starts now, in submission order, only if it fits the slots free now AND either it
   is estimated to end by the shadow time, or it uses none of the reserved slots. So no backfilled
   item can push the head past its reservation, as far as the estimates hold.

Which estimate (the caller passes them; `estimate_run_s` implements the rule we use):
- a waiting item's `estimate_s` is its time limit. A rank is killed at its time limit, so a
  backfilled item cannot outstay the shadow time on a reserved slot (by more than launch
  overhead): the promise to the head holds however wrong other guesses are.
- a running item frees its slots at `started + estimate_run_s(time_limit, wall times of finished ok
  experiments of the same (stage, micro batch) shape)`: the mean of those, never above the
  limit. Guessing these too early is safe: an earlier shadow time lets fewer items backfill.
- slots held by someone whose end we cannot guess (another tuning job) free at `math.inf`. A head
  that needs them cannot be promised a time, so everything that fits may start; once they free,
  the head's reservation is finite again and enforced from then on.
An estimated end already in the past counts as "any moment now".

A head that can never fit the live slots gets no reservation and holds nothing back; dispatch
refuses such an experiment (`placement.fits_ever`) before it asks for a decision.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from scheduler.cluster.placement import in_order, place
from workers.device.slot import Slot


@dataclass(frozen=True)
class Waiting:
    """An experiment waiting for slots, as dispatch sees it: its gang shape and its estimate."""

    name: str
    num_nodes: int
    num_gpus: int  #: slots per node
    estimate_s: float  #: how long it may run once started: its time limit (module docstring)
    min_memory: int = 0  #: bytes each slot must offer
    kind: str = ""  #: slot kind every slot must be ("" = any one kind)
    exclusive: bool = False  #: only on nodes where nothing else runs (`placement.place`)
    allowed: frozenset[str] | None = None  #: the only slot queues it may use (its job's pool; None: any)

    def __post_init__(self) -> None:
        if self.num_nodes < 1 or self.num_gpus < 1:
            raise ValueError(f"{self.name}: needs at least 1 node x 1 slot, got {self.num_nodes} x {self.num_gpus}")
        if not self.estimate_s >= 0:
            raise ValueError(f"{self.name}: estimate_s must be >= 0 seconds, got {self.estimate_s}")


class Start(NamedTuple):
    """Start `name` now on `placement` (one list of slots per node). A tuple, so it unpacks."""

    name: str
    placement: list[list[Slot]]

    @property
    def queues(self) -> list[str]:
        return [slot.queue for node in self.placement for slot in node]


@dataclass(frozen=True)
class Reservation:
    """Where and when the blocked head is estimated to start; backfill must leave it intact."""

    start_at: float  #: the shadow time (math.inf when it waits on slots with no estimate)
    queues: frozenset[str]  #: the slots it would take at start_at


#: strict_fifo and backfill: (waiting in submission order, live slots, busy queue -> estimated
#: free time, now) -> the items to start now, in order.
Policy = Callable[[Sequence[Waiting], Sequence[Slot], Mapping[str, float], float], list[Start]]


def estimate_run_s(time_limit_s: float, finished_wall_s: Sequence[float] = ()) -> float:
    """How long an experiment is expected to run: its time limit, or the mean wall time of finished
    experiments of its shape when there are some, never more than the limit.

    Use the bare time limit for waiting items and the mean for running ones (module docstring).
    """
    if not finished_wall_s:
        return time_limit_s
    return min(time_limit_s, sum(finished_wall_s) / len(finished_wall_s))


def strict_fifo(queue: Sequence[Waiting], slots: Sequence[Slot], frees_at: Mapping[str, float],
                now: float) -> list[Start]:
    """DeepSpeed's rule: start items in order until the first that does not fit; nothing passes it."""
    slots = in_order(slots)  # once: every placement below takes them in this order
    busy = set(frees_at)
    starts: list[Start] = []
    for item in queue:
        placement = _place(slots, busy, item)
        if placement is None:
            break
        starts.append(Start(item.name, placement))
        busy.update(_taken(item, starts[-1], slots))
    return starts


def backfill(queue: Sequence[Waiting], slots: Sequence[Slot], frees_at: Mapping[str, float],
             now: float) -> list[Start]:
    """FIFO while items fit, then EASY backfill behind the first blocked one (module docstring).

    `frees_at` maps every busy slot queue to the time it is estimated to free, on the clock of `now`.
    """
    starts = strict_fifo(queue, slots, frees_at, now)
    blocked = list(queue[len(starts):])
    if not blocked:
        return starts
    slots = in_order(slots)
    ends = dict(frees_at)
    for start, item in zip(starts, queue):
        ends.update(dict.fromkeys(_taken(item, start, slots), now + item.estimate_s))
    head = reservation(blocked[0], slots, ends, now)
    busy = set(ends)
    # Busy only grows during a pass, so a shape that found no room stays without room: later items
    # of that shape are skipped without placing them again (a pass is O(items + shapes x slots)).
    no_room: set[tuple] = set()
    for item in blocked[1:]:
        if len(busy) >= len(slots):
            break
        within_shadow = head is None or now + item.estimate_s <= head.start_at
        shape = (item.num_nodes, item.num_gpus, item.min_memory, item.kind, item.exclusive, item.allowed,
                 within_shadow)
        if shape in no_room:
            continue
        placement = _backfill_placement(item, slots, busy, head, now)
        if placement is None:
            no_room.add(shape)
            continue
        starts.append(Start(item.name, placement))
        busy.update(_taken(item, starts[-1], slots))
    return starts


def _taken(item: Waiting, start: Start, slots: Sequence[Slot]) -> list[str]:
    """The slots a start keeps from the others: its own, and for an exclusive item every slot of its
    nodes (nothing may run beside it)."""
    if not item.exclusive:
        return start.queues
    nodes = {slot.node for placed in start.placement for slot in placed}
    return [slot.queue for slot in slots if slot.node in nodes]


def reservation(head: Waiting, slots: Sequence[Slot], frees_at: Mapping[str, float],
                now: float) -> Reservation | None:
    """The earliest estimated time and slots at which `head` fits, or None if it never fits these slots.

    Tries each estimated end time in order, as if every slot ending by then were free.
    """
    slots = in_order(slots)
    ends = {queue: max(end, now) for queue, end in frees_at.items()}
    moments = sorted({now, *ends.values()})

    def placement_at(moment: float) -> list[list[Slot]] | None:
        return _place(slots, {queue for queue, end in ends.items() if end > moment}, head)

    # Fewer slots are busy at a later moment, so "fits by then" is monotone in time: the earliest
    # moment is found by bisection, in O(log moments) placements instead of one per moment.
    low, high = 0, len(moments)
    while low < high:
        middle = (low + high) // 2
        if placement_at(moments[middle]) is None:
            low = middle + 1
        else:
            high = middle
    if low == len(moments):
        return None
    placement = placement_at(moments[low])
    assert placement is not None
    return Reservation(moments[low], frozenset(Start(head.name, placement).queues))


def _backfill_placement(item: Waiting, slots: Sequence[Slot], busy: set[str], head: Reservation | None,
                        now: float) -> list[list[Slot]] | None:
    """Free slots for `item` that cannot delay the head: any, if it ends by the shadow time,
    otherwise only slots outside the head's reservation."""
    if head is None or now + item.estimate_s <= head.start_at:
        return _place(slots, busy, item)
    return _place(slots, busy | head.queues, item)


def _place(slots: list[Slot], busy: set[str], item: Waiting) -> list[list[Slot]] | None:
    """`place` for `item` over `slots` already `in_order`."""
    return place(slots, busy, item.num_nodes, item.num_gpus, item.min_memory, item.kind, item.exclusive,
                 item.allowed, ordered=True)


#: The policies a job may ask for (`JobSpec.policy`), by name.
POLICIES: dict[str, Policy] = {"backfill": backfill, "strict_fifo": strict_fifo}
