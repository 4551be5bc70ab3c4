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
  measured size until its neighbours are within `sampling.REFINE_RATIO` of it, splitting the gaps between
  measured sizes before going below the smallest; a top that the memory line later moves up is
  probed again only when it is `sampling.TOP_GAIN` larger. A reading a larger size's contradicts
  (`sampling.implausible_reading`: a smaller size's throughput is at least m_s / m_l of a larger
  one's) is a straggler's: that config is measured once more (`_recheck`) and the refinement reads
  its better reading, so one slow run does not hide the region around the optimum;
- another stage is first measured at the incumbent's size (without max_train_batch_size, after its
  own top), which tells how it compares. It is explored further only if the incumbent was the
  largest size its own stage could hold and this stage holds more (the curve was still rising at
  the cap), or, with max_train_batch_size, if the incumbent accumulates because its stage cannot
  hold the size filling the step with one accumulation step less and this stage can
  (`_fuller_step`: that size is measured once, and wins or rules the stage out), or, without
  max_train_batch_size, if it beat the incumbent there (its own top may give it a larger step);
  otherwise the measurement rules it out. Without max_train_batch_size a stage whose predicted top
  fills less than half the incumbent's step is not measured at all (`_half_step`: ZeRO-0 of a large
  model, whose top probes mostly fail); ZeRO-3 moves strictly more data than
  ZeRO-1/2 at equal size, so it is not measured at all unless it can hold larger sizes that matter
  (the curve was still rising at the cap, or ZeRO-3 holds `ZERO3_ROOM` times what ZeRO-1/2 hold, so
  memory pressure may have turned it), or no ZeRO-1/2 stage was measured;
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
  ran yet);
- before confirming, the leader's saw-tooth neighbour with max_train_batch_size (`try_sawtooth`);
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

from scheduler.search.global_batch import kept_sizes, largest_kept
from scheduler.search.ranking import metric_value
from scheduler.search.repeats import is_repeat, original_name, says_nothing
from scheduler.search.sampling import (
    full_step_sizes, geometric_mid, implausible_reading, lead_first, next_size, sawtooth_neighbour, snap,
)
from scheduler.search.session import Session, Step
from scheduler.search.space import PROFILE


#: A stage stops probing upward after this many failed probes (the issue's target: at most 2).
MAX_FAILURES = 2
#: Before any size of the job ran, the top is halved after each failure up to this many times: a
#: profile that understates the activations can over-predict the top by 2-4x. Once a stage ran
#: something, another stage's top is predicted from it, and gets MAX_FAILURES.
MAX_BLIND_FAILURES = 3
#: At most this many sizes are measured per stage (a guard; refinement normally stops earlier).
MAX_POINTS = 7
#: Full mode explores the knobs of every stage whose fast-mode best is within this of the leader.
FULL_MODE_BAND = 0.10
#: ZeRO-3 is explored, although the incumbent's curve had turned, when it holds at least this many
#: times the largest size ZeRO-1/2 hold: near a stage's memory cap the allocator's pressure slows it,
#: and ZeRO-3 runs those sizes with that much more memory free (large models: bench/README.md).
ZERO3_ROOM = 1.3
#: The share of the memory budget the top probe may fill. Closer to 1 than memory.SAFETY: the
#: budget already leaves out the untracked reserve, the line is fitted on two of the stage's own
#: sizes before the top is probed, and a failure only costs one launch and bounds the stage.
TOP_SAFETY = 0.98
#: Without max_train_batch_size the top also sets the step every smaller size fills (DeepSpeed's
#: rule), so a margin below the budget costs throughput on every step of the real run, while a
#: failed probe costs one launch: the whole budget.
TOP_SAFETY_UNBOUNDED = 1.0
# ---------------------------------------------------------------- the generators


def sampled_stages(session: Session, stages: Sequence[int]) -> Step:
    """Every allowed stage, in order: sampled, followed from the incumbent, or ruled out."""
    explored: list[int] = []
    for stage in lead_first(stages, session.settings.dp_size):
        top = _top(session, stage)  # what the earlier stages' probes predict; the stage ran nothing yet
        if top < 1:
            continue
        incumbent = _leader(session, explored)
        if incumbent is None:
            yield from _explore(session, stage)
            explored.append(stage)
            continue
        inc_mbs = incumbent[1]
        upside = _at_cap(session, explored, inc_mbs) and top > inc_mbs
        fuller = _fuller_step(session, incumbent, top)
        if stage == 3 and not upside and any(s in (1, 2) for s in explored):
            lighter = max(_top(session, s) for s in explored if s in (1, 2))
            if top < ZERO3_ROOM * lighter:
                continue  # ZeRO-3 moves more data than ZeRO-1/2 at equal size: it can only win on memory
            upside = True  # so much more memory free that it can win on memory pressure: explore it
        if not upside and _half_step(session, stage, incumbent[0]):
            continue
        if not (yield from _anchor(session, stage)):
            continue
        size = min(inc_mbs, _top(session, stage, cautious=True))
        value = yield from _measure(session, stage, size, f"z{stage}_follow_{size}")
        explored.append(stage)
        if value is not None and fuller and not upside:
            value = yield from _measure(session, stage, fuller, f"z{stage}_step_{fuller}")
            upside = value is not None and _wins(session, stage, value, bounded=True)
        if value is not None and (upside or _wins(session, stage, value)):
            yield from _explore(session, stage, floor=size)


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


def _wins(session: Session, stage: int, value: float, bounded: bool = False) -> bool:
    """Whether the followed stage's reading `value` beats every other stage's: without
    max_train_batch_size, its reading at the incumbent's size (its space fills a step of its own
    top, so at equal size it may accumulate more and lead); with it (`bounded`), its reading at the
    size filling the step the incumbent's stage could not hold (`_fuller_step`)."""
    st = session.settings
    if st.samples_per_step and not bounded:
        return False
    measured = {exp.stage for exp, _ in session.measured.values() if exp.space != PROFILE} - {stage}
    best = [v for s in measured for v in _values(session, s).values() if v is not None]
    return bool(best) and (value > max(best) if st.maximize else value < min(best))


def _explore(session: Session, stage: int, floor: int = 0) -> Step:
    """Sample and refine one stage, above `floor`, until `next_size` says done (or the guards)."""
    st = session.settings
    if not (yield from _anchor(session, stage)):
        return
    if not _values(session, stage):
        top = _top(session, stage)
        sizes = _candidates(session, stage)
        low = snap(max(1.0, top / 4), sizes) if sizes else top
        if low < top:
            yield from _measure(session, stage, low, f"z{stage}_sample_{low}")
    elif not st.samples_per_step and not floor:
        yield from _sample_smallest(session, stage)
    while True:
        values = _values(session, stage)
        if sum(v is not None for v in values.values()) >= MAX_POINTS:
            return
        suspect = implausible_reading(values, st.maximize)
        if suspect is not None and (yield from _recheck(session, stage, suspect)):
            continue
        sizes = [m for m in _candidates(session, stage) if m >= floor]
        size = next_size({m: v for m, v in values.items() if m >= floor}, sizes, st.maximize)
        if size is None:
            return
        yield from _measure(session, stage, size, f"z{stage}_sample_{size}")


def _recheck(session: Session, stage: int, mbs: int) -> Step:
    """Measure once more a config whose one reading a larger size's contradicts
    (`sampling.implausible_reading`); False when it was read more than once already (then the
    refinement goes on with what it has). The search reads it at its better reading (`_values`)."""
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
    to the top (bench/README.md). Where the curve rises with the size (a GPU's, mostly) this costs
    one launch, and the refinement goes on from the geometric middle of the range."""
    values = _values(session, stage)
    sizes = _candidates(session, stage)
    if sizes and sum(v is not None for v in values.values()) == 1 and sizes[0] not in values:
        yield from _measure(session, stage, sizes[0], f"z{stage}_sample_{sizes[0]}")


def _candidates(session: Session, stage: int) -> list[int]:
    """The sizes worth measuring in the stage now: the full-step sizes of its space, and its top (with
    a kept global batch, the sizes dividing its share: `global_batch.kept_sizes`).
    Without max_train_batch_size the space ends at the largest size known to run; a top above it
    is probed at the user's gas and, once it runs, widens the space."""
    top = _top(session, stage)
    step = samples_per_step(session, stage)
    if session.settings.kept_per_gpu:
        return kept_sizes(step, session.settings.min_micro_batch_size, top)
    if session.settings.samples_per_step:
        return full_step_sizes(step, top)
    known = min(top, _known_feasible(session, stage) or top)
    return full_step_sizes(step, known) + ([top] if top > known else [])


def samples_per_step(session: Session, stage: int) -> int:
    """The samples per GPU per optimizer step a stage's configs fill (the space searched).

    With max_train_batch_size, what it allows. Without it, DeepSpeed's rule (its mtbpg): the stage's
    largest feasible micro-batch times the user's gas, so a size below the top gets the accumulation
    that fills the same step. Feasible means known to run (`_known_feasible`): every stage runs
    its top first (`_anchor`, at the user's gas, which the predicted top stands in for until then),
    so the step never outgrows what the stage can hold.
    """
    st = session.settings
    if st.samples_per_step:
        return st.samples_per_step
    return max(1, st.gradient_accumulation_steps) * max(1, _known_feasible(session, stage) or _top(session, stage))


def _known_feasible(session: Session, stage: int) -> int:
    """The largest size the stage ran at the user's gas (0: none yet): its top, as DeepSpeed's max
    probes find it (the sizes sampled below the top run at more gas). Another stage's success does
    not count: a stage holding less may hold much more, and its space is bounded by its own top."""
    gas = session.settings.gradient_accumulation_steps
    return max((exp.micro_batch_size for exp, record in session.stage_records(stage)
                if record.get("status") == "ok" and exp.gradient_accumulation_steps <= gas and not exp.tuning_space),
               default=0)


def _anchor(session: Session, stage: int) -> Step:
    """Without max_train_batch_size, probe the stage's top (at the user's gas) until a size runs, as
    DeepSpeed's max probes do, so its space is bounded by a size it can hold; True once it is,
    False when the stage gave up (`_top` came to 0)."""
    if session.settings.samples_per_step:
        return True
    while not _known_feasible(session, stage):
        top = _top(session, stage, cautious=True)
        if top < 1:
            return False
        yield from _measure(session, stage, top, f"z{stage}_top_{top}")
    return True


def gas_for(session: Session, stage: int, mbs: int) -> int:
    """The accumulation of `mbs` in the stage's space: what fills `samples_per_step`, at least the user's."""
    st = session.settings
    if st.samples_per_step:
        return st.gas_for(mbs)
    return max(1, st.gradient_accumulation_steps, samples_per_step(session, stage) // mbs)


def _measure(session: Session, stage: int, mbs: int, label: str) -> Step:
    """One config's metric (None: it failed). A failure that says nothing about the config
    (`says_nothing`: not out-of-memory, or out of memory beside others' memory), or an out-of-memory
    a larger success of the stage contradicts (`_contradicted`), is launched once more (`<name>_r2`,
    a repeat) before the config counts as failed. Failing twice, the size is left out of the stage's
    probing (`_sizes`), but is no memory fact for other stages (`session.too_large`)."""
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
    return record.get("status") == "oom" and any(ran and size >= mbs for size, ran in _sizes(session, stage).items())


def _top(session: Session, stage: int, cautious: bool = False) -> int:
    """The largest size worth probing now: the calibrated prediction, capped, kept below failures;
    after a failure above a success, the geometric midpoint between them; after MAX_FAILURES
    failures, the largest success. A size that ran at any gas counts (memory does not depend on
    the accumulation), and so does a size a stage holding more ran (`memory_facts.shared_facts`).
    `cautious`: the size is the stage's first probe (`memory_facts.predict_max_micro_batch_size`)."""
    sizes = _sizes(session, stage)
    failed = [m for m, ok in sizes.items() if not ok]
    borrowed = session.shared_facts(stage).success  # the stage's own failure outranks another stage's success
    largest_ok = max([m for m, ok in sizes.items() if ok] + [borrowed if not failed or borrowed < min(failed) else 0])
    predicted = session.predicted_max(stage, TOP_SAFETY if session.settings.samples_per_step else TOP_SAFETY_UNBOUNDED,
                                      cautious)
    if failed:
        smallest_failed = min(failed)
        if largest_ok and _failures_since_a_success(session, stage) >= MAX_FAILURES:
            return largest_ok
        ran_elsewhere = any(record.get("status") == "ok" for exp, record in session.measured.values()
                            if exp.space != PROFILE and exp.stage != stage)
        if not largest_ok and len(failed) >= (MAX_FAILURES if ran_elsewhere else MAX_BLIND_FAILURES):
            return 0
        if largest_ok:
            mid = geometric_mid(largest_ok, smallest_failed)
            predicted = min(predicted, mid if mid is not None else largest_ok)
        else:
            predicted = min(predicted, smallest_failed // 2)
    top = max(predicted, largest_ok)
    kept = session.settings.kept_per_gpu
    return largest_kept(kept, top) if kept else top  # a kept global batch: only sizes dividing its share


def _failures_since_a_success(session: Session, stage: int) -> int:
    """Sizes of the stage that failed after its first success: the ones that bracket its top (the
    blind ones before it only found a size that runs). A size whose retry ran is none of them."""
    failed, seen_ok = set(), bool(session.shared_facts(stage).success)
    ran = _sizes(session, stage)
    for exp, record in session.stage_records(stage):
        if exp.tuning_space:
            continue
        if record.get("status") == "ok":
            seen_ok = True
        elif seen_ok and not ran.get(exp.micro_batch_size):
            failed.add(exp.micro_batch_size)
    return len(failed)


def _values(session: Session, stage: int) -> dict[int, float | None]:
    """size -> metric (None: failed) of the stage's measured sizes at their gas in the space. Without
    max_train_batch_size only sizes that fill the step count (a size between the top probes, run at
    the user's gas below a top that ran, leaves part of the step empty). A config whose first launch
    failed (`says_nothing`) reads its retry's metric; other repeats are the confirm phase's."""
    st = session.settings
    filling = None if st.samples_per_step else set(_candidates(session, stage))
    out: dict[int, float | None] = {}
    for exp, record in session.stage_records(stage):
        if exp.tuning_space or (is_repeat(exp.name, session.measured) and not _retry_of_failure(session, exp.name)):
            continue
        value = _better_reading(session, exp.name, metric_value(record, st.metric))
        if filling is not None and value is not None and exp.micro_batch_size not in filling:
            continue
        if exp.gradient_accumulation_steps == gas_for(session, stage, exp.micro_batch_size):
            out[exp.micro_batch_size] = value
    return out


def _better_reading(session: Session, name: str, value: float | None) -> float | None:
    """`value`, or the better reading of its `_recheck` (a straggler only slows a run)."""
    again = session.measured.get(f"{name}_r2")
    if value is None or again is None:
        return value
    other = metric_value(again[1], session.settings.metric)
    if other is None:
        return value
    return max(value, other) if session.settings.maximize else min(value, other)


def _retry_of_failure(session: Session, name: str) -> bool:
    """Whether `name` is the retry `_measure` launched after its original failed (confirm repeats
    only configs that ran)."""
    original = original_name(name, session.measured)
    return name == f"{original}_r2" and session.measured[original][1].get("status") != "ok"


def _sizes(session: Session, stage: int) -> dict[int, bool]:
    """size -> whether it ran (at any gas) in the stage, for the memory side."""
    out: dict[int, bool] = {}
    for exp, record in session.stage_records(stage):
        if not exp.tuning_space:
            out[exp.micro_batch_size] = out.get(exp.micro_batch_size, False) or record.get("status") == "ok"
    return out


def _leader(session: Session, stages: Sequence[int]) -> tuple[int, int] | None:
    """(stage, mbs) of the best config measured so far in `stages` at its gas in the space (None:
    none succeeded): the incumbent another stage is followed from, the leader before confirming."""
    leader: tuple[float, int, int] | None = None
    sign = 1 if session.settings.maximize else -1
    for stage in stages:
        for mbs, value in _values(session, stage).items():
            if value is not None and (leader is None or sign * value > sign * leader[0]):
                leader = (value, stage, mbs)
    return None if leader is None else leader[1:]


def _at_cap(session: Session, stages: Sequence[int], mbs: int) -> bool:
    """Whether `mbs` is the largest size measured ok in any stage so far: the curve was still
    rising where memory stopped it, so a stage holding larger sizes may do better."""
    largest = max((m for stage in stages for m, v in _values(session, stage).items() if v is not None), default=0)
    return mbs >= largest


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
    return larger if _top(session, stage) < larger <= top else None


def _relative(value: float, reference: float, maximize: bool) -> float:
    change = value - reference if maximize else reference - value
    return change / abs(reference) if reference else 0.0


def try_sawtooth(session: Session, stages: Sequence[int]) -> Step:
    """Before the winner is confirmed, measure the leader's saw-tooth neighbour (`sawtooth_neighbour`)
    once: refinement stops at sizes within sampling.REFINE_RATIO, which a size one smaller always is, though
    its extra accumulation step may train more samples per step for the same fixed costs. Only with
    max_train_batch_size: without it every sampled size fills the step, and a kept global batch is
    filled exactly by every size it allows."""
    st = session.settings
    if not st.samples_per_step or st.kept_per_gpu:
        return
    leader = _leader(session, stages)
    if leader is None:
        return
    stage, mbs = leader
    size = sawtooth_neighbour(mbs, gas_for(session, stage, mbs), st.samples_per_step)
    if size is not None and size not in _values(session, stage):
        yield from _measure(session, stage, size, f"z{stage}_sawtooth_{size}")


def widen_step(session: Session, stages: Sequence[int]) -> Step:
    """Without max_train_batch_size, before the winner is confirmed: when the leader accumulates
    (gas >= 2) and its stage's top is predicted above the largest size known to run, probe that top
    once, and if it runs measure the leader's accumulation at the largest size that fills the wider
    step. The step every size fills is the largest size that ran (DeepSpeed's rule), and the stage's
    first probes bracket the top only to a halving: a leader at gas 2 then runs at half a step that
    is short of the top, where the optimum is half the top (bench/README.md, the cliff family)."""
    st = session.settings
    if st.samples_per_step or st.kept_per_gpu:
        return
    leader = _leader(session, stages)
    if leader is None:
        return
    stage, mbs = leader
    gas = gas_for(session, stage, mbs)
    top, known = _top(session, stage), _known_feasible(session, stage)
    if gas < 2 or top <= known:
        return
    if (yield from _measure(session, stage, top, f"z{stage}_widen_{top}")) is None:
        return
    size = samples_per_step(session, stage) // gas
    if size > mbs and size not in _values(session, stage):
        yield from _measure(session, stage, size, f"z{stage}_widened_{size}")


def stages_near_leader(session: Session, stages: Sequence[int]) -> list[tuple[int, int, int]]:
    """(stage, mbs, gas) of each stage >= 1 whose best is within FULL_MODE_BAND of the leader's."""
    st = session.settings
    bests = []
    for stage in stages:
        values = {m: v for m, v in _values(session, stage).items() if v is not None}
        if values and stage >= 1:
            mbs = max(values, key=lambda m: values[m] if st.maximize else -values[m])
            bests.append((values[mbs], stage, mbs))
    leader = [v for v, _, _ in bests]
    if not leader:
        return []
    top = max(leader) if st.maximize else min(leader)
    return [(stage, mbs, gas_for(session, stage, mbs)) for value, stage, mbs in bests
            if _relative(value, top, st.maximize) >= -FULL_MODE_BAND]
