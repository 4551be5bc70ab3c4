"""All-or-nothing reservations of several slots at once, with a lease that cannot leak.

One Lua script takes every slot of an experiment with one owner token and a PX lease, or takes
none, in a single atomic step: two schedulers can never each hold half of what both need (the
deadlock of taking locks one by one), and a scheduler that dies holds its slots for at most one
lease. Renew and release check the token, so a stale owner can never free someone else's slots,
and a renewal recreates a key only when the Redis server lost it (a restart without its data), never
one that `stop_launch` released or whose lease lapsed: a given-up launch cannot hold a slot again.

It lives in `workers/` because both ends use it: dispatch (on the control worker) reserves, each
running rank keeps its own slot's lease alive (`keep`), and the chord callback releases as soon as
an experiment is recorded. So a lease outlives its experiment only by one lease at most, whoever
dies: a lost node stops renewing and its slots free themselves.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

import redis

from workers.state import keys

_RESERVE = """
-- KEYS[1..n]  autotune:gang:<slot queue> of every slot of the gang
-- ARGV[1]     the new owner token
-- ARGV[2]     the lease in milliseconds
-- returns 1 when every key was free and is now held by ARGV[1], else 0 and nothing changed
for i = 1, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 1 then return 0 end
end
for i = 1, #KEYS do
  redis.call('SET', KEYS[i], ARGV[1], 'PX', ARGV[2])
end
return 1
"""
_KEEP = """
-- KEYS[1]  autotune:gang:<slot queue> of the one slot a running rank renews
-- KEYS[2]  autotune:server, the token of this server's data (set here to ARGV[4] when missing)
-- ARGV[1]  the launch's owner token
-- ARGV[2]  the lease in milliseconds
-- ARGV[3]  the data token the rank last renewed under ('': none yet)
-- ARGV[4]  a fresh token, for data that has none
-- returns {answer, the data token}: answer 1 when ARGV[1] held it (lease extended); 2 when the key
-- was gone and the data is other than ARGV[3] (Redis restarted without its data: taken back); 0
-- when another token holds it, or the key was freed in the same data (released by stop_launch, or
-- its lease lapsed): this launch was given up
local server = redis.call('GET', KEYS[2])
if not server then
  server = ARGV[4]
  redis.call('SET', KEYS[2], server)
end
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return {1, server}
end
if not holder and ARGV[3] ~= '' and ARGV[3] ~= server then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return {2, server}
end
return {0, server}
"""
_RELEASE = """
-- KEYS[1..n]  autotune:gang:<slot queue> of the slots to free
-- ARGV[1]     the owner token: only keys it still holds are deleted
-- returns how many keys it held
local released = 0
for i = 1, #KEYS do
  if redis.call('GET', KEYS[i]) == ARGV[1] then
    redis.call('DEL', KEYS[i])
    released = released + 1
  end
end
return released
"""


@dataclass(frozen=True)
class Renewal:
    """A lease renewal's answer: whether this launch still holds the slot, and the token of the
    Redis data that answered (`keys.SERVER_EPOCH`; the rank passes it to its next renewal)."""

    held: bool
    server: str


class GangReservations:
    """Reserve, renew and release sets of slot queues in Redis."""

    def __init__(self, client: redis.Redis) -> None:
        self._client = client
        self._reserve = client.register_script(_RESERVE)
        self._release = client.register_script(_RELEASE)
        self._keep = client.register_script(_KEEP)

    @staticmethod
    def _keys(queues: list[str]) -> list[str]:
        return [keys.gang(q) for q in sorted(set(queues))]

    def reserve(self, queues: list[str], lease_s: float, owner: str = "") -> str | None:
        """A new owner token if every queue was free (all now held), else None (none held).

        The token starts with `owner` (e.g. "job/experiment"), so whoever looks at a slot's key
        can tell who holds it; the random part keeps it unguessable.
        """
        token = f"{owner}#{uuid.uuid4().hex}" if owner else uuid.uuid4().hex
        taken = self._reserve(keys=self._keys(queues), args=[token, int(lease_s * 1000)])
        return token if taken == 1 else None

    def keep(self, queue: str, token: str, lease_s: float, server: str = "") -> Renewal:
        """A running rank's renewal of its own slot: extend the lease while the token holds it; take
        the slot back only where the key vanished with the server's data (`server`, the data token
        the rank last renewed under, `keys.SERVER_EPOCH`, differs from the one there now). A key
        freed in the same data (the launch was stopped, or its lease lapsed) stays free: the launch
        was given up. (A token key, not INFO's run id: the cluster's Redis user may not run INFO.)"""
        answer, found = self._keep(keys=[keys.gang(queue), keys.SERVER_EPOCH],
                                   args=[token, int(lease_s * 1000), server, uuid.uuid4().hex])
        return Renewal(int(answer) > 0, found.decode() if isinstance(found, bytes) else str(found))

    def holds(self, queues: list[str], token: str) -> bool:
        """Whether `token` still holds every one of `queues` (its lease has not lapsed)."""
        ordered = sorted(set(queues))
        values = self._client.mget([keys.gang(q) for q in ordered]) if ordered else []
        return all(v is not None and v.decode() == token for v in values)

    def release(self, queues: list[str], token: str) -> int:
        """Free the queues this token holds; returns how many it still held."""
        return int(self._release(keys=self._keys(queues), args=[token]))

    def release_in(self, pipe: redis.client.Pipeline, queues: list[str], token: str) -> None:
        """`release`, queued in `pipe` (its answer in the pipeline's results), so a caller frees the
        slots in the round trip of what it does next. EVAL, not EVALSHA: a pipeline holding a script
        object asks Redis first whether the script is loaded, which is the round trip saved."""
        found = self._keys(queues)
        pipe.eval(_RELEASE, len(found), *found, token)

    def holders(self, queues: list[str]) -> dict[str, str]:
        """queue -> owner of its reservation, for the reserved ones among `queues`."""
        ordered = sorted(set(queues))
        values = self._client.mget([keys.gang(q) for q in ordered]) if ordered else []
        return {q: v.decode().partition("#")[0] or "?" for q, v in zip(ordered, values) if v is not None}

    def owners(self, queues: list[str]) -> dict[str, str]:
        """queue -> the owner (`reserve`'s `owner`, e.g. "job/experiment") of each reserved one."""
        ordered = sorted(set(queues))
        values = self._client.mget([keys.gang(q) for q in ordered]) if ordered else []
        return {q: v.decode().rsplit("#", 1)[0] for q, v in zip(ordered, values) if v is not None and b"#" in v}

    def held(self, queues: list[str]) -> set[str]:
        """Which of `queues` are reserved by anyone right now."""
        ordered = sorted(set(queues))
        values = self._client.mget([keys.gang(q) for q in ordered]) if ordered else []
        return {q for q, v in zip(ordered, values) if v is not None}


class SlotLease:
    """A running rank's hold on its own slot, renewed from its polls (`renew`), every lease/3.

    A renewal that fails (Redis away) is tried again at the next poll after `RETRY_S`, not a third
    of a lease later: when Redis comes back without its data, the rank takes its slot back within a
    poll or two, before the resubmitted job could queue its experiment elsewhere
    (`scheduler.cluster.progress`). Once another launch owns the slot, or the slot was freed on the
    same server, the answer stays "taken": a given-up launch never holds the slot again.
    """

    RETRY_S = 1.0

    def __init__(self, client: redis.Redis, queue: str, token: str, lease_s: float) -> None:
        self._gangs, self._queue, self._token, self._lease_s = GangReservations(client), queue, token, lease_s
        self._renew_at = 0.0
        self._server = ""
        self._taken = False

    def renew(self) -> bool:
        """Renew when due; True when this launch no longer holds its slot. Raises redis.RedisError
        when Redis did not answer (the next poll after RETRY_S tries again)."""
        if self._taken or time.monotonic() < self._renew_at:
            return self._taken
        self._renew_at = time.monotonic() + self.RETRY_S
        renewal = self._gangs.keep(self._queue, self._token, self._lease_s, self._server)
        self._server = renewal.server
        self._renew_at = time.monotonic() + self._lease_s / 3
        self._taken = not renewal.held
        return self._taken
