"""bench/trace_replay.py: what each search reads from a trace, and what it is judged by."""
from __future__ import annotations

from typing import Any

import pytest

from bench.collect_traces import space
from bench.trace_replay import Trace, Untraced, deepspeed, every_config_once, ours, right

GiB = 1 << 30


def _window(step_s: float, last_s: float, samples: int) -> dict[str, Any]:
    steps = [step_s, step_s, last_s]
    return {"step_seconds": steps, "throughput": samples * 3 / sum(steps), "engine_throughput": samples / last_s}


def _trace(best: tuple[int, int, int]) -> Trace:
    """Every config 1 s a step except `best` (0.5 s); every last step reads 2x fast (a lucky engine)."""
    configs = []
    for stage, mbs, gas, _ in space([0, 1], 8):
        step = 0.5 if (stage, mbs, gas) == best else 1.0
        samples = mbs * gas * 2
        windows = [_window(step, step / 2 if (stage, mbs) == (0, 2) else step, samples) for _ in range(3)]
        configs.append({"stage": stage, "mbs": mbs, "gas": gas,
                        "launches": [{"status": "ok", "peak_rss_bytes": GiB, "readings": windows}]})
    return Trace({"script": "t", "world": 2, "max_mbs": 8, "stages": [0, 1], "profile": {
        "model_info": {"num_params": 1_000_000, "trainable_num_params": 1_000_000, "activation_mem_per_gpu": 1 << 20},
        "peak_rss_bytes": GiB}, "configs": configs})


def test_each_search_reads_what_its_tool_measures() -> None:
    trace = _trace((1, 1, 8))
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4, "zero_optimization": {"stage": 0}}
    ours_record = trace.run(0, "z0_gas4_tmbspg2", config, profile=False, engine=False)
    ds_record = trace.run(0, "z0_gas4_tmbspg2", config, profile=False, engine=True)
    # 16 samples a step: the window's mean step (1, 1, 0.5 s) for ours, the last step alone for DeepSpeed
    assert ours_record["metrics"]["throughput"] == pytest.approx(16 * 3 / 2.5)
    assert ours_record["step_seconds"] == [1.0, 1.0, 0.5]
    assert ds_record["metrics"]["throughput"] == pytest.approx(32.0) and "step_seconds" not in ds_record
    assert trace.optimum() == (pytest.approx(32.0), (1, 1, 8, False))
    with pytest.raises(Untraced):
        trace.run(0, "z2_gas1_tmbspg1", {**config, "zero_optimization": {"stage": 2}}, profile=False, engine=False)


def test_a_replay_is_judged_by_the_mean_of_the_named_configs_windows() -> None:
    """ZeRO-1 mbs 2 x gas 4 trains twice as fast as the rest: ours finds it (it measures the middle
    of the range); DeepSpeed's max-first probing never generates it and names a config at half."""
    trace = _trace((1, 2, 4))
    found = ours(trace, 0, 24 * GiB)
    assert (found.named, found.fraction, found.untraced) == ("z1 mbs 2 gas 4", 1.0, False)
    missed = deepspeed(trace, 0, 24 * GiB)
    assert missed.fraction == pytest.approx(0.5) and missed.launches == 6


def test_every_config_read_once_names_the_best_reading_of_the_whole_space() -> None:
    """The exhaustive reference reads each of the 24 configs once: the twice-as-fast config reads
    best in every window, so it is named, at 24 launches. A config at half the best's mean is named
    whenever its one lucky window (3x the best's) is the one drawn: one reading each names it."""
    trace = _trace((0, 4, 2))
    once = every_config_once(trace, 0, 24 * GiB)
    assert (once.named, once.fraction, once.launches, once.right) == ("z0 mbs 4 gas 2", 1.0, 24, True)
    lucky = _two_configs([10.0, 10.0], [5.0, 5.0, 30.0])
    named = {every_config_once(lucky, seed, 24 * GiB).named for seed in range(20)}
    assert named == {"z1 mbs 1 gas 1", "z1 mbs 2 gas 1"}


def _two_configs(best: list[float], other: list[float]) -> Trace:
    """A trace of two configs, each window read as the throughput given."""
    def config(mbs: int, values: list[float]) -> dict[str, Any]:
        windows = [{"throughput": v, "engine_throughput": v, "step_seconds": [1.0]} for v in values]
        return {"stage": 1, "mbs": mbs, "gas": 1, "launches": [{"status": "ok", "peak_rss_bytes": GiB, "readings": windows}]}
    return Trace({"world": 2, "configs": [config(1, best), config(2, other)]})


def test_a_pick_is_right_within_3_percent_of_the_best_or_inside_its_95_percent_interval() -> None:
    """The best reads 100 on average. Its windows 90 and 110 (standard deviation 14.1, standard error
    14.1 / sqrt(2) = 10): the 95 % interval 100 +- 19.6 holds a pick at 95, right though 5 % behind. With
    steady windows (100, 100) the interval is 100 itself: 95 is wrong, 97 right (within 3 %)."""
    wide = _two_configs([90.0, 110.0], [95.0, 95.0])
    assert wide.interval((1, 1, 1, False)) == pytest.approx((100 - 1.96 * 10, 100 + 1.96 * 10))
    assert right(wide, (1, 2, 1, False)) and right(wide, (1, 1, 1, False))
    assert not right(_two_configs([100.0, 100.0], [95.0, 95.0]), (1, 2, 1, False))
    assert right(_two_configs([100.0, 100.0], [97.0, 97.0]), (1, 2, 1, False))


def _checkpointed_trace(capacity: int) -> Trace:
    """Every config of ZeRO 0-1 up to 8 samples a step, each also checkpointed (collect_traces.py
    --checkpointing --every-gas: a memory cap moves the stage's top, and its space with it): 0.5 GiB
    a sample without checkpointing, 0.1 with, over 1 GiB; a step of gas x (0.1 + 0.05 mbs) s, 1.3x
    that checkpointed (the recompute), plus 0.2 s: the largest micro-batch that fits is the fastest."""
    configs = []
    for stage, mbs, gas, checkpointed in space([0, 1], 8, checkpointing=True, every_gas=True):
        samples = mbs * gas * 2
        step = gas * (0.1 + 0.05 * mbs) * (1.3 if checkpointed else 1.0) + 0.2
        peak = GiB + mbs * (GiB // 10 if checkpointed else GiB // 2)
        configs.append({"stage": stage, "mbs": mbs, "gas": gas,
                        "strategy": ["activation_checkpointing"] if checkpointed else [],
                        "launches": [{"status": "ok", "peak_rss_bytes": peak,
                                      "readings": [_window(step, step, samples) for _ in range(3)]}]})
    return Trace({"script": "t", "world": 2, "max_mbs": 8, "stages": [0, 1], "strategies": ["activation_checkpointing"],
                  "profile": {"model_info": {"num_params": 1_000_000, "trainable_num_params": 1_000_000,
                                             "activation_mem_per_gpu": GiB // 2},
                              "peak_rss_bytes": GiB + GiB // 2}, "configs": configs}, capacity=capacity)


def test_a_config_above_the_replays_memory_runs_out_of_it_and_is_no_optimum() -> None:
    trace = _checkpointed_trace(capacity=2 * GiB)
    plain = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "zero_optimization": {"stage": 1}}
    assert trace.run(0, "z1_gas2_tmbspg4", plain, profile=False, engine=False)["status"] == "oom"
    checkpointed = {**plain, "autotuning": {"memory_strategy": ["activation_checkpointing"]}}
    assert trace.run(0, "z1_gas2_tmbspg4_ac", checkpointed, profile=False, engine=False)["status"] == "ok"
    assert trace.optimum()[1][1:] == (8, 1, True)  # plain, 8 x 1 needs 5 GiB
    assert trace.user_config()["autotuning"]["memory_strategies"] == ["activation_checkpointing"]
    assert _trace((1, 1, 8)).optimum()[1] == (1, 1, 8, False)  # no capacity: every traced config ran


def test_a_replay_where_only_checkpointing_fits_the_fast_shape_names_it() -> None:
    """In 2 GiB micro-batch 2 is the largest plain size; checkpointed, 8 fits and trains 17 % faster
    despite the recompute: our search tries the strategy and names it; DeepSpeed's, which tunes no
    strategy, cannot."""
    trace = _checkpointed_trace(capacity=2 * GiB)
    found = ours(trace, 0, 2 * GiB)
    assert found.named.endswith("checkpointed") and found.fraction > 0.9, found
    assert deepspeed(trace, 0, 2 * GiB).fraction < found.fraction
