"""DeepSpeed's autotuning search as a generator of phases, with DeepSpeed's defects fixed: fast mode
(ZeRO stage x micro-batch size, gradient accumulation from max_train_batch_size) and, with
`"fast": false`, full mode (each stage's ZeRO knobs explored by a tuner after its fast search).

Why this shape: the search is DeepSpeed's own (section 1.8 of the reference notes), so results and
experiment names read the same, but it is written against `scheduler.search.phases.Search` so the caller can
run a phase's experiments concurrently and replay the search from stored records after a crash.

Fixed here, compared with DeepSpeed 0.19:
- the min probe and the max probes of a stage run together in one phase, not one after another;
- the memory estimate is calibrated from each probe's measured peak, and an OOM is an upper bound
  for the search, not an error, so later stages rarely probe a size that cannot fit;
- the binary search's upper end is the smallest size that failed, and a size measured before is
  judged by its own result (DeepSpeed moves up past an already-run size even when it failed);
- the fine-grained search reads each probe's own metrics (DeepSpeed re-reads another's file);
- an experiment measured once is reused, never run or counted again;
- the plateau and fine-grained gains follow the metric's direction, so latency is minimised;
- every config is the user's config pinned to one point: zero options and offload survive;
- without max_train_batch_size, mp_size no longer divides the per-GPU batch (gas could reach 0).

A user's micro-batch list and full mode's knob points follow our policy whatever the search
(`scheduler.search.repeats`: a crash launched once more, the winner confirmed by repeats) except
under `"search": "deepspeed"`, which keeps DeepSpeed's (one reading each, a crash is a result);
`search_notes` says which in the command's first lines and in summary.txt, with the global batch
kept or freed (`scheduler.search.global_batch`).
"""
from __future__ import annotations

import math
from collections.abc import Generator, Sequence
from dataclasses import replace
from typing import Any

from scheduler.search.confirm import KEPT_BATCH_LAUNCHES, MATERIAL_LOSS, READ_ONCE_GRACE, REPEAT_BUDGET, TORN_RATIO
from scheduler.search.full_space import full_experiments
from scheduler.search.global_batch import batch_notes, no_fit_message
from scheduler.search.measured_fit import strategy_after_failures
from scheduler.search.memory import SAFETY, GiB, MemoryModel, ModelInfo, overhead_from_profile, prior_overhead_bytes
from scheduler.search.phases import Phase, Search
from scheduler.search.ranking import best, metric_value
from scheduler.search.repeats import confirm, relaunch
from scheduler.search.sampled_search import stages_near_leader, try_sawtooth, widen_step
from scheduler.search.second_round import confirm_and_refine
from scheduler.search.session import (
    NoStageFits, SearchAborted, SearchSettings, Session, measured_capacity, measured_reserve, peak_of, succeeded,
)
from scheduler.search.space import PROFILE, experiment_name
from scheduler.search.stage_follow import sampled_stages
from scheduler.search.strategy_fit import profile_offloaded, stages_that_fit
from scheduler.search.strategy_search import try_strategies
from scheduler.search.strategy_swap import swap_own_offload

#: DeepSpeed's METRIC_PERCENT_DIFF_CONST: a larger batch must improve the metric by more than this.
PLATEAU = 0.05
#: The fine-grained search tries about this many sizes below the largest candidate.
FINE_STEPS = 3

Step = Generator[Phase, dict[str, dict], Any]


# ---------------------------------------------------------------- DeepSpeed's list arithmetic


def max_probes(predicted: int, start: int, cap: int, smallest_failure: int | None = None) -> tuple[int, ...]:
    """ceil(1.05 m), m, int(0.95 m) for m = min(predicted, cap), largest first, keeping the sizes above
    `start`, within `cap` and below a size already known to fail."""
    m = min(predicted, cap)
    limit = cap if smallest_failure is None else min(cap, smallest_failure - 1)
    sizes: list[int] = []
    for size in (-(-105 * m // 100), m, 95 * m // 100):
        if start < size <= limit and size not in sizes:
            sizes.append(size)
    return tuple(sizes)


def max_train_batch_size_per_gpu(max_mbs: int, gas: int, dp_size: int, max_train_batch_size: int | None) -> int:
    """Samples per GPU per optimizer step shared by the candidates (DeepSpeed's mtbpg)."""
    if max_train_batch_size:
        return max(max_mbs, max_train_batch_size // dp_size)
    return max_mbs * max(1, gas)


def tuning_micro_batch_sizes(min_mbs: int, max_mbs: int, k: int, mtbpg: int) -> list[int]:
    """DeepSpeed's candidates: sizes from max/2 (or min) up to max in steps of (max-low)//k, keeping
    only those whose accumulation steps (mtbpg // size) differ from the largest size's, plus max."""
    if min_mbs <= 0 or max_mbs <= 0:
        return []
    low = max(min_mbs, max_mbs // 2)
    stride = (max_mbs - low) // k or 1
    min_gas = mtbpg // max_mbs
    return [m for m in range(low, max_mbs, stride) if mtbpg // m != min_gas] + [max_mbs]


def fine_grained_micro_batch_sizes(candidates: Sequence[int], min_mbs: int, max_mbs: int) -> list[int]:
    """Sizes just below the largest candidate, tried from the top down."""
    low = candidates[-2] + 1 if len(candidates) > 1 else min_mbs
    stride = (max_mbs - low) // FINE_STEPS or 1
    return list(reversed(range(low, max_mbs, stride)))


def gain(previous: float, current: float, maximize: bool) -> float:
    """Relative improvement from `previous` to `current` in the metric's direction (inf from 0)."""
    if not previous:
        return math.inf
    change = (current - previous) if maximize else (previous - current)
    return change / abs(previous)


# ---------------------------------------------------------------- the search


def fast_search(settings: SearchSettings) -> Search:
    """Profile (unless model_info is given), then per allowed stage 0..3: the memory gate, the min and
    max probes, the binary search, the candidate list and the fine-grained search. Raises
    `NoStageFits` or `SearchAborted` from `next`/`send` when the search cannot start."""
    session = Session(settings)
    info, profile_peak = settings.model_info, None
    if info is None:
        info, profile_peak = yield from _profile(session)
        profiled = session.measured[PROFILE][1]
        reserve = measured_reserve(profiled, settings.host_memory)
        if reserve is not None:
            settings = session.settings = replace(settings, measured_reserve_bytes=reserve)
        total = measured_capacity(profiled, settings.host_memory)
        if total is not None and total < settings.capacity_bytes:
            settings = session.settings = replace(settings, capacity_bytes=total)
    overhead = settings.overhead_bytes
    if overhead is None:
        measured = overhead_from_profile(info, settings.setup, profile_peak)
        overhead = measured if measured is not None else \
            prior_overhead_bytes(settings.capacity_bytes, settings.host_memory) - settings.reserve_bytes
    session.model = MemoryModel(info, settings.setup, max(0, overhead))
    stages = stages_that_fit(session, _feasible_stages)  # with a memory strategy when none fits without
    settings = session.settings
    if settings.micro_batch_sizes:
        for stage in stages:
            yield from _run_list(session, stage)
        if settings.search == "sampled":
            yield from confirm(session)
        _refuse_if_nothing_kept(session)
        return
    if settings.search == "sampled":
        yield from sampled_stages(session, stages)
        stages = (yield from strategy_after_failures(session, stages)) or stages
        yield from try_sawtooth(session, stages)
        yield from widen_step(session, stages)
        yield from try_strategies(session)
        yield from swap_own_offload(session)
        if not settings.fast:
            for stage, mbs, gas in stages_near_leader(session, stages):
                yield from tune_full_space(session, stage, [mbs], mbs * gas)
        yield from confirm_and_refine(session, stages)
        _refuse_if_nothing_kept(session)
        return
    carried_best = carried_max = 0
    carried_metric: float | None = None
    for stage in stages:
        best_mbs, max_mbs, candidates = yield from _tune_stage(session, stage, carried_max)
        stage_metric = session.metric(_best_name(session, stage))
        if not settings.fast and stage > 0 and candidates and best_mbs > carried_best \
                and not _worse(stage_metric, carried_metric, settings.maximize):
            yield from tune_full_space(session, stage, *candidates)
        if best_mbs > carried_best:
            carried_best, carried_max, carried_metric = best_mbs, max_mbs, stage_metric


def search_notes(settings: SearchSettings) -> list[str]:
    """What the command prints first and summary.txt repeats about the search's own rules: the global
    batch kept, freed or overwritten (`global_batch.batch_notes`), and how a winner is named."""
    if settings.search == "sampled":
        budget = (f"up to {REPEAT_BUDGET} launches, or with the global batch kept as many as keep the job "
                  f"within {KEPT_BATCH_LAUNCHES} launches, a config read once at half the leader's reading "
                  "or more counting as a close rival," if settings.kept_per_gpu else f"up to {REPEAT_BUDGET} launches")
        rule = ("Search: no config is named on one reading (the leader and its close rivals are measured "
                f"again, <name>_r<n>, {budget} and {READ_ONCE_GRACE} more while the leader was read once"
                + ("" if settings.kept_per_gpu else
                   f" or a contender's two readings are over {TORN_RATIO:g}x apart (a straggler's or a lucky one)")
                + f", then any leader still read once, or read twice over {TORN_RATIO:g}x apart or with one reading "
                f"over {MATERIAL_LOSS:.0%} behind the runner-up; "
                "a config read three times or more is judged on the median of its readings, else their mean, "
                "and one whose readings beat the curve of its stage's other sizes by over a fifth on the curve "
                "until three readings agree); "
                "a crash, timeout or failed rendezvous is launched once more (<name>_r2)")
    else:
        rule = ('Search: "search": "deepspeed" keeps DeepSpeed\'s behaviour: every config is read once and the '
                "best single reading wins (no confirmation); a crash is that config's result (no relaunch)")
    return [*batch_notes(settings.global_batch, settings.dp_size), rule]


def _refuse_if_nothing_kept(session: Session) -> None:
    """With a kept global batch, a search where no experiment ran ends with one line naming the
    smallest size that failed and what would help (`global_batch.no_fit_message`)."""
    st = session.settings
    tried = [(exp, record) for exp, record in session.measured.values() if exp.space != PROFILE]
    if not st.kept_per_gpu or any(succeeded(record) for _, record in tried):
        return
    raise SearchAborted(no_fit_message(st.global_batch, st.dp_size, [
        (exp.micro_batch_size, exp.gradient_accumulation_steps, exp.stage, record.get("status", "lost"))
        for exp, record in tried]))


def _profile(session: Session) -> Step:
    [record] = yield from session.measure(PROFILE, [session.profile_experiment()])
    if record.get("status") == "oom":  # again with the allowed offload, if any (strategy_search)
        record = (yield from profile_offloaded(session)) or record
    info = ModelInfo.from_mapping(record.get("metrics")) if succeeded(record) else None
    if info is not None:
        return info, peak_of(record, session.settings.peak_memory_key)
    status = record.get("status", "lost")
    if status == "oom":
        raise SearchAborted(f"the model-info profile run {PROFILE} (ZeRO-3, micro-batch 1) ran out of memory: "
                            "the model fits these slots at no stage; use slots with more memory, more GPUs per "
                            "experiment, or zero_optimization.offload_param / offload_optimizer")
    raise SearchAborted(f"the model-info profile run {PROFILE} ended '{status}' without num_params and "
                        f"activation_mem_per_gpu; see {PROFILE}/stderr.log in the results folder, or give "
                        "them in autotuning.model_info")


def _feasible_stages(session: Session) -> tuple[int, ...]:
    fits = [session.gate(stage) for stage in session.settings.stages]
    feasible = tuple(fit.stage for fit in fits if fit.feasible)
    if feasible:
        return feasible
    closest = min(fits, key=lambda fit: (fit.shortfall_bytes, fit.stage))
    # With model_info this is decided before anything starts; else only the profile run's measurement tells.
    measured = "" if session.settings.model_info else (
        f" (known only from the profile run's measurement: {PROFILE}'s record stays in the results folder, "
        "and the next run with this config reuses it)")
    raise NoStageFits(
        f"no allowed ZeRO stage fits micro-batch 1 in the slots' {_gib(closest.capacity_bytes)}: stage "
        f"{closest.stage} needs about {_gib(closest.required_bytes)}, {_gib(closest.shortfall_bytes)} more; use "
        "slots with more memory, more GPUs per experiment, offload, or allow a higher zero_optimization.stage"
        + measured, closest.shortfall_bytes)


def _gib(size: int) -> str:
    return f"{size / GiB:.2f} GiB"


def _run_list(session: Session, stage: int) -> Step:
    """The user's own micro-batch list, as DeepSpeed runs it: every size gets gas = mtbpg // size, so
    all of them train on about the same number of samples per GPU and optimizer step. A crash is
    launched once more (`repeats.relaunch`), and `fast_search` confirms the winner after the list."""
    st = session.settings
    mtbpg = st.kept_per_gpu or max(st.micro_batch_sizes) * st.gradient_accumulation_steps
    yield from relaunch(session, f"z{stage}_list",
                        [session.experiment(stage, m, max(1, mtbpg // m)) for m in st.micro_batch_sizes])


def _tune_stage(session: Session, stage: int, prev_max: int) -> Step:
    """Returns (the stage's best micro-batch size by the metric, the largest that ran, (candidate
    sizes, mtbpg) for full mode); (0, 0, None) when the stage is skipped or even its smallest fails."""
    st = session.settings
    if prev_max and session.predicted_max(stage, safety=1.0) < prev_max:
        return 0, 0, None  # it cannot hold a larger batch than an earlier, cheaper stage (DeepSpeed's rule)
    start = prev_max or min(max(st.first_micro_batch_size, st.min_micro_batch_size), st.micro_batch_cap)
    top = yield from _min_and_max(session, stage, start, "min_max")
    if top is None and not prev_max and start != st.min_micro_batch_size:
        start = st.min_micro_batch_size
        top = yield from _min_and_max(session, stage, start, "min_fallback")
    if top is None:
        return 0, 0, None
    if top == start:
        top = yield from _bisect(session, stage, start)
    candidates = yield from _candidates_and_fine(session, stage, start, top)
    return session.best_mbs(stage), top, candidates


def _min_and_max(session: Session, stage: int, start: int, label: str) -> Step:
    """`start` and the max probes in one phase: None if `start` failed, else the largest size that ran
    (DeepSpeed takes the first max probe that succeeds, largest first)."""
    st = session.settings
    probes = max_probes(session.predicted_max(stage), start, st.micro_batch_cap, session.smallest_failure(stage))
    sizes = (start, *probes)
    experiments = [session.experiment(stage, m, st.gradient_accumulation_steps) for m in sizes]
    records = yield from session.measure(f"z{stage}_{label}", experiments)
    if not succeeded(records[0]):
        return None
    return max(m for m, record in zip(sizes, records) if succeeded(record))


def _bisect(session: Session, stage: int, start: int) -> Step:
    """Binary search above `start` (which ran) up to the smallest failure, or the prediction when
    nothing failed; stops when a larger batch improves the metric by less than PLATEAU, or when the
    calibrated memory line says no larger size fits."""
    st = session.settings
    gas = st.gradient_accumulation_steps
    failure = session.smallest_failure(stage)
    high = min(st.micro_batch_cap, failure - 1 if failure is not None else session.predicted_max(stage))
    good = start
    previous = session.metric(experiment_name(stage, gas, start))
    while good < high:
        mid = _next_probe(session, stage, good, high)
        if mid is None:
            break
        [record] = yield from session.measure(f"z{stage}_bisect_{mid}", [session.experiment(stage, mid, gas)])
        if not succeeded(record):
            high = mid - 1
            continue
        good = mid
        value = metric_value(record, st.metric)
        if previous and value is not None and gain(previous, value, st.maximize) < PLATEAU:
            break
        previous = value
    return good


def _next_probe(session: Session, stage: int, good: int, high: int) -> int | None:
    """The bisection midpoint, lowered to the calibrated prediction: the one with the safety margin
    while it is above `good`, then the unmargined one; None when even that says nothing larger fits.
    DeepSpeed's estimate does not learn from probes, so with it this is the plain midpoint."""
    mid = (good + 1 + high) // 2
    if session.settings.estimator != "calibrated":
        return mid
    for safety in (SAFETY, 1.0):
        predicted = session.predicted_max(stage, safety)
        if predicted > good:
            return min(mid, predicted)
    return None


def _candidates_and_fine(session: Session, stage: int, start: int, top: int) -> Step:
    """DeepSpeed's candidate list with gas from mtbpg, all in one phase, then the fine-grained search
    down from the largest size with its gas, while each step improves the metric by more than PLATEAU."""
    st = session.settings
    mtbpg = max_train_batch_size_per_gpu(top, st.gradient_accumulation_steps, st.dp_size, st.max_train_batch_size)
    sizes = tuning_micro_batch_sizes(start, top, st.num_tuning_micro_batch_sizes, mtbpg)
    yield from session.measure(f"z{stage}_candidates",
                               [session.experiment(stage, m, max(1, mtbpg // m)) for m in sizes])
    gas = max(1, mtbpg // top)
    best_value = session.metric(experiment_name(stage, gas, top))
    for mbs in fine_grained_micro_batch_sizes(sizes, start, top):
        if best_value is None:
            break
        [record] = yield from session.measure(f"z{stage}_fine_{mbs}", [session.experiment(stage, mbs, gas)])
        value = metric_value(record, st.metric)
        if value is None or gain(best_value, value, st.maximize) <= PLATEAU:
            break
        best_value = value
    return sizes, mtbpg


def tune_full_space(session: Session, stage: int, sizes: Sequence[int], mtbpg: int) -> Step:
    """Full mode for one stage: DeepSpeed's ZeRO-knob space x the fast search's candidate sizes, explored
    by the configured tuner in batches as wide as the slots allow, until its trial cap or early stop.
    A knob point whose failure says nothing about it is launched once more (`repeats.relaunch`; not
    under `"search": "deepspeed"`) and the tuner sees the retry's result."""
    from scheduler.search.tuners import StopRule, Trial, make_tuner, plan  # numpy: full mode's alone, not every start's

    st = session.settings
    cfg = st.tuning_config
    if cfg is None:
        return
    experiments = full_experiments(cfg, stage, sizes, mtbpg, st.num_nodes, st.num_gpus)
    tuner = make_tuner(st.tuner_type, experiments, seed=st.tuner_seed, maximize=st.maximize)
    rule = StopRule(st.maximize, st.tuner_num_trials, st.tuner_early_stopping)
    history: list[Trial] = []
    while batch := plan(tuner, history, rule, st.concurrency):
        records = yield from relaunch(session, f"{experiments[0].space}_trial{len(history) + 1}",
                                      [experiments[i] for i in batch])
        history.extend(Trial(i, metric_value(record, st.metric)) for i, record in zip(batch, records))


def _best_name(session: Session, stage: int) -> str:
    pairs = session.stage_records(stage)
    winner = best([rec for _, rec in pairs], session.settings.metric, session.settings.maximize)
    return winner["name"] if winner else ""


def _worse(value: float | None, reference: float | None, maximize: bool) -> bool:
    if reference is None:
        return False
    if value is None:
        return True
    return value < reference if maximize else value > reference
