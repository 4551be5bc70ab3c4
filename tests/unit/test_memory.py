"""The memory model (`scheduler.memory`): hand-computed tables, the gate, calibration, DeepSpeed's estimate."""
from __future__ import annotations

from typing import Any

import pytest

from scheduler.memory import (
    GPU_UNTRACKED_FLOOR, NO_LIMIT, overhead_from_profile, peak_grows, prior_overhead_bytes, untracked_reserve_bytes, Calibration, MemoryModel, ModelInfo, Observation, StageFit, StateBytes, TrainingSetup, bounds,
    calibrate, deepspeed_fp16, deepspeed_instantiation_bytes, deepspeed_max_micro_batch_size, deepspeed_stage_fits,
    mixed_precision, model_state_bytes, predict_max_micro_batch_size, stage_gate,
)

GiB = 1024**3
K = ModelInfo(num_params=1000, trainable_num_params=1000, activation_mem_per_gpu=10)

# ---------------------------------------------------------------- model states, by hand
# 1000 parameters; fp32 is 4 + 4 + 12 bytes each, fp16/bf16 2 + 2 + 12; ZeRO shards the optimizer
# from stage 1, gradients from 2, parameters at 3 over dp = world / mp ranks.


@pytest.mark.parametrize(
    ("setup", "stage", "expected"),
    [
        (TrainingSetup(world_size=4), 0, (4000, 4000, 12000)),
        (TrainingSetup(world_size=4), 1, (4000, 4000, 3000)),
        (TrainingSetup(world_size=4), 2, (4000, 1000, 3000)),
        (TrainingSetup(world_size=4), 3, (1000, 1000, 3000)),
        (TrainingSetup(world_size=4, mixed_precision=True), 0, (2000, 2000, 12000)),
        (TrainingSetup(world_size=4, mixed_precision=True), 1, (2000, 2000, 3000)),
        (TrainingSetup(world_size=4, mixed_precision=True), 2, (2000, 500, 3000)),
        (TrainingSetup(world_size=4, mixed_precision=True), 3, (500, 500, 3000)),
        (TrainingSetup(world_size=4, mixed_precision=True, offload_optimizer=True), 1, (2000, 2000, 0)),
        (TrainingSetup(world_size=4, mixed_precision=True, offload_optimizer=True), 3, (500, 500, 0)),
        (TrainingSetup(world_size=4, mixed_precision=True, offload_optimizer=True, offload_param=True), 3, (0, 500, 0)),
        (TrainingSetup(world_size=4, mixed_precision=True, offload_param=True), 2, (2000, 500, 3000)),
        (TrainingSetup(world_size=4, mp_size=2, mixed_precision=True), 0, (1000, 1000, 6000)),
        (TrainingSetup(world_size=4, mp_size=2, mixed_precision=True), 1, (1000, 1000, 3000)),
        (TrainingSetup(world_size=4, mp_size=2, mixed_precision=True), 3, (500, 500, 3000)),
        (TrainingSetup(world_size=1), 3, (4000, 4000, 12000)),
    ],
    ids=["fp32-z0", "fp32-z1", "fp32-z2", "fp32-z3", "mixed-z0", "mixed-z1", "mixed-z2", "mixed-z3",
         "offload-opt-z1", "offload-opt-z3", "offload-both-z3", "offload-param-ignored-below-z3",
         "mp2-z0", "mp2-z1", "mp2-z3-divides-once", "one-rank-z3-shards-nothing"],
)
def test_model_state_bytes(setup: TrainingSetup, stage: int, expected: tuple[int, int, int]) -> None:
    state = model_state_bytes(K, setup, stage)
    assert (state.params, state.grads, state.optimizer) == expected
    assert state.total == sum(expected)


def test_frozen_parameters_need_no_gradients_or_optimizer_state() -> None:
    info = ModelInfo(num_params=1000, trainable_num_params=500, activation_mem_per_gpu=0)
    assert model_state_bytes(info, TrainingSetup(mixed_precision=True), 0) == StateBytes(2000, 1000, 6000)


@pytest.mark.parametrize(
    ("ds_config", "host_memory", "expected"),
    [
        ({}, False, TrainingSetup(world_size=4)),
        ({"bf16": {"enabled": True}}, False, TrainingSetup(world_size=4, mixed_precision=True)),
        ({"fp16": {"enabled": "auto"}}, False, TrainingSetup(world_size=4, mixed_precision=True)),
        ({"fp16": {"enabled": False}}, False, TrainingSetup(world_size=4)),
        ({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}, False,
         TrainingSetup(world_size=4, offload_optimizer=True)),
        ({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}, True, TrainingSetup(world_size=4)),
        ({"zero_optimization": {"offload_optimizer": {"device": "nvme"}}}, True,
         TrainingSetup(world_size=4, offload_optimizer=True)),
        ({"zero_optimization": {"offload_optimizer": {"device": "none"}}}, False, TrainingSetup(world_size=4)),
        ({"zero_optimization": {"offload_param": {"device": "CPU"}}}, False,
         TrainingSetup(world_size=4, offload_param=True)),
    ],
    ids=["default", "bf16", "fp16-auto", "fp16-off", "offload-cpu", "offload-cpu-on-cpu-slot",
         "offload-nvme-on-cpu-slot", "offload-none", "offload-param"],
)
def test_setup_from_ds_config(ds_config: dict[str, Any], host_memory: bool, expected: TrainingSetup) -> None:
    assert TrainingSetup.from_ds_config(ds_config, world_size=4, host_memory=host_memory) == expected


@pytest.mark.parametrize(("world", "mp", "dp"), [(4, 1, 4), (4, 2, 2), (4, 4, 1), (1, 1, 1), (2, 4, 1)])
def test_data_parallel_size(world: int, mp: int, dp: int) -> None:
    assert TrainingSetup(world_size=world, mp_size=mp).dp_size == dp


def test_mixed_precision_reads_fp16_and_bf16() -> None:
    assert mixed_precision({"bfloat16": {"enabled": True}})
    assert not mixed_precision({"fp16": "yes"})


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({"num_params": 10, "trainable_num_params": 4, "activation_mem_per_gpu": 7}, ModelInfo(10, 4, 7)),
        ({"num_params": 10, "activation_mem_per_gpu": 7}, ModelInfo(10, 10, 7)),
        ({"num_params": 10.0, "activation_mem_per_gpu": -5}, ModelInfo(10, 10, 0)),
        ({"num_params": 10}, None),
        ({"num_params": None, "activation_mem_per_gpu": 7}, None),
        ({"num_params": True, "activation_mem_per_gpu": 7}, None),
        ({"profile": True}, None),
        (None, None),
    ],
    ids=["full", "trainable-defaults", "negative-activation-clamped", "no-activation", "null", "bool",
         "profile-request", "none"],
)
def test_model_info_from_mapping(data: Any, expected: ModelInfo | None) -> None:
    assert ModelInfo.from_mapping(data) == expected


# ---------------------------------------------------------------- the analytical model and the gate


MODEL = MemoryModel(K, TrainingSetup(world_size=1), overhead_bytes=100)  # states 20000 + 100 + 10 per sample


def test_required_bytes_fits_and_max() -> None:
    assert MODEL.fixed_bytes(0) == 20100
    assert MODEL.required_bytes(0, 5) == 20150
    assert MODEL.fits(0, 5, 20150) and not MODEL.fits(0, 6, 20150)
    assert MODEL.max_micro_batch_size(0, 20155) == 5
    assert MODEL.max_micro_batch_size(0, 20109) == 0


def test_gate_reports_the_shortfall() -> None:
    assert MODEL.gate(0, 20000) == StageFit(0, 20110, 20000)
    assert MODEL.gate(0, 20000).shortfall_bytes == 110
    assert not MODEL.gate(0, 20000).feasible
    assert MODEL.gate(0, 20110).feasible


def test_stage_gate_per_stage() -> None:
    model = MemoryModel(K, TrainingSetup(world_size=4), overhead_bytes=0)  # totals 20000, 11000, 8000, 5000
    fits = stage_gate(model, (0, 1, 2, 3), 10000)
    assert [(f.stage, f.required_bytes, f.feasible, f.shortfall_bytes) for f in fits] == [
        (0, 20010, False, 10010), (1, 11010, False, 1010), (2, 8010, True, 0), (3, 5010, True, 0)]


def test_no_activation_growth_means_no_limit() -> None:
    model = MemoryModel(ModelInfo(1000, 1000, 0), TrainingSetup(), overhead_bytes=0)
    assert model.max_micro_batch_size(0, 20000) == NO_LIMIT
    assert model.max_micro_batch_size(0, 19999) == 0


# ---------------------------------------------------------------- calibration


@pytest.mark.parametrize(
    ("points", "prior", "intercept", "slope", "distinct"),
    [
        ([(10, 5000)], 300, 2000, 300, 1),
        ([(10, 3000), (20, 5000)], 300, 1000, 200, 2),
        ([(1, 1100), (2, 1300), (3, 1300)], 0, 1033.333, 100, 3),
        ([(10, 4000), (10, 5000)], 100, 3500, 100, 1),
    ],
    ids=["one-point-keeps-prior-slope", "two-points-exact", "least-squares", "repeated-size-is-one-point"],
)
def test_calibrate(points: list[tuple[int, int]], prior: float, intercept: float, slope: float,
                   distinct: int) -> None:
    fit = calibrate([Observation(m, peak) for m, peak in points], prior_slope=prior)
    assert fit is not None
    assert fit.intercept == pytest.approx(intercept, abs=1e-3)
    assert fit.slope == pytest.approx(slope)
    assert fit.points == distinct


def test_calibrate_ignores_ooms_and_unmeasured_successes() -> None:
    assert calibrate([Observation(8, oom=True), Observation(4)], prior_slope=1) is None
    fit = calibrate([Observation(8, oom=True), Observation(4), Observation(2, 700)], prior_slope=100)
    assert (fit.intercept, fit.slope) == (500, 100)


def test_calibration_prediction_uses_the_safety_margin() -> None:
    fit = Calibration(intercept=1000, slope=200, points=2)
    assert fit.bytes_at(10) == 3000
    assert fit.max_micro_batch_size(10000) == 42  # (9500 - 1000) / 200 = 42.5
    assert fit.max_micro_batch_size(10000, safety=1.0) == 45
    assert fit.shifted(-1000).max_micro_batch_size(10000) == 47
    assert Calibration(20000, 0, 1).max_micro_batch_size(10000) == 0


def test_bounds() -> None:
    obs = [Observation(4, 10), Observation(9, oom=True), Observation(6), Observation(12, oom=True)]
    assert bounds(obs) == (6, 9)
    assert bounds([]) == (0, None)


# A model whose states are 16000 bytes at one rank (mixed precision), 100 bytes per sample, no overhead.
ONE = MemoryModel(ModelInfo(1000, 1000, 100), TrainingSetup(mixed_precision=True), overhead_bytes=0)
# The same on four ranks: stage 0 holds 16000 bytes, stage 1 7000.
FOUR = MemoryModel(ModelInfo(1000, 1000, 100), TrainingSetup(world_size=4, mixed_precision=True), overhead_bytes=0)
MEASURED = [Observation(10, 20000), Observation(20, 23000)]  # a = 17000, b = 300


@pytest.mark.parametrize(
    ("model", "stage", "observations", "safety", "expected"),
    [
        (ONE, 0, {}, 0.95, 100),  # analytical, no margin: (26000 - 16000) / 100
        (ONE, 0, {0: MEASURED}, 0.95, 25),  # (24700 - 17000) / 300 = 25.7
        (ONE, 0, {0: MEASURED}, 1.0, 30),
        (ONE, 0, {0: [*MEASURED, Observation(24, oom=True)]}, 0.95, 23),
        (ONE, 0, {0: [*MEASURED, Observation(27)]}, 0.95, 27),  # a success is a lower bound
        (ONE, 0, {0: [*MEASURED, Observation(27), Observation(24, oom=True)]}, 0.95, 23),
        (ONE, 0, {0: [Observation(50, oom=True)]}, 0.95, 49),  # only an OOM: the model, bounded
        (FOUR, 1, {0: MEASURED}, 0.95, 55),  # carried: a = 17000 - 9000, (24700 - 8000) / 300 = 55.7
        (FOUR, 1, {0: MEASURED, 1: [Observation(50, oom=True)]}, 0.95, 49),
        (FOUR, 1, {0: MEASURED, 1: [Observation(10, 12000)]}, 0.95, 52),  # prior slope 300: a = 9000
        # one point at mbs >= 8: slope from the analytical intercept (7000) to it, 500 > the profile's 100
        (FOUR, 1, {1: [Observation(10, 12000)]}, 0.95, 35),  # a = 7000: (24700 - 7000) / 500 = 35.4
        (FOUR, 1, {1: [Observation(4, 12000)]}, 0.95, 131),  # below mbs 8: profile slope 100, a = 11600
    ],
    ids=["analytical", "own-fit", "own-fit-no-margin", "below-oom", "known-success", "oom-wins",
         "oom-only", "carried-from-stage-0", "carried-then-bounded", "prior-from-other-stage", "slope-to-the-analytical-intercept", "prior-from-profile"],
)
def test_predict_max_micro_batch_size(model: MemoryModel, stage: int, observations: dict[int, list[Observation]],
                                      safety: float, expected: int) -> None:
    assert predict_max_micro_batch_size(model, stage, 26000, observations, safety) == expected


# ---------------------------------------------------------------- DeepSpeed's estimate (reference section 1.7)

N, ACT, CAP16 = 150_000_000, 200_000_000, 16 * GiB


@pytest.mark.parametrize(
    ("stage", "instantiation", "max_mbs"),
    [(0, 3.0e9, 70), (1, 1.2e9, 79), (2, 9.75e8, 81), (3, 7.5e8, 82)],
)
def test_deepspeed_estimate_matches_the_worked_numbers(stage: int, instantiation: float, max_mbs: int) -> None:
    info = ModelInfo(N, N, ACT)
    assert deepspeed_instantiation_bytes(N, stage, True, 4) == pytest.approx(instantiation)
    assert deepspeed_max_micro_batch_size(info, stage, True, 4, 1, CAP16) == max_mbs
    assert deepspeed_stage_fits(info, stage, True, 4, 1, CAP16).feasible


@pytest.mark.parametrize(
    ("fp16", "stage", "world", "mp", "deepspeed", "ours"),
    [
        (False, 0, 1, 1, 16000, 20000),  # fp32 counted at 16 B/param
        (True, 0, 1, 1, 20000, 16000),  # fp16 counted at 20
        (True, 3, 4, 2, 2500, 4000),  # mp divides again after sharding over the whole world
    ],
    ids=["fp32", "fp16", "mp-double-division"],
)
def test_deepspeed_estimate_differs_from_ours(fp16: bool, stage: int, world: int, mp: int, deepspeed: float,
                                              ours: int) -> None:
    assert deepspeed_instantiation_bytes(1000, stage, fp16, world, mp) == deepspeed
    setup = TrainingSetup(world_size=world, mp_size=mp, mixed_precision=fp16)
    assert model_state_bytes(K, setup, stage).total == ours


def test_deepspeed_precision_and_gate_edges() -> None:
    assert deepspeed_fp16({"fp16": {"enabled": True}})
    assert not deepspeed_fp16({"bf16": {"enabled": True}})
    assert deepspeed_instantiation_bytes(0, 0, True, 1) == 0
    info = ModelInfo(1000, 1000, 10)
    assert not deepspeed_stage_fits(info, 0, False, 1, 1, 16010).feasible  # needs strictly more
    assert deepspeed_stage_fits(info, 0, False, 1, 1, 16011).feasible
    assert deepspeed_max_micro_batch_size(ModelInfo(1000, 1000, 0), 0, False, 1, 1, 1) == NO_LIMIT


# ---------------------------------------------------------------- peaks that do not grow, the opening estimate


@pytest.mark.parametrize(
    ("points", "prior", "grows"),
    [
        ([(10, 5000), (20, 4000)], 300, False),  # shrinking: not a device peak
        ([(10, 5000), (40, 5030)], 300, False),  # flat host memory under a GPU job: 1 B/sample
        ([(10, 5000), (40, 7400)], 300, True),  # 80 B/sample >= 25 % of the profile's 300
        ([(10, 5000), (40, 6000)], 0, True),  # no profile figure: grows by 20 % of the peak
        ([(10, 5000), (40, 5050)], 0, False),  # ... by 1 %: noise
        ([(10, 5000)], 300, True),  # one size: nothing to tell
    ],
)
def test_peak_grows(points: list[tuple[int, int]], prior: float, grows: bool) -> None:
    observations = [Observation(m, peak) for m, peak in points]
    assert peak_grows(observations, prior) is grows
    assert (calibrate(observations, prior_slope=prior) is not None) is grows


def test_a_flat_peak_is_never_fitted_so_the_model_decides() -> None:
    flat = {0: [Observation(10, 5000), Observation(40, 5001)]}
    assert predict_max_micro_batch_size(ONE, 0, 26000, flat, 0.95) == ONE.max_micro_batch_size(0, 26000)


def test_overhead_from_profile_is_what_the_profile_held_beyond_states() -> None:
    info = ModelInfo(1000, 1000, 100)
    setup = TrainingSetup(world_size=4, mixed_precision=True)  # stage 3 states: 500 + 500 + 3000
    assert overhead_from_profile(info, setup, 6000) == 6000 - 4000 - 100
    assert overhead_from_profile(info, setup, 3000) == 0
    assert overhead_from_profile(info, setup, None) is None


def test_gpu_priors_scale_with_the_device() -> None:
    assert prior_overhead_bytes(16 * GiB, host_memory=False) == 2 * GiB
    assert prior_overhead_bytes(80 * GiB, host_memory=False) == int(0.06 * 80 * GiB)
    assert prior_overhead_bytes(80 * GiB, host_memory=True) == 512 * 2**20
    assert untracked_reserve_bytes(16 * GiB, host_memory=False) == GPU_UNTRACKED_FLOOR
    assert untracked_reserve_bytes(80 * GiB, host_memory=False) == 2 * GiB
    assert untracked_reserve_bytes(80 * GiB, host_memory=True) == 0
