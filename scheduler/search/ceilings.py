"""A config whose readings its own stage's curve contradicts is ranked at what that curve predicts.

Why: a stage whose readings are sometimes lucky (1.3-1.8x its true throughput: a timing window
that missed steps, a neighbour's load lifted for one run) can read one config lucky twice in a row.
Two lucky readings agree with each other, so repeating them (`scheduler.search.confirm`) does not
expose them, and their mean beats an honest, better config of another stage: the winner's curse
(bench/lucky_stage.py). The readings of the same stage at other sizes tell: training time has the
structure `scheduler.search.cost_model` fits, and a smooth curve does not jump by a fifth at one
size while its neighbours stay below. So a config whose pooled value exceeds the fit of its stage's
other configs' readings (leave one out; each reading on its own, a torn pair's too, since one of
the two is honest; less the few the fit cannot explain, `cost_model.robust_fit`: on a stage often
read lucky, several lucky neighbours bend the fit of the rest) by more than `FLOOR` and by more
than `Z` standard errors of that prediction (which grow away from the measured sizes: an optimum
at the edge of the range, the real GPT example's micro-batch 1, is extrapolated and not
contradicted) is ranked at the prediction instead, until its own readings settle it: from
`SETTLED_READINGS` readings on, all within `AGREE_RATIO` of each other, they are believed over the
curve (a real spike at one size reads the same every time; a lucky stage's readings of one config
disagree, as only some runs are lucky), so `scheduler.search.confirm` measures a contradicted
contender until they do or it has that many. Three readings or more that do not settle are
ranked at the one nearest that fit (`unsettled_readings`): their median is a lucky reading
whenever two of them are. A config read twice whose readings are further apart than `AGREE_RATIO`
(`torn`) has no pooled value to judge with: the mean of a lucky reading and an honest one says
neither. Below the floor the curve is trusted to have features of its own (tiles, waves, the
allocator near the memory top). Only throughput-like metrics: the model is of seconds per sample.

A curve of two or three configs is too short to fit, but one bound holds on any curve: a step of
more samples (a larger micro-batch, more accumulation, or both) never takes less time, so a config
cannot read faster than a smaller one of its curve by more than their ratio of samples per step
(`dominance_bound`). A pooled value past that bound by more than `FLOOR` is ranked at the bound,
until its readings settle it as above (a lucky stage read 26 x 1 at 1.44 beside 20 x 1 at 0.69).
Settled readings do not lift a bound set by a smaller config read twice in agreement (`firm_bounds`):
it is a physical limit, not a fit, and three lucky readings in a row agree with each other too
(21 x 1 at 1.53, 1.31, 1.52 of its speed beside 19 x 1's 0.91). A bound set by a config read once
may be a straggler's reading: that config is the leader's witness (`bound_witnesses`), read again
before the winner is named (`scheduler.search.repeats`).

Pure: values in, ceilings out.
"""
from __future__ import annotations

import functools
import json
import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from scheduler.search.cost_model import TRIM_MISFIT, Reading, StageModel, closest_reading, robust_fit

#: A config's pooled value is contradicted only when it beats its stage's prediction by more than this.
FLOOR = 0.2
#: ... and by more than this many standard errors of the prediction.
Z = 3.0
#: The relative noise of one reading the prediction's error is computed with (at least the fit's misfit).
NOISE = 0.03
#: Readings of one config that settle it against its curve: at least this many ...
SETTLED_READINGS = 3
#: ... each within this ratio of the others (`scheduler.search.confirm.TORN_RATIO`: two readings
#: further apart are a straggler's or a lucky one and a real one).
AGREE_RATIO = 1.4
#: The keys of a config that place it on its stage's curve, not on another curve.
SIZE_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")


@dataclass(frozen=True)
class Point:
    """A config's pooled value, where it lies on its curve (`curve`: its stage and everything else)."""

    key: Hashable
    curve: str
    mbs: int
    gas: int
    value: float
    evidence: bool = True  #: whether its value may judge other configs (`torn`: a mean of two that says neither)
    readings: int = 1  #: how many readings its value pools
    values: tuple[float, ...] = ()  #: its readings, one by one (empty: its value only)


def torn(values: Sequence[float]) -> bool:
    """Whether a config's readings are two further apart than `AGREE_RATIO`: one is a straggler's or a
    lucky one, so their mean is no estimate of the config, and no evidence against its neighbours
    (from three readings on, the median is one)."""
    return len(values) == 2 and min(values) > 0 and max(values) / min(values) > AGREE_RATIO


def settled(values: Sequence[float]) -> bool:
    """Whether a config's readings settle its value whatever its curve predicts (module docstring)."""
    return len(values) >= SETTLED_READINGS and min(values) > 0 and max(values) / min(values) <= AGREE_RATIO


def point(key: Hashable, ds_config: Mapping[str, Any] | None, value: float, evidence: bool = True,
          readings: int = 1, values: Sequence[float] = ()) -> Point | None:
    """The `Point` of a config from its DeepSpeed config, or None without a micro-batch size."""
    if not isinstance(ds_config, Mapping):
        return None
    mbs = ds_config.get("train_micro_batch_size_per_gpu")
    gas = ds_config.get("gradient_accumulation_steps") or 1
    if not isinstance(mbs, int) or not isinstance(gas, int) or mbs < 1 or gas < 1:
        return None
    curve = json.dumps({k: v for k, v in ds_config.items() if k not in SIZE_KEYS}, sort_keys=True, default=str)
    return Point(key, curve, mbs, gas, value, evidence, readings, tuple(values))


def ceilings(points: Sequence[Point]) -> dict[Hashable, float]:
    """key -> the value a contradicted config is ranked at (its curve's prediction), for each
    config the fit of its curve's other configs contradicts (module docstring)."""
    out = _past_bounds(points, firm=False)
    for members in _curves(points).values():
        if len(members) < 4:
            continue
        best = max(p.value for p in members)
        for p in members:
            if p.value < best / (1 + FLOOR):
                continue  # too far behind its curve's best to lead
            model = _curve_fit(_others(p, members))
            predicted = model.predict(p.mbs, p.gas) if model is not None else 0.0
            if predicted <= 0:
                continue
            spread = math.hypot(max(NOISE, model.misfit), model.error(p.mbs, p.gas, NOISE))
            gap = p.value / predicted - 1
            if gap > FLOOR and gap > Z * spread:
                out[p.key] = min(predicted, out.get(p.key, math.inf))
    return out


def unsettled_readings(points: Sequence[Point]) -> dict[Hashable, float]:
    """key -> of each config read three times or more whose readings disagree (not `settled`), the
    reading nearest what the fit of its curve's other readings predicts, where that fit explains
    them within twice the noise once the few it cannot are left out (`cost_model.robust_fit`): two
    lucky readings of three make the median a lucky one, and the curve tells which is honest."""
    out: dict[Hashable, float] = {}
    for members in _curves(points).values():
        for p in members:
            if len(p.values) < SETTLED_READINGS or settled(p.values):
                continue
            others = _others(p, members)
            model = _curve_fit(others) if len(others) >= 4 else None
            if model is not None and model.points > sum(c > 0 for c in model.coefficients) \
                    and model.misfit <= TRIM_MISFIT * NOISE:
                out[p.key] = closest_reading(p.values, model.predict(p.mbs, p.gas))
    return out


@functools.lru_cache(maxsize=4096)
def _curve_fit(readings: tuple[Reading, ...]) -> StageModel | None:
    """`cost_model.robust_fit` of a curve's readings, kept: ranking asks again after every launch,
    mostly of the same readings, and leaving readings out one at a time takes many fits."""
    return robust_fit(readings, NOISE)


def _others(p: Point, members: Sequence[Point]) -> tuple[Reading, ...]:
    """The readings of `p`'s curve that judge it: every other member's (`_readings`)."""
    return tuple(Reading(o.mbs, o.gas, v) for o in members if o is not p for v in _readings(o))


def _readings(p: Point) -> tuple[float, ...]:
    """What `p` tells of its curve: each of its readings (a torn pair's too: their mean says neither,
    one of them is honest), or its value alone where only that is known and it is evidence."""
    return tuple(v for v in p.values if v > 0) if p.values else (p.value,) if p.evidence else ()


def dominance_bound(p: Point, members: Sequence[Point], firm: bool = False) -> float | None:
    """The most `p` can read given its curve's smaller configs (no larger micro-batch, no more
    accumulation): each one's value times the ratio of samples per step, since `p`'s step takes at
    least as long; None when its curve has no smaller config. `firm`: only smaller configs read
    twice or more whose readings agree (`confirmed`), whose value no straggler's reading lowered."""
    bounds = [o.value * (p.mbs * p.gas) / (o.mbs * o.gas) for o in _smaller(p, members)
              if not firm or confirmed(o)]
    return min(bounds, default=None)


def confirmed(p: Point) -> bool:
    """Whether `p`'s value rests on two readings or more that are not `torn`."""
    return p.evidence and p.readings >= 2


def firm_bounds(points: Sequence[Point]) -> dict[Hashable, float]:
    """key -> the `dominance_bound` of each config its `firm` bound contradicts (past it by more
    than `FLOOR`): a physical limit, not a fit, so the config's own readings, settled or not, cannot
    lift it (three lucky readings in a row agree with each other)."""
    return _past_bounds(points, firm=True)


def _past_bounds(points: Sequence[Point], firm: bool) -> dict[Hashable, float]:
    """key -> the `dominance_bound` (`firm` or not) of each config past it by more than `FLOOR`."""
    out: dict[Hashable, float] = {}
    for members in _curves(points).values():
        for p in members:
            bound = dominance_bound(p, members, firm)
            if bound is not None and p.value > bound * (1 + FLOOR):
                out[p.key] = bound
    return out


def bound_witnesses(points: Sequence[Point]) -> dict[Hashable, Hashable]:
    """key -> the smaller config read once whose reading bounds it below its value (past the bound
    by more than `FLOOR`): measured again, it makes the bound `firm`, or shows it was a straggler's."""
    out: dict[Hashable, Hashable] = {}
    for members in _curves(points).values():
        for p in members:
            witnesses = [(o.value * (p.mbs * p.gas) / (o.mbs * o.gas), o.key) for o in _smaller(p, members)
                         if o.readings < 2]
            bound, key = min(witnesses, default=(math.inf, None))
            if key is not None and p.value > bound * (1 + FLOOR):
                out[p.key] = key
    return out


def _smaller(p: Point, members: Sequence[Point]) -> list[Point]:
    return [o for o in members if o is not p and o.evidence and o.mbs <= p.mbs and o.gas <= p.gas]


def _curves(points: Sequence[Point]) -> dict[str, list[Point]]:
    curves: dict[str, list[Point]] = {}
    for p in points:
        if p.value > 0:
            curves.setdefault(p.curve, []).append(p)
    return curves
