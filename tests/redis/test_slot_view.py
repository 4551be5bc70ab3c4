"""What a dispatch pass reads of the slots (`workers.state.slot_view`) against a real redis-server: the free
and the marked slots in one script over the slot index, the parsed registrations kept until one
appears, changes or lapses."""
from __future__ import annotations

from dataclasses import replace

import redis

from workers.state import keys
from workers.state.gang import GangReservations
from workers.state.registry import announce_slot
from workers.device.slot import Slot
from workers.state.slot_health import mark_unhealthy
from workers.state.slot_view import read_view

GiB = 2**30


def slots(count: int) -> list[Slot]:
    return [Slot("n0", d, "cuda", 80 * GiB, "10.0.0.1", 4, (), f"gpu{d}@n0", instance=f"i{d}", cuda_index=d)
            for d in range(count)]


def test_a_pass_sees_the_free_and_the_marked_slots_and_parses_each_epoch_once(client: redis.Redis) -> None:
    a, b, c, d = slots(4)
    for slot in (a, b, c, d):
        announce_slot(client, slot)
    GangReservations(client).reserve([b.queue], 30, owner="j/x")
    mark_unhealthy(client, c.queue, 5 * GiB, "before a launch")
    view = read_view(client)
    assert view.free == {a.queue, d.queue} and set(view.sick) == {c.queue}
    assert [slot.queue for slot in view.slots] == [a.queue, b.queue, c.queue, d.queue]
    assert view.busy() == {b.queue, c.queue} and view.sick[c.queue]["used_bytes"] == 5 * GiB

    again = read_view(client)  # nothing registered changed: the same parsed slots
    assert again.epoch == view.epoch and again.slots is view.slots

    announce_slot(client, replace(a, instance="restarted"))  # a worker restarted: its registration changed
    changed = read_view(client)
    assert changed.epoch != view.epoch and changed.slots[0].instance == "restarted"

    client.delete(keys.slot(d.queue))  # its worker died: the registration lapsed
    lapsed = read_view(client)
    assert lapsed.epoch != changed.epoch and d.queue not in lapsed.free
    assert d.queue not in {slot.queue for slot in lapsed.slots} and not client.sismember(keys.SLOT_INDEX, d.queue)


def test_a_reserved_slot_is_busy_whether_marked_or_not(client: redis.Redis) -> None:
    """A rank that finds others' memory marks its slot and gives it back: the mark shows from then."""
    [a] = slots(1)
    announce_slot(client, a)
    gangs = GangReservations(client)
    token = gangs.reserve([a.queue], 30, owner="j/x")
    mark_unhealthy(client, a.queue, GiB, "before a launch")
    assert read_view(client).free == frozenset() and read_view(client).busy() == {a.queue}
    gangs.release([a.queue], token)
    assert set(read_view(client).sick) == {a.queue} and read_view(client).busy() == {a.queue}
