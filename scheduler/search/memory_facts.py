"""What the probes so far predict about each stage's largest micro-batch: the stage's own measured
line, another stage's carried over, the other stages' ok/failed brackets, and the proven bounds.

Why its own module: `scheduler.search.memory` is the model (what a stage holds, the fitted lines);
this is how the search reads it against what ran, shared by DeepSpeed's algorithm and ours
(`session.Session.predicted_max`, `Session.shared_facts`).

A misleading profile is found out by its first failure: DeepSpeed's profile measures
forward-only activations (0.45-0.9 of the real growth on bench/surfaces.py's scripts) and the overhead
is a prior when the profile measured no peak, so the model's first top is often too large. Its first
out-of-memory at a size it said fits (`model_overpredicted`) shows that; from then on a stage that
has run nothing, on a script without measured peaks, is first probed halfway between what the
other stages' brackets say it surely holds and the optimistic end (`CAUTIOUS_SHARE`), since a probe
at the optimistic end tends to fail again: on bench/search_quality.py (seeds 0-59) the cautious probe
takes the failed probes after the first from 305 to 248.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from scheduler.search.memory import (
    PSEUDO_SLOPE_MIN_MBS, SAFETY, Calibration, MemoryModel, Observation, bounds, calibrate,
)

#: Once the model over-predicted, a stage's first probe lies this share of the way from its sure
#: size (`SharedFacts.predicted_success`) to the optimistic prediction (0: the sure size).
CAUTIOUS_SHARE = 0.5


def predict_max_micro_batch_size(model: MemoryModel, stage: int, capacity_bytes: int,
                                 observations: Mapping[int, Sequence[Observation]],
                                 safety: float = SAFETY, cautious: bool = False) -> int:
    """The largest micro-batch expected to fit at `stage`.

    The stage's own fit if it has measured probes, else the nearest measured stage's fit shifted by
    the analytical difference between the two stages, else the analytical model. A known success is
    a lower bound; the prediction always stays below the smallest OOM seen at this stage, and below
    the nearest measured stage's smallest OOM moved by the same analytical difference (the fitted
    line is an average; an OOM is where the peaks really are). Every stage's probes bound every
    other stage (`shared_facts`): proven bounds always, and, where no stage fitted a line (no peak
    measured, or none that grows), the other stages' brackets moved by the analytical difference.
    `cautious` (the size about to be probed first at a stage that ran nothing): once the model was
    caught over-predicting (`model_overpredicted`), the prediction lies CAUTIOUS_SHARE of the way
    from what the other stages' brackets say it holds for sure (`predicted_success`) to the
    optimistic end, not at that end (module docstring).
    """
    own = list(observations.get(stage, ()))
    line = _line_for(model, stage, observations)
    if line is None:
        predicted = model.max_micro_batch_size(stage, capacity_bytes)
    else:
        predicted = line.max_micro_batch_size(capacity_bytes, safety)
        borrowed = _borrowed_oom_bound(model, stage, observations, line.slope)
        if borrowed is not None:
            predicted = min(predicted, borrowed - 1)
    facts = shared_facts(model, stage, capacity_bytes, observations)
    if line is None:
        if facts.predicted_failure is not None:
            predicted = min(predicted, facts.predicted_failure - 1)
        predicted = max(predicted, facts.predicted_success)
        if cautious and not own and facts.predicted_success and model_overpredicted(model, capacity_bytes, observations):
            predicted = facts.predicted_success + int(CAUTIOUS_SHARE * (predicted - facts.predicted_success))
    largest_ok, smallest_oom = bounds(own)
    predicted = max(predicted, largest_ok)
    limit = min((m for m in (smallest_oom, facts.failure) if m is not None), default=None)
    return max(0, min(predicted, limit - 1)) if limit is not None else predicted


def model_overpredicted(model: MemoryModel, budget: int, observations: Mapping[int, Sequence[Observation]]) -> bool:
    """Whether some stage ran out of memory at a size the analytical model says fits: its figures
    (the profile's activations, the overhead's prior) are wrong for this script."""
    for stage, found in observations.items():
        oom = bounds(list(found))[1]
        if oom is not None and oom <= model.max_micro_batch_size(stage, budget):
            return True
    return False


@dataclass(frozen=True)
class SharedFacts:
    """What the other stages' probes say about one stage's largest micro-batch.

    Two kinds. From the order of what the stages hold (`MemoryModel.held_bytes`: model states and
    DeepSpeed's buckets; offload aside, a stage holding more at equal size fails wherever one holding
    less failed, and one holding less runs wherever one holding more ran): `success` (a size taken to
    fit, 0: none) and `failure` (a size taken not to, None: none); a stage's own failure outranks a
    borrowed success (`stage_space.stage_top`).
    Predicted, from another stage's ok/failed bracket [a, b) moved by the analytical difference D of
    the two stages' fixed bytes (`predicted_success`, `predicted_failure`): the top moves by D / s,
    where s, the bytes per sample, lies between s_low = max(the profile's figure, R / b) and
    s_high = max(s_low, R / a) (R: the budget less the other stage's fixed bytes), so the bounds
    take the end of that range that keeps them bounds. This needs no measured peak, so it also steers stages of
    a script whose memory the allocator does not see. A predicted failure below a predicted success
    (the analytical difference is wrong somewhere) keeps only the failures moved from stages that
    also ran something (a stage failing at every size it tried, R / b from a tiny R, moves least
    surely: ZeRO-0 of a large model), else neither is kept.
    """

    success: int = 0
    failure: int | None = None
    predicted_success: int = 0
    predicted_failure: int | None = None


def shared_facts(model: MemoryModel, stage: int, budget_bytes: int,
                 observations: Mapping[int, Sequence[Observation]]) -> SharedFacts:
    """`SharedFacts` for `stage` from every other stage's observations (see the class)."""
    held = model.held_bytes(stage)
    success, failure, predicted_success, predicted_failure = 0, None, 0, None
    bracketed_failure = None
    for other, found in observations.items():
        if other == stage:
            continue
        largest_ok, smallest_oom = bounds(list(found))
        other_held = model.held_bytes(other)
        if other_held >= held:
            success = max(success, largest_ok)
        if smallest_oom is not None and other_held <= held:
            failure = smallest_oom if failure is None else min(failure, smallest_oom)
        room = budget_bytes - model.fixed_bytes(other)
        shift = model.fixed_bytes(other) - model.fixed_bytes(stage)  #: > 0: this stage holds less
        low = max(float(model.info.activation_mem_per_gpu), room / smallest_oom if smallest_oom and room > 0 else 0.0)
        high = max(low, room / largest_ok) if largest_ok and room > 0 else None
        per_sample_fail = low if shift >= 0 else high
        per_sample_ok = high if shift >= 0 else low
        if smallest_oom is not None and per_sample_fail:
            moved = math.ceil(smallest_oom + shift / per_sample_fail)
            predicted_failure = moved if predicted_failure is None else min(predicted_failure, moved)
            if largest_ok:
                bracketed_failure = moved if bracketed_failure is None else min(bracketed_failure, moved)
        if largest_ok and per_sample_ok:
            predicted_success = max(predicted_success, math.floor(largest_ok + shift / per_sample_ok))
    if predicted_failure is not None and predicted_success >= predicted_failure:
        predicted_failure = bracketed_failure  # a stage that failed at every size it tried moves least surely
    if predicted_failure is not None and predicted_success >= predicted_failure:
        predicted_success, predicted_failure = 0, None  # the analytical difference contradicts the probes
    return SharedFacts(success, failure, max(0, predicted_success), predicted_failure)


def _borrowed_oom_bound(model: MemoryModel, stage: int, observations: Mapping[int, Sequence[Observation]],
                        slope: float) -> int | None:
    """The nearest other stage's smallest OOM, moved by the stages' analytical difference."""
    if observations.get(stage) or slope <= 0:
        return None
    for _, other in sorted((abs(s - stage), s) for s in observations if s != stage):
        smallest_oom = bounds(list(observations[other]))[1]
        if smallest_oom is not None:
            return smallest_oom + int((model.fixed_bytes(other) - model.fixed_bytes(stage)) // slope)
    return None


def _line_for(model: MemoryModel, stage: int,
              observations: Mapping[int, Sequence[Observation]]) -> Calibration | None:
    profile = float(model.info.activation_mem_per_gpu)
    fits = {s: calibrate(obs, _prior_slope(model, s, observations), profile) for s, obs in observations.items()}
    fitted = sorted((abs(s - stage), s) for s, fit in fits.items() if fit is not None)
    if not fitted:
        return None
    source = fitted[0][1]
    return fits[source].shifted(model.fixed_bytes(stage) - model.fixed_bytes(source))


def _prior_slope(model: MemoryModel, stage: int, observations: Mapping[int, Sequence[Observation]]) -> float:
    """Slope for a single-point fit: the nearest stage's multi-point fit, else the larger of the
    profile's activations and the slope from the analytical intercept to the measured point (the
    profile's figure is forward-only, so it understates the growth; the larger slope predicts less)."""
    profile = float(model.info.activation_mem_per_gpu)
    for _, other in sorted((abs(s - stage), s) for s in observations if s != stage):
        fit = calibrate(observations[other], prior_slope=profile)
        if fit is not None and fit.points >= 2:
            return fit.slope
    measured = [(o.micro_batch_size, o.peak_bytes) for o in observations.get(stage, ()) if o.peak_bytes and not o.oom]
    if measured and max(measured)[0] >= PSEUDO_SLOPE_MIN_MBS:
        mbs, peak = max(measured)
        return max(profile, (peak - model.fixed_bytes(stage)) / mbs)
    return profile
