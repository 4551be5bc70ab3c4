"""The tuners and DeepSpeed's tuning-loop rules (`scheduler.search.tuners`): order, seeds, stopping, replay."""
from __future__ import annotations

import json
import math
import random
from typing import Any

import numpy as np
import pytest

from scheduler.inputs.config import load_config
from scheduler.search.full_space import full_experiments
from scheduler.search.space import Experiment
from scheduler.search.tuners import (
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


# ---------------------------------------------------------------- found by mutation testing: bounds and messages

from scheduler.search.tuners import Progress, Tuner  # noqa: E402


def test_deepspeed_s_stopping_defaults() -> None:
    # DeepSpeed's autotuning constants: tuner_num_trials 50, tuner_early_stopping 5; it maximises
    rule = StopRule()
    assert (rule.maximize, rule.num_trials, rule.early_stopping) == (True, 50, 5)


@pytest.mark.parametrize(
    ("stop", "running", "done"),
    [(None, 0, False), (Stop.EARLY, 0, True), (Stop.EARLY, 1, False), (Stop.TRIALS, 0, True),
     (Stop.EXHAUSTED, 2, False)],
)
def test_progress_is_done_when_stopped_and_nothing_runs(stop: Stop | None, running: int, done: bool) -> None:
    assert Progress(3, None, 0, stop, running).done is done


def test_progress_counts_running_experiments() -> None:
    state = progress([Trial(0, 1.0)], StopRule(early_stopping=None), 10, running=[3, 4])
    assert (state.trials, state.running, state.stop) == (1, 2, None)


def test_a_tuner_of_no_candidates_proposes_nothing() -> None:
    assert GridTuner(0).next_batch([], 4) == []
    assert RandomTuner(0, seed=1).next_batch([], 4) == []
    assert progress([], StopRule(), 0).stop is Stop.EXHAUSTED


def test_a_negative_candidate_count_is_refused() -> None:
    with pytest.raises(ValueError) as caught:
        GridTuner(-1)
    assert str(caught.value) == "a tuner needs a candidate count >= 0, got -1"


@pytest.mark.parametrize("exploration", [-0.01, 1.01])
def test_exploration_outside_0_1_is_refused(exploration: float) -> None:
    with pytest.raises(ValueError) as caught:
        ModelBasedTuner([{"x": 1}, {"x": 2}], 0, exploration=exploration)
    assert str(caught.value) == f"exploration is a probability in [0, 1], got {exploration}"


def test_exploration_bounds_are_allowed() -> None:
    configs = [{"x": i} for i in range(6)]
    history = [Trial(0, 1.0), Trial(5, 6.0)]  # the model ranks x near 5 best
    greedy = ModelBasedTuner(configs, 3, exploration=0.0)
    assert greedy.next_batch(history, 1) == [4]
    always = [ModelBasedTuner(configs, seed, exploration=1.0).next_batch(history, 1)[0] for seed in range(40)]
    assert set(always) == {1, 2, 3, 4}  # uniform over the untried, not only the predicted best


@pytest.mark.parametrize("init_trials", [0, 1])
def test_at_least_one_success_is_needed_before_a_model(init_trials: int) -> None:
    configs = [{"x": i} for i in range(6)]
    tuner = ModelBasedTuner(configs, 0, init_trials=init_trials)
    assert tuner.scores([]) is None
    assert tuner.scores([Trial(1, None)]) is None
    scores = tuner.scores([Trial(1, 2.0)])
    assert scores is not None and scores.tolist() == [0.0] * 6  # one value: nothing to tell apart


def test_the_model_needs_init_trials_successes() -> None:
    configs = [{"x": i} for i in range(6)]
    tuner = ModelBasedTuner(configs, 0, init_trials=3)
    assert tuner.scores([Trial(0, 1.0), Trial(1, 2.0), Trial(2, None)]) is None
    assert tuner.scores([Trial(0, 1.0), Trial(1, 2.0), Trial(2, 3.0)]) is not None


def test_bad_index_messages() -> None:
    with pytest.raises(ValueError) as caught:
        GridTuner(4).next_batch([Trial(4, 1.0), Trial(-1, 1.0)], 1)
    assert str(caught.value) == "candidate indices [4, -1] are outside 0..3"
    with pytest.raises(ValueError) as caught:
        GridTuner(4).next_batch([], 1, running=[7])
    assert str(caught.value) == "candidate indices [7] are outside 0..3"
    with pytest.raises(ValueError) as caught:
        GridTuner(4).next_batch([Trial(1, 1.0), Trial(1, 2.0)], 1)
    assert str(caught.value) == "the history holds a candidate twice; keep one record per experiment name"
    with pytest.raises(ValueError) as caught:
        progress([Trial(1, 1.0)], StopRule(), 4, running=[1])
    assert str(caught.value) == "an experiment cannot be both finished (history) and running"
    assert GridTuner(4).next_batch([Trial(0, 1.0), Trial(3, 1.0)], 4) == [1, 2]  # 0 and size - 1 are valid


def test_make_tuner_message_lists_deepspeed_s_tuner_types() -> None:
    with pytest.raises(ValueError) as caught:
        make_tuner("xgboost", [], seed=0)
    assert str(caught.value) == "tuner_type 'xgboost' is not one of gridsearch, random, model_based"


def test_make_tuner_passes_seed_and_direction() -> None:
    candidates = [Experiment(f"e{i}", 1, 1, 1, {"x": i}) for i in range(10)]
    random_tuner = make_tuner("random", candidates, seed=9)
    assert random_tuner.next_batch([], 10) == RandomTuner(10, 9).next_batch([], 10)
    model = make_tuner("model_based", candidates, seed=9, maximize=False)
    assert (model.seed, model.maximize, model.size) == (9, False, 10)
    assert make_tuner("model_based", candidates, seed=9).maximize is True
    assert make_tuner("gridsearch", candidates, seed=9).size == 10


@pytest.mark.parametrize(
    ("history", "free", "running", "rule", "expected"),
    [
        # cap 5: 2 finished + 1 running leave 2
        ([Trial(0, 1.0), Trial(1, 2.0)], 8, [2], StopRule(num_trials=5, early_stopping=None), [3, 4]),
        # window: best at iteration 1 (0 before it) + 4 = 4 trials; 2 finished + 1 running leave 1
        ([Trial(0, 3.0), Trial(1, 2.0)], 8, [2], StopRule(num_trials=50, early_stopping=4), [3]),
        # early stopping 0 is off, like None
        ([Trial(0, 3.0), Trial(1, 2.0)], 2, [], StopRule(num_trials=50, early_stopping=0), [2, 3]),
        # free slots bound it
        ([], 1, [], StopRule(num_trials=50, early_stopping=5), [0]),
    ],
    ids=["cap", "window", "early-stopping-off", "free-slots"],
)
def test_plan_starts_what_can_still_count(history, free, running, rule, expected) -> None:
    assert plan(GridTuner(10), history, rule, free, running) == expected


@pytest.mark.parametrize(
    ("values", "early", "trials", "best_iter"),
    [
        ([1.0, 1.0, 1.0], 3, 3, 0),  # a tie does not move the best: stop at 0 + 3
        ([1.0, 2.0, 2.0, 2.0], 2, 3, 1),
        ([None, None, 5.0, 1.0, 1.0], 3, 5, 2),  # a first success at trial 3 moves the window to 2 + 3
        ([None, None, 5.0], 2, 2, 0),  # no success yet: the window counts from the first trial
    ],
)
def test_the_early_stopping_window(values, early: int, trials: int, best_iter: int) -> None:
    history, state = run_tuner(GridTuner(len(values) + 5), lambda i: values[i] if i < len(values) else 0.0,
                               StopRule(early_stopping=early))
    assert (state.trials, state.best_iter, state.stop) == (trials, best_iter, Stop.EARLY)


def test_the_trial_cap_and_exhaustion_bounds() -> None:
    assert progress([Trial(0, 1.0)], StopRule(num_trials=2, early_stopping=None), 5, running=[1]).stop is Stop.TRIALS
    assert progress([Trial(0, 1.0)], StopRule(num_trials=3, early_stopping=None), 5, running=[1]).stop is None
    assert progress([Trial(0, 1.0)], StopRule(num_trials=9, early_stopping=None), 2, running=[1]).stop is Stop.EXHAUSTED
    assert progress([Trial(0, 1.0)], StopRule(num_trials=9, early_stopping=None), 3, running=[1]).stop is None
    # the trial cap is reported before exhaustion, early stopping before both
    assert progress([Trial(0, 1.0)], StopRule(num_trials=1, early_stopping=None), 1).stop is Stop.TRIALS
    assert progress([Trial(0, 1.0)], StopRule(num_trials=1, early_stopping=1), 1).stop is Stop.EARLY


@pytest.mark.parametrize(
    ("configs", "expected"),
    [
        ([], (0, 1)),
        ([{"a": 1}, {"a": 1}], (2, 1)),
        ([{"a": True}, {"a": False}], (2, 1)),
    ],
    ids=["none", "nothing-varies", "booleans"],
)
def test_feature_matrix_shapes(configs, expected) -> None:
    assert feature_matrix(configs).shape == expected


def test_feature_matrix_codes() -> None:
    configs = [
        {"b": True, "n": 2, "s": "x", "inf": float("inf"), "empty": {}, "sub": {"autotuning": 1}, "autotuning": {"a": 1}},
        {"b": False, "n": 5, "s": "a", "inf": 1.0, "empty": {"k": 1}, "sub": {"autotuning": 2}, "autotuning": {"a": 2}},
        {"b": True, "s": "x", "inf": 1.0, "empty": {}, "sub": {"autotuning": 3}, "autotuning": {"a": 3}},
    ]
    features = feature_matrix(configs)
    # sorted leaf paths: b, empty, empty.k, inf, n, s, sub.autotuning (top-level autotuning left out)
    assert features.T.tolist() == [
        [1.0, 0.0, 1.0],  # booleans as 0/1
        [0.0, -1.0, 0.0],  # an empty object is a leaf: its JSON text "{}", missing below
        [0.0, 1.0, 0.0],  # a number column: missing is its minimum minus 1
        [1.0, 0.0, 0.0],  # a non-finite number makes the column text: "1.0" < "Infinity"
        [2.0, 5.0, 1.0],
        [1.0, 0.0, 1.0],  # texts coded by their sorted JSON: "a" 0, "x" 1
        [1.0, 2.0, 3.0],
    ]


def test_tuners_keep_their_seed_for_resuming() -> None:
    assert RandomTuner(10, seed=7).seed == 7
    assert ModelBasedTuner([{"x": 1}, {"x": 2}], seed=8).seed == 8


TEN = [{"x": i} for i in range(10)]


@pytest.mark.parametrize("seed", range(4))
def test_ties_in_the_model_go_to_the_candidates_next_to_the_best_trial(seed: int) -> None:
    # the model sees x <= 4 at 5.0 and x >= 5 at 9.0: 5, 6, 8, 9 tie; 6 and 8 are next to the best (7)
    history = [Trial(2, 5.0), Trial(7, 9.0)]
    assert sorted(ModelBasedTuner(TEN, seed, exploration=0.0).next_batch(history, 2)) == [6, 8]
    # minimising, the best is 2 (5.0): its neighbours among the predicted-best region x <= 4
    assert sorted(ModelBasedTuner(TEN, seed, maximize=False, exploration=0.0).next_batch(history, 2)) == [1, 3]


@pytest.mark.parametrize("seed", range(4))
def test_two_equally_best_trials_the_earlier_candidate_is_the_best(seed: int) -> None:
    history = [Trial(8, 9.0), Trial(1, 9.0), Trial(4, 1.0)]
    assert sorted(ModelBasedTuner(TEN, seed, exploration=0.0).next_batch(history, 2)) == [0, 2]


def test_failures_score_as_the_worst_value_below_one() -> None:
    # values below 1: a failure must still rank below every measured value
    history = [Trial(0, 0.5), Trial(1, 0.25), Trial(8, None), Trial(9, None)]
    tuner = ModelBasedTuner(TEN, 0, exploration=0.0)
    scores = tuner.scores(history)
    assert scores[9] < scores[0] and scores[8] <= scores[1] + 1e-9
    assert tuner.next_batch(history, 3) == [2, 3, 4]


def test_plan_starts_nothing_when_in_flight_trials_already_pass_the_window() -> None:
    # best at iteration 0, window 2, but 1 finished + 2 running = 3 started: nothing more may start
    assert plan(GridTuner(10), [Trial(0, 1.0)], StopRule(early_stopping=2), 4, running=[1, 2]) == []
    assert GridTuner(4).next_batch([], -1) == []


def test_feature_paths_keep_their_parents() -> None:
    configs = [{"a": {"x": 1}, "b": {"x": 5}}, {"a": {"x": 2}, "b": {"x": 5}}]
    assert feature_matrix(configs).tolist() == [[1.0], [2.0]]  # a.x varies, b.x does not


def test_feature_texts_ignore_key_order_and_accept_any_value() -> None:
    from pathlib import Path

    same = [{"l": [{"a": 1, "b": 2}], "n": 1}, {"l": [{"b": 2, "a": 1}], "n": 2}]
    assert feature_matrix(same).tolist() == [[1.0], [2.0]]  # the two lists are one JSON text
    unsorted = [{"l": [{"b": 2, "a": 1}]}, {"l": [{"c": 0}]}]
    assert feature_matrix(unsorted).tolist() == [[0.0], [1.0]]  # '[{"a": 1, "b": 2}]' < '[{"c": 0}]'
    paths = [{"p": Path("b")}, {"p": Path("a")}, {"p": Path("b")}]
    assert feature_matrix(paths).tolist() == [[1.0], [0.0], [1.0]]


@pytest.mark.parametrize("seed", range(6))
def test_distance_counts_each_key_s_rank_scaled_to_0_1(seed: int) -> None:
    """Equal scores go to the candidates nearest the best, each key's rank scaled to [0, 1]: one step
    of a 2-valued key (1.0) is farther than three steps of a 5-valued one (3/4)."""
    configs = [{"a": a, "b": b} for a in (0, 1) for b in range(5)]
    index = {(c["a"], c["b"]): i for i, c in enumerate(configs)}
    history = [Trial(index[(0, 0)], 5.0), Trial(index[(1, 4)], 5.0)]  # equal values: no model, all tie
    picks = ModelBasedTuner(configs, seed, exploration=0.0).next_batch(history, 3)
    assert picks == [index[(0, 1)], index[(0, 2)], index[(0, 3)]]


def test_plan_refuses_an_experiment_both_finished_and_running() -> None:
    with pytest.raises(ValueError, match="both finished"):
        plan(GridTuner(4), [Trial(1, 1.0)], StopRule(), 2, running=[1])


def test_run_tuner_runs_one_at_a_time_unless_given_more_slots() -> None:
    class Recording(GridTuner):
        def __init__(self, size: int) -> None:
            super().__init__(size)
            self.asked: list[tuple[int, int]] = []

        def next_batch(self, history, n, running=()):
            self.asked.append((len(history), n))
            return super().next_batch(history, n, running)

    one = Recording(3)
    run_tuner(one, float, NO_EARLY)
    assert one.asked == [(0, 1), (1, 1), (2, 1)]  # every proposal sees every earlier result
    two = Recording(3)
    run_tuner(two, float, NO_EARLY, batch_size=2)
    assert two.asked == [(0, 2), (2, 2)]
