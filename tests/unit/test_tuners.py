"""The tuners and DeepSpeed's tuning-loop rules (`scheduler.tuners`): order, seeds, stopping, replay."""
from __future__ import annotations

import json
import math
import random
from typing import Any

import numpy as np
import pytest

from scheduler.config import load_config
from scheduler.full_space import full_experiments
from scheduler.space import Experiment
from scheduler.tuners import (
    GridTuner, ModelBasedTuner, RandomTuner, Stop, StopRule, Trial, feature_matrix, make_tuner, plan,
    progress, run_tuner, trials_from_records,
)

NO_EARLY = StopRule(num_trials=1000, early_stopping=None)

# ---------------------------------------------------------------- a synthetic smooth space

BUCKETS = [1e7, 2e7, 5e7, 1e8, 2e8, 5e8, 1e9, 2e9]


@pytest.fixture(scope="module")
def space(tmp_path_factory: pytest.TempPathFactory) -> list[Experiment]:
    """8 x 8 bucket sizes x 4 micro-batch sizes = 256 ZeRO-1 experiments."""
    folder = tmp_path_factory.mktemp("space")
    data = {"zero_optimization": {"stage": 1, "reduce_bucket_size": BUCKETS, "allgather_bucket_size": BUCKETS},
            "autotuning": {"enabled": True}}
    (folder / "ds_config.json").write_text(json.dumps(data))
    return full_experiments(load_config(folder / "ds_config.json", cwd=folder), 1, [8, 16, 24, 32], 32, 1, 1)


def throughput(exp: Experiment) -> float:
    """Peaks at rbs 1e8, abs ~4e8, mbs 24; smooth in log bucket size."""
    zero = exp.ds_config["zero_optimization"]
    return (100 - 4 * (math.log10(zero["reduce_bucket_size"]) - 8.0) ** 2
            - 2 * (math.log10(zero["allgather_bucket_size"]) - 8.6) ** 2 - 0.01 * (exp.micro_batch_size - 24) ** 2)


def ranks(values: list[float], maximize: bool = True) -> list[int]:
    order = sorted(range(len(values)), key=lambda i: -values[i] if maximize else values[i])
    rank = [0] * len(values)
    for position, index in enumerate(order):
        rank[index] = position
    return rank


# ---------------------------------------------------------------- grid and random


def test_grid_goes_in_order_skipping_tried_and_running() -> None:
    tuner = GridTuner(6)
    assert tuner.next_batch([], 3) == [0, 1, 2]
    assert tuner.next_batch([Trial(0, 1.0), Trial(2, None)], 2, running=[1]) == [3, 4]
    assert tuner.next_batch([Trial(i, 1.0) for i in range(6)], 2) == []
    assert tuner.next_batch([], 0) == []


def test_grid_run_evaluates_every_candidate_in_order() -> None:
    history, state = run_tuner(GridTuner(5), lambda i: float(i), NO_EARLY, batch_size=2)
    assert [t.index for t in history] == [0, 1, 2, 3, 4]
    assert state.stop is Stop.EXHAUSTED and state.done
    assert state.best == Trial(4, 4.0)


def test_random_same_seed_same_order_different_seeds_differ() -> None:
    def order(seed: int) -> list[int]:
        return [t.index for t in run_tuner(RandomTuner(20, seed), lambda i: 0.0, NO_EARLY)[0]]

    assert order(7) == order(7)
    assert sorted(order(7)) == list(range(20))
    assert order(7) != list(range(20))
    assert len({tuple(order(seed)) for seed in range(10)}) == 10


def test_random_choice_depends_on_what_ran_not_on_arrival_order() -> None:
    tuner = RandomTuner(30, seed=3)
    first = tuner.next_batch([], 4)
    history = [Trial(i, float(i)) for i in first]
    assert tuner.next_batch(history, 3) == tuner.next_batch(history[::-1], 3)
    assert not set(tuner.next_batch(history, 3)) & set(first)


# ---------------------------------------------------------------- model-based


def test_model_based_finds_the_best_region_in_a_few_trials(space: list[Experiment]) -> None:
    values = [throughput(e) for e in space]
    rank = ranks(values)

    def best_rank(tuner) -> int:
        history, _ = run_tuner(tuner, lambda i: values[i], StopRule(num_trials=12, early_stopping=None))
        return min(rank[t.index] for t in history)

    model = [best_rank(ModelBasedTuner(space, seed)) for seed in range(12)]
    rand = [best_rank(RandomTuner(len(space), seed)) for seed in range(12)]
    assert sum(r < 13 for r in model) >= 8  # top 5% of 256 within 12 trials, in most seeds
    assert sum(model) < sum(rand)


def test_model_based_minimises_latency(space: list[Experiment]) -> None:
    latency = [1000.0 / throughput(e) for e in space]
    rank = ranks(latency, maximize=False)
    rule = StopRule(maximize=False, num_trials=12, early_stopping=None)
    found = []
    for seed in range(6):
        history, state = run_tuner(ModelBasedTuner(space, seed, maximize=False), lambda i: latency[i], rule)
        assert state.best.value == min(t.value for t in history)
        found.append(rank[state.best.index])
    assert sorted(found)[len(found) // 2] < 13


def test_model_based_still_explores_every_config() -> None:
    # Trials at even x fall from 10 to 4, so the model ranks the untried odd x as 1 > 3 > 5 > 7;
    # over many seeds every untried config is still chosen, the predicted best most often.
    configs = [{"zero_optimization": {"reduce_bucket_size": float(x)}} for x in range(8)]
    history = [Trial(0, 10.0), Trial(2, 8.0), Trial(4, 6.0), Trial(6, 4.0)]
    assert ModelBasedTuner(configs, 0, exploration=0.0).next_batch(history, 3) == [1, 3, 5]
    picks = [ModelBasedTuner(configs, seed).next_batch(history, 1)[0] for seed in range(120)]
    assert set(picks) == {1, 3, 5, 7}
    assert 0.75 < picks.count(1) / len(picks) < 0.95  # 0.8 greedy + 0.2 / 4 exploring


def test_model_based_starts_in_seeded_random_order() -> None:
    configs = [{"x": i} for i in range(10)]
    assert ModelBasedTuner(configs, 5).next_batch([], 3) == RandomTuner(10, 5).next_batch([], 3)
    one_success = [Trial(2, 1.0), Trial(4, None)]
    assert ModelBasedTuner(configs, 5).scores(one_success) is None


def test_model_based_scores_ignore_arrival_order() -> None:
    configs = [{"x": i, "y": i % 3} for i in range(12)]
    history = [Trial(3, 5.0), Trial(8, 2.0), Trial(1, None), Trial(10, 4.0)]
    tuner = ModelBasedTuner(configs, 1)
    assert np.array_equal(tuner.scores(history), ModelBasedTuner(configs, 1).scores(history[::-1]))


def test_model_based_scores_failures_as_the_worst() -> None:
    configs = [{"x": i} for i in range(10)]
    history = [Trial(0, 10.0), Trial(1, 11.0), Trial(8, None), Trial(9, None)]
    scores = ModelBasedTuner(configs, 0, exploration=0.0).scores(history)
    assert scores[9] < scores[1]
    assert ModelBasedTuner(configs, 0, exploration=0.0).next_batch(history, 1) == [2]  # next to the best


# ---------------------------------------------------------------- stopping rules


def test_early_stopping_counts_like_deepspeed() -> None:
    # DeepSpeed trace C: "Tuner early stopped at iteration 7. Best iteration is 2. threshold is 5"
    values = [1.0, 2.0, 5.0, 4.0, 3.0, 2.0, 1.0, 9.0, 9.5]
    history, state = run_tuner(GridTuner(len(values)), lambda i: values[i], StopRule(early_stopping=5))
    assert (state.trials, state.best_iter, state.best, state.stop) == (7, 2, Trial(2, 5.0), Stop.EARLY)


@pytest.mark.parametrize("batch_size", [1, 2, 3, 4, 8])
def test_batching_does_not_change_the_early_stopping_count(batch_size: int) -> None:
    values = [1.0, 2.0, 5.0, 4.0, 3.0, 2.0, 1.0, 9.0, 9.5, 10.0]
    history, state = run_tuner(GridTuner(len(values)), lambda i: values[i], StopRule(early_stopping=5), batch_size)
    assert [t.index for t in history] == list(range(7))
    assert state.stop is Stop.EARLY


def test_every_failure_still_stops_early() -> None:
    history, state = run_tuner(GridTuner(40), lambda i: None, StopRule(early_stopping=5), batch_size=3)
    assert (len(history), state.best, state.stop) == (5, None, Stop.EARLY)


def test_failures_count_as_trials_without_value() -> None:
    values = [None, 3.0, None, None, 2.0, None, 1.0]
    history, state = run_tuner(GridTuner(len(values)), lambda i: values[i], StopRule(early_stopping=4))
    assert (state.trials, state.best, state.best_iter) == (5, Trial(1, 3.0), 1)


@pytest.mark.parametrize("batch_size", [1, 3, 4, 10])
def test_trial_cap_is_exact(batch_size: int) -> None:
    history, state = run_tuner(GridTuner(20), lambda i: float(i),
                               StopRule(num_trials=7, early_stopping=None), batch_size)
    assert len(history) == 7 and state.stop is Stop.TRIALS


def test_trial_cap_counts_running_experiments() -> None:
    rule = StopRule(num_trials=3, early_stopping=None)
    assert plan(GridTuner(10), [], rule, free_slots=8, running=[0, 1]) == [2]
    assert plan(GridTuner(10), [Trial(2, 1.0)], rule, free_slots=8, running=[0, 1]) == []
    assert not progress([Trial(2, 1.0)], rule, 10, running=[0, 1]).done
    assert progress([Trial(2, 1.0), Trial(0, 1.0), Trial(1, 1.0)], rule, 10).done


def test_plan_waits_when_in_flight_trials_could_reach_the_stopping_point() -> None:
    rule = StopRule(early_stopping=3)
    assert plan(GridTuner(10), [], rule, free_slots=8) == [0, 1, 2]
    waiting = progress([Trial(0, 1.0)], rule, 10, running=[1, 2])
    assert plan(GridTuner(10), [Trial(0, 1.0)], rule, free_slots=7, running=[1, 2]) == []
    assert waiting.stop is None and not waiting.done
    # 2 improved: the window now ends after trial 1 + 3, and 1 is still running: room for one more
    assert plan(GridTuner(10), [Trial(0, 1.0), Trial(2, 4.0)], rule, free_slots=7, running=[1]) == [3]


def test_in_flight_results_after_the_stop_count_for_the_best_only() -> None:
    rule = StopRule(early_stopping=2)
    history = [Trial(0, 5.0), Trial(1, 1.0), Trial(2, 9.0)]  # 2 was running when the stop fired
    state = progress(history, rule, 10)
    assert state.stop is Stop.EARLY and state.best == Trial(2, 9.0)
    assert plan(GridTuner(10), history, rule, free_slots=4) == []


def test_latency_is_minimised() -> None:
    values = [30.0, 10.0, 20.0, 10.0]
    state = progress([Trial(i, v) for i, v in enumerate(values)], StopRule(maximize=False), 4)
    assert state.best == Trial(1, 10.0)
    state = progress([Trial(i, v) for i, v in enumerate(values)], StopRule(maximize=True), 4)
    assert state.best == Trial(0, 30.0)


def test_non_finite_values_are_failures() -> None:
    state = progress([Trial(0, float("nan")), Trial(1, float("inf")), Trial(2, 1.0)], StopRule(), 3)
    assert state.best == Trial(2, 1.0)


# ---------------------------------------------------------------- replay


def simulate(tuner_for, size: int, value, slots: int, rule: StopRule, seed: int):
    """An asynchronous run: experiments finish in a seeded random order, plan() on every finish."""
    finish_order = random.Random(seed)
    history: list[Trial] = []
    running: list[int] = []
    calls: list[tuple[list[Trial], list[int], int, list[int]]] = []
    while True:
        free = slots - len(running)
        started = plan(tuner_for(), history, rule, free, running)
        calls.append((list(history), list(running), free, started))
        running += started
        if not running:
            return history, calls
        done = running.pop(finish_order.randrange(len(running)))
        history.append(Trial(done, value(done)))


@pytest.mark.parametrize("kind", ["gridsearch", "random", "model_based"])
def test_same_history_gives_the_same_next_choice(space: list[Experiment], kind: str) -> None:
    values = [throughput(e) for e in space]
    rule = StopRule(num_trials=14, early_stopping=6)
    history, calls = simulate(lambda: make_tuner(kind, space, seed=11), len(space), lambda i: values[i],
                              slots=3, rule=rule, seed=4)
    assert len(history) <= 14 and len({t.index for t in history}) == len(history)
    fresh = make_tuner(kind, space, seed=11)  # e.g. after a crash: rebuilt, then replayed
    for past, running, free, started in calls:
        assert plan(fresh, past, rule, free, running) == started


def test_different_seeds_take_different_model_based_paths(space: list[Experiment]) -> None:
    values = [throughput(e) for e in space]
    rule = StopRule(num_trials=6, early_stopping=None)
    paths = {tuple(t.index for t in run_tuner(ModelBasedTuner(space, s), lambda i: values[i], rule)[0])
             for s in range(3)}
    assert len(paths) == 3


# ---------------------------------------------------------------- plumbing


def test_trials_from_records(space: list[Experiment]) -> None:
    records: list[dict[str, Any]] = [
        {"name": space[5].name, "status": "ok", "metrics": {"throughput": 12.5}},
        {"name": "z0_gas1_tmbspg1", "status": "ok", "metrics": {"throughput": 99.0}},
        {"name": space[2].name, "status": "oom", "metrics": None},
        {"name": space[7].name, "status": "ok", "metrics": {"latency": 3.0}},
    ]
    assert trials_from_records(space, records, "throughput") == [Trial(5, 12.5), Trial(2, None), Trial(7, None)]


def test_make_tuner() -> None:
    candidates = [Experiment(f"e{i}", 1, 1, 1, {"x": i}) for i in range(4)]
    assert isinstance(make_tuner("gridsearch", candidates, seed=0), GridTuner)
    assert isinstance(make_tuner("random", candidates, seed=0), RandomTuner)
    assert isinstance(make_tuner("model_based", candidates, seed=0), ModelBasedTuner)
    with pytest.raises(ValueError, match="tuner_type 'xgboost'"):
        make_tuner("xgboost", candidates, seed=0)


def test_bad_histories_are_refused() -> None:
    with pytest.raises(ValueError, match="twice"):
        GridTuner(4).next_batch([Trial(1, 1.0), Trial(1, 2.0)], 1)
    with pytest.raises(ValueError, match="outside"):
        GridTuner(4).next_batch([Trial(4, 1.0)], 1)
    with pytest.raises(ValueError, match="both finished"):
        progress([Trial(1, 1.0)], StopRule(), 4, running=[1])


def test_feature_matrix_keeps_varying_leaves_with_one_length() -> None:
    configs = [
        {"zero_optimization": {"stage": 2, "overlap_comm": True, "reduce_bucket_size": 5e8},
         "autotuning": {"metric_path": "a"}, "train_micro_batch_size_per_gpu": 4},
        {"zero_optimization": {"stage": 2, "overlap_comm": False, "offload_optimizer": {"device": "cpu"}},
         "autotuning": {"metric_path": "b"}, "train_micro_batch_size_per_gpu": 4},
    ]
    features = feature_matrix(configs)
    assert features.shape == (2, 3)  # device, overlap_comm, reduce_bucket_size
    assert features[:, 0].tolist() == [-1.0, 0.0]  # missing, then the one JSON text seen
    assert features[:, 1].tolist() == [1.0, 0.0]
    assert features[:, 2].tolist() == [5e8, 5e8 - 1]  # missing: just below the column's minimum
