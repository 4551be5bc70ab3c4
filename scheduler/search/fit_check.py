"""How well the fitted cost model predicted what a job measured: each config's pooled reading against
what the fit of the other configs of its stage predicts (leave one out).

Why: the search reads its readings through the cost model (`scheduler.search.cost_model`): a reading
the model contradicts is measured again, a size it predicts better is measured. A user deciding
whether to trust the pick, and the next engineer deciding whether the model's form fits real
scripts, need to see where the model was right and where it was not. The report prints this table
and plots it (`scheduler.report.model_fit`). Pure: experiments and records in, rows out.
"""
from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from scheduler.search.cost_model import Reading, fit
from scheduler.search.ranking import metric_value, pooled_value
from scheduler.search.space import PROFILE, Experiment


@dataclass(frozen=True)
class FitCheck:
    """One config: what it read (pooled over its readings) and what the others of its space predict."""

    space: str
    name: str  #: the config's first experiment
    mbs: int
    gas: int
    read: float
    readings: int
    predicted: float | None  #: None: fewer than three other configs in the space to fit

    @property
    def ratio(self) -> float | None:
        """read / predicted (None without a prediction)."""
        return self.read / self.predicted if self.predicted else None


def fit_checks(experiments: Sequence[Experiment], records: Mapping[str, Mapping[str, Any]],
               metric: str, maximize: bool) -> list[FitCheck]:
    """One row per measured config of every tuning space, in the order first measured; empty for a
    lower-is-better metric (the model is of throughput)."""
    if not maximize:
        return []
    configs: dict[tuple[str, int, int], tuple[str, list[float]]] = {}
    for exp in experiments:
        record = records.get(exp.name)
        value = metric_value(dict(record), metric) if record is not None else None
        if exp.space == PROFILE or value is None or value <= 0:
            continue
        key = (exp.space, exp.micro_batch_size, exp.gradient_accumulation_steps)
        configs.setdefault(key, (exp.name, []))[1].append(value)
    rows = []
    for (space, mbs, gas), (name, values) in configs.items():
        others = [Reading(m, g, pooled_value(v)) for (s, m, g), (_, v) in configs.items()
                  if s == space and (m, g) != (mbs, gas)]
        model = fit(others) if len(others) >= 3 else None
        rows.append(FitCheck(space, name, mbs, gas, pooled_value(values), len(values),
                             model.predict(mbs, gas) if model is not None else None))
    return rows


def median_error(rows: Sequence[FitCheck]) -> float | None:
    """The median of |read / predicted - 1| over the rows with a prediction (None: none)."""
    errors = [abs(row.ratio - 1) for row in rows if row.ratio is not None]
    return statistics.median(errors) if errors else None
