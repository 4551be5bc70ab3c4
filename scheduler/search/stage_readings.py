"""What one stage's readings say: its measured sizes, the reading of each, the leader, a reading
the cost model contradicts, a leading top no probe checked.

Why its own module: the sampled search reads a stage through these, and the readings need the cost
model (`scheduler.search.cost_model`) and the noise pooled over the job's repeats
(`scheduler.search.confirm`), which the generators do not. Functions of a `Session`, no phases.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence

from scheduler.search.confirm import MIN_NOISE, PRIOR_NOISE, SEPARATION_Z, TORN_RATIO, group_readings, pooled_noise
from scheduler.search.cost_model import Reading, StageModel, closest_reading, contradicted, fit
from scheduler.search.ranking import MEDIAN_FROM, metric_value, pooled_value
from scheduler.search.repeats import is_repeat, original_name
from scheduler.search.sampling import RIVAL_SHARE, TOP_GAIN, geometric_mid
from scheduler.search.session import Session
from scheduler.search.space import PROFILE
from scheduler.search.stage_space import MAX_FAILURES, failures_since_a_success, gas_for, sizes_ran, stage_candidates

#: A size the cost model predicts cannot lead is skipped only where its prediction's relative
#: standard error is below this: the model is not trusted far from the sizes it was fitted on.
TRUSTED_ERROR = 0.1
#: On a curve too short to fit, a reading far below a smaller size's is doubted only when that size
#: is at least the larger over this (`_torn_pair`): across a wider span a real curve can fall as far.
TORN_SPAN = 2.0


def stage_values(session: Session, stage: int) -> dict[int, float | None]:
    """size -> metric (None: failed) of the stage's measured sizes at their gas in the space. Without
    max_train_batch_size only sizes that fill the step count (a size between the top probes, run at
    the user's gas below a top that ran, leaves part of the step empty). A config whose first launch
    failed (`says_nothing`) reads its retry's metric; a config read twice (`_recheck`, or the confirm
    phase) reads the reading the stage's other sizes agree with (`settled_reading`), and one read
    three times or more their median, as the winner is ranked (`ranking.pooled_value`)."""
    st = session.settings
    filling = None if st.samples_per_step else set(stage_candidates(session, stage))
    out: dict[int, float | None] = {}
    rechecked: dict[int, list[float]] = {}
    for exp, record in session.stage_records(stage):
        if exp.tuning_space or (is_repeat(exp.name, session.measured) and not retry_of_failure(session, exp.name)):
            continue
        value = metric_value(record, st.metric)
        if filling is not None and value is not None and exp.micro_batch_size not in filling:
            continue
        if exp.gradient_accumulation_steps == gas_for(session, stage, exp.micro_batch_size):
            out[exp.micro_batch_size] = value
            again = repeat_readings(session, exp.name)
            if value is not None and again:
                rechecked[exp.micro_batch_size] = [value, *again]
    for mbs, readings in rechecked.items():
        out[mbs] = pooled_value(readings) if len(readings) >= MEDIAN_FROM else \
            settled_reading(session, stage, out, mbs, readings)
    return out


def repeat_readings(session: Session, name: str) -> list[float]:
    """The readings of `name`'s repeats (`_recheck`'s and the confirm phase's: `<name>_r2`, `_r3`, ...)."""
    out = []
    for index in range(2, len(session.measured) + 2):
        again = session.measured.get(f"{name}_r{index}")
        if again is None:
            return out
        value = metric_value(again[1], session.settings.metric)
        if value is not None:
            out.append(value)
    return out


def settled_reading(session: Session, stage: int, values: Mapping[int, float | None], mbs: int,
             readings: Sequence[float]) -> float:
    """Which of a rechecked config's two readings the search reads: the one nearest what the fit of
    the stage's other sizes predicts (`cost_model.closest_reading`: a straggler's reading is below
    it, a lucky one above); with fewer than three other sizes to fit, the better one (a straggler
    only slows a run)."""
    st = session.settings
    if not st.maximize:
        return min(readings)
    model = stage_fit(session, stage, {m: v for m, v in values.items() if m != mbs})
    if model is None:
        return max(readings)
    return closest_reading(readings, model.predict(mbs, gas_for(session, stage, mbs)))


def stage_fit(session: Session, stage: int, values: Mapping[int, float | None]) -> StageModel | None:
    """The cost model fitted to the stage's readings `values` (size -> metric; failed and
    non-positive ones left out), each at its accumulation in the space; None below three readings."""
    readings = [Reading(m, gas_for(session, stage, m), v) for m, v in values.items() if v is not None and v > 0]
    return fit(readings) if len(readings) >= 3 else None


def suspect_size(session: Session, stage: int, values: Mapping[int, float | None]) -> int | None:
    """The size whose reading the fit of the stage's other sizes contradicts
    (`cost_model.contradicted`: a straggler's or a lucky reading), where it could steer the
    refinement or lead (at least RIVAL_SHARE of the best reading); on a curve of fewer than four,
    too short to fit, a size reading far below a smaller one (`_torn_pair`), the stage's first
    readings at its accumulation counted too (`_at_gas`); None when there is none. Throughput-like
    metrics only (the model is of seconds per sample)."""
    if not session.settings.maximize:
        return None
    ok = {m: v for m, v in values.items() if v is not None and v > 0}
    if len(ok) < 4:  # the fit of the others needs three of them
        return _torn_pair(ok) or next((m for m in ok if _torn_pair(_at_gas(session, stage, m, ok)) == m), None)
    readings = [Reading(m, gas_for(session, stage, m), v) for m, v in sorted(ok.items())]
    found = contradicted(readings, reading_noise(session), RIVAL_SHARE * max(ok.values()))
    return None if found is None else found.mbs


def _at_gas(session: Session, stage: int, mbs: int, ok: Mapping[int, float]) -> dict[int, float]:
    """`mbs`'s reading beside the stage's first readings at its accumulation, in the space or not.
    Without max_train_batch_size a size that runs above the stage's top widens the step, and the
    sizes filling the narrower one leave the space (`stage_values`): bench/search_quality.py's
    large-model 5 read ZeRO-2's 10 at 0.95 of the optimum, then 11, the optimum, at 0.57 (a
    straggler's), alone in the space. At one accumulation those readings still say how fast the
    stage runs there."""
    gas, metric = gas_for(session, stage, mbs), session.settings.metric
    same = {exp.micro_batch_size: metric_value(record, metric) for exp, record in session.stage_records(stage)
            if exp.gradient_accumulation_steps == gas and not is_repeat(exp.name, session.measured)}
    return {**{m: v for m, v in same.items() if v is not None and v > 0}, mbs: ok[mbs]}


def _torn_pair(ok: Mapping[int, float]) -> int | None:
    """On a curve too short to fit: a size reading below a smaller size's reading by more than
    TORN_RATIO, where the smaller is within TORN_SPAN of it and reads at least RIVAL_SHARE of the
    best. A somewhat larger micro-batch shares its per-micro-step costs over more samples, so its
    rate falls that far only at a memory cliff or a steep peak; more often the reading was a
    straggler's (bench/heldout.py's drifting machine: ZeRO-3's 72 read 0.60 beside 60's 1.00, and
    the search named 60, 0.95 of the optimum at 72)."""
    best = max(ok.values(), default=0.0)
    for high in sorted(ok, reverse=True):
        if any(ok[high] * TORN_RATIO < ok[low] and ok[low] >= RIVAL_SHARE * best
               for low in ok if high / TORN_SPAN <= low < high):
            return high
    return None


def reading_noise(session: Session) -> float:
    """The relative noise of one reading: pooled over the configs read more than once so far, each
    config's outlying readings left out (`_body`)."""
    readings: dict[str, list[float]] = {}
    for name, (exp, record) in session.measured.items():
        value = metric_value(record, session.settings.metric)
        if exp.space != PROFILE and value is not None:
            readings.setdefault(original_name(name, session.measured), []).append(value)
    pooled = pooled_noise(group_readings({name: _body(values) for name, values in readings.items()}))
    return max(MIN_NOISE, PRIOR_NOISE if pooled is None else pooled)


def _body(values: Sequence[float]) -> list[float]:
    """A config's readings within sqrt(TORN_RATIO) of their median: two readings torn apart
    (`confirm.TORN_RATIO`) hold an outlier, a straggler's or a lucky one, and their spread is that
    outlier's, not the noise of a reading. Counted as noise, one straggler read beside its config's
    honest reading (0.5x) gave a noise of 0.46, and no reading of the job was contradicted after."""
    middle = statistics.median(values)
    if middle <= 0:
        return []
    return [v for v in values if v > 0 and max(v / middle, middle / v) <= math.sqrt(TORN_RATIO)]


def retry_of_failure(session: Session, name: str) -> bool:
    """Whether `name` is the retry `_measure` launched after its original failed (confirm repeats
    only configs that ran)."""
    original = original_name(name, session.measured)
    return name == f"{original}_r2" and session.measured[original][1].get("status") != "ok"


def leader_of(session: Session, stages: Sequence[int]) -> tuple[int, int] | None:
    """(stage, mbs) of the best config measured so far in `stages` at its gas in the space (None:
    none succeeded): the incumbent another stage is followed from, the leader before confirming."""
    leader: tuple[float, int, int] | None = None
    sign = 1 if session.settings.maximize else -1
    for stage in stages:
        for mbs, value in stage_values(session, stage).items():
            if value is not None and (leader is None or sign * value > sign * leader[0]):
                leader = (value, stage, mbs)
    return None if leader is None else leader[1:]


def above_unchecked_top(session: Session, stage: int, values: Mapping[int, float | None]) -> int | None:
    """A size above the stage's largest that ran, to probe when that size leads the job on a curve
    still rising there (it beats a smaller size of its stage) and no probe checked the memory above
    it: no measured peak anywhere in the job, so the stage's top is another stage's ok/failed bracket
    moved by the analytical difference of their fixed bytes (`memory_facts.SharedFacts`), a bound only
    when those bytes are right. On a script whose allocator reports nothing they are not (ZeRO-3 of a
    large model was predicted to hold 10 and held 30, and the search named 10 at 0.64 of the optimum).
    The size is the geometric middle up to the stage's own smallest failure, or, without one, up to
    the analytical model's own top (the profile's bytes per sample: optimistic, as the profile's
    activations are forward-only) below any proven failure; not past `MAX_FAILURES` failures above
    a success, nor within `TOP_GAIN` of the largest, nor with the search's own memory strategy (whose
    bytes that top does not count), nor with a kept global batch (its sizes divide the batch). None
    when there is nothing to probe."""
    st = session.settings
    ok = {m: v for m, v in values.items() if v is not None}
    if len(ok) < 2 or session.model is None or st.estimator == "deepspeed" or st.strategy or st.kept_per_gpu:
        return None
    largest = max(ok)
    if leader_of(session, st.stages) != (stage, largest):
        return None
    if any(o.peak_bytes for found in session.observations().values() for o in found):
        return None
    ran = sizes_ran(session, stage)
    failed = [m for m, good in ran.items() if not good and m > largest]
    if failed:
        if failures_since_a_success(session, stage) >= MAX_FAILURES:
            return None
        upper = min(failed)
    else:
        upper = min(session.model.max_micro_batch_size(stage, st.budget_bytes), st.micro_batch_cap) + 1
        proven = session.shared_facts(stage).failure
        upper = min(upper, proven) if proven else upper
    if st.samples_per_step:
        upper = min(upper, st.samples_per_step + 1)
    size = geometric_mid(largest, upper)
    return None if size is None or size < TOP_GAIN * largest or size in ran else size


def at_cap(session: Session, stages: Sequence[int], mbs: int) -> bool:
    """Whether `mbs` is the largest size measured ok in any stage so far: the curve was still
    rising where memory stopped it, so a stage holding larger sizes may do better."""
    largest = max((m for stage in stages for m, v in stage_values(session, stage).items() if v is not None), default=0)
    return mbs >= largest


def flat_to_top(session: Session, stage: int) -> int | None:
    """The stage's largest size measured ok, when the cost model fitted to its readings predicts it
    within SEPARATION_Z readings' noise (or the fit's misfit) of the stage's best prediction: the
    curve is flat or rising up to the memory top, so a leader below that top leads on noise, and a
    stage (or a strategy) holding larger sizes may do better. None otherwise, with fewer than three
    sizes read, or for a metric minimised (the model is of seconds per sample)."""
    fitted = _throughput_fit(session, stage, stage_values(session, stage))
    if fitted is None:
        return None
    values, model = fitted
    top = max(values)
    predicted = {m: model.predict(m, gas_for(session, stage, m)) for m in values}
    if predicted[top] * (1 + SEPARATION_Z * max(reading_noise(session), model.misfit)) < max(predicted.values()):
        return None
    return top


def predicted_better(session: Session, stage: int, values: Mapping[int, float | None],
                     sizes: Sequence[int]) -> int | None:
    """When the refinement has nothing left to split: the unmeasured size of `sizes` the cost model,
    fitted to the stage's readings (three or more), predicts beats the stage's best reading by
    more than one reading's noise (or the fit's misfit); the best such, or None. It finds what the
    gaps between measured sizes hide, such as a size filling the step with one micro-step less (8
    ranks, a step of 512: 128 x 4 between 102 x 5 and 136 x 3, which differ by less than the
    refinement's ratio). However uncertain the prediction: measuring is how it is checked (only
    skipping a size needs a trusted one, `predicted_worse`)."""
    fitted = _throughput_fit(session, stage, values)
    if fitted is None:
        return None
    ok, model = fitted
    noise = reading_noise(session)
    bar = max(ok.values()) * (1 + max(noise, model.misfit))
    options = [(model.predict(m, gas_for(session, stage, m)), m) for m in sizes if m not in values]
    better = [(value, m) for value, m in options if value > bar]
    return max(better)[1] if better else None


def predicted_worse(session: Session, stage: int, values: Mapping[int, float | None], size: int) -> float | None:
    """What the cost model fitted to the stage's readings predicts of `size`, when even its upper
    bound (the prediction plus SEPARATION_Z of its uncertainty: one reading's noise or the fit's
    misfit, and the prediction's own error, trusted below TRUSTED_ERROR) stays below the stage's
    best reading: measuring it could not change the refinement's lead. None otherwise."""
    fitted = _throughput_fit(session, stage, values)
    if fitted is None:
        return None
    ok, model = fitted
    noise, gas = reading_noise(session), gas_for(session, stage, size)
    predicted, error = model.predict(size, gas), model.error(size, gas, noise)
    if predicted <= 0 or error >= TRUSTED_ERROR:
        return None
    upper = predicted * (1 + SEPARATION_Z * math.hypot(max(noise, model.misfit), error))
    return predicted if upper < max(ok.values()) else None


def smoothed_best(session: Session, stage: int, values: Mapping[int, float | None]) -> int | None:
    """The measured size the cost model fitted to the stage's readings (four or more, its misfit
    within one reading's noise) predicts best, when its reading is within the noise of the best
    reading: between readings the noise cannot order, the curve's shape says where the peak is.
    None otherwise."""
    fitted = _throughput_fit(session, stage, values)
    if fitted is None or len(fitted[0]) < 4:
        return None
    ok, model = fitted
    noise = reading_noise(session)
    if model.misfit > noise:
        return None
    size = max(ok, key=lambda m: model.predict(m, gas_for(session, stage, m)))
    return size if ok[size] * (1 + SEPARATION_Z * math.sqrt(2) * noise) >= max(ok.values()) else None


def _throughput_fit(session: Session, stage: int,
                    values: Mapping[int, float | None]) -> tuple[dict[int, float], StageModel] | None:
    """(the stage's positive readings, the cost model fitted to them), for a throughput-like metric
    (the model is of seconds per sample) with three readings or more; else None."""
    if not session.settings.maximize:
        return None
    ok = {m: v for m, v in values.items() if v is not None and v > 0}
    model = stage_fit(session, stage, ok)
    return None if model is None else (ok, model)


def beats_other_stages(session: Session, stage: int, value: float, bounded: bool = False) -> bool:
    """Whether the followed stage's reading `value` beats every other stage's: without
    max_train_batch_size, its reading at the incumbent's size (its space fills a step of its own
    top, so at equal size it may accumulate more and lead); with it (`bounded`), its reading at the
    size filling the step the incumbent's stage could not hold (`stage_follow._fuller_step`)."""
    st = session.settings
    if st.samples_per_step and not bounded:
        return False
    measured = {exp.stage for exp, _ in session.measured.values() if exp.space != PROFILE} - {stage}
    best = [v for s in measured for v in stage_values(session, s).values() if v is not None]
    return bool(best) and (value > max(best) if st.maximize else value < min(best))


def beats_at_equal_size(session: Session, stage: int, size: int, value: float, incumbent: tuple[int, int]) -> bool:
    """Whether `stage`, followed below the incumbent's size (it holds no more), reads better than the
    incumbent's stage at that same size and accumulation: the two curves then differ by that ratio,
    the incumbent's curve scaled by it beats the incumbent, and the stage's larger sizes are worth
    exploring. Its reading set against the incumbent's larger size would compare a size with
    another (bench/search_quality.py's needs-strategy script 6048: ZeRO-2 read 0.45 at 2 x 4,
    ZeRO-0 0.41 there and 0.48 at its top, 3 x 2; ZeRO-2's own 3 x 2 was never run, and its
    checkpointed 8 x 1, the optimum, never either: 0.81 named). A margin of one reading's noise
    lost picks on bench/heldout.py and saved no launch."""
    inc_stage, inc_mbs = incumbent
    st = session.settings
    if size >= inc_mbs or gas_for(session, inc_stage, size) != gas_for(session, stage, size):
        return False
    there = stage_values(session, inc_stage).get(size)
    if not there or not value:
        return False
    return value > there if st.maximize else value < there
