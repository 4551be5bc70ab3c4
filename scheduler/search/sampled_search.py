"""Our fast-mode search (`"search": "sampled"`, the default): sample each stage's feasible range,
refine around the best, carry what earlier stages measured into later ones, confirm the winner.

Why not DeepSpeed's: it assumes throughput grows with the micro-batch. It starts at half the
largest fitting size and later stages start where the previous stage ended, so a mid-size optimum
(with more gradient accumulation) is never generated, and it spends 3 probes per stage straddling a
memory estimate that is often wrong. Throughput curves saturate, can peak in the middle and drop
near the memory cap; measurements are noisy, some configs far more than others. So, per stage:

- the space is at least DeepSpeed's: every size gets the gas that fills the samples per GPU per
  optimizer step (`samples_per_step`): max_train_batch_size // dp when the user set it; without it
  (most configs), DeepSpeed's mtbpg rule, the stage's largest size that ran at the user's gas
  times that gas. So a middle size runs with more accumulation, and the sizes sampled are the
  largest for each gas (`full_step_sizes`);
- the lead stage (ZeRO-1 when data parallelism shards anything, `lead_first`; else the lowest that
  fits) samples its range on a geometric scale. With max_train_batch_size, a low size first (a
  quarter of the predicted maximum, so the stage's memory line has two measured points before the
  top is probed), then the top; without it, the top first (`anchor`: the step is bounded by a size
  that ran; from 128 on, a multiple of 8: `stage_space.ALIGN`), then, on CPU slots or for a model
  whose states fill half the device, the smallest size, with the most accumulation
  (`_sample_smallest`: the real GPT example's optimum lay there, below a plateau a quarter of the
  top would have sat on). Then golden-section-like refinement on log(mbs) around the best
  measured size (where the cost model explains four or more readings within the noise, the size it
  predicts best, if its reading is within the noise of the best: `stage_readings.smoothed_best`)
  until its neighbours are within `sampling.REFINE_RATIO` of it, splitting the gaps between
  measured sizes before going below the smallest; a top that the memory line later moves up is
  probed again only when it is `sampling.TOP_GAIN` larger. Where memory strategies are allowed,
  they are tried from the lead stage's top as soon as it leads the stage's readings, and when they
  pay decisively the refinement stops there (`scheduler.search.strategy_first`). A reading the
  fit of the stage's other sizes contradicts (`scheduler.search.cost_model`: seconds per sample as
  a per-micro-step, a per-sample, a per-step and a growing per-sample cost, fitted to the stage's
  readings) is a straggler's or a lucky one: that config is measured once more (`_recheck`) and
  the refinement reads the reading the fit agrees with, so one slow run does not hide the region
  around the optimum and one lucky run does not pull the refinement to it; on a curve too short to
  fit, so is a size reading far below a smaller one at its accumulation (`stage_readings.suspect_size`,
  the smaller one counted even where a wider step left it out of the space). A size the refinement would split
  at whose trusted prediction stays below the stage's best reading even at its upper bound is read
  off the fit instead of measured (`stage_readings.predicted_worse`: it could not lead). When the
  refinement has no gap left to split, a size the fit predicts better than the stage's best by more
  than the noise, however uncertain, is measured (`stage_readings.predicted_better`);
- every later stage is followed from the incumbent (`scheduler.search.stage_follow`): measured at
  its size, and explored (`explore_stage`, above that size) only where it can lead;
- a failure that says nothing about the config (`scheduler.search.repeats.says_nothing`: a crash,
  a timeout, a rendezvous that failed, an out-of-memory beside others' memory) is launched once
  more at once (`measure_size`), and so is an out-of-memory at a size the stage already ran at or above
  (`_contradicted`: memory does not shrink as the size grows); a size failing twice is left out of its stage, and is no memory fact;
- the memory side follows `scheduler.search.memory_facts`: predictions stay between the largest ok and the
  smallest size out of memory, and every stage's probes bound the others (`memory_facts.shared_facts`: a failure
  bounds the stages holding more, a success the stages holding less, a bracket moves the others'
  predicted tops, with or without measured peaks); once the model was caught over-predicting (an
  out-of-memory at a size it said fits), a stage's first probe (`anchor`, a followed size) is the
  cautious prediction, halfway from what the others' brackets say it surely holds; after a failure
  the next upward probe is the geometric midpoint, and a stage stops probing upward after
  `MAX_FAILURES` failures above a success (`MAX_BLIND_FAILURES` halvings when nothing in the job
  ran yet); a leading top no measured peak checked is probed above (`above_unchecked_top`);
- before confirming, the leader's saw-tooth neighbour with max_train_batch_size, and the size
  filling its step at its own accumulation where it was measured as a provisional top, a reading
  they leave contradicted read again (`try_sawtooth`);
  without it, a leader that accumulates widens its stage's step to the predicted top
  (`widen_step`): one probe of the top, then the leader's gas at the largest size filling it;
- `scheduler.search.repeats.confirm` (run after this search by `fast_search`): no config is named
  on one reading; the leader and the rivals it is not separated from are measured again.

What the benches show this buys, and what they cannot: bench/search_quality.py (synthetic
surfaces, with and without max_train_batch_size, heavy-tailed and per-config noise),
bench/trace_replay.py (replays on real traces of the GPT example, whose optimum on CPU slots is
the smallest micro-batch with the most accumulation) and
bench/vs_deepspeed.py (the real GPT example, end to end); see bench/README.md.

Pure decision logic (`scheduler.search.sampling`: `next_size`, `geometric_mid`, ...;
`scheduler.search.confirm`) is separate from the generator so it is tested directly; the generators only turn decisions into phases (one experiment
each unless the slots allow more) and are replayed from records like every search here.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from scheduler.search.ranking import metric_value
from scheduler.search.repeats import says_nothing
from scheduler.search.sampling import filled_size, next_size, sawtooth_neighbour, snap
from scheduler.search.session import Session, Step
from scheduler.search.stage_readings import (
    above_unchecked_top, leader_of, predicted_better, predicted_worse, smoothed_best, stage_values, suspect_size,
)
from scheduler.search.stage_space import (
    gas_for, known_feasible, samples_per_step, sizes_ran, stage_candidates, stage_top,
)
from scheduler.search.strategy_first import strategies_pay_first


#: At most this many sizes are measured per stage (a guard; refinement normally stops earlier).
MAX_POINTS = 7
#: Full mode explores the knobs of every stage whose fast-mode best is within this of the leader.
FULL_MODE_BAND = 0.10
#: On GPU slots the lead stage's smallest size is sampled where the model's states take at least
#: this share of the memory budget: every size near the top then runs with the device nearly full.
PRESSED_STATES_SHARE = 0.5


# ---------------------------------------------------------------- the generators


def explore_stage(session: Session, stage: int, floor: int = 0, strategies_first: bool = False) -> Step:
    """Sample and refine one stage, above `floor`, until `next_size` says done and the cost model
    predicts no unmeasured size better (`stage_readings.predicted_better`), or the guards. With
    `strategies_first` (the lead stage), the memory strategies are tried as soon as the stage's top
    leads its readings (`strategy_first.strategies_pay_first`); True when they paid decisively: the
    refinement below the top stops there."""
    st = session.settings
    if not (yield from anchor(session, stage)):
        return
    if not stage_values(session, stage):
        top = stage_top(session, stage)
        sizes = stage_candidates(session, stage)
        low = snap(max(1.0, top / 4), sizes) if sizes else top
        if low < top:
            yield from measure_size(session, stage, low, f"z{stage}_sample_{low}")
    elif not st.samples_per_step and not floor:
        yield from _sample_smallest(session, stage)
    predicted: dict[int, float] = {}  # sizes the refinement reads off the fit instead of measuring
    while True:
        values = stage_values(session, stage)
        if sum(v is not None for v in values.values()) >= MAX_POINTS:
            return
        suspect = suspect_size(session, stage, values)
        if suspect is not None and (yield from _recheck(session, stage, suspect)):
            continue
        if strategies_first and (yield from strategies_pay_first(session, stage)):
            return True
        sizes = [m for m in stage_candidates(session, stage) if m >= floor]
        size = next_size({m: v for m, v in {**predicted, **values}.items() if m >= floor}, sizes, st.maximize,
                         smoothed_best(session, stage, {m: v for m, v in values.items() if m >= floor}))
        if size is not None and (worse := predicted_worse(session, stage, values, size)) is not None:
            predicted[size] = worse
            continue
        if size is None:
            size = predicted_better(session, stage, {m: v for m, v in values.items() if m >= floor}, sizes)
        if size is None:
            size = above_unchecked_top(session, stage, values)
        if size is None:
            return
        yield from measure_size(session, stage, size, f"z{stage}_sample_{size}")


def _recheck(session: Session, stage: int, mbs: int) -> Step:
    """Measure once more a config whose one reading the stage's other sizes contradict (`suspect_size`);
    False when it was read more than once already (then the refinement goes on with what it has).
    The search reads the reading the fit agrees with (`settled_reading`)."""
    exp = session.experiment(stage, mbs, gas_for(session, stage, mbs))
    if f"{exp.name}_r2" in session.measured or exp.name not in session.measured:
        return False
    yield from session.measure(f"z{stage}_recheck_{mbs}", [replace(exp, name=f"{exp.name}_r2")])
    return True


def _sample_smallest(session: Session, stage: int) -> Step:
    """On CPU slots without max_train_batch_size, the lead stage's second sample is the smallest
    size of its space, the one with the most accumulation, right after the top (`anchor`): both
    ends of the range are measured before it is refined. A quarter of the top, the low sample with
    max_train_batch_size, cannot see a curve that rises again below it: on CPU slots the real GPT
    example's optimum was micro-batch 1 with gas 16, 10 % above a plateau from a quarter of the top
    to the top (bench/trace_replay.py: right in 74.5 % of replays with this sample, 19.5 % without).
    On GPU slots, where a micro-step's fixed costs (kernel launches) make the smallest size slow, only
    where the model's states take `PRESSED_STATES_SHARE` of the budget: the sizes near the top then
    run with the device nearly full, and large models' optima lay at small sizes with much
    accumulation (bench/search_quality.py's large-model family). Elsewhere on GPUs it won as many
    searches as it lost (bench/rule_ablation.py, written-apart scripts included) for half a launch a
    search; the refinement starts from the range's middle instead."""
    st, model = session.settings, session.model
    if not st.host_memory and (model is None or model.held_bytes(stage) < PRESSED_STATES_SHARE * st.budget_bytes):
        return
    values = stage_values(session, stage)
    sizes = stage_candidates(session, stage)
    if sizes and sum(v is not None for v in values.values()) == 1 and sizes[0] not in values:
        yield from measure_size(session, stage, sizes[0], f"z{stage}_sample_{sizes[0]}")


def anchor(session: Session, stage: int) -> Step:
    """Without max_train_batch_size, probe the stage's top (at the user's gas) until a size runs, as
    DeepSpeed's max probes do, so its space is bounded by a size it can hold; True once it is,
    False when the stage gave up (`stage_top` came to 0). A top whose config was measured already
    (its space's accumulation above the user's, so `known_feasible` does not count it) ends the
    probing: True when it ran, as measuring it again would change nothing."""
    if session.settings.samples_per_step:
        return True
    while not known_feasible(session, stage):
        top = stage_top(session, stage, cautious=True)
        if top < 1:
            return False
        done = session.measured.get(session.experiment(stage, top, gas_for(session, stage, top)).name)
        if done is not None:
            return done[1].get("status") == "ok"
        yield from measure_size(session, stage, top, f"z{stage}_top_{top}")
    return True


def measure_size(session: Session, stage: int, mbs: int, label: str) -> Step:
    """One config's metric (None: it failed). A failure that says nothing about the config
    (`says_nothing`: not out-of-memory, or out of memory beside others' memory), or an out-of-memory
    a larger success of the stage contradicts (`_contradicted`), is launched once more (`<name>_r2`,
    a repeat) before the config counts as failed. Failing twice, the size is left out of the stage's
    probing (`sizes_ran`), but is no memory fact for other stages (`session.too_large`)."""
    exp = session.experiment(stage, mbs, gas_for(session, stage, mbs))
    [record] = yield from session.measure(label, [exp])
    if says_nothing(record) or _contradicted(session, stage, mbs, record):
        [record] = yield from session.measure(f"{label}_retry", [replace(exp, name=f"{exp.name}_r2")])
    return metric_value(record, session.settings.metric)


def _contradicted(session: Session, stage: int, mbs: int, record: Mapping[str, Any]) -> bool:
    """Whether `record` ran out of memory at a size its stage already ran at or above: memory does
    not shrink as the micro-batch grows (nor with the accumulation, which adds no activations), so
    the failure is the GPU's state, not the config's; it is launched once more, not believed
    (`session.too_large` leaves such an out-of-memory out of the memory facts, too)."""
    return record.get("status") == "oom" and any(ran and size >= mbs for size, ran in sizes_ran(session, stage).items())


def _relative(value: float, reference: float, maximize: bool) -> float:
    change = value - reference if maximize else reference - value
    return change / abs(reference) if reference else 0.0


def try_sawtooth(session: Session, stages: Sequence[int]) -> Step:
    """Before the winner is confirmed, measure the leader's saw-tooth neighbour (`sawtooth_neighbour`)
    once: refinement stops at sizes within sampling.REFINE_RATIO, which a size one smaller always is, though
    its extra accumulation step may train more samples per step for the same fixed costs. Then, when
    the leader leaves its step unfilled and its stage holds the size filling it at the leader's own
    accumulation (`filled_size`: a leader measured as a provisional top), that size once. Only with
    max_train_batch_size: without it every sampled size fills the step, and a kept global batch is
    filled exactly by every size it allows."""
    st = session.settings
    if not st.samples_per_step or st.kept_per_gpu:
        return
    leader = leader_of(session, stages)
    if leader is None:
        return
    stage, mbs = leader
    size = sawtooth_neighbour(mbs, gas_for(session, stage, mbs), st.samples_per_step)
    if size is not None and size not in stage_values(session, stage):
        yield from measure_size(session, stage, size, f"z{stage}_sawtooth_{size}")
    filled = filled_size(mbs, gas_for(session, stage, mbs), st.samples_per_step)
    if filled is not None and filled <= stage_top(session, stage) and filled not in stage_values(session, stage):
        yield from measure_size(session, stage, filled, f"z{stage}_filled_{filled}")


def widen_step(session: Session, stages: Sequence[int]) -> Step:
    """Without max_train_batch_size, before the winner is confirmed: when the leader accumulates
    (gas >= 2) and its stage's top is predicted above the largest size known to run, and the step
    that top gives is wider than the one the leader fills (a leader measured at another stage's
    config may fill it already), probe that top once, and if it runs measure the leader's
    accumulation at the largest size that fills the wider step. The step every size fills is the
    largest size that ran (DeepSpeed's rule), and the stage's first probes bracket the top only to a
    halving: a leader at gas 2 then runs at half a step that is short of the top, where the optimum
    is half the top (bench/surfaces.py's cliff family)."""
    st = session.settings
    if st.samples_per_step or st.kept_per_gpu:
        return
    leader = leader_of(session, stages)
    if leader is None:
        return
    stage, mbs = leader
    gas = gas_for(session, stage, mbs)
    top, known = stage_top(session, stage), known_feasible(session, stage)
    if gas < 2 or top <= known or max(1, st.gradient_accumulation_steps) * top // gas <= mbs:
        return
    if (yield from measure_size(session, stage, top, f"z{stage}_widen_{top}")) is None:
        return
    size = samples_per_step(session, stage) // gas
    if size > mbs and size not in stage_values(session, stage):
        yield from measure_size(session, stage, size, f"z{stage}_widened_{size}")


def stages_near_leader(session: Session, stages: Sequence[int]) -> list[tuple[int, int, int]]:
    """(stage, mbs, gas) of each stage >= 1 whose best is within FULL_MODE_BAND of the leader's."""
    st = session.settings
    bests = []
    for stage in stages:
        values = {m: v for m, v in stage_values(session, stage).items() if v is not None}
        if values and stage >= 1:
            mbs = max(values, key=lambda m: values[m] if st.maximize else -values[m])
            bests.append((values[mbs], stage, mbs))
    leader = [v for v, _, _ in bests]
    if not leader:
        return []
    top = max(leader) if st.maximize else min(leader)
    return [(stage, mbs, gas_for(session, stage, mbs)) for value, stage, mbs in bests
            if _relative(value, top, st.maximize) >= -FULL_MODE_BAND]
