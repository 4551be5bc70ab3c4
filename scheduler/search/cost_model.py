"""A model of how one job's training spends time, fitted to what its experiments measured.

Why: a search that reads each measurement on its own follows noise (a straggler's slow reading hides
the region around the optimum, a lucky one is named) and needs a rule for every shape of curve it
has met. Training time has a known structure, so the search fits it instead and asks the fit:

    seconds per sample  u(m, g) = a / m  +  b  +  c / (m g)  +  d m

for one ZeRO stage at micro-batch m and gradient accumulation g: `a` is each micro-step's fixed cost
(kernel launches, ZeRO-3's gathers), `b` the per-sample compute, `c` the optimizer step and the
gradients' communication, paid once per m g samples, and `d` the per-sample cost that grows with the
size (a rate that saturates and then falls: cache and workspace limits, the allocator's pressure
near the memory top). Throughput is 1 / u up to the job's constant world size. Every coefficient is
a time, so none is negative: the fit is a non-negative least squares on relative residuals (a
reading's error is a share of it), with a tiny ridge that only settles terms the readings cannot
tell apart (within one stage's space m g is nearly constant, so `b` and `c` trade).

What it is used for (`scheduler.search.sampled_search`): a reading the fit of the stage's other
readings contradicts by more than the noise allows (`contradicted`: a straggler's or a lucky one) is
measured again before it steers the refinement or leads, and the two readings are then read where
the model says (`closest_reading`); a config whose readings beat the fit of its stage's others is
ranked at that fit (`scheduler.search.ceilings`), which leaves out the few outliers among them
that bend it (`robust_fit`; one, `trimmed_fit`, where no few explain the rest within the noise).
The model is only trusted where it was checked: a prediction's uncertainty (`StageModel.error`)
grows with the distance from the measured sizes and with the fit's own misfit, so where a real
script's curve is not this one the search measures instead.

Pure: numbers in, numbers out; no session, no records.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

#: The terms of u(m, g), in the order of `StageModel.coefficients`.
TERMS = ("per_micro_step", "per_sample", "per_step", "per_sample_growth")
#: Ridge weight on each coefficient (relative to its column's scale): small, so it only picks among
#: fits the readings cannot tell apart, and larger on the growth term, which a monotone curve lacks.
RIDGE = (1e-6, 1e-6, 1e-6, 1e-3)
#: A reading is contradicted when its leave-one-out residual exceeds this many standard errors.
CONTRADICTION_Z = 3.0
#: ... and at least this relative size: a model misfit of a few percent is no outlier.
CONTRADICTION_FLOOR = 0.12
#: `trimmed_fit` looks for one outlier only when the fit misses by more than this many times the noise.
TRIM_MISFIT = 2.0
#: `robust_fit` leaves out at most this share of the readings: under half, so the curve it keeps is
#: the one most readings agree on (a stage read lucky 30 % of the time, bench/lucky_stage.py).
ROBUST_SHARE = 0.45


@dataclass(frozen=True)
class Reading:
    """One successful measurement of a config of one stage: (micro-batch, accumulation, throughput)."""

    mbs: int
    gas: int
    value: float


def features(mbs: int, gas: int) -> tuple[float, float, float, float]:
    """The regressors of u(m, g) (module docstring), in the order of TERMS."""
    return (1.0 / mbs, 1.0, 1.0 / (mbs * gas), float(mbs))


@dataclass(frozen=True)
class StageModel:
    """One stage's fitted seconds per sample, and how far its predictions can be trusted."""

    coefficients: tuple[float, float, float, float]
    #: the inverse of the fitted normal matrix (relative units), for a prediction's standard error
    covariance: tuple[tuple[float, ...], ...]
    misfit: float  #: relative residual standard deviation of the fit (0 with no degree of freedom)
    points: int

    def seconds_per_sample(self, mbs: int, gas: int) -> float:
        return sum(c * f for c, f in zip(self.coefficients, features(mbs, gas)))

    def predict(self, mbs: int, gas: int) -> float:
        """The throughput the fit expects of (mbs, gas) (0 when it predicts no time at all)."""
        u = self.seconds_per_sample(mbs, gas)
        return 1.0 / u if u > 0 else 0.0

    def error(self, mbs: int, gas: int, noise: float) -> float:
        """The relative standard error of `predict(mbs, gas)` when each reading errs by `noise`
        (relative) or by the fit's own misfit, whichever is larger."""
        u = self.seconds_per_sample(mbs, gas)
        if u <= 0:
            return math.inf
        x = [f / u for f in features(mbs, gas)]
        leverage = sum(x[i] * self.covariance[i][j] * x[j] for i in range(4) for j in range(4))
        return max(noise, self.misfit) * math.sqrt(max(leverage, 0.0))


def fit(readings: Sequence[Reading]) -> StageModel | None:
    """The non-negative ridge least-squares fit of u(m, g) to `readings` on relative residuals
    (None: no reading). Every subset of terms is tried; the best fit with all coefficients >= 0
    wins (four terms: sixteen tiny solves)."""
    rows = [(features(r.mbs, r.gas), 1.0 / r.value) for r in readings if r.value > 0]
    if not rows:
        return None
    scales = [max(abs(f[j]) / u for f, u in rows) or 1.0 for j in range(4)]
    best: tuple[float, list[float], list[list[float]]] | None = None
    for size in range(1, 5):
        for active in itertools.combinations(range(4), size):
            solved = _solve(rows, scales, active)
            if solved is None:
                continue
            theta, inverse = solved
            if min(theta) < 0:
                continue
            loss = _loss(rows, theta, scales)
            if best is None or loss < best[0] - 1e-12:
                best = (loss, theta, inverse)
    if best is None:
        return None
    _, theta, inverse = best
    residuals = [sum(c * f for c, f in zip(theta, feats)) / u - 1.0 for feats, u in rows]
    used = sum(1 for c in theta if c > 0)
    freedom = len(rows) - used
    misfit = math.sqrt(sum(r * r for r in residuals) / freedom) if freedom > 0 else 0.0
    return StageModel(tuple(theta), tuple(tuple(row) for row in inverse), misfit, len(rows))


def trimmed_fit(readings: Sequence[Reading], noise: float) -> StageModel | None:
    """`fit`, less the one reading whose leaving out most lowers the misfit, when the fit of all
    misses by more than TRIM_MISFIT times `noise` and leaving it out at least halves that misfit:
    one lucky reading among a stage's others bends their fit up and widens its misfit, so a lucky
    contender beside them is no longer contradicted (`scheduler.search.ceilings`). Five readings or
    more, and only fits with a degree of freedom left compete: any few readings fit exactly, which
    singles out no outlier (trimming four, one of three left out by chance as often as the lucky
    one, capped honest contenders twice as often as the plain fit and caught no more lucky ones)."""
    model = fit(readings)
    if model is None or len(readings) < 5 or model.misfit <= TRIM_MISFIT * noise:
        return model
    trimmed = (fit([r for j, r in enumerate(readings) if j != i]) for i in range(len(readings)))
    best = min((m for m in trimmed if m is not None and m.points > sum(c > 0 for c in m.coefficients)),
               key=lambda m: m.misfit, default=None)
    return best if best is not None and best.misfit <= model.misfit / 2 else model


def robust_fit(readings: Sequence[Reading], noise: float, share: float = ROBUST_SHARE) -> StageModel | None:
    """`fit` of the readings left once the fewest, at most `share` of them, are left out (each time
    the one whose leaving out most lowers the misfit) for the fit to miss by no more than TRIM_MISFIT
    times `noise`: on a stage whose readings are often lucky, several lucky readings bend the fit of
    the others, and one left out (`trimmed_fit`) leaves the rest bent. Where no such few exist,
    `trimmed_fit`."""
    kept = list(readings)
    model = fit(kept)
    for _ in range(int(len(kept) * share)):
        if model is None or model.misfit <= TRIM_MISFIT * noise or len(kept) < 5:
            break
        trials = [(fit(kept[:i] + kept[i + 1:]), i) for i in range(len(kept))]
        trials = [(m, i) for m, i in trials if m is not None and m.points > sum(c > 0 for c in m.coefficients)]
        if not trials:
            break
        model, index = min(trials, key=lambda t: t[0].misfit)
        kept = kept[:index] + kept[index + 1:]
    if model is not None and model.misfit <= TRIM_MISFIT * noise:
        return model
    return trimmed_fit(readings, noise)


def _solve(rows: Sequence[tuple[Sequence[float], float]], scales: Sequence[float],
           active: Sequence[int]) -> tuple[list[float], list[list[float]]] | None:
    """Ridge least squares over the `active` terms: (coefficients of all four terms, the inverse
    normal matrix embedded in 4 x 4); None when singular."""
    k = len(active)
    normal = [[0.0] * k for _ in range(k)]
    right = [0.0] * k
    for feats, u in rows:
        x = [feats[j] / u for j in active]
        for p in range(k):
            right[p] += x[p]
            for q in range(k):
                normal[p][q] += x[p] * x[q]
    for p, j in enumerate(active):
        normal[p][p] += RIDGE[j] * scales[j] ** 2 * len(rows)
    inverse = _invert(normal)
    if inverse is None:
        return None
    theta = [0.0] * 4
    full = [[0.0] * 4 for _ in range(4)]
    for p, j in enumerate(active):
        theta[j] = sum(inverse[p][q] * right[q] for q in range(k))
        for q, i in enumerate(active):
            full[j][i] = inverse[p][q]
    return theta, full


def _loss(rows: Sequence[tuple[Sequence[float], float]], theta: Sequence[float], scales: Sequence[float]) -> float:
    squares = sum((sum(c * f for c, f in zip(theta, feats)) / u - 1.0) ** 2 for feats, u in rows)
    return squares + len(rows) * sum(RIDGE[j] * (theta[j] * scales[j]) ** 2 for j in range(4))


def _invert(matrix: list[list[float]]) -> list[list[float]] | None:
    """Gauss-Jordan inverse with partial pivoting (None: singular)."""
    n = len(matrix)
    work = [row[:] + [1.0 if i == j else 0.0 for j in range(n)] for i, row in enumerate(matrix)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(work[r][col]))
        if abs(work[pivot][col]) < 1e-14:
            return None
        work[col], work[pivot] = work[pivot], work[col]
        head = work[col][col]
        work[col] = [v / head for v in work[col]]
        for r in range(n):
            if r != col and work[r][col]:
                factor = work[r][col]
                work[r] = [v - factor * w for v, w in zip(work[r], work[col])]
    return [row[n:] for row in work]


def residual(model: StageModel, reading: Reading) -> float:
    """log(read / predicted): positive when the reading beats the fit."""
    predicted = model.predict(reading.mbs, reading.gas)
    return math.log(reading.value / predicted) if predicted > 0 and reading.value > 0 else 0.0


def contradicted(readings: Sequence[Reading], noise: float, relevant: float = 0.0) -> Reading | None:
    """The reading the fit of the others contradicts most, or None. Each reading is predicted by the
    fit of the stage's other readings (leave one out, which needs at least three others); it is
    contradicted when it differs from that prediction by more than CONTRADICTION_Z standard errors
    of the difference and by at least CONTRADICTION_FLOOR. Only readings that matter count: the
    reading or its prediction at least `relevant` (a size far behind the best changes no decision)."""
    worst: tuple[float, Reading] | None = None
    for index, reading in enumerate(readings):
        others = [r for i, r in enumerate(readings) if i != index]
        model = fit(others) if len(others) >= 3 else None
        if model is None or max(reading.value, model.predict(reading.mbs, reading.gas)) < relevant:
            continue
        gap = abs(residual(model, reading))
        spread = math.hypot(max(noise, model.misfit), model.error(reading.mbs, reading.gas, noise))
        score = gap / spread if spread > 0 else math.inf
        if gap >= CONTRADICTION_FLOOR and score > CONTRADICTION_Z and (worst is None or score > worst[0]):
            worst = (score, reading)
    return None if worst is None else worst[1]


def closest_reading(values: Sequence[float], predicted: float) -> float:
    """Of several readings of one config, the one nearest (in ratio) what the fit of its
    neighbours predicts: a straggler's reading is below it, a lucky one above."""
    if predicted <= 0:
        return max(values)
    return min(values, key=lambda v: abs(math.log(v / predicted)) if v > 0 else math.inf)
