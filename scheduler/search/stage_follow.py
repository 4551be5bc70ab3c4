"""The stages after the first: each followed from the incumbent, explored only where it can lead.

Why its own module: the sampled search (`scheduler.search.sampled_search`) samples and refines one
stage at a time; whether a later stage is worth that at all, and from which size, is decided
against the incumbent (the best config so far). One reading at the incumbent's size tells most of
how a stage compares, and exploring a stage that cannot lead costs launches and failed top probes.

- **Followed**: a stage is first measured at the incumbent's size (without max_train_batch_size,
  after its own top); that one reading tells how it compares.
- **Explored further** only when one of these holds, else the reading rules it out:
  - the incumbent was the largest size its own stage could hold and this stage holds more (the
    curve was still rising at the cap);
  - with max_train_batch_size, the incumbent accumulates because its stage cannot hold the size
    filling the step with one accumulation step less, and this stage can (`_fuller_step`: that
    size is measured once, and wins or rules the stage out);
  - without it, the stage beat the incumbent there (its own top may give it a larger step);
  - holding less than the incumbent's size (measured at the size it holds), it beat the
    incumbent's stage at that size (`stage_readings.beats_at_equal_size`: like for like).
- **ZeRO-0 beside a ZeRO-1 incumbent** (or the reverse) is measured once at the incumbent's own size
  and accumulation, and explored only for the first reason with a top `sampling.TOP_GAIN` above the
  incumbent's (`_same_micro_steps`: both reduce gradients only at the accumulation boundary, so
  their micro-steps are the same work and their best sizes over one space coincide; a top
  predicted a few percent above is mostly the model's error, and its probes fail).
- **Not measured at all**, without max_train_batch_size: a stage whose predicted top fills less than
  half the incumbent's step (`_half_step`: ZeRO-0 of a large model, whose top probes mostly fail).
- **ZeRO-3** moves more data than ZeRO-1/2 at equal size. On fewer than `ZERO3_AT_SCALE`
  data-parallel ranks it is measured only when it can hold larger sizes that matter (the curve was
  still rising at the cap, or it holds `ZERO3_ROOM` times what ZeRO-1/2 hold, so memory pressure
  may have turned their curves), or when no ZeRO-1/2 stage was measured. From `ZERO3_AT_SCALE`
  ranks on, where its sharding and prefetch let it lead, it is always measured once at the
  incumbent's samples per step in the fewest micro-steps its first probe size holds
  (`_fewest_micro_steps`: it gathers every parameter each micro-step, so at the incumbent's
  smaller size it reads far below its best; out of memory there, at the incumbent's own config),
  and explored if it reads better there (`_leads_at`).

Pure decision logic over a `Session`, turned into phases like the sampled search's.
"""
from __future__ import annotations

from collections.abc import Sequence

from scheduler.search.ranking import metric_value
from scheduler.search.sampled_search import anchor, explore_stage, measure_size
from scheduler.search.sampling import TOP_GAIN, lead_first
from scheduler.search.session import Session, Step
from scheduler.search.stage_readings import (
    at_cap, beats_at_equal_size, beats_other_stages, leader_of, stage_values,
)
from scheduler.search.stage_space import MAX_FAILURES, gas_for, samples_per_step, stage_candidates, stage_top


#: ZeRO-3 is explored, although the incumbent's curve had turned, when it holds at least this many
#: times the largest size ZeRO-1/2 hold: near a stage's memory cap the allocator's pressure slows it,
#: and ZeRO-3 runs those sizes with that much more memory free.
ZERO3_ROOM = 1.3
#: From this many data-parallel ranks ZeRO-3 is measured at least once whatever it holds: its
#: parameter sharding frees (1 - 1/dp) of the parameters and its prefetch hides the gathers behind
#: compute, so at scale it can lead (a 4-rank bf16 script; bench/heldout.py's 4-16 rank families).
#: On 2 ranks it frees half the parameters and leads only on memory (`ZERO3_ROOM`).
ZERO3_AT_SCALE = 4


def sampled_stages(session: Session, stages: Sequence[int]) -> Step:
    """Every allowed stage, in order: sampled, followed from the incumbent, or ruled out; once memory
    strategies paid decisively from the lead stage's top (`strategy_first`), the others only probed at
    their tops, for the strategies tried from the best of them (`strategy_search.try_strategies`)."""
    explored: list[int] = []
    paid = False  # memory strategies paid decisively from the lead stage's top (`strategy_first`)
    for stage in lead_first(stages, session.settings.dp_size):
        top = stage_top(session, stage)  # what the earlier stages' probes predict; the stage ran nothing yet
        if top < 1:
            continue
        if paid:
            yield from _top_only(session, stage)
            continue
        incumbent = leader_of(session, explored)
        if incumbent is None:
            paid = bool((yield from explore_stage(session, stage, strategies_first=True)))
            explored.append(stage)
            continue
        inc_mbs = incumbent[1]
        upside = at_cap(session, explored, inc_mbs) and top > inc_mbs
        if stage == 3 and any(s in (1, 2) for s in explored):
            lighter = max(stage_top(session, s) for s in explored if s in (1, 2))
            roomy = top >= ZERO3_ROOM * lighter  # near the top pressure slows the lighter stages
            if not (upside or roomy):
                if session.settings.dp_size < ZERO3_AT_SCALE or not (
                        yield from _leads_at(session, stage, incumbent, _fewest_micro_steps(session, incumbent))):
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
        if not (yield from anchor(session, stage)):
            continue
        size = min(inc_mbs, stage_top(session, stage, cautious=True))
        value = yield from measure_size(session, stage, size, f"z{stage}_follow_{size}")
        explored.append(stage)
        if value is not None and fuller and not upside:
            value = yield from measure_size(session, stage, fuller, f"z{stage}_step_{fuller}")
            upside = value is not None and beats_other_stages(session, stage, value, bounded=True)
        if value is not None and (upside or beats_other_stages(session, stage, value)
                                  or beats_at_equal_size(session, stage, size, value, incumbent)):
            yield from explore_stage(session, stage, floor=size)


def _top_only(session: Session, stage: int) -> Step:
    """A stage after the strategies paid decisively from the lead stage's top (`strategy_first`): its
    top alone, what it holds and how fast it runs there, for the strategies tried again from the best
    of the stages' tops. Without max_train_batch_size its probes to a size that runs (`anchor`); with
    it, its largest full-step size, a smaller one after a failure, `MAX_FAILURES` probes at most."""
    if not session.settings.samples_per_step:
        yield from anchor(session, stage)
        return
    for _ in range(MAX_FAILURES):
        sizes = stage_candidates(session, stage)
        if not sizes or max(sizes) in stage_values(session, stage):
            return
        if (yield from measure_size(session, stage, max(sizes), f"z{stage}_top_{max(sizes)}")) is not None:
            return


def _same_micro_steps(stage: int, other: int) -> bool:
    """Whether `stage` and `other` are ZeRO-0 and ZeRO-1: both reduce gradients only at the
    accumulation boundary, so their micro-steps are the same work and they differ by a cost per
    optimizer step (ZeRO-1 shards the optimizer and gathers the parameters after it). Over the same
    space their best sizes coincide: one reading at the other's leading config tells which leads."""
    return {stage, other} == {0, 1}


def _leads_at(session: Session, stage: int, incumbent: tuple[int, int],
              config: tuple[int, int] | None = None) -> Step:
    """Measure `stage` once at `config` (micro-batch, accumulation; default: the incumbent's own,
    which the stage holds) and say whether it reads better than the incumbent: a comparison at
    the incumbent's samples per step that needs no probe of the stage's top. A `config` that
    fails (its size above what the stage holds) is compared at the incumbent's own instead."""
    inc_stage, inc_mbs = incumbent
    own = (inc_mbs, gas_for(session, inc_stage, inc_mbs))
    mbs, gas = config or own
    exp = session.experiment(stage, mbs, gas)
    [record] = yield from session.measure(f"z{stage}_compare_{mbs}", [exp])
    value = metric_value(record, session.settings.metric)
    if value is None and (mbs, gas) != own:
        return (yield from _leads_at(session, stage, incumbent))
    lead = stage_values(session, inc_stage).get(inc_mbs)
    if value is None or lead is None:
        return False
    return value > lead if session.settings.maximize else value < lead


def _fewest_micro_steps(session: Session, incumbent: tuple[int, int]) -> tuple[int, int] | None:
    """ZeRO-3's config for its comparison with the incumbent: the incumbent's samples per step in
    the fewest micro-steps ZeRO-3's first probe size holds (`stage_top`, cautious); None (the
    incumbent's own config) when that size is no larger than the incumbent's. Each ZeRO-3
    micro-step gathers every parameter (the cost model's per-micro-step term), hidden by its
    prefetch only behind a long enough compute, so at the incumbent's smaller size and longer
    accumulation it reads far below its best (bench/heldout.py's comm-bound scripts: 0.57-0.65
    of the optimum at the incumbent's config, 0.90-1.00 at one micro-step)."""
    inc_stage, inc_mbs = incumbent
    samples = inc_mbs * gas_for(session, inc_stage, inc_mbs)
    top = stage_top(session, 3, cautious=True)
    if top <= inc_mbs:
        return None
    steps = -(-samples // top)
    size = samples // steps
    return size, gas_for(session, 3, size) if session.settings.samples_per_step else steps


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
