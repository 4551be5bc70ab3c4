"""The leader's neighbour along the accumulation saw-tooth (one size smaller with one more
accumulation step) and the size filling its step at its own accumulation: tried before the winner
is named when they fill more of the step."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from bench.surfaces import classic, make_surface, user_config
from scheduler.search.fast_search import PROFILE, fast_search
from scheduler.search.global_batch import GlobalBatch
from scheduler.search.phases import drive
from scheduler.search.ranking import best
from scheduler.search.sampling import filled_size, sawtooth_neighbour
from scheduler.search.session import SearchSettings
from tests.unit.test_fast_search import LAW, USER_CONFIG, Law, Runner


@pytest.mark.parametrize(("mbs", "gas", "step", "expected"), [
    (27, 4, 130, 26),  # 26 x 5 = 130 samples beside 27 x 4 = 108
    (32, 4, 130, None),  # 26 x 5 = 130 beside 32 x 4 = 128: under 5 % more, not worth a launch
    (16, 1, 16, None),  # a full step at gas 1: 8 x 2 fills the same 16
    (10, 2, 20, None),  # 6 x 3 = 18: fewer samples than the leader
    (10, 2, 21, 7),  # 7 x 3 = 21 beside 10 x 2 = 20: 5 % more, tried
    (11, 1, 21, 10),  # 10 x 2 = 20 beside 11: 1.8x the samples
    (1, 16, 16, None),  # nothing below 1
    (8, 2, None, None),  # no step limit: every size fills its step already
])
def test_sawtooth_neighbour(mbs: int, gas: int, step: int | None, expected: int | None) -> None:
    assert sawtooth_neighbour(mbs, gas, step) == expected


@pytest.mark.parametrize(("mbs", "gas", "step", "expected"), [
    (12, 2, 32, 16),  # a provisional top at gas 2: 16 x 2 fills the step of 32
    (7, 2, 16, 8),  # 8 x 2 = 16 beside 7 x 2 = 14
    (31, 2, 64, None),  # 32 x 2 = 64 beside 62: under 5 % more, not worth a launch
    (16, 2, 32, None),  # the leader fills its step already
    (10, 3, 32, None),  # 32 // 3 = 10: no larger size at gas 3
    (12, 2, None, None),  # no step limit: every size fills its step already
])
def test_filled_size(mbs: int, gas: int, step: int | None, expected: int | None) -> None:
    assert filled_size(mbs, gas, step) == expected


@dataclass(frozen=True)
class Steps(Law):
    """The law's memory, but 0.5 s per micro-step plus 0.01 s per sample and a fixed 2 s per
    optimizer step: larger micro-batches are faster, and so is a step filled with one more
    accumulation step (26 x 5 beats 27 x 4)."""

    def run(self, exp) -> dict[str, Any]:
        record = super().run(exp)
        if record["status"] == "ok" and exp.name != PROFILE:
            mbs, gas = exp.micro_batch_size, exp.gradient_accumulation_steps
            step_s = 2.0 + gas * (0.5 + 0.01 * mbs)
            record["metrics"] = {**record["metrics"], "throughput": mbs * gas * self.world / step_s}
        return record


def test_the_sawtooth_neighbour_of_a_sampled_stages_leader_is_measured_before_confirming() -> None:
    """16 GiB holds micro-batch 27 at ZeRO-1 with 530 MB of activations per sample; max_train_batch_size
    520 on 4 ranks leaves 130 per GPU: the top, 27 x 4 = 108, leads the sampled sizes (7, 14, 21), and
    26 x 5 = 130, within REFINE_RATIO of it, is not a gap the refinement splits; the cost model fitted
    to the four predicts it better by more than the noise, so it is measured, and wins."""
    settings = SearchSettings(ds_config=USER_CONFIG, capacity_bytes=LAW.capacity, stages=(1,), num_gpus=4,
                              host_memory=True, max_train_batch_size=520)
    runner = Runner(Steps(activation=530_000_000))
    phases = drive(fast_search(settings), runner)
    assert [(p.name, [(e.micro_batch_size, e.gradient_accumulation_steps) for e in p.experiments])
            for p in phases if not p.name.startswith(("profile", "confirm"))] == [
        ("z1_sample_7", [(7, 18)]), ("z1_sample_27", [(27, 4)]), ("z1_sample_14", [(14, 9)]),
        ("z1_sample_21", [(21, 6)]), ("z1_sample_26", [(26, 5)])]
    assert phases[-1].name.startswith("confirm")  # the neighbour comes before the confirmation
    winner = best([r for n, r in runner.records.items() if n != PROFILE], "throughput", True)
    assert winner["name"] == "z1_gas5_tmbspg26"


def test_the_leaders_sawtooth_neighbour_is_tried_when_its_stage_was_only_followed() -> None:
    """Bench surface monotone 29 (a step limit): ZeRO-0, measured only at the incumbent's size 10,
    leads; no fit of its stage exists, so the leader's saw-tooth neighbour, 8, is measured before
    the confirmation (`try_sawtooth`)."""
    phases, _ = _search_on(make_surface("monotone", 29))
    names = [phase.name for phase in phases]
    assert "z0_sawtooth_8" in names
    assert names.index("z0_sawtooth_8") < names.index(next(n for n in names if n.startswith("confirm")))


def test_a_leader_measured_as_a_provisional_top_has_its_step_filled_before_confirming() -> None:
    """Bench surface cliff 49 (max_train_batch_size 64 on 2 ranks: a step of 32): ZeRO-1's top
    probe at 24 failed, so 12 x 2, the midpoint, was probed as the stage's top; later probes ran
    17 and 20, and 12 x 2 led on a lucky reading, with 16 x 2 (a full step, the optimum) within
    REFINE_RATIO of it and never split off. The size filling the leader's step at its own
    accumulation is measured before the confirmation, and wins."""
    surface = make_surface("cliff", 49)
    phases, records = _search_on(surface)
    names = [phase.name for phase in phases]
    assert "z1_filled_16" in names
    assert names.index("z1_filled_16") < names.index(next(n for n in names if n.startswith("confirm")))
    winner = best([r for r in records if r["name"] != PROFILE], "throughput", True)
    assert _config_of(winner) == (1, 16, 2) == (1, *surface.optimum()[1][1:])


def test_a_kept_global_batch_has_no_sawtooth_to_try() -> None:
    settings = SearchSettings(ds_config={**USER_CONFIG, "train_batch_size": 96}, capacity_bytes=LAW.capacity,
                              stages=(1,), num_gpus=4, host_memory=True, global_batch=GlobalBatch(96, "t"))
    phases = drive(fast_search(settings), Runner(Steps()))
    assert not [p for p in phases if "_sawtooth_" in p.name]


def _search_on(surface) -> tuple[list[Any], list[dict[str, Any]]]:
    """fast_search on a bench surface as bench/search_quality.py drives it: (phases, records)."""
    settings = SearchSettings(ds_config=user_config(surface), capacity_bytes=surface.capacity, stages=(0, 1, 2, 3),
                              num_gpus=surface.world, max_train_batch_size=surface.max_train_batch_size,
                              peak_memory_key="peak_device_bytes", host_memory=False, concurrency=1)
    records: list[dict[str, Any]] = []

    def run_phase(phase):
        out = {exp.name: surface.run(exp.name, exp.ds_config, profile=exp.name == PROFILE) for exp in phase.experiments}
        records.extend(out.values())
        return out

    return drive(fast_search(settings), run_phase), records


def _config_of(record: dict[str, Any]) -> tuple[int, int, int]:
    config = record["ds_config"]
    return (int(config["zero_optimization"]["stage"]), int(config["train_micro_batch_size_per_gpu"]),
            int(config["gradient_accumulation_steps"]))


def test_without_a_limit_a_leader_at_gas_2_widens_its_step_to_the_stages_top() -> None:
    """The cliff surface of bench seed 16 (no max_train_batch_size): ZeRO-1 holds micro-batch 302,
    its probes found 264 (320 failed), so every size filled a step of 264 and the leader was 132 x 2,
    0.941 of the optimum, 151 x 2. The top predicted between them (288, a multiple of 8) is probed
    once; it runs, the step widens, and the leader's accumulation at the largest size filling it,
    144 x 2, is measured: 0.979 of the optimum (which of the two is named is the noise's call)."""
    surface = make_surface("cliff", 16)
    assert surface.max_train_batch_size is None and surface.max_fit(1) == 302
    phases, records = _search_on(surface)
    names = [phase.name for phase in phases]
    widen = next(i for i, name in enumerate(names) if name.startswith("z1_widen_"))
    widened = names.index(next(name for name in names if name.startswith("z1_widened_")))
    assert widen < widened < names.index(next(name for name in names if name.startswith("confirm")))
    top = phases[widen].experiments[0].micro_batch_size
    assert 274 < top <= 302 and phases[widen].experiments[0].gradient_accumulation_steps == 1
    assert [(e.micro_batch_size, e.gradient_accumulation_steps) for e in phases[widened].experiments] == [(top // 2, 2)]
    ran_before = sum(len(phase.experiments) for phase in phases[:widen])
    before = max(surface.throughput(*_config_of(r)) for r in records[:ran_before]
                 if r["name"] != PROFILE and r["status"] == "ok" and _config_of(r)[0] == 1)
    widened_value = surface.throughput(1, top // 2, 2)
    assert widened_value > before and widened_value / surface.optimum()[0] >= 0.97


@pytest.mark.parametrize("seed", range(12))
def test_with_max_train_batch_size_no_step_is_widened(seed: int) -> None:
    """max_train_batch_size fixes the step whatever the top: nothing to widen (classic surfaces all
    have one)."""
    phases, _ = _search_on(classic(make_surface("cliff", seed)))
    assert not [phase for phase in phases if "_widen" in phase.name]


def test_a_leader_at_gas_1_widens_nothing() -> None:
    """The law's throughput grows with the size: the leader is the top at the user's gas, which
    already fills the step."""
    settings = SearchSettings(ds_config=USER_CONFIG, capacity_bytes=LAW.capacity, stages=(1,), num_gpus=4,
                              host_memory=True)
    runner = Runner(LAW)
    phases = drive(fast_search(settings), runner)
    winner = best([r for n, r in runner.records.items() if n != PROFILE], "throughput", True)
    assert winner["ds_config"]["gradient_accumulation_steps"] == 1
    assert not [phase for phase in phases if "_widen" in phase.name]
