"""The fitted time model (scheduler.search.cost_model): what it recovers, what it calls an outlier."""
from __future__ import annotations

import math

import pytest

from scheduler.search.cost_model import Reading, closest_reading, contradicted, fit, robust_fit, trimmed_fit

#: a, b, c, d of seconds per sample: micro-step overhead, per-sample, per-step, per-sample growth.
TRUE = (0.004, 0.0004, 0.06, 0.000002)


def speed(mbs: int, gas: int, coefficients: tuple[float, ...] = TRUE) -> float:
    a, b, c, d = coefficients
    return 1.0 / (a / mbs + b + c / (mbs * gas) + d * mbs)


def full_step(sizes: list[int], step: int = 256) -> list[Reading]:
    return [Reading(m, step // m, speed(m, step // m)) for m in sizes]


def test_a_fit_of_the_models_own_readings_predicts_every_size_between_them() -> None:
    """Readings at full steps and at gas 1 (which tells the per-step cost from the per-sample one):
    the fit predicts sizes it never saw within 1 %."""
    readings = full_step([1, 4, 16, 64, 256]) + [Reading(m, 1, speed(m, 1)) for m in (32, 128)]
    model = fit(readings)
    assert model is not None
    for mbs, gas in [(2, 128), (8, 32), (24, 10), (100, 2), (200, 1), (48, 1)]:
        assert model.predict(mbs, gas) == pytest.approx(speed(mbs, gas), rel=0.01)
    assert model.misfit < 0.01  # the ridge's share only


def test_a_trimmed_fit_leaves_out_one_lucky_reading_and_nothing_from_a_clean_curve() -> None:
    """One reading 1.5x among six: the fit of all bends to it; the trimmed fit predicts the curve
    within 1 % again. With readings only as noisy as the job (misfit within TRIM_MISFIT times its
    noise) it is the plain fit, though leaving one out would lower the misfit."""
    clean = full_step([1, 4, 16, 64, 256]) + [Reading(32, 1, speed(32, 1))]
    noisy = [Reading(r.mbs, r.gas, r.value * f) for r, f in zip(clean, (1.02, 0.98, 1, 1, 1, 1))]
    lucky = [Reading(r.mbs, r.gas, r.value * (1.5 if r.mbs == 16 else 1.0)) for r in clean]
    bent, trimmed = fit(lucky), trimmed_fit(lucky, 0.02)
    assert bent is not None and trimmed is not None
    assert bent.predict(24, 10) > 1.05 * speed(24, 10)
    assert trimmed.predict(24, 10) == pytest.approx(speed(24, 10), rel=0.01)
    assert trimmed_fit(noisy, 0.02) == fit(noisy)


def test_a_reading_is_left_out_only_for_a_fit_with_a_degree_of_freedom_left() -> None:
    """Five readings 6 % off either way, none an outlier: their fit misses by more than twice the
    noise, and any four left fit the four terms exactly, which singles out nothing: the plain fit."""
    sizes = ((1, 256), (4, 64), (16, 16), (64, 4), (256, 1))
    readings = [Reading(m, g, speed(m, g) * f) for (m, g), f in zip(sizes, (0.94, 0.94, 0.94, 1.06, 1.0))]
    model = fit(readings)
    assert model is not None and model.misfit > 2 * 0.02
    assert trimmed_fit(readings, 0.02) == model


def test_a_robust_fit_leaves_out_several_lucky_readings() -> None:
    """Three readings 1.4-1.7x among ten (a stage whose runs are often lucky): the fit of all, and
    the fit less one (`trimmed_fit`), stay bent; leaving out the three the fit can least explain
    predicts the curve within 2 % again. A clean curve keeps every reading."""
    clean = full_step([1, 2, 4, 8, 16, 32, 64, 128, 256]) + [Reading(48, 1, speed(48, 1))]
    lift = {4: 1.4, 32: 1.7, 128: 1.5}
    lucky = [Reading(r.mbs, r.gas, r.value * lift.get(r.mbs, 1.0)) for r in clean]
    trimmed, robust = trimmed_fit(lucky, 0.02), robust_fit(lucky, 0.02)
    assert trimmed is not None and robust is not None
    assert trimmed.predict(16, 16) > 1.05 * speed(16, 16)
    assert robust.predict(16, 16) == pytest.approx(speed(16, 16), rel=0.02)
    assert robust.points == len(clean) - len(lift)
    assert robust_fit(clean, 0.02) == fit(clean)


def test_a_robust_fit_leaves_out_no_more_than_its_share() -> None:
    """The three lucky readings among ten above, with a share allowing two: no fit of the rest is
    claimed to be the curve, `trimmed_fit`'s answer stands (one left out, the others bent)."""
    clean = full_step([1, 2, 4, 8, 16, 32, 64, 128, 256]) + [Reading(48, 1, speed(48, 1))]
    lift = {4: 1.4, 32: 1.7, 128: 1.5}
    lucky = [Reading(r.mbs, r.gas, r.value * lift.get(r.mbs, 1.0)) for r in clean]
    assert robust_fit(lucky, 0.02, share=0.2) == trimmed_fit(lucky, 0.02) != robust_fit(lucky, 0.02)


def test_four_readings_are_not_trimmed() -> None:
    """One reading 1.5x among four: three left can fit a curve of fewer terms exactly enough to
    single one out, but whether it singles out the lucky one is chance (a lucky contender's
    neighbours, trimmed so, capped honest contenders twice as often for no more lucky ones caught)."""
    four = [Reading(m, g, speed(m, g) * (1.5 if m == 16 else 1.0)) for m, g in ((4, 64), (16, 16), (64, 4), (32, 1))]
    assert trimmed_fit(four, 0.02) == fit(four)


def test_coefficients_are_never_negative() -> None:
    """Throughput falling with the size at first would need a negative per-micro-step cost: the fit
    keeps every time >= 0 and says how badly it fits instead."""
    readings = [Reading(m, 1, 100.0 / m ** 0.2) for m in (1, 2, 4, 8, 16)]
    model = fit(readings)
    assert model is not None and min(model.coefficients) >= 0
    assert model.misfit > 0.01


def test_the_uncertainty_grows_away_from_what_was_measured() -> None:
    model = fit(full_step([4, 8, 16, 32]))
    assert model is not None
    inside = model.error(12, 21, noise=0.03)
    outside = model.error(256, 1, noise=0.03)
    assert outside > 3 * inside


@pytest.mark.parametrize("factor", [0.55, 1.45])
def test_a_stragglers_or_a_lucky_reading_is_contradicted(factor: float) -> None:
    """Five sizes of one stage's space; one read 0.55x (a straggler's step) or 1.45x (a lucky
    window) of its true speed: the fit of the other four contradicts it."""
    readings = full_step([2, 8, 16, 64, 128])
    readings[2] = Reading(16, 16, readings[2].value * factor)
    assert contradicted(readings, noise=0.03) == readings[2]


def test_noise_within_the_floor_is_not_contradicted() -> None:
    readings = full_step([2, 8, 16, 64, 128])
    readings[2] = Reading(16, 16, readings[2].value * 1.08)
    assert contradicted(readings, noise=0.03) is None


def test_a_noisier_job_tolerates_more() -> None:
    """The same 25 % deviation: an outlier at 3 % noise, not at 10 % (3 standard errors)."""
    readings = full_step([2, 8, 16, 64, 128])
    readings[2] = Reading(16, 16, readings[2].value * 1.25)
    assert contradicted(readings, noise=0.03) == readings[2]
    assert contradicted(readings, noise=0.10) is None


def test_a_reading_far_behind_the_best_or_without_three_others_is_not_chased() -> None:
    """A straggler's reading at the smallest size is found where a neighbour supports the fit below
    the others (with 8 the next size, the fit would blame 8 instead: both get read again in turn)."""
    readings = full_step([2, 4, 8, 16, 64, 128])
    slow = Reading(2, 128, readings[0].value * 0.5)
    best = max(r.value for r in readings)
    assert contradicted([slow] + readings[1:], noise=0.03) == slow
    assert contradicted([slow] + readings[1:], noise=0.03, relevant=0.9 * best) is None
    assert contradicted([slow] + readings[1:3], noise=0.03) is None


def test_of_two_readings_the_one_the_fit_agrees_with_is_read() -> None:
    assert closest_reading([50.0, 90.0], 85.0) == 90.0
    assert closest_reading([130.0, 92.0], 90.0) == 92.0
    assert closest_reading([130.0, 92.0], 0.0) == 130.0  # no prediction: the better reading


def test_fit_needs_a_positive_reading() -> None:
    assert fit([]) is None
    assert fit([Reading(4, 2, 0.0)]) is None
    assert math.isfinite(fit([Reading(4, 2, 10.0)]).predict(4, 2))
