"""What a dispatch pass reads of the slots: one script, nothing parsed twice.

Why: dispatch runs after every record and every sweep. It read every registration, every slot's
gang key and every slot's health mark (three MGETs of 1,024 keys at 1,024 slots) and parsed every
registration, on every pass: at 1,024 slots that was most of a pass in which nothing could start
(bench/scale.py). Here one script walks the slot index (`keys.SLOT_INDEX`, workers.state.registry) inside
Redis and returns only what a pass needs that changes between passes: the free slots (registered,
not reserved, not marked out of tuning: workers.state.gang, workers.state.slot_health), the unreserved marked
ones, and the index's epoch. The parsed registrations (and whatever the caller memoises about them, `memo`) are
kept by this process until the epoch changes: a slot appeared, changed or went.

So a pass that finds fewer free slots than anything waiting needs does no work in this process that
grows with the cluster; Redis walks the index in one script (one lookup a reserved slot, three a
free one). An unreserved registration found lapsed is pruned from the index and the epoch set
afresh, so a dead slot leaves every cache (a reserved one once its lease goes).
"""
from __future__ import annotations

import json
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any

import redis

from workers.state import keys
from workers.state.registry import live_slots
from workers.device.slot import Slot

_VIEW = """
-- KEYS[1] the slot index, KEYS[2] its epoch
-- ARGV[1], ARGV[2], ARGV[3] the key prefixes of registrations, gang reservations and health marks;
-- ARGV[4] a fresh epoch token, set when an indexed registration is found lapsed (or none is set)
-- returns {epoch, the free queues, {queue, mark, ...} of the unreserved marked ones}; a reserved
-- slot costs one lookup (a saturated cluster's every slot), a lapsed unreserved one leaves the index
local free, sick, gone = {}, {}, 0
for _, queue in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  if redis.call('EXISTS', ARGV[2] .. queue) == 0 then
    if redis.call('EXISTS', ARGV[1] .. queue) == 0 then
      redis.call('SREM', KEYS[1], queue)
      gone = gone + 1
    else
      local mark = redis.call('GET', ARGV[3] .. queue)
      if mark then
        sick[#sick + 1] = queue
        sick[#sick + 1] = mark
      else
        free[#free + 1] = queue
      end
    end
  end
end
local epoch = redis.call('GET', KEYS[2])
if gone > 0 or not epoch then
  epoch = ARGV[4]
  redis.call('SET', KEYS[2], epoch)
end
return {epoch, free, sick}
"""


@dataclass
class _Parsed:
    """The registrations of one epoch, parsed, and what callers derived from them."""

    epoch: bytes
    slots: list[Slot]
    memo: dict[Any, Any] = field(default_factory=dict)


_cache: _Parsed | None = None
_lock = threading.Lock()


@dataclass(frozen=True)
class SlotView:
    """One pass's view of the slots: which are free and which marked, read at once."""

    epoch: bytes
    free: frozenset[str]  #: registered, not reserved, not marked
    #: not reserved but marked out of tuning: queue -> the mark (workers.state.slot_health). A reserved
    #: slot is busy whether marked or not; its mark shows once its launch lets it go (a rank that
    #: finds others' memory marks its slot and gives it back at once).
    sick: dict[str, dict]
    slots: list[Slot]  #: every registered slot, by node then device (parsed at most once an epoch)
    memo: dict[Any, Any]  #: the caller's memo for this epoch's slots (e.g. which shapes fit at all)

    def busy(self) -> set[str]:
        """The registered slots that are not free (reserved or marked): O(slots), for a pass that places."""
        return {slot.queue for slot in self.slots if slot.queue not in self.free}


def read_view(client: redis.Redis) -> SlotView:
    """The slots as a dispatch pass sees them (module docstring)."""
    global _cache
    epoch, free, sick = client.register_script(_VIEW)(
        keys=[keys.SLOT_INDEX, keys.SLOT_EPOCH],
        args=[keys.slot(""), keys.gang(""), keys.unhealthy(""), uuid.uuid4().hex])
    with _lock:
        cached = _cache
        if cached is None or cached.epoch != epoch:
            # Read after the epoch: a change meanwhile sets a newer one, and the next pass reads again.
            cached = _cache = _Parsed(epoch, live_slots(client))
    marks = {sick[i].decode(): json.loads(sick[i + 1]) for i in range(0, len(sick), 2)}
    return SlotView(epoch, frozenset(queue.decode() for queue in free), marks, cached.slots, cached.memo)
