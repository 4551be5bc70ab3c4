"""The memory model (`scheduler.search.memory`): hand-computed tables, the gate, calibration, DeepSpeed's estimate."""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from scheduler.search.memory import (
    GPU_UNTRACKED_FLOOR, NO_LIMIT, overhead_from_profile, peak_grows, prior_overhead_bytes, untracked_reserve_bytes, Calibration, MemoryModel, ModelInfo, Observation, StageFit, StateBytes, TrainingSetup, bounds,
    calibrate, mixed_precision, model_state_bytes, stage_gate,
)
from scheduler.search.memory_facts import SharedFacts, predict_max_micro_batch_size, shared_facts
from scheduler.search.deepspeed_memory import (
    deepspeed_fp16, deepspeed_instantiation_bytes, deepspeed_max_micro_batch_size, deepspeed_stage_fits,
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
    setup = TrainingSetup.from_ds_config(ds_config, world_size=4, host_memory=host_memory)
    assert (setup.reduce_bucket_elements, setup.overlap_comm, setup.host_memory) == (500_000_000, None, host_memory)
    assert replace(setup, reduce_bucket_elements=0, host_memory=False) == expected


@pytest.mark.parametrize(
    ("zero", "host_memory", "bytes_by_stage"),
    [
        ({}, False, (0, 2_000_000_000, 2_000_000_000, 2_000_000_000)),  # fp32: 5e8 x 4 B, one bucket
        ({"overlap_comm": True}, False, (0, 4_000_000_000, 4_000_000_000, 2_000_000_000)),  # two at ZeRO-1/2
        ({"overlap_comm": True, "reduce_bucket_size": 2e8}, False, (0, 1_600_000_000, 1_600_000_000, 800_000_000)),
        ({"contiguous_gradients": False}, False, (0, 0, 0, 0)),  # no flat bucket at all
        ({}, True, (0, 40_000, 40_000, 40_000)),  # host RAM: only the 10^4 gradients' pages are touched
        ({"overlap_comm": True}, True, (0, 80_000, 80_000, 40_000)),
    ],
    ids=["default", "overlap", "smaller-bucket", "not-contiguous", "host", "host-overlap"],
)
def test_deepspeeds_gradient_buckets(zero: dict[str, Any], host_memory: bool,
                                     bytes_by_stage: tuple[int, int, int, int]) -> None:
    setup = TrainingSetup.from_ds_config({"zero_optimization": zero}, world_size=4, host_memory=host_memory)
    model = MemoryModel(ModelInfo(10_000, 10_000, 100), setup, overhead_bytes=7)
    assert tuple(model.buffer_bytes(stage) for stage in range(4)) == bytes_by_stage
    for stage in range(4):  # fixed = states + buckets + overhead; held leaves the common overhead out
        assert model.fixed_bytes(stage) == model.state(stage).total + bytes_by_stage[stage] + 7
        assert model.held_bytes(stage) == model.fixed_bytes(stage) - 7
    mixed = MemoryModel(ModelInfo(10_000, 10_000, 100), replace(setup, mixed_precision=True))
    assert tuple(mixed.buffer_bytes(stage) for stage in range(4)) == tuple(b // 2 for b in bytes_by_stage)


def test_the_profile_overhead_leaves_out_zero3s_bucket() -> None:
    setup = TrainingSetup.from_ds_config({}, world_size=4)
    info = ModelInfo(10_000, 10_000, 100)
    states = model_state_bytes(info, setup, 3).total
    peak = states + 2_000_000_000 + 100 + 12345  # states, ZeRO-3's bucket, one sample, the rest
    assert overhead_from_profile(info, setup, peak) == 12345


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


# ---------------------------------------------------------------- found by mutation testing: the borrowed OOM bound

# FOUR's fixed bytes by stage (mixed precision, 4 ranks, no overhead): 16000, 7000, 5500, 4000.


def test_calibration_shift_moves_only_the_intercept() -> None:
    assert Calibration(100.0, 2.0, 3).shifted(-40.0) == Calibration(60.0, 2.0, 3)


@pytest.mark.parametrize(
    ("model", "stage", "observations", "expected"),
    [
        # stage 0's line (a 17000, b 300) moved to stage 1: a 8000, (24700 - 8000) / 300 = 55.7; stage 0's
        # OOM at 21 moved by (16000 - 7000) // 300 = 30 sizes bounds it: 21 + 30 - 1 = 50
        (FOUR, 1, {0: [Observation(10, 20000), Observation(20, 23000), Observation(21, oom=True)]}, 50),
        # the same with a probe of stage 1 itself (a success without a peak): no bound is borrowed
        (FOUR, 1, {0: [Observation(10, 20000), Observation(20, 23000), Observation(21, oom=True)],
                   1: [Observation(5)]}, 55),
        # 1 byte per sample: a 19990 moved to 10990, (24700 - 10990) / 1 = 13710; bound 21 + 9000 - 1
        (MemoryModel(ModelInfo(1000, 1000, 1), TrainingSetup(world_size=4, mixed_precision=True), 0), 1,
         {0: [Observation(10, 20000), Observation(20, 20010), Observation(21, oom=True)]}, 9020),
        # the nearest stage lends its OOM: stage 3 (a 4000, b 400) moved to stage 2: a 5500,
        # (24700 - 5500) / 400 = 48; its OOM at 30 moved by floor(-1500 / 400) = -4: 30 - 4 - 1 = 25
        # (stage 0's OOM at 100 is farther and would allow 100 + 26 - 1)
        (FOUR, 2, {0: [Observation(100, oom=True)],
                   3: [Observation(10, 8000), Observation(20, 12000), Observation(30, oom=True)]}, 25),
    ],
    ids=["bounded-by-the-other-stage", "own-probe-borrows-nothing", "one-byte-per-sample", "nearest-stage"],
)
def test_the_nearest_measured_stage_s_oom_bounds_the_prediction(model: MemoryModel, stage: int, observations,
                                                                 expected: int) -> None:
    assert predict_max_micro_batch_size(model, stage, 26000, observations) == expected


def test_a_flat_line_has_no_limit_and_borrows_no_bound() -> None:
    # no activation figure and one size below PSEUDO_SLOPE_MIN_MBS: slope 0, nothing grows with the batch
    flat = MemoryModel(ModelInfo(1000, 1000, 0), TrainingSetup(world_size=4, mixed_precision=True), 0)
    observations = {0: [Observation(4, 20000), Observation(6, oom=True)]}
    assert predict_max_micro_batch_size(flat, 1, 26000, observations) == NO_LIMIT


# ---------------------------------------------------------------- DeepSpeed's estimate, by hand


@pytest.mark.parametrize(
    ("fp16", "stage", "world", "mp", "required"),
    [
        # fp32: 4 + 4 + 8 B/param; stage 1 shards the 8000 optimizer bytes over 4: 4000 + 4000 + 2000, / mp 2
        (False, 1, 4, 2, 5000 + 10 + 1),
        # fp16: 2 + 2 + 16; 2000 + 2000 + 16000 / 4 = 8000, / mp 2
        (True, 1, 4, 2, 4000 + 10 + 1),
        (True, 2, 4, 1, 2000 + 500 + 4000 + 10 + 1),
        (False, 3, 2, 1, 2000 + 2000 + 4000 + 10 + 1),
    ],
)
def test_deepspeed_stage_fits_required_bytes(fp16: bool, stage: int, world: int, mp: int, required: int) -> None:
    fit = deepspeed_stage_fits(ModelInfo(1000, 1000, 10), stage, fp16, world, mp, 10**6)
    assert (fit.stage, fit.required_bytes, fit.capacity_bytes) == (stage, required, 10**6)


@pytest.mark.parametrize(
    ("activation", "mp", "capacity", "expected"),
    [
        (1, 1, 16010, 10),  # (16010 - 16000) // 1
        (10, 1, 15000, 0),  # the model alone does not fit
        (10, 2, 16000, 800),  # mp 2 halves the 16000: (16000 - 8000) // 10
        (0, 1, 1, NO_LIMIT),
    ],
)
def test_deepspeed_max_micro_batch_size_by_hand(activation: int, mp: int, capacity: int, expected: int) -> None:
    info = ModelInfo(1000, 1000, activation)
    assert deepspeed_max_micro_batch_size(info, 0, False, 1, mp, capacity) == expected


@pytest.mark.parametrize(
    ("ds_config", "fp16"),
    [({"fp16": {}}, False), ({"fp16": {"enabled": True}}, True), ({"fp16": {"enabled": False}}, False),
     ({"fp16": True}, False), ({}, False), ({"bf16": {"enabled": True}, "fp16": {"loss_scale": 0}}, False)],
)
def test_deepspeed_fp16_defaults_to_off(ds_config: dict[str, Any], fp16: bool) -> None:
    assert deepspeed_fp16(ds_config) is fp16


def test_setup_defaults_to_device_memory_and_keeps_mp_size() -> None:
    cpu_offload = {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}
    assert TrainingSetup.from_ds_config(cpu_offload, world_size=4).offload_optimizer is True
    nvme = {"zero_optimization": {"offload_optimizer": {"device": "nvme"}, "offload_param": {"device": "nvme"}}}
    setup = TrainingSetup.from_ds_config(nvme, world_size=8, mp_size=2, host_memory=False)
    assert setup == TrainingSetup(world_size=8, mp_size=2, offload_optimizer=True, offload_param=True,
                                  reduce_bucket_elements=500_000_000)
    assert setup.dp_size == 4


def test_a_slope_below_one_byte_per_sample_still_limits() -> None:
    assert Calibration(100.0, 0.5, 2).max_micro_batch_size(1000, safety=1.0) == 1800  # (1000 - 100) / 0.5


@pytest.mark.parametrize(
    ("points", "prior", "grows"),
    [
        ([(10, 5000), (20, 5003)], 1.0, True),  # 0.3 B/sample >= 25 % of a 1 B/sample profile
        ([(10, 5000), (20, 6000)], 400, True),  # exactly 25 % of 400
        ([(10, 5000), (20, 5999)], 400, False),  # just under
        ([(10, 100), (20, 110)], 0, True),  # 1 B/sample over 10 sizes: 10 >= 2 % of 105
        ([(10, 5000), (40, 5090)], 0, False),  # 3 x 30 = 90 < 2 % of 5045 = 100.9
        ([(1, 9900), (11, 10100)], 0, True),  # 20 x 10 = 200, exactly 2 % of the mean 10000
    ],
    ids=["profile-below-one-byte", "quarter-of-profile", "under-a-quarter", "slow-growth-no-profile",
         "range-times-slope", "exactly-two-percent"],
)
def test_peak_grows_bounds(points: list[tuple[int, int]], prior: float, grows: bool) -> None:
    assert peak_grows([Observation(m, peak) for m, peak in points], prior) is grows


@pytest.mark.parametrize(
    ("stage", "observations", "expected"),
    [
        # stage 1's own line grows at 50 B/sample, 50 % of the profile's 100: it is used, a 9500:
        # (24700 - 9500) / 50 = 304 (judged against the profile, not stage 0's steeper 400)
        (1, {0: [Observation(10, 20000), Observation(20, 24000)],
             1: [Observation(10, 10000), Observation(20, 10500)]}, 304),
        # a single point at stage 2 takes the slope of the nearest fitted stage (3: 200, not 0: 400):
        # a = 7000 - 4 x 200 = 6200, (24700 - 6200) / 200 = 92
        (2, {0: [Observation(10, 20000), Observation(20, 24000)], 2: [Observation(4, 7000)],
             3: [Observation(10, 6000), Observation(20, 8000)]}, 92),
        # one point at exactly mbs 8: slope to the analytical intercept 7000, (12000 - 7000) / 8 = 625;
        # a = 7000, (24700 - 7000) / 625 = 28
        (1, {1: [Observation(8, 12000)]}, 28),
        (1, {1: [Observation(1, oom=True)]}, 0),  # even one sample ran out of memory
    ],
    ids=["own-line-against-the-profile", "prior-from-the-nearest-stage", "pseudo-slope-from-mbs-8", "oom-at-1"],
)
def test_predictions_by_hand(stage: int, observations, expected: int) -> None:
    assert predict_max_micro_batch_size(FOUR, stage, 26000, observations) == expected


@pytest.mark.parametrize(
    ("stage", "expected"),
    [
        # 1001 parameters over mp 2: 501 per rank (rounded up); mixed precision 2 + 2 + 12 bytes; dp = 8 / 2 = 4
        (0, (1002, 1002, 6012)),
        (1, (1002, 1002, 1503)),  # 6012 / 4
        (2, (1002, 251, 1503)),  # 1002 / 4 = 250.5, rounded up
        (3, (251, 251, 1503)),
    ],
)
def test_model_state_bytes_round_up_what_does_not_divide(stage: int, expected: tuple[int, int, int]) -> None:
    setup = TrainingSetup(world_size=8, mp_size=2, mixed_precision=True)
    state = model_state_bytes(ModelInfo(1001, 1001, 0), setup, stage)
    assert (state.params, state.grads, state.optimizer) == expected


def test_calibrate_keeps_a_slope_below_one_byte_per_sample() -> None:
    fit = calibrate([Observation(10, 5000), Observation(20, 5003)], prior_slope=1.0)
    assert fit is not None
    assert (fit.slope, fit.intercept, fit.points) == (pytest.approx(0.3), pytest.approx(4997.0), 2)


# ---------------------------------------------------------------- memory facts shared by every stage
# FOUR holds 16000 / 7000 / 5500 / 4000 bytes at stages 0-3 and its profile says 100 bytes per sample;
# with 26000 bytes ZeRO-1 has 19000 bytes of room for activations.
ZERO_1_BRACKET = {1: [Observation(50), Observation(60, oom=True)]}  # no peaks: no line is fitted


def test_a_bracket_bounds_and_moves_every_other_stage() -> None:
    """ZeRO-1 ran 50 and failed at 60: a sample takes between 19000 / 60 = 316.7 and 19000 / 50 = 380
    bytes. ZeRO-0 holds 9000 bytes more: its top moves down by 9000 / 380 = 23.7 at least (failure
    bound ceil(60 - 23.7) = 37) and 9000 / 316.7 = 28.4 at most (success bound floor(50 - 28.4) = 21);
    ZeRO-1's failure at 60 is proven for it. ZeRO-2 holds 1500 less: up by 1500 / 380 = 3.9 at least
    (floor(53.9) = 53) and 1500 / 316.7 = 4.7 at most (ceil(64.7) = 65); ZeRO-1's 50 is proven."""
    assert shared_facts(FOUR, 0, 26000, ZERO_1_BRACKET) == SharedFacts(0, 60, 21, 37)
    assert shared_facts(FOUR, 2, 26000, ZERO_1_BRACKET) == SharedFacts(50, None, 53, 65)
    # a stage's own observations say nothing here
    assert shared_facts(FOUR, 1, 26000, ZERO_1_BRACKET) == SharedFacts()


def test_without_any_peak_the_other_stages_brackets_steer_the_prediction() -> None:
    # the analytical model alone says 100 for ZeRO-0 and 205 for ZeRO-2; the moved failures cap them
    assert FOUR.max_micro_batch_size(0, 26000) == 100 and FOUR.max_micro_batch_size(2, 26000) == 205
    assert predict_max_micro_batch_size(FOUR, 0, 26000, ZERO_1_BRACKET) == 36
    assert predict_max_micro_batch_size(FOUR, 2, 26000, ZERO_1_BRACKET) == 64
    # a model that predicts too little is raised to the moved success: with a profile of 1000 bytes
    # per sample the model gives ZeRO-2 20500 / 1000 = 20; the profile's figure is then the bytes per
    # sample at both ends (above 380), so ZeRO-1's 50 moves up by 1500 / 1000 to 51
    heavy = MemoryModel(ModelInfo(1000, 1000, 1000), TrainingSetup(world_size=4, mixed_precision=True), 0)
    assert heavy.max_micro_batch_size(2, 26000) == 20
    assert predict_max_micro_batch_size(heavy, 2, 26000, ZERO_1_BRACKET) == 51


def test_brackets_that_contradict_the_analytical_difference_are_not_moved() -> None:
    # ZeRO-1 ran 50 (at most 380 bytes per sample), ZeRO-2 (holding less) failed at 40 (at least
    # 20500 / 40 = 512.5): moved to ZeRO-3, a success at floor(50 + 3000 / 380) = 57 above a failure
    # at ceil(40 + 1500 / 512.5) = 43. ZeRO-2 ran nothing: its failure moves least surely (its bytes
    # per sample rest on the model's room for it alone) and is dropped; the moved success stays.
    observations = {1: [Observation(50)], 2: [Observation(40, oom=True)]}
    assert shared_facts(FOUR, 3, 26000, observations) == SharedFacts(50, None, 57, None)
    # with a success of its own at 30, ZeRO-2's bracket is kept and the contradiction drops both
    observations[2].append(Observation(30))
    assert shared_facts(FOUR, 3, 26000, observations) == SharedFacts(50, None, 0, None)
