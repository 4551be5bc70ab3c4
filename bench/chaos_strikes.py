"""What bench/chaos.py's faults around a running rank strike: the Celery pool process running its
task (`kill_pool`), the warm interpreter it was forked from (`kill_warm`), and the installed
distribution whose METADATA a `bump_package` touches.

Why apart from bench/chaos.py: each is chosen from records and the process table, and a wrong
choice (a PID the kernel gave to another process, a cold rank's parent taken for a warm process)
would strike a stranger, or nothing, and still print a fault line. The matching (`pools_running`,
`warm_parents`) is pure and tested on planted records in tests/unit/test_chaos.py; the readers
beside it only gather what it matches.

- A rank task claims its task id for its pool process in Redis (`workers.slot.rank_claim`: the PID and
  start time of the process running it), and its slot records the rank's PID (`keys.rank_process`,
  `workers.process.process_identity`): the pool process of a running rank is the claimant of the task whose
  record names that rank, while the claimant's start time is the one claimed.
- A rank forked from the warm process is that process's child, and the warm process is the standard
  library's forkserver (its title `autotune warm slot=...`, or before it the command line
  `python -c from multiprocessing.forkserver import main ...`: `workers.warm.warm_server.shows_warm`,
  docs/cluster.md); a cold rank's parent is its pool process, which shows Celery's title.
- A bump moves the mtime of the METADATA file of a distribution that every warm process of the soak
  imported (they preload torch: the two-rank runs import it): what `pip install -U` or a reinstall
  does to that file, and what `workers.warm.warm_plan.code_changed` compares. The file's content stays.
"""
from __future__ import annotations

import functools
import importlib.metadata
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import redis

from bench.chaos_checks import Seen
from workers.state import keys
from workers.process.process_identity import RankProcess, rank_records, start_time, title_of
from workers.warm.warm_server import shows_warm

#: Modules every warm process of the soak imported (`import torch` imports the other two): the
#: distributions a `bump_package` may touch.
BUMP_MODULES = ("torch", "numpy", "typing_extensions")
CLAIM_CLOCK_S = 0.01  #: a claimant's start time matches the claim within this (`workers.slot.rank_claim`)


@dataclass(frozen=True)
class Struck:
    """A process a fault kills, and the running rank that made it the target."""

    pid: int
    shown: str  #: what `ps` shows for it
    rank_pid: int
    seen: Seen  #: the rank, as its title names it


@dataclass(frozen=True)
class Bump:
    """A distribution whose METADATA file a `bump_package` touches."""

    name: str
    version: str
    metadata: Path


def pools_running(records: Mapping[str, RankProcess], claims: Mapping[str, Any], live: Mapping[int, Seen],
                  processes: Mapping[int, tuple[float, str]]) -> list[Struck]:
    """The pool processes running the soak's live ranks. `records` and `claims`: "<slot>:<task id>"
    -> the slot's record of the task's rank, and the task's claim as stored (JSON); `live`: the
    running ranks (pid -> what its title names); `processes`: pid -> (start time, what `ps` shows)
    of live processes. A record counts only while its rank runs as recorded (its title names that
    slot and launch); a claim only while its claimant's start time is the claimed one."""
    found = []
    for key, record in sorted(records.items()):
        seen = live.get(record.pid)
        if seen is None or (seen.slot, seen.launch) != (record.identity.slot, record.identity.launch[:12]):
            continue
        claimant = _claimant(claims.get(key))
        if claimant is None or claimant[0] == record.pid or claimant[0] not in processes:
            continue
        started, shown = processes[claimant[0]]
        if abs(started - claimant[1]) < CLAIM_CLOCK_S:
            found.append(Struck(claimant[0], shown, record.pid, seen))
    return found


def _claimant(raw: Any) -> tuple[int, float] | None:
    """(pid, start time) of a claim as stored; None for a missing or malformed one."""
    try:
        claim = json.loads(raw)
        return int(claim["pid"]), float(claim["started"])
    except (TypeError, ValueError, KeyError):
        return None


def warm_parents(live: Mapping[int, Seen], processes: Mapping[int, tuple[int, str]]) -> list[Struck]:
    """The warm processes the soak's live ranks were forked from: a rank's parent when that shows the
    forkserver's line. `processes`: pid -> (parent pid, what `ps` shows) of live processes."""
    found = []
    for pid, seen in sorted(live.items()):
        parent = processes.get(pid, (0, ""))[0]
        shown = processes.get(parent, (0, ""))[1]
        if parent and shows_warm(shown):
            found.append(Struck(parent, shown, pid, seen))
    return found


def read_pools(client: redis.Redis, live: Mapping[int, Seen]) -> list[Struck]:
    """`pools_running` over the slots' rank records and the tasks' claims in Redis, now."""
    # the key ends "<slot>:<task id>", neither holding a colon
    records = {":".join(name.rsplit(":", 2)[1:]): record for name, record in rank_records(client).items()}
    slot_tasks = sorted(records)
    values = client.mget([keys.rank_claim(*key.split(":", 1)) for key in slot_tasks]) if slot_tasks else []
    claims = dict(zip(slot_tasks, values))
    processes = {}
    for pid in {claimant[0] for claimant in map(_claimant, values) if claimant}:
        try:
            proc = psutil.Process(pid)
            processes[pid] = (proc.create_time(), title_of(proc))
        except psutil.Error:
            continue
    return pools_running(records, claims, live, processes)


def read_warm(live: Mapping[int, Seen]) -> list[Struck]:
    """`warm_parents` over the live ranks and their parents, now."""
    processes: dict[int, tuple[int, str]] = {}
    for pid in live:
        try:
            parent = psutil.Process(pid).ppid()
            processes[pid] = (parent, "")
            processes.setdefault(parent, (0, title_of(psutil.Process(parent))))
        except psutil.Error:
            continue
    return warm_parents(live, processes)


def warm_processes(roots: Iterable[int]) -> list[int]:
    """The warm processes under the processes `roots` (the soak's slot workers)."""
    found = []
    for root in roots:
        try:
            found += [proc.pid for proc in psutil.Process(root).children(recursive=True)
                      if shows_warm(title_of(proc))]
        except psutil.Error:
            continue
    return sorted(found)


def warm_identities(pids: Iterable[int]) -> dict[int, int]:
    """pid -> start time (clock ticks since boot: exact) of those of `pids` still alive; a PID the
    kernel gave to another process later has another start time."""
    return {pid: started for pid in pids if (started := start_time(pid))}


@functools.lru_cache(maxsize=1)
def bump_candidates() -> tuple[Bump, ...]:
    """The distributions of BUMP_MODULES installed here, each with its METADATA file, the one
    `workers.warm.warm_preload.code_stamp` notes (looked up once: packages_distributions reads every
    distribution's metadata)."""
    owners = importlib.metadata.packages_distributions()
    found = {}
    for module in BUMP_MODULES:
        for name in owners.get(module, []):
            dist = importlib.metadata.distribution(name)
            folder = getattr(dist, "_path", None)  # PathDistribution's folder: the only kind pip installs
            if folder is not None and (Path(str(folder)) / "METADATA").is_file():
                found[name] = Bump(name, dist.version, Path(str(folder)) / "METADATA")
    return tuple(found[name] for name in sorted(found))


def bump(target: Bump) -> None:
    """Move the METADATA file's mtime to now, its content untouched (an upgrade, as a stat sees it)."""
    os.utime(target.metadata)
