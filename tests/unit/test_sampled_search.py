"""The sampled search (`scheduler.sampled_search`): its pure decisions, and the whole search driven by
the synthetic law of test_fast_search (16 GiB, 4 ranks) and by bench surfaces."""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from bench.surfaces import make_surface, user_config
from scheduler.fast_search import PROFILE, SearchSettings, fast_search, too_large
from scheduler.phases import drive, replay
from scheduler.ranking import best
from scheduler.sampled_search import (
    REMEASURE_SUFFIX, full_step_sizes, geometric_mid, lead_first, next_size, snap, to_remeasure,
)
from tests.unit.test_fast_search import LAW, USER_CONFIG, Law, Runner, layout


def sampled(**changes: Any) -> SearchSettings:
    base = SearchSettings(ds_config=USER_CONFIG, capacity_bytes=LAW.capacity, stages=(0, 1, 2, 3), num_gpus=4,
                          host_memory=True, max_train_batch_size=512)
    return replace(base, **changes)


# ---------------------------------------------------------------- pure decisions


def test_full_step_sizes_keep_the_largest_size_per_accumulation() -> None:
    assert full_step_sizes(16, 15) == [1, 2, 3, 4, 5, 8, 15]  # 16 // g, plus the top that fits
    assert full_step_sizes(None, 4) == [1, 2, 3, 4]
    assert full_step_sizes(64, 0) == []


def test_geometric_mid_and_snap() -> None:
    assert geometric_mid(4, 64) == 16 and geometric_mid(4, 5) is None and geometric_mid(4, 6) == 5
    assert snap(12, [8, 16]) == 16 and snap(11, [8, 16]) == 8


@pytest.mark.parametrize(
    ("values", "sizes", "expected"),
    [
        ({}, [1, 2, 4, 8, 16], 16),  # the top first
        ({4: 1.0}, [1, 2, 4, 8, 16], 16),  # the top is always seen
        ({4: 1.0, 16: 2.0}, [1, 2, 4, 8, 16], 8),  # rising: split below the best
        ({4: 2.0, 16: 1.0}, [1, 2, 4, 8, 16], 8),  # falling at the top: the larger gap next to the best
        ({4: 2.0, 8: 1.5, 16: 1.0}, [1, 2, 4, 8, 16], 1),  # best is the smallest: four times lower
        ({1: 1.0, 4: 2.0, 8: 1.5, 16: 1.0}, [1, 2, 4, 8, 16], 2),
        ({2: 1.0, 4: 2.0, 8: 1.5, 16: 1.0}, [1, 2, 4, 8, 16], None),  # neighbours within REFINE_RATIO... by size
        ({8: 1.0, 16: None}, [1, 2, 4, 8], 2),  # failures are not neighbours; best smallest: go lower
        ({4: 2.0, 64: 1.0}, [1, 2, 4, 8, 16, 32, 64], 16),  # best smallest: the gap above is split first
        ({4: 1.0, 60: 2.0}, [1, 2, 4, 8, 16, 32, 64], 16),  # a top within TOP_GAIN of a measured size is left
        ({4: 1.0, 58: 2.0}, [1, 2, 4, 8, 16, 32, 64], 64),  # ... and one TOP_GAIN larger is probed
    ],
)
def test_next_size(values: dict[int, float | None], sizes: list[int], expected: int | None) -> None:
    assert next_size(values, sizes) == expected


def test_next_size_minimises_latency() -> None:
    assert next_size({4: 2.0, 16: 1.0}, [1, 2, 4, 8, 16], maximize=False) == 8
    assert next_size({4: 1.0, 8: 1.5, 16: 2.0}, [1, 2, 4, 8, 16], maximize=False) == 1


@pytest.mark.parametrize(
    ("status", "mbs", "smallest_ok", "bound"),
    [("oom", 8, None, True), ("crashed", 16, 8, True), ("crashed", 8, None, False), ("crashed", 4, 8, False),
     ("timeout", 16, 8, True), ("ok", 16, 8, False)],
)
def test_every_failure_above_a_success_is_an_upper_bound(status: str, mbs: int, smallest_ok: int | None,
                                                         bound: bool) -> None:
    assert too_large({"status": status}, mbs, smallest_ok) is bound


# ---------------------------------------------------------------- the whole search


def run(settings: SearchSettings, law: Law = LAW):
    runner = Runner(law)
    return drive(fast_search(settings), runner), runner


def test_no_experiment_is_run_twice_and_the_winner_ran_under_its_own_name() -> None:
    phases, runner = run(sampled())
    names = [name for phase in phases for name in phase.names]
    assert len(names) == len(set(names)) == len(runner.records)
    winner = best([r for n, r in runner.records.items() if n != PROFILE], "throughput", True)
    assert not winner["name"].endswith(REMEASURE_SUFFIX)
    for phase in phases[1:]:
        for exp in phase.experiments:
            assert exp.micro_batch_size * exp.gradient_accumulation_steps * 4 <= 512


def test_replay_from_records_asks_for_nothing_new() -> None:
    phases, runner = run(sampled())
    answered, pending = replay(fast_search(sampled()), lambda e: runner.records.get(e.name))
    assert pending is None and answered == phases


@pytest.mark.parametrize("failure", ["oom", "crashed"])
def test_a_failed_size_is_never_exceeded_again_in_its_stage(failure: str) -> None:
    class Crashing(Law):
        def run(self, exp) -> dict[str, Any]:
            record = super().run(exp)
            return {**record, "status": failure} if record["status"] == "oom" else record

    law = Crashing(overhead=3 * 2**30)  # the profile-based opening estimate is 2 GiB short: probes fail
    phases, runner = run(sampled(), law)
    for stage in range(4):
        sizes = [(int(n.split("tmbspg")[1].split("_")[0]), r["status"]) for n, r in runner.records.items()
                 if n.startswith(f"z{stage}_")]
        ok = [m for m, status in sizes if status == "ok"]
        failed = [m for m, status in sizes if status != "ok"]
        assert len(failed) <= 2
        if failed and ok:
            assert max(ok) < min(failed)
            later = [m for m, _ in sizes[sizes.index((min(failed), failure)) + 1:]]
            assert all(m < min(failed) for m in later)


def test_only_a_near_tie_is_re_measured() -> None:
    assert to_remeasure([(100.0, "a"), (99.7, "b"), (99.6, "c")]) == ["a", "b"]  # RACE_SIZE: the best two
    assert to_remeasure([(99.7, "b"), (100.0, "a")]) == ["a", "b"]
    assert to_remeasure([(100.0, "a"), (99.0, "b")]) == []  # 1 % apart: the measurement decides
    assert to_remeasure([(100.0, "a")]) == []


def test_race_repeats_run_alone_with_the_original_config() -> None:
    class Tied(Law):
        def run(self, exp) -> dict[str, Any]:
            record = super().run(exp)
            if record["status"] == "ok" and exp.name != PROFILE:
                record["metrics"] = {**record["metrics"], "throughput": 100.0 + exp.micro_batch_size * 1e-6}
            return record

    phases, runner = run(sampled(), Tied())
    race = [p for p in phases if p.name.startswith("race_")]
    assert len(race) == 2 and all(len(p.experiments) == 1 for p in race)
    for exp in (e for p in race for e in p.experiments):
        original = exp.name[: -len(REMEASURE_SUFFIX)]
        assert runner.records[original]["ds_config"] == exp.ds_config


def test_zero_1_leads_when_data_parallel() -> None:
    assert lead_first((0, 1, 2, 3), 4) == [1, 0, 2, 3]
    assert lead_first((0, 1, 2, 3), 1) == [0, 1, 2, 3]
    assert lead_first((0, 2), 4) == [0, 2]
    phases, _ = run(sampled())
    assert phases[1].experiments[0].stage == 1


def test_pooled_means_decide_the_winner() -> None:
    config_a, config_b = {"a": 1}, {"b": 1}
    records = [{"name": "a", "status": "ok", "ds_config": config_a, "metrics": {"throughput": 10.0}},
               {"name": "b", "status": "ok", "ds_config": config_b, "metrics": {"throughput": 10.5}},
               {"name": "a_r2", "status": "ok", "ds_config": config_a, "metrics": {"throughput": 11.5}},
               {"name": "b_r2", "status": "ok", "ds_config": config_b, "metrics": {"throughput": 10.4}}]
    assert best(records, "throughput", True)["name"] == "a"  # mean 10.75 beats 10.45; first name kept
    assert best(records[:2], "throughput", True)["name"] == "b"


def test_deepspeed_search_stays_selectable() -> None:
    phases, _ = run(sampled(search="deepspeed"))
    assert any(p.name.endswith("_min_max") for p in phases)
    assert not any(p.name.startswith("race") for p in phases)


@pytest.mark.parametrize(("family", "seed"), [("mid-peak", 3), ("monotone", 5), ("large-model", 2)])
def test_a_peak_that_does_not_grow_is_not_fitted(family: str, seed: int) -> None:
    """A GPU job measured on the host: flat peaks. The search still ends, within 2 failures a stage."""
    surface = make_surface(family, seed)
    settings = SearchSettings(ds_config=user_config(surface), capacity_bytes=surface.capacity,
                              stages=(0, 1, 2, 3), num_gpus=2, max_train_batch_size=surface.max_train_batch_size,
                              peak_memory_key="peak_rss_bytes")
    launched: list[dict[str, Any]] = []

    def run_phase(phase):
        out = {e.name: surface.run(e.name, e.ds_config, profile=e.name == PROFILE) for e in phase.experiments}
        launched.extend(out.values())
        return out

    drive(fast_search(settings), run_phase)
    for stage in range(4):
        failed = [r for r in launched if r["status"] != "ok" and r["name"].startswith(f"z{stage}_")]
        assert len(failed) <= 2, layout


def test_summary_shows_crashes_above_a_success_as_too_large() -> None:
    from scheduler.outputs import treated_as_too_large

    def rec(status: str, stage: int, mbs: int) -> dict[str, Any]:
        return {"status": status, "ds_config": {"zero_optimization": {"stage": stage},
                                                 "train_micro_batch_size_per_gpu": mbs}}
    records = [rec("ok", 1, 8), rec("crashed", 1, 16), rec("crashed", 1, 4), rec("crashed", 2, 16)]
    assert treated_as_too_large(records) == 1


def _launches(surface) -> list[tuple[str, str]]:
    settings = SearchSettings(ds_config=user_config(surface), capacity_bytes=surface.capacity, stages=(0, 1, 2, 3),
                              num_gpus=surface.world, max_train_batch_size=surface.max_train_batch_size,
                              peak_memory_key="peak_device_bytes")
    launched: list[tuple[str, str]] = []

    def run_phase(phase):
        out = {e.name: surface.run(e.name, e.ds_config, profile=e.name == PROFILE) for e in phase.experiments}
        launched.extend((name, record["status"]) for name, record in out.items())
        return out

    drive(fast_search(settings), run_phase)
    return launched


def test_a_crash_above_a_success_steers_the_whole_search_as_an_oom_does() -> None:
    """A script that prints the CUDA OOM traceback and exits 1 (`crashed`) must cost no more probes than
    one whose OOM is recognised: where every failure lies above a success of its stage, both searches
    launch the same experiments (a crash not taken as a bound is not carried to the next stage, which
    then probes past it)."""
    compared = 0
    for family in ("monotone", "cliff", "large-model", "small-model"):
        for seed in range(40):
            surface = make_surface(family, seed)
            as_oom = _launches(replace(surface, failure_status="oom"))
            failures = [name for name, status in as_oom if status != "ok"]
            stage_ok = {name.split("_")[0] for name, status in as_oom if status == "ok"}
            if not failures or any(name.split("_")[0] not in stage_ok for name in failures):
                continue
            as_crash = _launches(replace(surface, failure_status="crashed"))
            assert [name for name, _ in as_crash] == [name for name, _ in as_oom], (family, seed)
            compared += 1
    assert compared >= 10
