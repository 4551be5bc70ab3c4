"""Live searches (`scheduler.search.live_search`) give exactly what a replay from the records gives.

The oracle is `scheduler.search.phases.replay` itself, run from scratch at every step over the same
records; the searches are a toy whose phases depend on the metrics it is sent, and the real fast
search of a list-mode config.
"""
from __future__ import annotations

import random
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from scheduler.search.ceilings import SETTLED_READINGS
from scheduler.search.repeats import REPEAT_NAME, original_name
from scheduler.inputs.config import parse_config
from scheduler.search.fast_search import SearchSettings, fast_search
from scheduler.search.live_search import LiveSearches
from scheduler.search.phases import Phase, Search, replay
from scheduler.search.space import Experiment


def _exp(name: str) -> Experiment:
    return Experiment(name, 0, 1, 1, {"name": name})


def toy_search(rounds: int = 6) -> Search:
    """Each phase's experiments depend on the best metric of the previous one."""
    best = 0
    for round_ in range(rounds):
        names = [f"r{round_}_from{best}_{i}" for i in range(1 + (best % 3))]
        records = yield Phase(f"round{round_}", tuple(_exp(n) for n in names))
        best = max(int(r["metrics"]["throughput"]) for r in records.values())


def surface(exp: Experiment) -> dict[str, Any]:
    return {"name": exp.name, "status": "ok", "metrics": {"throughput": sum(map(ord, exp.name)) % 17}}


def _names(phases: list[Phase]) -> list[tuple[str, ...]]:
    return [phase.names for phase in phases]


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("processes", [1, 2])
def test_live_equals_replay_at_every_step(seed: int, processes: int) -> None:
    """Records arrive one at a time in a random order; after each, every process's live search
    (processes take the steps in turn) stands where a fresh replay stands."""
    rng = random.Random(seed)
    disk: dict[str, dict[str, Any]] = {}
    lives = [LiveSearches() for _ in range(processes)]
    builds = [0]

    def build() -> Search:
        builds[0] += 1
        return toy_search()

    step = 0
    while True:
        answered, current = replay(toy_search(), lambda exp: disk.get(exp.name))
        progress = lives[step % processes].advance("job", build, lambda exp: disk.get(exp.name))
        assert _names(progress.answered) == _names(answered)
        assert (progress.current.names if progress.current else None) == (current.names if current else None)
        if current is None:
            break
        missing = [e for e in current.experiments if e.name not in disk]
        exp = rng.choice(missing)
        disk[exp.name] = surface(exp)
        step += 1
    assert builds[0] == processes  # each process built its search once, then only fed it


def test_newly_answered_are_the_phases_of_this_step() -> None:
    disk: dict[str, dict[str, Any]] = {}
    lives = LiveSearches()
    first = lives.advance("job", toy_search, lambda exp: disk.get(exp.name))
    assert first.rebuilt and first.newly_answered == [] and first.current is not None
    for exp in first.current.experiments:
        disk[exp.name] = surface(exp)
    second = lives.advance("job", toy_search, lambda exp: disk.get(exp.name))
    assert not second.rebuilt and _names(second.newly_answered) == [first.current.names]
    third = lives.advance("job", toy_search, lambda exp: disk.get(exp.name))
    assert third.newly_answered == []
    rebuilt = LiveSearches().advance("job", toy_search, lambda exp: disk.get(exp.name))
    assert rebuilt.rebuilt and _names(rebuilt.newly_answered) == _names(second.answered)


def test_a_failing_search_is_dropped_and_rebuilt() -> None:
    builds = []

    def failing() -> Search:
        builds.append(1)
        yield Phase("one", (_exp("a"),))
        raise RuntimeError("no stage fits")

    lives = LiveSearches()
    lives.advance("job", failing, lambda exp: None)
    for _ in range(2):
        with pytest.raises(RuntimeError):
            lives.advance("job", failing, lambda exp: {"metrics": {}})
    assert len(builds) == 2  # the second failure came from a rebuilt search, not a dead generator


def test_least_recently_used_searches_are_dropped() -> None:
    lives = LiveSearches(capacity=2)
    for key in ("a", "b", "a", "c"):
        lives.advance(key, toy_search, lambda exp: None)
    assert lives.advance("b", toy_search, lambda exp: None).rebuilt  # "b" was dropped for "c"
    assert not lives.advance("c", toy_search, lambda exp: None).rebuilt


def test_the_real_list_search_live_equals_replay(tmp_path: Path) -> None:
    user = {"train_micro_batch_size_per_gpu": [1, 2, 4, 8], "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": [0, 1, 2]},
            "autotuning": {"enabled": True, "model_info": {"num_params": 1000, "trainable_num_params": 1000,
                                                           "activation_mem_per_gpu": 1}}}
    cfg = parse_config(user, tmp_path / "cfg.json", tmp_path)
    settings = SearchSettings.from_config(cfg, capacity_bytes=2**34, num_nodes=1, num_gpus=1)
    disk: dict[str, dict[str, Any]] = {}
    lives = LiveSearches()
    while True:
        answered, current = replay(fast_search(settings), lambda exp: disk.get(exp.name))
        progress = lives.advance("job", lambda: fast_search(settings), lambda exp: disk.get(exp.name))
        assert _names(progress.answered) == _names(answered)
        assert (progress.current.names if progress.current else None) == (current.names if current else None)
        if current is None:
            break
        exp = next(e for e in current.experiments if e.name not in disk)
        disk[exp.name] = {**surface(exp), "ds_config": exp.ds_config, "peak_rss_bytes": 2**30}
    repeats = [name for name in disk if REPEAT_NAME.match(name)]
    readings = Counter(original_name(name, disk) for name in disk)
    assert len(disk) - len(repeats) == 12 and 1 <= len(repeats) and max(readings.values()) <= SETTLED_READINGS


# ---------------------------------------------------------------- found by mutation testing


def two_phase_search() -> Search:
    yield Phase("first", (_exp("a"), _exp("b")))
    yield Phase("second", (_exp("c"),))


def test_a_live_search_reads_only_the_new_records() -> None:
    """After its first step a live search asks `new_records`, never `lookup` (the whole disk)."""
    lives = LiveSearches()
    record = {"metrics": {}}
    lives.advance("job", two_phase_search, lambda exp: None)
    asked: list[str] = []

    def disk_must_not_be_read(exp: Experiment):
        raise AssertionError(f"the live search read {exp.name} from disk")

    def new(exp: Experiment):
        asked.append(exp.name)
        return record if exp.name == "a" else None

    progress = lives.advance("job", two_phase_search, disk_must_not_be_read, new_records=new)
    assert (progress.rebuilt, progress.current.name, progress.found) == (False, "first", frozenset({"a"}))
    assert asked == ["a", "b"]
    asked.clear()
    progress = lives.advance("job", two_phase_search, disk_must_not_be_read,
                             new_records=lambda exp: asked.append(exp.name) or record)
    assert asked == ["b", "c"]  # "a" was found in the step before: not asked again
    assert progress.current is None and [p.name for p in progress.answered] == ["first", "second"]


def test_found_lists_the_current_phase_s_records_so_far() -> None:
    lives = LiveSearches()
    progress = lives.advance("job", two_phase_search, lambda exp: {"metrics": {}} if exp.name == "b" else None)
    assert progress.found == frozenset({"b"})
    assert progress.newly_answered == [] and progress.answered == []
    progress = lives.advance("job", two_phase_search, lambda exp: {"metrics": {}} if exp.name != "c" else None)
    assert (progress.current.name, progress.found) == ("second", frozenset())


def test_a_search_with_no_phases_ends_at_once() -> None:
    def empty() -> Search:
        return
        yield  # a generator that yields nothing

    progress = LiveSearches().advance("job", empty, lambda exp: None)
    assert (progress.answered, progress.current, progress.newly_answered, progress.rebuilt, progress.found) == (
        [], None, [], True, frozenset())
