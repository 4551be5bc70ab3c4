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
  top is probed), then the top; without it, the top first (`_anchor`: the step is bounded by a size
  that ran), then the smallest size, with the most accumulation (`_sample_smallest`: on CPU slots
  the real GPT example's optimum lay there, below a plateau a quarter of the top would have sat
  on). Then golden-section-like refinement on log(mbs) around the best
  measured size (where the cost model explains four or more readings within the noise, the size it
  predicts best, if its reading is within the noise of the best: `stage_readings.smoothed_best`)
  until its neighbours are within `sampling.REFINE_RATIO` of it, splitting the gaps between
  measured sizes before going below the smallest; a top that the memory line later moves up is
  probed again only when it is `sampling.TOP_GAIN` larger. A reading the fit of the stage's
  other sizes contradicts (`scheduler.search.cost_model`: seconds per sample as a per-micro-step,
  a per-sample, a per-step and a growing per-sample cost, fitted to the stage's readings) is a
  straggler's or a lucky one: that config is measured once more (`_recheck`) and the refinement
  reads the reading the fit agrees with, so one slow run does not hide the region around the
  optimum and one lucky run does not pull the refinement to it. A size the refinement would split
  at whose trusted prediction stays below the stage's best reading even at its upper bound is read
  off the fit instead of measured (`stage_readings.predicted_worse`: it could not lead). When the
  refinement has no gap left to split, a size the fit predicts better than the stage's best by more
  than the noise, where its prediction is trusted, is measured (`stage_readings.predicted_better`);
- another stage is first measured at the incumbent's size (without max_train_batch_size, after its
  own top), which tells how it compares. It is explored further only if the incumbent was the
  largest size its own stage could hold and this stage holds more (the curve was still rising at
  the cap; or the cost model puts that largest size within the noise of the incumbent,
  `stage_readings.flat_to_top`, and this stage holds more than `FLAT_ROOM` times it), or, with
  max_train_batch_size, if the incumbent accumulates because its stage cannot hold the size
  filling the step with one accumulation step less and this stage can
  (`_fuller_step`: that size is measured once, and wins or rules the stage out), or, without
  max_train_batch_size, if it beat the incumbent there (its own top may give it a larger step),
  or, when it holds less than the incumbent's size (measured at the size it holds), if it beat the
  incumbent's stage at that size (`stage_readings.beats_at_equal_size`: like for like);
  otherwise the measurement rules it out. ZeRO-0 beside a ZeRO-1 incumbent (or the reverse) is
  measured once at the incumbent's own size and accumulation, and explored only for the first
  reason with a top `sampling.TOP_GAIN` above the incumbent's (`_same_micro_steps`: both reduce
  gradients only at the accumulation boundary, so their micro-steps are the same work and their
  best sizes over one space coincide: its own top and a refinement would cost launches and tell
  nothing the incumbent's stage did not, unless it holds clearly larger sizes where that stage's
  curve still rose; a top predicted a few percent above is mostly the model's error, and its
  probes fail). Without
  max_train_batch_size a stage whose predicted top fills less than half the incumbent's step is not
  measured at all (`_half_step`: ZeRO-0 of a large model, whose top probes mostly fail). ZeRO-3
  moves more data than ZeRO-1/2 at equal size: on fewer than `ZERO3_AT_SCALE` data-parallel ranks
  it is measured only when it can hold larger sizes that matter (the curve was still rising at the
  cap, or it holds `ZERO3_ROOM` times what ZeRO-1/2 hold, so memory pressure may have turned their
  curves), or no ZeRO-1/2 stage was measured; from
  `ZERO3_AT_SCALE` ranks on, where its sharding and prefetch let it lead, it is always measured once,
  at the incumbent's own size and accumulation (`_leads_at`: no probe of its top), and explored if
  it reads better there;
- a failure that says nothing about the config (`scheduler.search.repeats.says_nothing`: a crash,
  a timeout, a rendezvous that failed, an out-of-memory beside others' memory) is launched once
  more at once (`_measure`), and so is an out-of-memory at a size the stage already ran at or above
  (`_contradicted`: memory does not shrink as the size grows); a size failing twice is left out of its stage, and is no memory fact;
- the memory side follows `scheduler.search.memory_facts`: predictions stay between the largest ok and the
  smallest size out of memory, and every stage's probes bound the others (`memory_facts.shared_facts`: a failure
  bounds the stages holding more, a success the stages holding less, a bracket moves the others'
  predicted tops, with or without measured peaks); once the model was caught over-predicting (an
  out-of-memory at a size it said fits), a stage's first probe (`_anchor`, a followed size) is the
  cautious prediction, halfway from what the others' brackets say it surely holds; after a failure
  the next upward probe is the geometric midpoint, and a stage stops probing upward after
  `MAX_FAILURES` failures above a success (`MAX_BLIND_FAILURES` halvings when nothing in the job
  ran yet); a leading top no measured peak checked is probed above (`above_unchecked_top`);
- before confirming, the leader's saw-tooth neighbour with max_train_batch_size, and the size
  filling its step at its own accumulation where it was measured as a provisional top (`try_sawtooth`);
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
from scheduler.search.sampling import TOP_GAIN, filled_size, lead_first, next_size, sawtooth_neighbour, snap
from scheduler.search.session import Session, Step
from scheduler.search.stage_readings import (
    above_unchecked_top, at_cap, beats_at_equal_size, beats_other_stages, flat_to_top, leader_of, predicted_better,
    predicted_worse, smoothed_best, stage_values, suspect_size,
)
from scheduler.search.stage_space import (
    gas_for, known_feasible, samples_per_step, sizes_ran, stage_candidates, stage_top,
)


#: At most this many sizes are measured per stage (a guard; refinement normally stops earlier).
MAX_POINTS = 7
#: Full mode explores the knobs of every stage whose fast-mode best is within this of the leader.
FULL_MODE_BAND = 0.10


#: ZeRO-3 is explored, although the incumbent's curve had turned, when it holds at least this many
#: times the largest size ZeRO-1/2 hold: near a stage's memory cap the allocator's pressure slows it,
#: and ZeRO-3 runs those sizes with that much more memory free.
ZERO3_ROOM = 1.3
#: A stage holding more than this many times the top of an incumbent's curve that is flat up to
#: that top (`stage_readings.flat_to_top`) is explored: the leader below the top leads on noise.
FLAT_ROOM = 2.0
#: From this many data-parallel ranks ZeRO-3 is measured at least once whatever it holds: its
#: parameter sharding frees (1 - 1/dp) of the parameters and its prefetch hides the gathers behind
#: compute, so at scale it can lead (a 4-rank bf16 script; bench/heldout.py's 4-16 rank families).
#: On 2 ranks it frees half the parameters and leads only on memory (`ZERO3_ROOM`).
ZERO3_AT_SCALE = 4


# ---------------------------------------------------------------- the generators


def sampled_stages(session: Session, stages: Sequence[int]) -> Step:
    """Every allowed stage, in order: sampled, followed from the incumbent, or ruled out."""
    explored: list[int] = []
    for stage in lead_first(stages, session.settings.dp_size):
        top = stage_top(session, stage)  # what the earlier stages' probes predict; the stage ran nothing yet
        if top < 1:
            continue
        incumbent = leader_of(session, explored)
        if incumbent is None:
            yield from explore_stage(session, stage)
            explored.append(stage)
            continue
        inc_mbs = incumbent[1]
        upside = at_cap(session, explored, inc_mbs) and top > inc_mbs
        flat = flat_to_top(session, incumbent[0]) or 0  # a leader below a flat top leads on noise
        upside = upside or (flat > inc_mbs and at_cap(session, explored, flat) and top > FLAT_ROOM * flat)
        if stage == 3 and any(s in (1, 2) for s in explored):
            lighter = max(stage_top(session, s) for s in explored if s in (1, 2))
            roomy = top >= ZERO3_ROOM * lighter  # near the top pressure slows the lighter stages
            if not (upside or roomy):
                if session.settings.dp_size < ZERO3_AT_SCALE or not (yield from _leads_at(session, stage, incumbent)):
                    continue
            upside = True
        fuller = _fuller_step(session, incumbent, top)
        if not upside and _half_step(session, stage, incumbent[0]):
            continue
        same = _same_micro_steps(stage, incumbent[0]) and not (upside and top >= TOP_GAIN * inc_mbs)
        if same and stage_top(session, stage, cautious=True) >= inc_mbs:
            yield from _leads_at(session, stage, incumbent)
            explored.append(stage)
            continue
        if not (yield from _anchor(session, stage)):
            continue
        size = min(inc_mbs, stage_top(session, stage, cautious=True))
        value = yield from _measure(session, stage, size, f"z{stage}_follow_{size}")
        explored.append(stage)
        if value is not None and fuller and not upside:
            value = yield from _measure(session, stage, fuller, f"z{stage}_step_{fuller}")
            upside = value is not None and beats_other_stages(session, stage, value, bounded=True)
        if value is not None and (upside or beats_other_stages(session, stage, value)
                                  or beats_at_equal_size(session, stage, size, value, incumbent)):
            yield from explore_stage(session, stage, floor=size)


def _same_micro_steps(stage: int, other: int) -> bool:
    """Whether `stage` and `other` are ZeRO-0 and ZeRO-1: both reduce gradients only at the
    accumulation boundary, so their micro-steps are the same work and they differ by a cost per
    optimizer step (ZeRO-1 shards the optimizer and gathers the parameters after it). Over the same
    space their best sizes coincide: one reading at the other's leading config tells which leads."""
    return {stage, other} == {0, 1}


def _leads_at(session: Session, stage: int, incumbent: tuple[int, int]) -> Step:
    """Measure `stage` once at the incumbent's own config (its size and accumulation, which the
    stage holds) and say whether it reads better: a like-for-like comparison that needs no probe
    of the stage's top."""
    inc_stage, mbs = incumbent
    gas = gas_for(session, inc_stage, mbs)
    exp = session.experiment(stage, mbs, gas)
    [record] = yield from session.measure(f"z{stage}_compare_{mbs}", [exp])
    value = metric_value(record, session.settings.metric)
    lead = stage_values(session, inc_stage).get(mbs)
    if value is None or lead is None:
        return False
    return value > lead if session.settings.maximize else value < lead


def _half_step(session: Session, stage: int, incumbent_stage: int) -> bool:
    """Without max_train_batch_size, whether `stage` can fill less than half the step the incumbent's
    stage fills (its predicted top against the incumbent's stage's largest size that ran): every
    config of its space would carry the step's fixed costs (the optimizer step, the gradients'
    communication) over under half the samples. It is not measured: on bench/search_quality.py
    this is ZeRO-0 of a large model, whose top probes failed 130 times in 177 launches over 300
    searches and never came within 1 % of the optimum."""
    if session.settings.samples_per_step:
        return False
    return 2 * samples_per_step(session, stage) < samples_per_step(session, incumbent_stage)


def explore_stage(session: Session, stage: int, floor: int = 0) -> Step:
    """Sample and refine one stage, above `floor`, until `next_size` says done and the cost model
    predicts no unmeasured size better (`stage_readings.predicted_better`), or the guards."""
    st = session.settings
    if not (yield from _anchor(session, stage)):
        return
    if not stage_values(session, stage):
        top = stage_top(session, stage)
        sizes = stage_candidates(session, stage)
        low = snap(max(1.0, top / 4), sizes) if sizes else top
        if low < top:
            yield from _measure(session, stage, low, f"z{stage}_sample_{low}")
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
        yield from _measure(session, stage, size, f"z{stage}_sample_{size}")


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
    """Without max_train_batch_size, the lead stage's second sample is the smallest size of its
    space, the one with the most accumulation, right after the top (`_anchor`): both ends of the
    range are measured before it is refined. A quarter of the top, the low sample with
    max_train_batch_size, cannot see a curve that rises again below it: on CPU slots the real GPT
    example's optimum was micro-batch 1 with gas 16, 10 % above a plateau from a quarter of the top
    to the top. Where the curve rises with the size (a GPU's, mostly) this costs
    one launch, and the refinement goes on from the geometric middle of the range."""
    values = stage_values(session, stage)
    sizes = stage_candidates(session, stage)
    if sizes and sum(v is not None for v in values.values()) == 1 and sizes[0] not in values:
        yield from _measure(session, stage, sizes[0], f"z{stage}_sample_{sizes[0]}")


def _anchor(session: Session, stage: int) -> Step:
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
        yield from _measure(session, stage, top, f"z{stage}_top_{top}")
    return True


def _measure(session: Session, stage: int, mbs: int, label: str) -> Step:
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


def _fuller_step(session: Session, incumbent: tuple[int, int], top: int) -> int | None:
    """With a samples-per-step limit: the size filling the step with one accumulation step less than
    the incumbent's, when the incumbent's stage cannot hold it and a stage whose top is `top` can
    (the curve along the full-step sizes was cut by memory, not turned); else None."""
    st = session.settings
    stage, mbs = incumbent
    gas = gas_for(session, stage, mbs)
    if not st.samples_per_step or gas < 2:
        return None
    larger = st.samples_per_step // (gas - 1)
    return larger if stage_top(session, stage) < larger <= top else None


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
        yield from _measure(session, stage, size, f"z{stage}_sawtooth_{size}")
    filled = filled_size(mbs, gas_for(session, stage, mbs), st.samples_per_step)
    if filled is not None and filled <= stage_top(session, stage) and filled not in stage_values(session, stage):
        yield from _measure(session, stage, filled, f"z{stage}_filled_{filled}")


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
    if (yield from _measure(session, stage, top, f"z{stage}_widen_{top}")) is None:
        return
    size = samples_per_step(session, stage) // gas
    if size > mbs and size not in stage_values(session, stage):
        yield from _measure(session, stage, size, f"z{stage}_widened_{size}")


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
