"""Which experiments of a full-mode space to run next, and when to stop: DeepSpeed's tuners, replayable.

A tuner sees only the candidates (fixed at construction), its seed, and the trials so far, and
answers `next_batch(history, n, running) -> [candidate index]`. No state carries between calls (the
model-based tuner only memoises its last fit), so the scheduler can rebuild it after a crash and
replay the stored records: the same history (and the same experiments in flight) always gives the
same next choice.

`plan()` wraps a tuner with DeepSpeed's `BaseTuner.tune` rules: a trial cap (`tuner_num_trials`),
early stopping (`tuner_early_stopping`), latency minimised while throughput and FLOPS are maximised
(DeepSpeed maximises all three), and failed experiments counted as trials with no value.

How concurrency changes early stopping. DeepSpeed runs a batch of `free slots` experiments, waits
for all of them, takes the batch's best, and credits it to the *start* of the batch; it checks the
cap and the stop rule only between batches, so it overshoots both by up to a batch. Here results are
counted one by one in the order they arrived, exactly as DeepSpeed's one-at-a-time loop counts them
(stop once `trials >= best_iter + early_stopping`, where best_iter = trials before the best one),
and `plan()` never starts a trial that could only run past the cap or past the stopping point if
every experiment in flight fails to improve. So, for the same sequence of results, the number of
trials equals the sequential loop's exactly, whatever the batch size. Experiments already in flight
when the stop fires still finish and may still become the best; they never restart the search.
When nothing has succeeded yet the stopping window counts from the first trial, so a space where
everything fails stops after `early_stopping` trials (DeepSpeed runs on to `tuner_num_trials`).
"""
from __future__ import annotations

import json
import math
import random
from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable, Collection, Mapping, Sequence

import numpy as np

from scheduler.inputs.config_schema import TUNER_TYPES
from scheduler.search.ranking import metric_value
from scheduler.search.space import Experiment



@dataclass(frozen=True)
class Trial:
    """One finished experiment, by its index among the candidates."""

    index: int
    value: float | None  #: the metric; None when it failed (status != "ok") or reported none


class Stop(str, Enum):
    """Why no further trial may start."""

    EARLY = "early_stopping"  #: `early_stopping` trials counted from the best one (itself included)
    TRIALS = "num_trials"  #: the trial cap is reached (trials finished plus in flight)
    EXHAUSTED = "exhausted"  #: every candidate has run or is running


@dataclass(frozen=True)
class StopRule:
    """DeepSpeed's stopping knobs; its defaults are tuner_num_trials 50, tuner_early_stopping 5."""

    maximize: bool = True
    num_trials: int = 50
    early_stopping: int | None = 5  #: None or 0 switches early stopping off


@dataclass(frozen=True)
class Progress:
    """Where a tuning run stands, computed from its history alone."""

    trials: int  #: trials finished (DeepSpeed's "iteration")
    best: Trial | None  #: the best successful trial (ties: the earlier one)
    best_iter: int  #: trials finished before the best one (0 while none succeeded)
    stop: Stop | None  #: why no new trial may start, or None
    running: int = 0

    @property
    def done(self) -> bool:
        return self.stop is not None and self.running == 0


# ---------------------------------------------------------------- tuners


class Tuner(ABC):
    """Chooses candidate indices to run next; stateless between calls."""

    def __init__(self, size: int) -> None:
        if size < 0:
            raise ValueError(f"a tuner needs a candidate count >= 0, got {size}")
        self.size = size

    def next_batch(self, history: Sequence[Trial], n: int, running: Collection[int] = ()) -> list[int]:
        """Up to `n` distinct candidates that have neither run (`history`) nor are `running`."""
        taken = _tried(history, self.size) | _checked(running, self.size)
        untried = [i for i in range(self.size) if i not in taken]
        if n <= 0 or not untried:
            return []
        return self._choose(history, untried, min(n, len(untried)))

    @abstractmethod
    def _choose(self, history: Sequence[Trial], untried: list[int], n: int) -> list[int]:
        """`n` of `untried` (n <= len(untried)), best first."""


class GridTuner(Tuner):
    """Candidates in their given order (full_space's product order, the same on every run)."""

    def _choose(self, history: Sequence[Trial], untried: list[int], n: int) -> list[int]:
        return untried[:n]


class RandomTuner(Tuner):
    """Candidates in one seeded random order; the caller stores the seed to resume."""

    def __init__(self, size: int, seed: int) -> None:
        super().__init__(size)
        self.seed = seed
        self._order = _permutation(size, seed)

    def _choose(self, history: Sequence[Trial], untried: list[int], n: int) -> list[int]:
        free = set(untried)
        return [i for i in self._order if i in free][:n]


class ModelBasedTuner(Tuner):
    """A gradient-boosted cost model over the candidates' tuned keys picks the predicted best.

    Until `init_trials` trials have succeeded it explores in a seeded random order. Afterwards each
    pick is, with probability `exploration`, a uniformly random untried candidate (so every
    candidate can be chosen at any step) and otherwise the untried candidate the model predicts
    best. A tree model predicts whole regions alike; such ties go to the candidate closest to the
    best trial so far (a local search inside the predicted-best region), then the seeded order.
    The model is fitted to every finished trial; a failed one is scored as the worst value seen,
    which steers the search away from e.g. OOM regions. The random stream of a call is derived
    from (seed, trials proposed so far), so replay agrees.
    """

    def __init__(self, candidates: Sequence[Experiment | Mapping[str, Any]], seed: int,
                 maximize: bool = True, exploration: float = 0.2, init_trials: int = 2) -> None:
        super().__init__(len(candidates))
        if not 0.0 <= exploration <= 1.0:
            raise ValueError(f"exploration is a probability in [0, 1], got {exploration}")
        self.seed, self.maximize = seed, maximize
        self.exploration, self.init_trials = exploration, max(1, init_trials)
        self.features = feature_matrix([_ds_config(c) for c in candidates])
        self._order = _permutation(self.size, seed)
        self._rank = {index: position for position, index in enumerate(self._order)}
        self._position = _ordinal(self.features)
        self._cache: tuple[Any, np.ndarray] | None = None

    def _choose(self, history: Sequence[Trial], untried: list[int], n: int) -> list[int]:
        scores = self.scores(history)
        rng = np.random.default_rng([_seed_word(self.seed), self.size - len(untried)])
        if scores is None:
            free = set(untried)
            return [i for i in self._order if i in free][:n]
        distance = self._distance_to_best(history)
        ranked = sorted(untried, key=lambda i: (-scores[i], distance[i], self._rank[i]))
        picks: list[int] = []
        for _ in range(n):
            pool = [i for i in ranked if i not in picks]
            explore = rng.random() < self.exploration
            picks.append(pool[int(rng.integers(len(pool)))] if explore else pool[0])
        return picks

    def _distance_to_best(self, history: Sequence[Trial]) -> np.ndarray:
        sign = 1.0 if self.maximize else -1.0
        best = max((t for t in history if _usable(t.value)), key=lambda t: (sign * t.value, -t.index))
        return np.abs(self._position - self._position[best.index]).sum(axis=1)

    def scores(self, history: Sequence[Trial]) -> np.ndarray | None:
        """The model's predicted goodness of every candidate (higher is better), or None before
        enough trials have succeeded to fit one."""
        rows = sorted({t.index: t.value for t in history}.items())
        values = [v for _, v in rows if _usable(v)]
        if len(values) < self.init_trials:
            return None
        key = tuple(rows)
        if self._cache is None or self._cache[0] != key:
            self._cache = (key, self._fit_predict(rows, values))
        return self._cache[1].copy()

    def _fit_predict(self, rows: list[tuple[int, float | None]], values: list[float]) -> np.ndarray:
        sign = 1.0 if self.maximize else -1.0
        worst = min(sign * v for v in values)
        x = self.features[[i for i, _ in rows]]
        y = np.array([sign * v if _usable(v) else worst for _, v in rows])
        if np.ptp(y) == 0:
            return np.zeros(self.size)
        from sklearn.ensemble import GradientBoostingRegressor  # seconds to import; only this tuner fits

        model = GradientBoostingRegressor(n_estimators=20, learning_rate=0.3, max_depth=3, random_state=0)
        return model.fit(x, y).predict(self.features)


def make_tuner(tuner_type: str, candidates: Sequence[Experiment], *, seed: int, maximize: bool = True) -> Tuner:
    """The tuner DeepSpeed's `autotuning.tuner_type` names (gridsearch | random | model_based)."""
    if tuner_type == "gridsearch":
        return GridTuner(len(candidates))
    if tuner_type == "random":
        return RandomTuner(len(candidates), seed)
    if tuner_type == "model_based":
        return ModelBasedTuner(candidates, seed, maximize=maximize)
    raise ValueError(f"tuner_type {tuner_type!r} is not one of {', '.join(TUNER_TYPES)}")


# ---------------------------------------------------------------- the tuning loop


def progress(history: Sequence[Trial], rule: StopRule, size: int, running: Collection[int] = ()) -> Progress:
    """Best so far and whether to stop, counting the history in the order results arrived."""
    _tried(history, size)
    best: Trial | None = None
    best_iter, stopped = 0, False
    for count, trial in enumerate(history, start=1):
        if _usable(trial.value) and (best is None or _better(trial.value, best.value, rule.maximize)):
            best, best_iter = trial, count - 1
        stopped = stopped or (bool(rule.early_stopping) and count >= best_iter + rule.early_stopping)
    in_flight = _checked(running, size)
    if in_flight & {t.index for t in history}:
        raise ValueError("an experiment cannot be both finished (history) and running")
    started = len(history) + len(in_flight)
    stop = (Stop.EARLY if stopped else Stop.TRIALS if started >= rule.num_trials
            else Stop.EXHAUSTED if started >= size else None)
    return Progress(len(history), best, best_iter, stop, len(running))


def plan(tuner: Tuner, history: Sequence[Trial], rule: StopRule, free_slots: int,
         running: Collection[int] = ()) -> list[int]:
    """The candidates to start now on `free_slots` slots (possibly none: stop, or wait for results)."""
    state = progress(history, rule, tuner.size, running)
    if state.stop is not None:
        return []
    started = len(history) + len(running)
    allowed = min(free_slots, rule.num_trials - started)
    if rule.early_stopping:
        allowed = min(allowed, state.best_iter + rule.early_stopping - started)
    return tuner.next_batch(history, allowed, running)


def run_tuner(tuner: Tuner, evaluate: Callable[[int], float | None], rule: StopRule,
              batch_size: int = 1) -> tuple[list[Trial], Progress]:
    """Run to the end with `batch_size` slots, each batch finishing before the next starts.

    `evaluate(index)` returns the metric or None for a failure. A simulator of the scheduler's loop
    (the real caller runs experiments on Celery and calls `plan` as slots free up).
    """
    history: list[Trial] = []
    while batch := plan(tuner, history, rule, batch_size):
        history.extend(Trial(i, evaluate(i)) for i in batch)
    return history, progress(history, rule, tuner.size)


def trials_from_records(candidates: Sequence[Experiment], records: Sequence[Mapping[str, Any]],
                        metric: str) -> list[Trial]:
    """The history, from final result records in the order they finished.

    One record per experiment name; leave out records of experiments that will run again (e.g.
    interrupted ones): they are not trials. Records of names outside `candidates` are skipped.
    """
    index = {exp.name: i for i, exp in enumerate(candidates)}
    return [Trial(index[r["name"]], metric_value(dict(r), metric)) for r in records if r.get("name") in index]


# ---------------------------------------------------------------- features


def feature_matrix(configs: Sequence[Mapping[str, Any]]) -> np.ndarray:
    """One numeric row per config: every leaf (outside `autotuning`) whose value varies.

    Numbers stay numbers (booleans 0/1, a missing key just below the column's minimum); other
    values (offload dicts, strings) are coded by their sorted distinct JSON texts. All rows have
    the same length, which DeepSpeed's flattening does not guarantee.
    """
    flat = [_flatten(c) for c in configs]
    paths = sorted({p for row in flat for p in row})
    columns = [_column([row.get(p, _MISSING) for row in flat]) for p in paths]
    varying = [c for c in columns if np.ptp(c) > 0] if configs else []
    return np.column_stack(varying) if varying else np.zeros((len(configs), 1))


_MISSING = object()


def _flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    leaves: dict[str, Any] = {}
    for key, value in config.items():
        if not prefix and key == "autotuning":
            continue
        path = f"{prefix}.{key}" if prefix else key
        if isinstance(value, Mapping) and value:
            leaves.update(_flatten(value, path))
        else:
            leaves[path] = value
    return leaves


def _column(values: list[Any]) -> np.ndarray:
    present = [v for v in values if v is not _MISSING]
    if all(isinstance(v, (bool, int, float)) and math.isfinite(v) for v in present):
        floor = min((float(v) for v in present), default=0.0) - 1.0
        return np.array([floor if v is _MISSING else float(v) for v in values])
    texts = sorted({json.dumps(v, sort_keys=True, default=str) for v in present})
    code = {text: float(i) for i, text in enumerate(texts)}
    return np.array([-1.0 if v is _MISSING else code[json.dumps(v, sort_keys=True, default=str)]
                     for v in values])


def _ordinal(features: np.ndarray) -> np.ndarray:
    """Each column as the rank of its value among the column's distinct values, scaled to [0, 1]."""
    columns = []
    for column in features.T:
        distinct = np.unique(column)
        columns.append(np.searchsorted(distinct, column) / max(1, len(distinct) - 1))
    return np.column_stack(columns) if columns else np.zeros((len(features), 0))


# ---------------------------------------------------------------- helpers


def _ds_config(candidate: Experiment | Mapping[str, Any]) -> Mapping[str, Any]:
    return candidate.ds_config if isinstance(candidate, Experiment) else candidate


def _permutation(size: int, seed: int) -> list[int]:
    order = list(range(size))
    random.Random(seed).shuffle(order)
    return order


def _seed_word(seed: int) -> int:
    return seed % 2**64


def _usable(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


def _better(value: float, than: float, maximize: bool) -> bool:
    return value > than if maximize else value < than


def _tried(history: Sequence[Trial], size: int) -> set[int]:
    indices = [t.index for t in history]
    tried = _checked(indices, size)
    if len(tried) != len(indices):
        raise ValueError("the history holds a candidate twice; keep one record per experiment name")
    return tried


def _checked(indices: Collection[int], size: int) -> set[int]:
    bad = [i for i in indices if not 0 <= i < size]
    if bad:
        raise ValueError(f"candidate indices {bad} are outside 0..{size - 1}")
    return set(indices)
