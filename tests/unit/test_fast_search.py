"""DeepSpeed's fast mode as phases (`scheduler.fast_search`, `scheduler.phases`), driven by a fake runner.

The fake runner is a pure function of the experiment: memory follows a synthetic law (the reference
notes' trace model: params 2 B/param, gradients 4, optimizer 12, ZeRO-sharded, 200 MB of activations
per sample, 1 GiB of overhead, 16 GiB slots), an experiment above the capacity is an OOM, and
throughput follows the traces' cost model. The law differs from our analytical model on purpose
(gradients, overhead), so calibration has something to correct.
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from scheduler.config import load_config
from scheduler.errors import ConfigError
from scheduler.fast_search import (
    PROFILE, NoStageFits, SearchAborted, SearchSettings, fast_search, fine_grained_micro_batch_sizes, gain,
    max_probes, max_train_batch_size_per_gpu, tuning_micro_batch_sizes,
)
from scheduler.memory import ModelInfo
from scheduler.phases import Phase, drive, replay
from scheduler.ranking import best

GiB = 1024**3
N, ACT = 150_000_000, 200_000_000
STAGE_COST_S = (0.0, 0.002, 0.006, 0.03)


@dataclass(frozen=True)
class Law:
    """Synthetic memory and speed of one model on `world` ranks."""

    world: int = 4
    capacity: int = 16 * GiB
    num_params: int = N
    activation: int = ACT
    overhead: int = GiB
    grad_bytes: int = 4

    def memory(self, stage: int, mbs: int) -> int:
        params = 2 * self.num_params / (self.world if stage >= 3 else 1)
        grads = self.grad_bytes * self.num_params / (self.world if stage >= 2 else 1)
        optimizer = 12 * self.num_params / (self.world if stage >= 1 else 1)
        return int(params + grads + optimizer + self.activation * mbs + self.overhead)

    def run(self, exp) -> dict[str, Any]:
        """The record of one experiment: a pure function of it."""
        if exp.name == PROFILE:
            return {"name": exp.name, "status": "ok", "peak_rss_bytes": self.memory(3, 1), "ds_config": exp.ds_config,
                    "metrics": {"num_params": self.num_params, "trainable_num_params": self.num_params,
                                "activation_mem_per_gpu": self.activation}}
        peak = self.memory(exp.stage, exp.micro_batch_size)
        if peak > self.capacity:
            return {"name": exp.name, "status": "oom", "peak_rss_bytes": self.capacity, "ds_config": exp.ds_config}
        step_s = 0.05 + 0.01 * exp.micro_batch_size + STAGE_COST_S[exp.stage]
        latency_s = step_s * exp.gradient_accumulation_steps
        samples = exp.micro_batch_size * exp.gradient_accumulation_steps * self.world
        return {"name": exp.name, "status": "ok", "peak_rss_bytes": peak, "ds_config": exp.ds_config,
                "metrics": {"throughput": samples / latency_s, "latency": latency_s * 1e6, "FLOPS_per_gpu": 1.0}}


LAW = Law()
USER_CONFIG: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": 1,
    "fp16": {"enabled": True},
    "zero_optimization": {"stage": "all", "overlap_comm": True, "offload_optimizer": {"device": "none"}},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
    "autotuning": {"enabled": True, "user_script": "train.py"},
}


def settings(**changes: Any) -> SearchSettings:
    """DeepSpeed's algorithm on host-like memory (no untracked reserve) with the fixed 512 MiB opening
    overhead: these tests pin the probe-and-bisect algorithm; the sampled search has its own below."""
    base = SearchSettings(ds_config=USER_CONFIG, capacity_bytes=LAW.capacity, stages=(0, 1, 2, 3), num_gpus=4,
                          search="deepspeed", host_memory=True, overhead_bytes=512 * 2**20)
    return replace(base, **changes)


class Runner:
    """Runs phases with a law and keeps every record, as the caller would on disk."""

    def __init__(self, law: Law = LAW) -> None:
        self.law, self.records = law, {}

    def __call__(self, phase: Phase) -> dict[str, dict[str, Any]]:
        out = {exp.name: self.law.run(exp) for exp in phase.experiments}
        self.records.update(out)
        return out

    def ooms(self) -> int:
        return sum(record["status"] == "oom" for record in self.records.values())


def run(search_settings: SearchSettings, law: Law = LAW) -> tuple[list[Phase], Runner]:
    runner = Runner(law)
    return drive(fast_search(search_settings), runner), runner


def layout(phases: list[Phase]) -> list[tuple[str, tuple[str, ...]]]:
    return [(phase.name, phase.names) for phase in phases]


# ---------------------------------------------------------------- DeepSpeed's arithmetic (reference 1.8.1-1.8.3)


@pytest.mark.parametrize(
    ("min_mbs", "max_mbs", "gas", "max_tbs", "world", "sizes", "mtbpg"),
    [
        (1, 66, 1, None, 4, [33, 66], 66),
        (1, 66, 2, None, 4, [33, 44, 66], 132),
        (66, 72, 1, None, 4, [72], 72),
        (1, 60, 1, 1024, 4, [30, 40, 50, 60], 256),
    ],
    ids=["gas1", "gas2", "narrow", "max_train_batch_size"],
)
def test_candidate_list_matches_the_reference(min_mbs: int, max_mbs: int, gas: int, max_tbs: int | None,
                                              world: int, sizes: list[int], mtbpg: int) -> None:
    assert max_train_batch_size_per_gpu(max_mbs, gas, world, max_tbs) == mtbpg
    assert tuning_micro_batch_sizes(min_mbs, max_mbs, 3, mtbpg) == sizes


def test_candidate_gas_from_max_train_batch_size() -> None:
    assert [256 // m for m in tuning_micro_batch_sizes(1, 60, 3, 256)] == [8, 6, 5, 4]
    assert tuning_micro_batch_sizes(0, 60, 3, 256) == []


def test_no_mp_division_of_the_per_gpu_batch() -> None:
    assert max_train_batch_size_per_gpu(5, 1, 2, None) == 5  # DeepSpeed: 5 * 1 // mp_size 2 = 2 -> gas 0 at mbs 5


@pytest.mark.parametrize(
    ("predicted", "start", "cap", "failure", "expected"),
    [
        (70, 1, 1024, None, (74, 70, 66)),
        (79, 66, 1024, None, (83, 79, 75)),
        (70, 68, 1024, None, (74, 70)),
        (70, 1, 72, None, (70, 66)),
        (70, 1, 1024, 71, (70, 66)),
        (1, 1, 1024, None, (2,)),
        (20, 1, 1024, None, (21, 20, 19)),
    ],
    ids=["trace-a-z0", "trace-a-z1", "above-start", "cap", "below-failure", "tiny", "twenty"],
)
def test_max_probes(predicted: int, start: int, cap: int, failure: int | None, expected: tuple[int, ...]) -> None:
    assert max_probes(predicted, start, cap, failure) == expected


@pytest.mark.parametrize(
    ("candidates", "min_mbs", "max_mbs", "expected"),
    [([33, 66], 1, 66, [64, 54, 44, 34]), ([72], 66, 72, [70, 68, 66]), ([77], 76, 77, [76])],
    ids=["trace-a-z0", "trace-a-z1", "trace-a-z3"],
)
def test_fine_grained_sizes(candidates: list[int], min_mbs: int, max_mbs: int, expected: list[int]) -> None:
    assert fine_grained_micro_batch_sizes(candidates, min_mbs, max_mbs) == expected


@pytest.mark.parametrize(
    ("previous", "current", "maximize", "expected"),
    [(100, 104, True, 0.04), (100, 110, True, 0.1), (100, 90, False, 0.1), (100, 110, False, -0.1)],
)
def test_gain_follows_the_metric_direction(previous: float, current: float, maximize: bool, expected: float) -> None:
    assert gain(previous, current, maximize) == pytest.approx(expected)


def test_gain_from_zero_is_unbounded() -> None:
    assert gain(0, 5, True) == float("inf")


# ---------------------------------------------------------------- end to end with the fake law

# Hand-derived from the law: true largest sizes are z0 67, z1 73, z2 76, z3 77. The analytical model
# predicts 71 at z0; from then on the fitted line (exact here) is carried to the next stage, shifted
# by the model's difference between stages.
EXPECTED_PHASES = [
    (PROFILE, (PROFILE,)),
    ("z0_min_max", ("z0_gas1_tmbspg1", "z0_gas1_tmbspg75", "z0_gas1_tmbspg71", "z0_gas1_tmbspg67")),
    ("z0_candidates", ("z0_gas2_tmbspg33",)),  # [33, 67]: 67 ran already
    ("z0_fine_56", ("z0_gas1_tmbspg56",)),
    ("z1_min_max", ("z1_gas1_tmbspg67", "z1_gas1_tmbspg73", "z1_gas1_tmbspg69")),  # predicted 69
    ("z1_fine_71", ("z1_gas1_tmbspg71",)),
    ("z2_min_max", ("z2_gas1_tmbspg73", "z2_gas1_tmbspg74")),  # predicted 70: only 74 is above 73
    ("z3_min_max", ("z3_gas1_tmbspg74", "z3_gas1_tmbspg76")),
    ("z3_fine_75", ("z3_gas1_tmbspg75",)),
]


def test_phases_of_the_calibrated_search() -> None:
    phases, runner = run(settings())
    assert layout(phases) == EXPECTED_PHASES
    assert best(list(runner.records.values()), "throughput", True)["name"] == "z1_gas1_tmbspg73"


def test_min_and_max_probes_of_a_stage_share_one_phase() -> None:
    phases, _ = run(settings(estimator="deepspeed"))
    by_name = dict(layout(phases))
    assert by_name["z1_min_max"] == ("z1_gas1_tmbspg66", "z1_gas1_tmbspg83", "z1_gas1_tmbspg79", "z1_gas1_tmbspg75")


@pytest.mark.parametrize("estimator", ["calibrated", "deepspeed"])
def test_no_experiment_is_yielded_twice(estimator: str) -> None:
    phases, runner = run(settings(estimator=estimator))
    names = [name for phase in phases for name in phase.names]
    assert len(names) == len(set(names)) == len(runner.records)


def oom_probe_counts(law: Law = LAW) -> tuple[int, int]:
    """OOM probes of the whole search with the calibrated model and with DeepSpeed's estimate."""
    return run(settings(), law)[1].ooms(), run(settings(estimator="deepspeed"), law)[1].ooms()


def test_calibration_saves_oom_probes() -> None:
    calibrated, deepspeed = oom_probe_counts()
    print(f"OOM probes on the trace law: calibrated {calibrated}, DeepSpeed's estimate {deepspeed}")
    assert (calibrated, deepspeed) == (2, 9), f"calibrated {calibrated}, DeepSpeed {deepspeed}"
    assert calibrated <= deepspeed


def test_deepspeed_estimate_reproduces_trace_a_where_the_algorithm_agrees() -> None:
    phases, _ = run(settings(estimator="deepspeed"))
    by_name = dict(layout(phases))
    assert by_name["z0_min_max"] == ("z0_gas1_tmbspg1", "z0_gas1_tmbspg74", "z0_gas1_tmbspg70", "z0_gas1_tmbspg66")
    assert by_name["z0_candidates"] == ("z0_gas2_tmbspg33",)
    assert by_name["z0_fine_64"] == ("z0_gas1_tmbspg64",)
    # z1: all three max probes fail; the bisection runs 70, which gains < 5 % over 66: plateau.
    assert [name for name, _ in phases_after(layout(phases), "z1_min_max")][:2] == ["z1_bisect_70", "z1_fine_69"]
    assert by_name["z3_min_max"][-1] == "z3_gas1_tmbspg77"
    assert "z3_fine_76" not in by_name  # z3_gas1_tmbspg76 ran as z3's first probe: reused, not rerun


def phases_after(phases: list[tuple[str, tuple[str, ...]]], name: str) -> list[tuple[str, tuple[str, ...]]]:
    index = [n for n, _ in phases].index(name)
    return phases[index + 1:]


# ---------------------------------------------------------------- replay (resume after a crash)


def test_replay_from_stored_records_yields_the_same_phases() -> None:
    phases, runner = run(settings())
    answered, pending = replay(fast_search(settings()), lambda e: runner.records.get(e.name))
    assert pending is None
    assert answered == phases
    assert [[e.ds_config for e in p.experiments] for p in answered] == [[e.ds_config for e in p.experiments]
                                                                         for p in phases]


def test_replay_stops_at_the_first_unfinished_phase_and_continues() -> None:
    phases, runner = run(settings())
    stored = {name: runner.records[name] for phase in phases[:4] for name in phase.names}
    search = fast_search(settings())
    answered, pending = replay(search, lambda e: stored.get(e.name))
    assert answered == phases[:4] and pending == phases[4]
    rest = [pending]
    rest += drive_from(search, pending, Runner())
    assert rest == phases[4:]


def drive_from(search, phase: Phase, runner: Runner) -> list[Phase]:
    out: list[Phase] = []
    try:
        while True:
            phase = search.send(runner(phase))
            out.append(phase)
    except StopIteration:
        return out


# ---------------------------------------------------------------- the search's edges


def test_user_model_info_skips_the_profile_run() -> None:
    phases, _ = run(settings(model_info=ModelInfo(N, N, ACT)))
    assert layout(phases) == EXPECTED_PHASES[1:]


def test_bisection_stops_at_the_plateau() -> None:
    # Activations understated by half: the max probes all run out of memory. From mbs 60 the
    # calibrated line (one point; slope from the analytical intercept to it, larger than the
    # profile's, since the law's overhead is 1 GiB, not 512 MiB) predicts 62; 62 gains < 5 %: stop.
    phases, _ = run(settings(stages=(0,), first_micro_batch_size=60, model_info=ModelInfo(N, N, ACT // 2)))
    assert layout(phases) == [
        ("z0_min_max", ("z0_gas1_tmbspg60", "z0_gas1_tmbspg150", "z0_gas1_tmbspg142", "z0_gas1_tmbspg134")),
        ("z0_bisect_62", ("z0_gas1_tmbspg62",)),
        ("z0_fine_61", ("z0_gas1_tmbspg61",)),
    ]


def test_calibrated_bisection_stops_where_the_fitted_line_ends() -> None:
    phases, runner = run(settings(stages=(0,), model_info=ModelInfo(N, N, ACT // 2)))
    assert [name for name, _ in layout(phases)] == ["z0_min_max", "z0_bisect_67", "z0_candidates", "z0_fine_56"]
    assert runner.ooms() == 3
    deepspeed = run(settings(stages=(0,), model_info=ModelInfo(N, N, ACT // 2), estimator="deepspeed"))[1]
    assert deepspeed.ooms() == 9  # plain bisection: 100, 83, 75, 71, 69, 68 after the three max probes


def test_latency_is_minimised() -> None:
    # Latency per step grows with the batch: the fine-grained search keeps going down while it improves.
    phases, _ = run(settings(stages=(0,), metric="latency", maximize=False, model_info=ModelInfo(N, N, ACT // 2)))
    assert [name for name, _ in layout(phases)][-3:] == ["z0_fine_56", "z0_fine_45", "z0_fine_34"]


def test_a_start_size_that_fails_falls_back_to_the_minimum() -> None:
    phases, _ = run(settings(stages=(0,), first_micro_batch_size=80, model_info=ModelInfo(N, N, ACT)))
    assert layout(phases)[:2] == [
        ("z0_min_max", ("z0_gas1_tmbspg80",)),  # predicted 71: no max probe above 80
        ("z0_min_fallback", ("z0_gas1_tmbspg1", "z0_gas1_tmbspg75", "z0_gas1_tmbspg71", "z0_gas1_tmbspg67")),
    ]


def test_deepspeed_rule_skips_stages_that_cannot_hold_a_larger_batch() -> None:
    # One rank: every stage holds the same states. 1.05 x DeepSpeed's 71 runs, so no later stage can beat 75.
    law = Law(world=1, num_params=500_000_000, activation=100_000_000, overhead=0, grad_bytes=2)
    search = settings(num_gpus=1, model_info=ModelInfo(law.num_params, law.num_params, law.activation),
                      estimator="deepspeed")
    phases, _ = run(search, law)
    assert layout(phases)[0] == ("z0_min_max", ("z0_gas1_tmbspg1", "z0_gas1_tmbspg75", "z0_gas1_tmbspg71",
                                                "z0_gas1_tmbspg67"))
    assert all(name.startswith("z0_") for name, _ in layout(phases))


def test_lost_records_count_as_failures() -> None:
    search = fast_search(settings(stages=(0,), model_info=ModelInfo(N, N, ACT)))
    assert next(search).names == ("z0_gas1_tmbspg1", "z0_gas1_tmbspg75", "z0_gas1_tmbspg71", "z0_gas1_tmbspg67")
    with pytest.raises(StopIteration):
        search.send({})  # nothing came back: the min probe is lost, and 1 is already the minimum


def test_max_train_batch_size_sets_gas_and_caps_the_batch() -> None:
    phases, runner = run(settings(stages=(1,), max_train_batch_size=1024))
    candidates = dict(layout(phases))["z1_candidates"]
    for name in candidates:
        record = runner.records[name]
        config = record["ds_config"]
        mbs, gas = config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]
        assert gas == 256 // mbs and config["train_batch_size"] == mbs * gas * 4 <= 1024
    assert len(candidates) >= 2


def test_user_list_runs_exactly_the_list_per_stage() -> None:
    phases, _ = run(settings(stages=(0, 1), micro_batch_sizes=(2, 4, 8), model_info=ModelInfo(N, N, ACT)))
    assert layout(phases) == [
        ("z0_list", ("z0_gas4_tmbspg2", "z0_gas2_tmbspg4", "z0_gas1_tmbspg8")),
        ("z1_list", ("z1_gas4_tmbspg2", "z1_gas2_tmbspg4", "z1_gas1_tmbspg8")),
    ]


def test_no_stage_fits_says_by_how_much() -> None:
    # Stage 3 is the closest: 6e8 of states + 512 MiB overhead + 2e8 activations = 1336870912 bytes.
    with pytest.raises(NoStageFits, match="stage 3 needs about 1.25 GiB") as caught:
        next(fast_search(settings(capacity_bytes=GiB, model_info=ModelInfo(N, N, ACT))))
    assert caught.value.shortfall_bytes == 1336870912 - GiB


@pytest.mark.parametrize(("status", "message"), [("oom", "ran out of memory"), ("crashed", "ended 'crashed'")])
def test_a_failed_profile_run_aborts(status: str, message: str) -> None:
    search = fast_search(settings())
    phase = next(search)
    assert phase.names == (PROFILE,)
    with pytest.raises(SearchAborted, match=message):
        search.send({PROFILE: {"name": PROFILE, "status": status}})


def test_configs_come_from_the_user_config_unchanged() -> None:
    before = copy.deepcopy(USER_CONFIG)
    phases, _ = run(settings())
    assert USER_CONFIG == before
    profile = phases[0].experiments[0].ds_config
    assert profile["autotuning"]["model_info"] == {"profile": True} and profile["memory_breakdown"] is False
    assert profile["zero_optimization"]["stage"] == 3 and profile["train_micro_batch_size_per_gpu"] == 1
    assert phases[0].experiments[0].space == PROFILE  # not counted in z3's summary row
    for exp in (e for phase in phases[1:] for e in phase.experiments):
        zero = exp.ds_config["zero_optimization"]
        assert zero["stage"] == exp.stage and zero["overlap_comm"] is True
        assert zero["offload_optimizer"] == {"device": "none"}
        assert exp.ds_config["optimizer"] == USER_CONFIG["optimizer"]
        assert "user_script" not in exp.ds_config["autotuning"]


# ---------------------------------------------------------------- settings from a TuningConfig


def tuning_config(tmp_path: Path, data: dict[str, Any]):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(data))
    return load_config(path, cwd=tmp_path)


def test_settings_from_config_defaults(tmp_path: Path) -> None:
    cfg = tuning_config(tmp_path, USER_CONFIG)
    found = SearchSettings.from_config(cfg, capacity_bytes=GiB, num_nodes=1, num_gpus=4, device_kind="cpu")
    assert (found.stages, found.metric, found.maximize) == ((0, 1, 2, 3), "throughput", True)
    assert (found.min_micro_batch_size, found.max_micro_batch_size, found.max_train_batch_size) == (1, 1024, None)
    assert (found.num_tuning_micro_batch_sizes, found.mp_size, found.model_info) == (3, 1, None)
    assert (found.first_micro_batch_size, found.micro_batch_sizes) == (1, ())
    assert found.host_memory and found.peak_memory_key == "peak_rss_bytes"
    assert found.micro_batch_cap == 1024


def test_settings_from_config_reads_autotuning(tmp_path: Path) -> None:
    data = copy.deepcopy(USER_CONFIG)
    data["train_micro_batch_size_per_gpu"] = [8, 2]
    data["autotuning"].update(max_train_batch_size=64, mp_size=2, num_tuning_micro_batch_sizes=4,
                              max_train_micro_batch_size_per_gpu=128, min_train_micro_batch_size_per_gpu=2,
                              model_info={"num_params": 10, "activation_mem_per_gpu": 3})
    found = SearchSettings.from_config(tuning_config(tmp_path, data), capacity_bytes=GiB, num_nodes=2, num_gpus=2)
    assert found.micro_batch_sizes == (2, 8) and found.dp_size == 2
    assert (found.max_train_batch_size, found.num_tuning_micro_batch_sizes) == (64, 4)
    assert found.micro_batch_cap == 32  # 64 samples over 2 data-parallel ranks
    assert found.model_info == ModelInfo(10, 10, 3)
    assert not found.host_memory and found.peak_memory_key == "peak_device_bytes"


@pytest.mark.parametrize(
    ("autotuning", "message"),
    [
        ({"max_train_batch_size": 0}, "max_train_batch_size must be"),
        ({"num_tuning_micro_batch_sizes": "3"}, "num_tuning_micro_batch_sizes must be"),
        ({"min_train_micro_batch_size_per_gpu": 9, "max_train_micro_batch_size_per_gpu": 8}, "make min <= max"),
        ({"mp_size": 3}, "must divide the GPUs"),
    ],
)
def test_settings_from_config_rejects_bad_values(tmp_path: Path, autotuning: dict[str, Any], message: str) -> None:
    data = copy.deepcopy(USER_CONFIG)
    data["autotuning"].update(autotuning)
    with pytest.raises(ConfigError, match=message):
        SearchSettings.from_config(tuning_config(tmp_path, data), capacity_bytes=GiB, num_nodes=1, num_gpus=4)


# ---------------------------------------------------------------- full mode: ZeRO knobs through a tuner


@dataclass(frozen=True)
class KnobLaw(Law):
    """Like Law, but overlap_comm and a larger reduce bucket really are faster: full mode has a point."""

    def run(self, exp) -> dict[str, Any]:
        record = super().run(exp)
        zero = exp.ds_config.get("zero_optimization", {})
        if record.get("metrics") and "throughput" in record["metrics"]:
            bonus = 1.0 + 0.1 * bool(zero.get("overlap_comm")) + 1e-10 * float(zero.get("reduce_bucket_size", 0))
            record["metrics"] = {**record["metrics"], "throughput": record["metrics"]["throughput"] * bonus}
        return record


def full_settings(tmp_path: Path, tuner_type: str, trials: int, concurrency: int = 2) -> SearchSettings:
    user = {**USER_CONFIG, "zero_optimization": {"stage": [0, 1]},
            "autotuning": {**USER_CONFIG["autotuning"], "fast": False, "tuner_type": tuner_type,
                           "tuner_num_trials": trials, "tuner_early_stopping": 50,
                           "model_info": {"num_params": N, "trainable_num_params": N,
                                          "activation_mem_per_gpu": ACT}}}
    cfg = tuning_config(tmp_path, user)
    return SearchSettings.from_config(cfg, capacity_bytes=LAW.capacity, num_nodes=1, num_gpus=4,
                                      concurrency=concurrency)


@pytest.mark.parametrize("tuner_type", ["gridsearch", "random", "model_based"])
def test_full_mode_tunes_zero_knobs_of_stage_1_after_its_fast_search(tmp_path: Path, tuner_type: str) -> None:
    search_settings = full_settings(tmp_path, tuner_type, trials=5)
    assert not search_settings.fast
    runner = Runner(KnobLaw())
    phases = drive(fast_search(search_settings), runner)
    trial_phases = [p for p in phases if "_trial" in p.name]
    assert trial_phases, layout(phases)
    assert all(p.name.startswith("z1_") for p in trial_phases)  # stage 0 is never full-tuned
    assert all(len(p.experiments) <= 2 for p in trial_phases)  # batches as wide as the slots allow
    assert sum(len(p.experiments) for p in trial_phases) == 5  # the trial cap, exactly
    assert {exp.space for p in trial_phases for exp in p.experiments} == {trial_phases[0].experiments[0].space}
    # replaying from the stored records asks for nothing new (resume after a crash)
    again = drive(fast_search(search_settings), lambda phase: {e.name: runner.records[e.name] for e in phase.experiments})
    assert layout(again) == layout(phases)


def test_fast_mode_never_runs_trials(tmp_path: Path) -> None:
    fast = replace(full_settings(tmp_path, "gridsearch", trials=5), fast=True)
    assert not [p for p in run(fast, KnobLaw())[0] if "_trial" in p.name]
