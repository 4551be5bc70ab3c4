"""DeepSpeed's fast mode as phases (`scheduler.search.fast_search`, `scheduler.search.phases`), driven by a fake runner.

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

from scheduler.inputs.config import load_config
from scheduler.errors import ConfigError
from scheduler.inputs.search_keys import parse_search_keys
from scheduler.search.fast_search import (
    PROFILE, fast_search, fine_grained_micro_batch_sizes, gain, max_probes, max_train_batch_size_per_gpu,
    tuning_micro_batch_sizes,
)
from scheduler.search.memory import ModelInfo
from scheduler.search.phases import Phase, drive, replay
from scheduler.search.ranking import best
from scheduler.search.repeats import says_nothing
from scheduler.search.session import NoStageFits, SearchAborted, SearchSettings, too_large

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
    # no flat gradient bucket: the law has none (scheduler.search.memory's bucket term: test_memory)
    "zero_optimization": {"stage": "all", "overlap_comm": True, "contiguous_gradients": False,
                          "offload_optimizer": {"device": "none"}},
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


# ---------------------------------------------------------------- DeepSpeed's arithmetic at its edges


@pytest.mark.parametrize(
    ("predicted", "start", "cap", "failure", "expected"),
    [(70, 1, 1024, 74, (70, 66)), (70, 1, 1024, 70, (66,))],
    ids=["failure-74-bounds-to-73", "failure-at-the-prediction"],
)
def test_max_probes_stay_below_the_smallest_failure(predicted: int, start: int, cap: int, failure: int,
                                                    expected: tuple[int, ...]) -> None:
    # ceil(1.05 * 70) = 74, 70, int(0.95 * 70) = 66; a size that failed bounds them to failure - 1.
    assert max_probes(predicted, start, cap, failure) == expected


def test_mtbpg_from_max_train_batch_size_is_a_whole_number() -> None:
    assert max_train_batch_size_per_gpu(60, 1, 4, 1022) == 255  # 1022 // 4, never 255.5


@pytest.mark.parametrize(
    ("min_mbs", "max_mbs", "mtbpg", "sizes"),
    [
        (1, 0, 0, []),  # DeepSpeed: min <= 0 or max <= 0 -> no list
        (1, 1, 1, [1]),  # low = max(1, 0) = 1, range(1, 1) is empty: only max
        (4, 6, 30, [4, 5, 6]),  # stride (6 - 4) // 3 = 0 -> 1; gas 7, 6, 5: all differ
        (1, 60, 70, [30, 60]),  # min_gas = 70 // 60 = 1; 40 and 50 have gas 1 too, dropped
    ],
    ids=["max-zero", "max-one", "stride-floor-one", "min-gas-is-floored"],
)
def test_candidate_list_edges(min_mbs: int, max_mbs: int, mtbpg: int, sizes: list[int]) -> None:
    assert tuning_micro_batch_sizes(min_mbs, max_mbs, 3, mtbpg) == sizes


@pytest.mark.parametrize(("status", "bound"), [("oom", True), ("crashed", False), ("timeout", False),
                                               ("lost", False), ("rendezvous_failed", False), ("ok", False)])
def test_only_an_out_of_memory_is_a_memory_bound(status: str, bound: bool) -> None:
    """On a GPU node most other failures are infrastructure."""
    assert too_large({"status": status}) is bound


@pytest.mark.parametrize(("fields", "bound"), [
    ({}, True), ({"device_foreign_bytes": 0, "device_foreign_after_bytes": None}, True),
    ({"device_foreign_bytes": 20 * 2**30}, False), ({"device_foreign_after_bytes": 8 * 2**30}, False),
])
def test_an_out_of_memory_beside_others_memory_is_no_bound(fields: dict, bound: bool) -> None:
    """Others' memory on the GPU when the run started, or still there a wait after
    its ranks ended (workers.state.slot_health), may have been what ran out; the search retries instead."""
    record = {"status": "oom", **fields}
    assert too_large(record) is bound
    assert says_nothing(record) is not bound


def test_gas_for_keeps_each_step_within_max_train_batch_size() -> None:
    limited = settings(max_train_batch_size=1024)  # 4 data-parallel ranks: 256 samples per GPU and step
    assert (limited.samples_per_step, limited.gas_for(60), limited.gas_for(300)) == (256, 4, 1)
    assert settings(gradient_accumulation_steps=3).gas_for(60) == 3  # no limit: the user's gas


# ---------------------------------------------------------------- the memory gate and the overhead it assumes

GPU_RESERVE = GiB  # memory.untracked_reserve_bytes: max(1 GiB, 2.5 %) for slots up to 40 GiB
PROFILE_METRICS = {"num_params": N, "trainable_num_params": N, "activation_mem_per_gpu": ACT}


def no_stage_fits(search_settings: SearchSettings, profile_peak: int | None = None,
                  **profile_fields: int) -> NoStageFits:
    """The NoStageFits the search raises, at its start or after its profile run measured `profile_peak`
    (and `profile_fields` in its record)."""
    search = fast_search(search_settings)
    with pytest.raises(NoStageFits) as caught:
        phase = next(search)
        assert phase.names == (PROFILE,)
        search.send({PROFILE: {"name": PROFILE, "status": "ok", "peak_device_bytes": profile_peak,
                               "metrics": PROFILE_METRICS, **profile_fields}})
    return caught.value


def test_no_stage_fits_message_in_full() -> None:
    # Stage 3 (closest): 6e8 of states + 512 MiB of host overhead + 2e8 activations = 1336870912 bytes.
    error = no_stage_fits(settings(capacity_bytes=GiB, model_info=ModelInfo(N, N, ACT)))
    assert str(error) == ("no allowed ZeRO stage fits micro-batch 1 in the slots' 1.00 GiB: stage 3 needs about "
                          "1.25 GiB, 0.25 GiB more; use slots with more memory, more GPUs per experiment, offload, "
                          "or allow a higher zero_optimization.stage")


def test_no_stage_fits_after_the_profile_says_only_the_profile_could_tell() -> None:
    """Given model_info, the refusal comes before anything starts (the command takes the
    search's first step); measured by the profile run, it comes later and says so, and that the
    profile's record is kept for the next run."""
    upfront = str(no_stage_fits(settings(capacity_bytes=GiB, model_info=ModelInfo(N, N, ACT))))
    later = str(no_stage_fits(settings(capacity_bytes=GiB, model_info=None, peak_memory_key="peak_device_bytes"),
                              2 * GiB))
    assert "profile run" not in upfront
    assert later.startswith("no allowed ZeRO stage fits micro-batch 1")
    assert later.endswith(f"(known only from the profile run's measurement: {PROFILE}'s record stays in the "
                          "results folder, and the next run with this config reuses it)")


@pytest.mark.parametrize(
    ("host_memory", "capacity", "profile_peak", "required", "budget"),
    [
        # measured: the profile's 1.3e9 peak less 6e8 of states and 2e8 of activations = 5e8 of overhead
        (False, 2 * GiB, 1_300_000_000, 1_300_000_000, 2 * GiB - GPU_RESERVE),
        # measured at or below the states: overhead 0, so stage 3 needs exactly its states + activations
        (False, 3 * GiB // 2, 700_000_000, 800_000_000, 3 * GiB // 2 - GPU_RESERVE),
        # unmeasured on a GPU: the prior max(2 GiB, 6 %) less the 1 GiB reserve the budget already drops
        (False, 2 * GiB, None, 800_000_000 + GiB, 2 * GiB - GPU_RESERVE),
        # unmeasured on host memory: 512 MiB, no reserve
        (True, GiB, None, 800_000_000 + 512 * 2**20, GiB),
    ],
    ids=["profile-peak", "profile-peak-below-states", "gpu-prior", "host-prior"],
)
def test_overhead_from_the_profile_peak_or_the_prior(host_memory: bool, capacity: int, profile_peak: int | None,
                                                     required: int, budget: int) -> None:
    search_settings = settings(host_memory=host_memory, capacity_bytes=capacity, overhead_bytes=None,
                               peak_memory_key="peak_device_bytes",
                               model_info=None if profile_peak else ModelInfo(N, N, ACT))
    error = no_stage_fits(search_settings, profile_peak)
    assert error.shortfall_bytes == required - budget
    assert f"stage 3 needs about {required / GiB:.2f} GiB" in str(error)


@pytest.mark.parametrize(
    ("host_memory", "capacity", "fields", "reserve"),
    [
        (False, 2 * GiB, {"device_untracked_bytes": 3 * GiB // 2}, 3 * GiB // 2),  # NCCL took more than the guess
        (False, 2 * GiB, {"device_untracked_bytes": GiB // 2}, GPU_RESERVE),  # less: the guess stands (lazy NCCL)
        # a notebook's 1 GiB was on the GPU too: not the job's, not its reserve
        (False, 2 * GiB, {"device_untracked_bytes": 3 * GiB // 2, "device_foreign_bytes": GiB}, GPU_RESERVE),
        (True, GiB, {"device_untracked_bytes": 3 * GiB // 2}, 0),  # host memory has no untracked reserve
        # per rank, net of each rank's own GPU's foreign memory (workers.slot.records): that figure decides
        (False, 2 * GiB, {"device_untracked_bytes": 3 * GiB // 2, "device_foreign_bytes": GiB,
                          "device_own_untracked_bytes": 3 * GiB // 2}, 3 * GiB // 2),
    ],
    ids=["measured-larger", "measured-smaller", "foreign-memory-left-out", "host-memory", "per-rank-figure"],
)
def test_the_reserve_the_profile_run_measured_replaces_a_smaller_guess(host_memory: bool, capacity: int,
                                                                       fields: dict[str, int], reserve: int) -> None:
    """What the profile's ranks held outside the allocator (total - free - reserved)
    is the job's reserve when it is more than max(1 GiB, 2.5 %)."""
    search_settings = settings(host_memory=host_memory, capacity_bytes=capacity, overhead_bytes=None,
                               peak_memory_key="peak_device_bytes", model_info=None)
    error = no_stage_fits(search_settings, 1_300_000_000, **fields)
    assert error.shortfall_bytes == 1_300_000_000 - (capacity - reserve)


@pytest.mark.parametrize(
    ("host_memory", "fields", "capacity"),
    [
        (False, {"device_total_bytes": 2 * GiB - GiB // 2}, 2 * GiB - GiB // 2),  # the driver kept 0.5 GiB
        (False, {"device_total_bytes": 3 * GiB}, 2 * GiB),  # more than the slot says: the slot's figure stands
        (False, {}, 2 * GiB),  # not measured
        (True, {"device_total_bytes": GiB}, 2 * GiB),  # host memory: no device total
    ],
    ids=["measured-smaller", "measured-larger", "unmeasured", "host-memory"],
)
def test_the_capacity_cuda_reported_to_the_profile_replaces_a_larger_listing(host_memory: bool,
                                                                             fields: dict[str, int],
                                                                             capacity: int) -> None:
    """The memory.total of nvidia-smi counts what the driver keeps; the profile's ranks
    read what the allocator can have (`torch.cuda.mem_get_info`'s total)."""
    search_settings = settings(host_memory=host_memory, capacity_bytes=2 * GiB, overhead_bytes=None,
                               peak_memory_key="peak_device_bytes", model_info=None)
    error = no_stage_fits(search_settings, 2_300_000_000, **fields)
    reserve = 0 if host_memory else GPU_RESERVE
    assert error.shortfall_bytes == 2_300_000_000 - (capacity - reserve)
    assert f"in the slots' {(capacity - reserve) / GiB:.2f} GiB" in str(error)  # what peaks may reach


def test_deepspeed_estimator_gates_stages_with_deepspeeds_formula() -> None:
    # DeepSpeed (reference 1.7), fp16 on 4 GPUs: stage 3 holds (2 + 2 + 16) * 1.5e8 / 4 = 7.5e8, plus 2e8 of
    # activations; a stage is tried when the memory is strictly larger, so 950000001 bytes are needed.
    error = no_stage_fits(settings(estimator="deepspeed", capacity_bytes=GiB // 2, model_info=ModelInfo(N, N, ACT)))
    assert error.shortfall_bytes == 950_000_001 - GiB // 2
    assert "in the slots' 0.50 GiB: stage 3 needs about 0.88 GiB, 0.38 GiB more" in str(error)


# ---------------------------------------------------------------- the profile run

OOM_MESSAGE = (f"the model-info profile run {PROFILE} (ZeRO-3, micro-batch 1) ran out of memory: the model fits these "
               "slots at no stage; use slots with more memory, more GPUs per experiment, or "
               "zero_optimization.offload_param / offload_optimizer")


def ended_message(status: str) -> str:
    return (f"the model-info profile run {PROFILE} ended '{status}' without num_params and activation_mem_per_gpu; "
            f"see {PROFILE}/stderr.log in the results folder, or give them in autotuning.model_info")


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        ({PROFILE: {"name": PROFILE, "status": "oom"}}, OOM_MESSAGE),
        ({PROFILE: {"name": PROFILE, "status": "crashed", "metrics": PROFILE_METRICS}}, ended_message("crashed")),
        ({PROFILE: {"name": PROFILE}}, ended_message("lost")),  # a record without a status
        ({}, ended_message("lost")),  # no record came back at all
    ],
    ids=["oom", "crashed-with-metrics", "no-status", "no-record"],
)
def test_a_failed_profile_run_aborts_with_the_whole_message(answer: dict[str, Any], message: str) -> None:
    # A crashed run's metrics are not trusted, even when model_info.json was written before the crash.
    search = fast_search(settings())
    next(search)
    with pytest.raises(SearchAborted) as caught:
        search.send(answer)
    assert str(caught.value) == message


def test_the_profile_experiment() -> None:
    search = fast_search(settings(num_nodes=2, num_gpus=2, start_profile_step=4, end_profile_step=9))
    [exp] = next(search).experiments
    assert (exp.name, exp.stage, exp.micro_batch_size, exp.gradient_accumulation_steps) == (PROFILE, 3, 1, 1)
    assert (exp.num_nodes, exp.num_gpus, exp.space, exp.metric_file) == (2, 2, PROFILE, "model_info.json")
    config = exp.ds_config
    assert (config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"],
            config["train_batch_size"]) == (1, 1, 4)  # 1 x 1 x 4 data-parallel ranks
    assert (config["autotuning"]["start_profile_step"], config["autotuning"]["end_profile_step"]) == (4, 9)


def test_search_experiments_carry_the_slots_and_the_profile_steps() -> None:
    search = fast_search(settings(num_nodes=2, num_gpus=2, start_profile_step=4, end_profile_step=9,
                                  model_info=ModelInfo(N, N, ACT)))
    exp = next(search).experiments[0]
    assert (exp.name, exp.num_nodes, exp.num_gpus) == ("z0_gas1_tmbspg1", 2, 2)
    autotuning = exp.ds_config["autotuning"]
    assert (autotuning["start_profile_step"], autotuning["end_profile_step"]) == (4, 9)


# ---------------------------------------------------------------- scripted outcomes: which sizes run, and how fast


class Table:
    """A runner's answers from a table: a size runs iff it is at most `limits[stage]` (else `oom`); its
    metric is `values[(stage, mbs)]`, by default the size itself (bigger batches are faster), its
    inverse 1000 / value for latency, or none at all with `reports_metric=False`. With the DeepSpeed
    estimator nothing is learnt from peaks, so the probes follow from DeepSpeed's formula alone: on the
    trace model it predicts z0 70, z1 79, z2 81, z3 82 (reference 1.7)."""

    def __init__(self, limits: dict[int, int], values: dict[tuple[int, int], float] | None = None,
                 metric: str = "throughput", reports_metric: bool = True,
                 crashed: frozenset[str] = frozenset()) -> None:
        self.limits, self.values, self.metric, self.reports_metric = limits, values or {}, metric, reports_metric
        self.crashed = crashed  #: experiment names that crash whatever their size

    def run(self, exp) -> dict[str, Any]:
        record = {"name": exp.name, "ds_config": exp.ds_config}
        if exp.name in self.crashed:
            return {**record, "status": "crashed"}
        if exp.micro_batch_size > self.limits.get(exp.stage, 0):
            return {**record, "status": "oom"}
        if not self.reports_metric:
            return {**record, "status": "ok", "metrics": {}}
        value = self.values.get((exp.stage, exp.micro_batch_size), float(exp.micro_batch_size))
        if self.metric == "latency":  # the same ranking, minimised: 1000 / value
            value = 1000.0 / value
        return {**record, "status": "ok", "metrics": {self.metric: value}}


def scripted(table: Table, **changes: Any) -> list[tuple[str, tuple[str, ...]]]:
    search_settings = settings(estimator="deepspeed", model_info=ModelInfo(N, N, ACT), **changes)
    return layout(run(search_settings, table)[0])


def one(stage: int, label: str, *sizes: int, gas: int = 1) -> tuple[str, tuple[str, ...]]:
    return f"z{stage}_{label}", tuple(f"z{stage}_gas{gas}_tmbspg{m}" for m in sizes)


#: z0 with only sizes up to 40 running: the three max probes fail, so the binary search runs from 1.
BISECT_FROM_ONE = [
    one(0, "min_max", 1, 74, 70, 66),
    one(0, "bisect_33", 33),  # (1 + 1 + 65) // 2 under the smallest failure, 66
    one(0, "bisect_49", 49),
    one(0, "bisect_41", 41),
    one(0, "bisect_37", 37),
    one(0, "bisect_39", 39),
]


@pytest.mark.parametrize(
    ("at_38", "fine"),
    [(105.0, [38]), (90.0, [38]), (120.0, [38, 32])],
    ids=["exactly-5-percent-better-stops", "worse-stops", "more-than-5-percent-better-goes-on"],
)
def test_bisection_and_fine_search_plateau_rules(at_38: float, fine: list[int]) -> None:
    # Bisection (reference 1.8.1): stop when (metric - previous) / previous < 0.05. 33 gains 900 % over 1;
    # 37 gains exactly 5 %: not a plateau, go on; 39 is worse: stop. Candidates for (1, 39) with mtbpg 39:
    # low 19, stride 6 -> 19, 25, 31, 37, of which only 19 has gas 39 // 19 = 2 != 1: [19, 39].
    # Fine search (1.8.3) down from 39 over range(20, 39, 6) reversed: 38, 32, ...; go on only while the
    # metric beats the best by more than 5 %.
    values = {(0, 1): 10.0, (0, 33): 100.0, (0, 37): 105.0, (0, 39): 100.0, (0, 38): at_38}
    phases = scripted(Table({0: 40}, values), stages=(0,))
    assert phases == BISECT_FROM_ONE + [one(0, "candidates", 19, gas=2)] + [one(0, f"fine_{m}", m) for m in fine]


def test_without_a_metric_the_bisection_still_ends_at_the_largest_size_that_runs() -> None:
    # No plateau can be judged, so the bisection goes on until low meets high: 33, 49 x, 41 x, 37, 39, 40.
    # Candidates for (1, 40): [20, 40]; no fine search without a metric. No experiment is z0's best, so
    # nothing is carried: z1 starts from the user's size again (probes 83, 79, 75).
    phases = scripted(Table({0: 40, 1: 50}, reports_metric=False), stages=(0, 1))
    assert phases[:9] == BISECT_FROM_ONE + [one(0, "bisect_40", 40), one(0, "candidates", 20, gas=2),
                                            one(1, "min_max", 1, 83, 79, 75)]


def test_a_stage_where_nothing_ran_carries_nothing() -> None:
    # User mbs 4. z0 runs nothing: 4 and its probes fail, then the minimum 1 alone (the probes must stay
    # under 4, the smallest failure). z1 is then the first explored stage: it starts at 4 again, falls
    # back to 1, which runs, and bisects up to 3 (2 fails). z2 starts from z1's largest size, 1.
    phases = scripted(Table({0: 0, 1: 1, 2: 50}), stages=(0, 1, 2), first_micro_batch_size=4)
    assert phases[:6] == [
        one(0, "min_max", 4, 74, 70, 66), one(0, "min_fallback", 1),
        one(1, "min_max", 4, 83, 79, 75), one(1, "min_fallback", 1), one(1, "bisect_2", 2),
        one(2, "min_max", 1, 86, 81, 76),  # ceil(1.05 * 81) = 86, 81, int(0.95 * 81) = 76
    ]


def test_a_failed_start_bounds_the_fallbacks_max_probes() -> None:
    # User mbs 70 (the law runs up to 67): 70 and the probes above it from the analytical 71 (75, 71) run out
    # of memory. The fallback's prediction is bounded by the smallest OOM: 69, so ceil(1.05 * 69) = 73
    # would be probed, but 70 already failed: only 69 and 65 (int(0.95 * 69)) run with 1. Then 65 is the
    # largest: candidates [32, 65] (low 32, stride 11) and the fine search's first step, 63, is slower.
    phases, _ = run(settings(stages=(0,), first_micro_batch_size=70, model_info=ModelInfo(N, N, ACT)))
    assert layout(phases) == [one(0, "min_max", 70, 75, 71), one(0, "min_fallback", 1, 69, 65),
                              one(0, "candidates", 32, gas=2), one(0, "fine_63", 63)]


def test_max_train_micro_batch_size_caps_every_stage() -> None:
    # Cap 8: z0 probes 8 and 7 (ceil(1.05 * 8) = 9 is above the cap), candidates [4, 8] for mtbpg 8 and no
    # fine probe (7 ran). Each later stage can hold 8 (not less than the previous max: tuned, as DeepSpeed
    # tunes when calc >= prev_max), starts at 8, and has nothing above it to probe.
    phases, _ = run(settings(max_micro_batch_size=8, model_info=ModelInfo(N, N, ACT)))
    assert layout(phases) == [one(0, "min_max", 1, 8, 7), one(0, "candidates", 4, gas=2),
                              one(1, "min_max", 8), one(2, "min_max", 8), one(3, "min_max", 8)]


def test_calibrated_bisection_uses_the_unmargined_line_above_the_margined_one() -> None:
    # Start 64 runs; the analytical max probes (half the activations: 150, 142, 134) run out of memory.
    # One measured point, peak(64) = 3773741824 + 64 * 2e8, gives the slope (peak - 2936870912) / 64 =
    # 213076108 (2936870912: the model's z0 states + 512 MiB). Under 95 % of 16 GiB the line ends at 62,
    # below 64, which ran; under 100 % at 66. So the bisection probes min(99, 66) = 66 (runs, < 5 % gain);
    # candidates for (64, 66) are [66], and the fine search from 66 tries 65.
    phases, _ = run(settings(stages=(0,), first_micro_batch_size=64, model_info=ModelInfo(N, N, ACT // 2)))
    assert layout(phases) == [one(0, "min_max", 64, 150, 142, 134), one(0, "bisect_66", 66), one(0, "fine_65", 65)]


def test_candidates_and_fine_search_take_gas_from_max_train_batch_size() -> None:
    # 1024 samples over 4 ranks: mtbpg 256, cap 256. z1 analytical max 77 -> probes 81, 77, 73; the law
    # runs up to 73. Candidates from low 36, stride 12: 36, 48, 60, 72 with gas 7, 5, 4, 3 (72 dropped:
    # 256 // 73 is 3 too), plus 73 at gas 3. Fine search from 73 at gas 3: range(61, 73, 4) reversed: 69,
    # which is slower: stop.
    phases, _ = run(settings(stages=(1,), max_train_batch_size=1024, model_info=ModelInfo(N, N, ACT)))
    assert layout(phases) == [
        one(1, "min_max", 1, 81, 77, 73),
        ("z1_candidates", ("z1_gas7_tmbspg36", "z1_gas5_tmbspg48", "z1_gas4_tmbspg60", "z1_gas3_tmbspg73")),
        one(1, "fine_69", 69, gas=3),
    ]


# ---------------------------------------------------------------- settings from a TuningConfig: every field


def test_settings_from_config_reads_every_field(tmp_path: Path) -> None:
    data = copy.deepcopy(USER_CONFIG)
    data.update(train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2)
    data["autotuning"].update(metric="latency", start_profile_step=2, end_profile_step=7, search="deepspeed",
                              min_train_micro_batch_size_per_gpu=2, max_train_micro_batch_size_per_gpu=64,
                              fast=False, tuner_type="random", tuner_num_trials=9, tuner_early_stopping=7,
                              tuner_seed=11)
    cfg = tuning_config(tmp_path, data)
    found = SearchSettings.from_config(cfg, capacity_bytes=GiB, num_nodes=1, num_gpus=4, estimator="deepspeed",
                                       concurrency=3)
    assert (found.metric, found.maximize, found.start_profile_step, found.end_profile_step) == ("latency", False, 2, 7)
    assert (found.gradient_accumulation_steps, found.first_micro_batch_size, found.micro_batch_sizes) == (2, 4, ())
    assert (found.min_micro_batch_size, found.max_micro_batch_size) == (2, 64)
    assert (found.estimator, found.search, found.fast) == ("deepspeed", "deepspeed", False)
    assert (found.tuner_type, found.tuner_num_trials, found.tuner_early_stopping, found.tuner_seed) == (
        "random", 9, 7, 11)
    assert (found.concurrency, found.capacity_bytes) == (3, GiB)
    assert found.tuning_config is cfg and found.ds_config is cfg.ds_config


def test_settings_from_config_defaults_of_the_search(tmp_path: Path) -> None:
    found = SearchSettings.from_config(tuning_config(tmp_path, USER_CONFIG), capacity_bytes=GiB, num_nodes=1,
                                       num_gpus=4)
    assert (found.estimator, found.search, found.fast) == ("calibrated", "sampled", True)
    assert (found.tuner_type, found.tuner_num_trials, found.tuner_early_stopping, found.tuner_seed) == (
        "gridsearch", 50, 5, 0)  # DeepSpeed's defaults
    assert (found.concurrency, found.start_profile_step, found.end_profile_step) == (1, 3, 5)
    no_slot = SearchSettings.from_config(tuning_config(tmp_path, USER_CONFIG), capacity_bytes=GiB, num_nodes=1,
                                         num_gpus=4, concurrency=0)
    assert no_slot.concurrency == 1


def test_min_equal_to_max_micro_batch_size_is_accepted(tmp_path: Path) -> None:
    data = copy.deepcopy(USER_CONFIG)
    data["autotuning"].update(min_train_micro_batch_size_per_gpu=8, max_train_micro_batch_size_per_gpu=8)
    found = SearchSettings.from_config(tuning_config(tmp_path, data), capacity_bytes=GiB, num_nodes=1, num_gpus=4)
    assert (found.min_micro_batch_size, found.max_micro_batch_size, found.micro_batch_cap) == (8, 8, 8)


@pytest.mark.parametrize(
    ("autotuning", "num_gpus", "message"),
    [
        ({"min_train_micro_batch_size_per_gpu": 9, "max_train_micro_batch_size_per_gpu": 8}, 4,
         "autotuning.min_train_micro_batch_size_per_gpu (9) is above max_train_micro_batch_size_per_gpu (8); "
         "make min <= max"),
        ({"mp_size": 3}, 2, "autotuning.mp_size (3) must divide the GPUs of one experiment (4)"),  # 2 nodes x 2
        ({"search": "bogus"}, 4, "autotuning.search 'bogus' is not one of sampled, deepspeed"),
    ],
    ids=["min-above-max", "mp-size", "search"],
)
def test_settings_from_config_errors_name_the_file_and_the_fix(tmp_path: Path, autotuning: dict[str, Any],
                                                               num_gpus: int, message: str) -> None:
    data = copy.deepcopy(USER_CONFIG)
    data["autotuning"].update(autotuning)
    with pytest.raises(ConfigError) as caught:  # where the config is read, or (mp_size) where it meets the slots
        cfg = tuning_config(tmp_path, data)
        SearchSettings.from_config(cfg, capacity_bytes=GiB, num_nodes=2 if num_gpus == 2 else 1, num_gpus=num_gpus)
    assert str(caught.value) == f"{tmp_path / 'ds_config.json'}: {message}"


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("max_train_batch_size", 0, "must be a positive integer, got 0"),
        ("num_tuning_micro_batch_sizes", "3", 'must be a positive integer, got "3"'),
        ("mp_size", True, "must be a positive integer, got true"),
        ("min_train_micro_batch_size_per_gpu", 2.5, "must be a positive integer, got 2.5"),
        ("max_train_micro_batch_size_per_gpu", 0, "must be a positive integer, got 0"),
        ("tuner_num_trials", -1, "must be a positive integer, got -1"),
        ("tuner_early_stopping", -1, "must be a non-negative integer, got -1"),
        ("tuner_seed", "7", 'must be a non-negative integer, got "7"'),
        ("tuner_type", "bayes", "'bayes' is not one of gridsearch, random, model_based"),
    ],
)
def test_the_search_keys_are_checked_where_the_config_is_read(tmp_path: Path, key: str, value: Any,
                                                               message: str) -> None:
    # load_config's schema refuses these first; the typed keys meet the same checks on any section.
    cfg = tuning_config(tmp_path, USER_CONFIG)
    data = copy.deepcopy(USER_CONFIG)
    data["autotuning"][key] = value
    with pytest.raises(ConfigError) as caught:
        parse_search_keys(cfg.path, data["autotuning"])
    assert str(caught.value) == f"{cfg.path}: autotuning.{key} {message}"


@pytest.mark.parametrize(("device_kind", "estimator"), [("tpu", "calibrated"), ("gpu", "bogus")])
def test_settings_from_config_refuses_unknown_device_kinds_and_estimators(tmp_path: Path, device_kind: str,
                                                                          estimator: str) -> None:
    with pytest.raises(ValueError) as caught:
        SearchSettings.from_config(tuning_config(tmp_path, USER_CONFIG), capacity_bytes=GiB, num_nodes=1, num_gpus=4,
                                   device_kind=device_kind, estimator=estimator)
    assert str(caught.value) == f"device_kind {device_kind!r} or estimator {estimator!r} is not known"


# ---------------------------------------------------------------- full mode after DeepSpeed's fast search


def deepspeed_full(tmp_path: Path, stages: tuple[int, ...], *, trials: int, early_stopping: int = 50,
                   concurrency: int = 1, estimator: str = "calibrated", metric: str = "throughput",
                   zero: dict[str, Any] | None = None, **autotuning: Any) -> SearchSettings:
    """DeepSpeed's algorithm with `"fast": false` and gridsearch, on the trace model and host memory (as
    `settings()`: 512 MiB of overhead, no reserve)."""
    user = {**USER_CONFIG, "zero_optimization": {"stage": list(stages), "contiguous_gradients": False, **(zero or {})},
            "autotuning": {**USER_CONFIG["autotuning"], "fast": False, "search": "deepspeed",
                           "tuner_type": "gridsearch", "tuner_num_trials": trials,
                           "tuner_early_stopping": early_stopping, "metric": metric,
                           "model_info": PROFILE_METRICS, **autotuning}}
    return SearchSettings.from_config(tuning_config(tmp_path, user), capacity_bytes=LAW.capacity, num_nodes=1,
                                      num_gpus=4, device_kind="cpu", estimator=estimator, concurrency=concurrency)


def trial_phases(phases: list[Phase]) -> list[Phase]:
    return [phase for phase in phases if "_trial" in phase.name]


def test_full_mode_tunes_only_stages_that_beat_the_carried_best(tmp_path: Path) -> None:
    # The fast search is EXPECTED_PHASES'. Best per stage (samples/s = 4 mbs / step): z0 67 -> 372.2; z1 73
    # -> 373.4, a larger best mbs and not worse: tuned (reference 1.8 step 9); z2 74 -> 371.9 and z3 76 ->
    # 361.9 are worse than the carried best: not tuned. Stage 0 is never full-tuned. z1's space is
    # DeepSpeed's z1_rbs_abs_tmbspg at mbs [73]; 5 trials in batches of 2.
    phases = drive(fast_search(deepspeed_full(tmp_path, (0, 1, 2, 3), trials=5, concurrency=2)), Runner(KnobLaw()))
    assert [phase for phase in layout(phases) if "_trial" not in phase[0]] == EXPECTED_PHASES[1:]
    names = [phase.name for phase in phases]
    assert names[names.index("z1_fine_71") + 1:names.index("z2_min_max")] == [
        "z1_rbs_abs_tmbspg_trial1", "z1_rbs_abs_tmbspg_trial3", "z1_rbs_abs_tmbspg_trial5"]
    assert [len(phase.experiments) for phase in trial_phases(phases)] == [2, 2, 1]


def test_full_mode_early_stopping_counts_from_the_best_trial(tmp_path: Path) -> None:
    # z1 alone (the first stage explored is tuned): probes 81, 77, 73 (73 runs), candidates [36, 73] with
    # mtbpg 73, so the grid is (rbs, abs) x mbs (36 at gas 2, 73 at gas 1), mbs fastest. KnobLaw multiplies
    # samples/s by 1 + 1e-10 * rbs: trial 1 (36) 351.3, trial 2 (73) 375.3, the best, at iteration 1;
    # DeepSpeed stops once trials >= best_iter + early_stopping = 3.
    phases = drive(fast_search(deepspeed_full(tmp_path, (1,), trials=50, early_stopping=2)), Runner(KnobLaw()))
    trials = trial_phases(phases)
    assert [phase.name for phase in trials] == [f"z1_rbs_abs_tmbspg_trial{i}" for i in (1, 2, 3)]
    zeros = [(exp, exp.ds_config["zero_optimization"]) for phase in trials for exp in phase.experiments]
    points = [(exp.micro_batch_size, exp.gradient_accumulation_steps, zero["reduce_bucket_size"],
               zero["allgather_bucket_size"]) for exp, zero in zeros]
    assert points == [(36, 2, 5e7, 5e7), (73, 1, 5e7, 5e7), (36, 2, 5e7, 5e8)]


def test_full_mode_space_of_one_point_runs_it_once(tmp_path: Path) -> None:
    # Every z1 knob fixed by the user, mbs 8 capped at 8: the fast search runs 8 only, and the space has one point.
    search_settings = deepspeed_full(tmp_path, (1,), trials=5, zero={"reduce_bucket_size": 5e8,
                                                                     "allgather_bucket_size": 5e8},
                                     max_train_micro_batch_size_per_gpu=8)
    search_settings = replace(search_settings, first_micro_batch_size=8)
    phases = drive(fast_search(search_settings), Runner())
    assert layout(phases)[0] == one(1, "min_max", 8)
    [trial] = trial_phases(phases)
    assert trial.name.startswith("z1_") and trial.name.endswith("_trial1")
    [exp] = trial.experiments
    zero = exp.ds_config["zero_optimization"]
    assert (exp.micro_batch_size, exp.gradient_accumulation_steps, zero["reduce_bucket_size"],
            zero["allgather_bucket_size"]) == (8, 1, 5e8, 5e8)


@pytest.mark.parametrize(
    ("metric", "z2_best"),
    [("throughput", 100.0), ("latency", 100.0), ("latency", 125.0)],
    ids=["equal-throughput", "equal-latency", "lower-latency"],
)
def test_full_mode_ties_and_the_metric_direction(tmp_path: Path, metric: str, z2_best: float) -> None:
    # Scripted (1000 / value for latency): z0 runs up to 74, all max probes run, best 74 (100). z1 starts at
    # 74, runs up to 83, but its best is 74 again (100): not a larger best mbs, so neither carried nor
    # tuned (DeepSpeed: `if next_mbs > mbs`). z2 starts from z0's max 74 (probes 86, 81, 76), best 86 at
    # least as good as the carried 100: a larger best mbs, not worse, so tuned, 2 trials.
    table = Table({0: 74, 1: 83, 2: 86}, {(0, 74): 100.0, (1, 74): 100.0, (2, 86): z2_best}, metric=metric)
    search_settings = deepspeed_full(tmp_path, (0, 1, 2), trials=2, estimator="deepspeed", metric=metric)
    phases = drive(fast_search(search_settings), Runner(table))
    assert [phase for phase in layout(phases) if "_trial" not in phase[0]] == [
        one(0, "min_max", 1, 74, 70, 66), one(0, "candidates", 37, gas=2), one(0, "fine_62", 62),
        one(1, "min_max", 74, 83, 79, 75), one(1, "fine_80", 80),
        one(2, "min_max", 74, 86, 81, 76), one(2, "fine_82", 82),
    ]
    assert [phase.name.split("_")[0] for phase in trial_phases(phases)] == ["z2", "z2"]


def test_sampled_full_mode_keeps_the_leaders_accumulation(tmp_path: Path) -> None:
    # max_train_batch_size 1024 over 4 ranks: 256 samples per GPU and step, so gas = 256 // mbs everywhere.
    search_settings = full_settings(tmp_path, "gridsearch", trials=5)
    search_settings = replace(search_settings, max_train_batch_size=1024)
    trials = trial_phases(drive(fast_search(search_settings), Runner(KnobLaw())))
    experiments = [exp for phase in trials for exp in phase.experiments]
    assert experiments
    assert all(exp.gradient_accumulation_steps == 256 // exp.micro_batch_size > 1 for exp in experiments)


def test_a_crashed_candidate_ends_the_fine_search_but_the_stage_is_still_full_tuned(tmp_path: Path) -> None:
    # z1 alone, mtbpg 256 (1024 over 4 ranks). DeepSpeed's probes 83, 79, 75 fail; the bisection from 1
    # under 74 runs 38, 56, 65, 70 (each > 5 % better) and 72 (+2.9 %: plateau). Candidates for (1, 72):
    # 36, 48, 60 (gas 7, 5, 4) and 72 at gas 3, which crashes: no metric to start the fine search from
    # (DeepSpeed: a failure breaks it). The stage still has a best (72 at gas 1): its space is tuned.
    table = Table({1: 73}, crashed=frozenset({"z1_gas3_tmbspg72"}))
    search_settings = deepspeed_full(tmp_path, (1,), trials=2, estimator="deepspeed", max_train_batch_size=1024)
    phases = drive(fast_search(search_settings), Runner(table))
    assert layout(phases)[:7] == [
        one(1, "min_max", 1, 83, 79, 75), one(1, "bisect_38", 38), one(1, "bisect_56", 56), one(1, "bisect_65", 65),
        one(1, "bisect_70", 70), one(1, "bisect_72", 72),
        ("z1_candidates", ("z1_gas7_tmbspg36", "z1_gas5_tmbspg48", "z1_gas4_tmbspg60", "z1_gas3_tmbspg72")),
    ]
    assert [phase.name for phase in phases[7:]] == ["z1_rbs_abs_tmbspg_trial1", "z1_rbs_abs_tmbspg_trial2"]
