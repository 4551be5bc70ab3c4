"""What a training process is, read from its title and from its slot's record, never from its environment.

Why: a rank forked from the slot's warm interpreter (`workers.warm.warm_start`) keeps the warm process's
command line and /proc/<pid>/environ, whatever it sets after the fork; so neither tells which slot,
job, experiment, rank or launch it is, and a check that reads them mistakes one rank for another
(or the warm process for a rank). Two things say it instead:

- **The title.** Every rank that runs under `workers.in_rank.entry` (cold or forked) takes the title its slot
  hands it (`workers.in_rank.entry.TITLE_ENV`, set by `workers.process.launch.run_watched`) through the setproctitle
  library: `ps` and `top` show `autotune rank 0/2 slot=n1.gpu0 launch=... job=... exp=...`, and a
  process it forks without exec (a DataLoader worker) shows the same. The title replaces the command
  line in place, so a long experiment name may be cut at the end; the rest comes first.
- **The record.** When a rank starts, its slot records the rank's PID, process group and start time
  under `keys.rank_process` (beside `keys.pgid`), in the cluster's Redis, with the identity above.
  Redis, not a file on the node: every reader already talks to it (`python -m deploy cleanup` runs
  on the operator's machine, which cannot read a node's files; the control worker cleans up lost
  launches from there too), and a record is scoped to its cluster, so two embedded clusters on one
  machine, whose slots have the same names, never see each other's ranks. A record that outlives its
  rank (its worker was killed) expires with the pgid key. Both keys' names are kept in the slot's
  index (`keys.rank_index`, and the slots that have one in `keys.RANK_SLOTS`), which every reader
  walks: a rank's start reads its own slot's few records, not a shared Redis's whole keyspace.

A record is a hint until checked (`owns_group`): the group's leader must still be the process that
was started then (a PID the kernel gave to another process has another start time); with the leader
gone, a process of the group must carry a rank title of that slot. A group that left neither (an
exec'd wrapper script's children after the wrapper died) is not recognised, and not killed.
"""
from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import psutil
import redis

from workers.state import keys
from workers.state.store import RedisSlotStore
from workers.in_rank.entry import TITLE_ENV

__all__ = ["TITLE_ENV", "RankIdentity", "RankProcess", "forget_rank", "kill_titled", "leftover_groups", "owns_group",
           "rank_records", "record_rank", "recorded_groups", "recorded_ranks", "start_time", "title_of",
           "titled_ranks"]

TITLE_WORD = "autotune rank"
#: A title cut short (it replaces the command line in place) still names the rank, slot and launch.
_TITLE = re.compile(r"^autotune rank (?P<rank>\d+)/(?P<world>\d+) slot=(?P<slot>\S+) launch=(?P<launch>\S+)"
                    r"(?: job=(?P<job>\S*))?(?: exp=(?P<experiment>\S*))?")


@dataclass(frozen=True)
class RankIdentity:
    """Which rank of which launch a training process is: what its title says."""

    slot: str
    job: str
    experiment: str
    rank: int
    world_size: int
    launch: str  #: the launch's attempt token (its first 12 characters in a title)

    def title(self) -> str:
        """The process title: the short fields first, the experiment (the one that may be cut) last."""
        return (f"{TITLE_WORD} {self.rank}/{self.world_size} slot={self.slot} launch={self.launch[:12]} "
                f"job={self.job} exp={self.experiment}")

    @classmethod
    def from_title(cls, text: str) -> RankIdentity | None:
        """The identity a title (a command line as `ps` shows it) names; None for any other process."""
        found = _TITLE.match(text.strip())
        if found is None:
            return None
        return cls(found["slot"], found["job"] or "", found["experiment"] or "", int(found["rank"]),
                   int(found["world"]), found["launch"])

    def same_launch(self, other: RankIdentity) -> bool:
        """Whether both name one launch (a title carries the token's first 12 characters only)."""
        return self.slot == other.slot and self.launch[:12] == other.launch[:12]


@dataclass(frozen=True)
class RankProcess:
    """A slot's record of one rank's process: who it is, and what proves a live process is still it."""

    identity: RankIdentity
    pid: int
    pgid: int
    started: int  #: when the process started, in clock ticks since boot (/proc/<pid>/stat); 0: unread

    def to_json(self) -> str:
        return json.dumps({**asdict(self.identity), "pid": self.pid, "pgid": self.pgid, "started": self.started})

    @classmethod
    def from_json(cls, text: str | bytes) -> RankProcess | None:
        """The record, or None for anything that is not one (a reader never fails on a bad record)."""
        try:
            data = json.loads(text)
            identity = RankIdentity(str(data["slot"]), str(data["job"]), str(data["experiment"]),
                                    int(data["rank"]), int(data["world_size"]), str(data["launch"]))
            return cls(identity, int(data["pid"]), int(data["pgid"]), int(data["started"]))
        except (ValueError, TypeError, KeyError):
            return None


def start_time(pid: int) -> int:
    """When the process started, in clock ticks since boot, as the kernel keeps it (0 when it is gone):
    exact, unlike a wall-clock time made from it (psutil's create_time moves by hundredths of a second
    between reads), so a record and a live process compare equal or not at all."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return int(stat.read().rpartition(b")")[2].split()[19])
    except (OSError, ValueError, IndexError):
        return 0


def record_rank(client: redis.Redis, task_id: str, identity: RankIdentity, pid: int, ttl_s: int) -> RankProcess:
    """Record a rank that just started as the leader of its own group (`pid` is its group) under
    `keys.rank_process`, beside its pgid under `keys.pgid` (which the slot's leftover scan reads),
    both named in the slot's index (`keys.rank_index`, itself in `keys.RANK_SLOTS`): one transaction,
    through the slots' store (`workers.state.rank_groups`). The index takes the record's TTL; a slot's records all have one (the rank's), so it lasts as
    long as the newest of them."""
    record = RankProcess(identity, pid, pid, start_time(pid))
    write_record(client, task_id, record, ttl_s)
    return record


def write_record(client: redis.Redis, task_id: str, record: RankProcess, ttl_s: int) -> None:
    """Write `record` as `record_rank` does (idempotent): a running rank writes it again after Redis
    was away (`workers.slot.rank_peers.StopCheck.keep_record`), since a restart can come back without
    it (its data wiped, or the last second of an append-only file lost), and a rank nobody can find
    is one no later launch on its slot ends."""
    RedisSlotStore(client).write_rank_group(record.identity.slot, task_id, record.to_json(), record.pgid, ttl_s)


def forget_rank(client: redis.Redis, slot: str, task_id: str) -> None:
    """The rank's group has ended: drop its record and its pgid key, and their names from the slot's index."""
    names = (keys.pgid(slot, task_id), keys.rank_process(slot, task_id))
    with client.pipeline(transaction=True) as pipe:
        pipe.delete(*names)
        pipe.srem(keys.rank_index(slot), *names)
        pipe.execute()


_INDEXED = """
-- KEYS[1] the slots that have an index (keys.RANK_SLOTS); ARGV[1] the prefix of a slot's index
-- (keys.rank_index), ARGV[2] the prefix of the names wanted (rank records' or pgids'), ARGV[3] one
-- slot, or none for every slot in KEYS[1]. Returns {name, value, ...} of the live keys wanted;
-- a name whose key is gone (expired, deleted) leaves its index, a slot whose index is gone KEYS[1]
local slots = ARGV[3] and {ARGV[3]} or redis.call('SMEMBERS', KEYS[1])
local found = {}
for _, slot in ipairs(slots) do
  local index = ARGV[1] .. slot
  for _, name in ipairs(redis.call('SMEMBERS', index)) do
    local value = redis.call('GET', name)
    if not value then
      redis.call('SREM', index, name)
    elseif string.sub(name, 1, #ARGV[2]) == ARGV[2] then
      found[#found + 1] = name
      found[#found + 1] = value
    end
  end
  if redis.call('EXISTS', index) == 0 then
    redis.call('SREM', KEYS[1], slot)
  end
end
return found
"""


def _indexed(client: redis.Redis, prefix: str, slot: str | None) -> dict[str, bytes]:
    """name -> value of the indexed keys starting with `prefix`, of `slot` or of every slot: one
    script walks the index inside Redis (a read costs the slot's few records, not the keyspace) and
    prunes what expired, atomically, so a name recorded again meanwhile is never dropped."""
    found = client.register_script(_INDEXED)(keys=[keys.RANK_SLOTS],
                                             args=[keys.rank_index(""), prefix, *([slot] if slot else [])])
    return {name.decode(): value for name, value in zip(found[::2], found[1::2])}


def rank_records(client: redis.Redis, slot: str | None = None) -> dict[str, RankProcess]:
    """key name -> rank record of `slot` (every slot by default), unchecked, read through the index."""
    parsed = {name: RankProcess.from_json(value) for name, value in
              _indexed(client, keys.rank_process_pattern().split("*")[0], slot).items()}
    return {name: record for name, record in parsed.items() if record is not None}


def recorded_ranks(client: redis.Redis, slot: str | None = None) -> list[RankProcess]:
    """Every rank record of `slot` (all slots by default), unchecked."""
    return list(rank_records(client, slot).values())


def recorded_groups(client: redis.Redis, slot: str | None = None) -> dict[str, int]:
    """key name -> process group of every pgid key of `slot` (all slots by default), unchecked."""
    found = {}
    for name, value in _indexed(client, keys.pgid_pattern().split("*")[0], slot).items():
        try:
            found[name] = int(value)
        except ValueError:
            continue
    return found


def leftover_groups(client: redis.Redis, slot: str) -> list[int]:
    """The slot's leftover scan (a restarted worker's: its predecessor was killed before its ranks'
    groups were): the groups the slot recorded that are still those ranks (`owns_group`, by the
    record's start time where there is one), every record of the slot dropped, with its index.

    A SCAN, not the index: it runs once per worker start, not per rank, and must find every key the
    predecessor left under the slot, one whose index expired or was lost with a Redis restart too."""
    found, names = set(), []
    for name in client.scan_iter(match=keys.rank_process_pattern(slot)):
        names.append(name)
        record = RankProcess.from_json(client.get(name) or b"")
        if record is not None and owns_group(record.pgid, slot, record.started or None):
            found.add(record.pgid)
    for name in client.scan_iter(match=keys.pgid_pattern(slot)):  # an op build's group has no rank record
        names.append(name)
        pgid = int(client.get(name) or 0)
        if pgid and pgid not in found and owns_group(pgid, slot):
            found.add(pgid)
    with client.pipeline(transaction=True) as pipe:
        pipe.delete(*names, keys.rank_index(slot))
        pipe.srem(keys.RANK_SLOTS, slot)
        pipe.execute()
    return sorted(found)


def title_of(proc: psutil.Process) -> str:
    """What `ps` shows as the process's command ('' when it cannot be read)."""
    try:
        return " ".join(proc.cmdline())
    except psutil.Error:
        return ""


def owns_group(pgid: int, slot: str, started: int | None = None) -> bool:
    """Whether process group `pgid` is still a rank of `slot` (module docstring): its leader started
    at `started` when that is known, else (or with the leader gone) a live process of the group
    carries a rank title of `slot`. Never reads an environment."""
    members = []
    for proc in psutil.process_iter(["status"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                members.append(proc)
        except (ProcessLookupError, psutil.Error):
            continue
    leader = next((proc for proc in members if proc.pid == pgid), None)
    if started and leader is not None:
        return start_time(pgid) == started
    return any(identity is not None and identity.slot == slot
               for identity in (RankIdentity.from_title(title_of(proc)) for proc in members))


def titled_ranks(procs: Iterable[psutil.Process] | None = None) -> dict[int, RankIdentity]:
    """pid -> identity of every live process carrying a rank title (one pass over the process table)."""
    found = {}
    for proc in psutil.process_iter() if procs is None else procs:
        identity = RankIdentity.from_title(title_of(proc))
        if identity is not None:
            found[proc.pid] = identity
    return found


def kill_titled(records: Iterable[RankProcess], grace_s: float) -> list[int]:
    """SIGTERM every live process whose title names the launch of one of `records` (a rank, or what
    it forked, wherever that went: another session too), SIGKILL what is left after `grace_s`;
    the pids it found."""
    launches = {(record.identity.slot, record.identity.launch[:12]) for record in records}
    procs = []
    for proc in psutil.process_iter():
        identity = RankIdentity.from_title(title_of(proc)) if launches else None
        if identity is not None and (identity.slot, identity.launch[:12]) in launches:
            procs.append(proc)
    terminate_then_kill(procs, grace_s)
    return [proc.pid for proc in procs]


def terminate_then_kill(procs: list[psutil.Process], grace_s: float) -> None:
    """SIGTERM each of `procs`, SIGKILL those still alive after `grace_s` (gone ones are skipped)."""
    for proc in procs:
        try:
            proc.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for proc in alive:
        try:
            proc.kill()
        except psutil.Error:
            pass
