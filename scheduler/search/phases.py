"""A search as a generator of phases, so that it reads like DeepSpeed's sequential loop and still resumes.

Why: a tuner written as straight-line code (probe, look at the result, probe again) is the easiest to
check against DeepSpeed's algorithm, but the process running it may die between two experiments. A
generator keeps the straight-line shape: it yields a `Phase` (experiments that may run concurrently)
and receives the records of exactly those experiments. Because it is a pure function of its settings
and of the records sent back, replaying it from the records stored on disk yields the same phases
again, up to the first one that was not finished; the caller runs only what is missing.

Protocol: `phase = next(search)`; run every experiment of the phase; `phase = search.send({name:
record})` for that phase's experiments; repeat until StopIteration (its value is None: the caller
picks the best from all records). A record missing from what is sent counts as `lost`.
"""
from __future__ import annotations

from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass
from typing import Any

from scheduler.search.space import Experiment


@dataclass(frozen=True)
class Phase:
    """Experiments the search needs measured before it can decide what comes next."""

    name: str
    experiments: tuple[Experiment, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(exp.name for exp in self.experiments)


Search = Generator[Phase, dict[str, dict], None]


def drive(search: Search, run_phase: Callable[[Phase], Mapping[str, dict[str, Any]]]) -> list[Phase]:
    """Runs a search to the end with `run_phase` and returns the phases in the order they came."""
    phases: list[Phase] = []
    try:
        phase = next(search)
        while True:
            phases.append(phase)
            phase = search.send(dict(run_phase(phase)))
    except StopIteration:
        return phases


def replay(search: Search, lookup: Callable[[Experiment], dict[str, Any] | None]) -> tuple[list[Phase], Phase | None]:
    """Answers phases from stored records (`lookup(exp)`: its record, or None) while it can.

    Returns the phases answered and the first phase with an experiment `lookup` cannot answer (None
    when the search finished). The search is then suspended at that phase: run its missing
    experiments and `send` the records of all of its experiments.
    """
    answered: list[Phase] = []
    try:
        phase = next(search)
        while True:
            records = {exp.name: lookup(exp) for exp in phase.experiments}
            if any(record is None for record in records.values()):
                return answered, phase
            answered.append(phase)
            phase = search.send(records)
    except StopIteration:
        return answered, None
