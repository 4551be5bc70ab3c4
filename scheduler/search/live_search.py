"""A job's search kept alive between its steps in one control process, fed only the new records.

Why: after every experiment the job takes a step, and a step that rebuilt the search generator and
replayed it against every record on disk (`scheduler.search.phases.replay`) would cost O(records): a
long job would pay O(records^2) in all and the gap between two experiments on a slot would grow as
the job goes on. The search is deterministic given its spec and the records it is sent, so the
generator of the previous step, suspended at its current phase, is exactly what a replay would
rebuild: the next step only has to look up the current phase's missing records and send them.

Replay from disk stays the recovery path: a process that has no live search for the job (the first
step, another control worker, a restart, Redis having lost the job and the job submitted again, a
changed spec) rebuilds it from the records on disk, and both paths give the same phases (tested).
Several control processes may take steps of one job in turn: each one's live search catches up
from the records on disk, phase by phase, since records are written before any step sees them.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from scheduler.search.phases import Phase, Search
from scheduler.search.space import Experiment

Lookup = Callable[[Experiment], "dict[str, Any] | None"]


@dataclass
class _Live:
    search: Search
    answered: list[Phase] = field(default_factory=list)
    current: Phase | None = None
    started: bool = False
    found: dict[str, dict[str, Any]] = field(default_factory=dict)  #: records of the current phase so far


@dataclass(frozen=True)
class Progress:
    """Where a search stands after a step."""

    answered: list[Phase]  #: every phase answered so far, in order
    current: Phase | None  #: the first phase still missing a record (None: the search ended)
    newly_answered: list[Phase]  #: the phases this step answered (all of them after a rebuild)
    rebuilt: bool  #: the search was rebuilt from the records on disk in this step
    found: frozenset[str]  #: experiments of the current phase that have their record


class LiveSearches:
    """Live searches of the jobs this process steps, least recently used dropped beyond `capacity`."""

    def __init__(self, capacity: int = 16) -> None:
        self._capacity = capacity
        self._live: OrderedDict[Hashable, _Live] = OrderedDict()

    def holds(self, key: Hashable) -> bool:
        """Whether this process has the live search of `key` (its next step is no rebuild)."""
        return key in self._live

    def advance(self, key: Hashable, build: Callable[[], Search], lookup: Lookup,
                new_records: Lookup | None = None) -> Progress:
        """Feed the search of `key` every record it can get, and say where it stands. A search this
        process does not have is rebuilt with `build` and answered by `lookup` (the records on disk);
        a live one only needs `new_records` (default `lookup`): the records that can have appeared
        since its last step. An exception from the search drops it."""
        live = self._live.pop(key, None)
        rebuilt = live is None
        if live is None:
            live = _Live(build())
        look = lookup if rebuilt or new_records is None else new_records
        before = len(live.answered)
        if not live.started:
            live.started = True
            live.current = next(live.search, None)
        while live.current is not None:
            for exp in live.current.experiments:
                if exp.name not in live.found and (record := look(exp)) is not None:
                    live.found[exp.name] = record
            if any(exp.name not in live.found for exp in live.current.experiments):
                break
            records = {exp.name: live.found[exp.name] for exp in live.current.experiments}
            live.answered.append(live.current)
            live.found = {}
            try:
                live.current = live.search.send(records)
            except StopIteration:
                live.current = None
        self._live[key] = live
        while len(self._live) > self._capacity:
            self._live.popitem(last=False)
        return Progress(list(live.answered), live.current, live.answered[before:], rebuilt,
                        frozenset(live.found))
