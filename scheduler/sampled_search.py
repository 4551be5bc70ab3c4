"""Our fast-mode search (`"search": "sampled"`, the default): sample each stage's feasible range,
refine around the best, carry what earlier stages measured into later ones, race the top few.

Why not DeepSpeed's: it assumes throughput grows with the micro-batch. It starts at half the
largest fitting size and later stages start where the previous stage ended, so a mid-size optimum
(with more gradient accumulation) is never generated, and it spends 3 probes per stage straddling a
memory estimate that is often wrong. Throughput curves saturate, can peak in the middle and drop
near the memory cap; measurements carry about 2 % noise. So, per stage:

- the lead stage (ZeRO-1 when data parallelism shards anything, `lead_first`; else the lowest that
  fits) samples its range on a geometric scale: a low size first (a quarter of the predicted
  maximum, so the stage's memory line has two measured points before the top is probed), then the
  top, then golden-section-like refinement on log(mbs) around the best measured size until its
  neighbours are within `REFINE_RATIO` of it, splitting the gaps between measured sizes before
  going below the smallest; a top that the memory line later moves up is probed again only when it
  is `TOP_GAIN` larger; every size gets gas = max_train_batch_size // (dp * mbs), so samples per
  step stay within the limit, and the sizes sampled are the largest for each gas (`full_step_sizes`);
- another stage is first measured at the incumbent's size, which tells how it compares at equal
  work. It is explored further only if the incumbent was the largest size its own stage could
  hold and this stage holds more (the curve was still rising at the cap); otherwise the
  measurement rules it out. ZeRO-3 moves strictly more data than ZeRO-1/2 at equal size, so it is
  not measured at all unless it can hold larger sizes that matter (the curve was still rising at the
  cap, or ZeRO-3 holds `ZERO3_ROOM` times what ZeRO-1/2 hold, so memory pressure may have turned it),
  or no ZeRO-1/2 stage was measured;
- the memory side follows `scheduler.memory`: predictions stay between the largest ok and the
  smallest failed size; after a failure the next upward probe is the geometric midpoint, and a
  stage stops probing upward after `MAX_FAILURES` failures;
- `race`: when the best config and the runner-up are within `RACE_BAND` (a coin toss under the
  noise), both are measured once more, as `<name>_r2`, one per phase (measured under the same
  conditions as the original, which ran alone: repeats run side by side on shared hosts measure
  each other), and the winner is picked on the mean (`scheduler.ranking.best` pools repeats).

What the bench (bench/search_quality.py) shows this buys, and what it cannot: a single measurement
per config with 2 % noise bounds the 10th percentile of the fraction of the optimum found below
0.99 even for a search that measures every config of the space once (bench/README.md).

Pure decision logic (`next_size`, `geometric_mid`) is separate from the generator so it is tested
directly; the generators only turn decisions into phases (one experiment each unless the slots
allow more) and are replayed from records like every search here.
"""
from __future__ import annotations

import math
from collections.abc import Generator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from scheduler.ranking import metric_value
from scheduler.space import PROFILE, Experiment

if TYPE_CHECKING:
    from scheduler.fast_search import _Session
    from scheduler.phases import Phase

Step = Generator["Phase", dict, Any]
T = TypeVar("T")

#: Refinement stops when the best size's measured neighbours are within this ratio of it.
REFINE_RATIO = 1.45
#: A stage stops probing upward after this many failed probes (the issue's target: at most 2).
MAX_FAILURES = 2
#: A larger top (the memory line moved up after a probe) is probed only if it is at least this much
#: larger than the largest size measured: a few percent more samples per micro-step change the
#: throughput by less than the measurement noise.
TOP_GAIN = 1.1
#: At most this many sizes are measured per stage (a guard; refinement normally stops earlier).
MAX_POINTS = 7
#: The best config and the runner-up are re-measured once when they are closer than this: a coin
#: toss under 2 % noise. Wider bands cost two launches on most scripts and, over the bench's
#: surfaces, do not raise the share of searches within 1 % of the optimum.
RACE_BAND = 0.005
RACE_SIZE = 2
#: Full mode explores the knobs of every stage whose fast-mode best is within this of the leader.
FULL_MODE_BAND = 0.10
#: ZeRO-3 is explored, although the incumbent's curve had turned, when it holds at least this many
#: times the largest size ZeRO-1/2 hold: near a stage's memory cap the allocator's pressure slows it,
#: and ZeRO-3 runs those sizes with that much more memory free (large models: bench/README.md).
ZERO3_ROOM = 1.3
REMEASURE_SUFFIX = "_r2"
#: The share of the memory budget the top probe may fill. Closer to 1 than memory.SAFETY: the
#: budget already leaves out the untracked reserve, the line is fitted on two of the stage's own
#: sizes before the top is probed, and a failure only costs one launch and bounds the stage.
TOP_SAFETY = 0.98


def geometric_mid(low: int, high: int) -> int | None:
    """The integer nearest sqrt(low * high), strictly between them, or None if there is none."""
    if high - low < 2:
        return None
    mid = round(math.sqrt(low * high))
    return min(max(mid, low + 1), high - 1)


def full_step_sizes(samples_per_step: int | None, top: int) -> list[int]:
    """The sizes worth measuring up to `top`: with a samples-per-step limit L, the largest size for
    each accumulation g (L // g), since any smaller size with the same g only wastes part of the
    step; without a limit every size. `top` itself is always one (the largest that fits)."""
    if top < 1:
        return []
    if not samples_per_step:
        return list(range(1, top + 1))
    return sorted({samples_per_step // g for g in range(1, samples_per_step + 1)
                   if 1 <= samples_per_step // g <= top} | {min(top, samples_per_step)})


def snap(target: float, sizes: Sequence[int]) -> int:
    """The size in `sizes` nearest `target` on a log scale."""
    return min(sizes, key=lambda m: (abs(math.log(m / target)), m))


def next_size(values: Mapping[int, float | None], sizes: Sequence[int], maximize: bool = True) -> int | None:
    """The next micro-batch size to measure in one stage, or None when the stage is done.

    `values`: size -> metric (None: failed). `sizes`: the sizes allowed now (`full_step_sizes` up to
    the largest size memory allows, below every failure). The largest is always seen; then the
    larger log-gap next to the best size is split at the allowed size nearest its geometric middle,
    going four times lower when the best is the smallest size measured; a gap narrower than
    REFINE_RATIO, or with no allowed size inside, is not split.
    """
    if not sizes:
        return None
    top = sizes[-1]
    ok = sorted(m for m, v in values.items() if v is not None and m <= top)
    if not ok or (top >= ok[-1] * TOP_GAIN and top not in values):
        return top if top not in values else None
    best = max(ok, key=lambda m: (values[m] if maximize else -values[m], -m))
    index = ok.index(best)
    options: list[tuple[float, int]] = []

    gaps = ([(ok[index - 1], best)] if index else []) + ([(best, ok[index + 1])] if index + 1 < len(ok) else [])
    for low, high in gaps:
        inside = [m for m in sizes if low < m < high and m not in values]
        if inside and high / low > REFINE_RATIO:
            options.append((math.log(high / low), snap(math.sqrt(low * high), inside)))
    if index == 0 and not options:
        below = [m for m in sizes if m < best and m not in values]
        if below:
            options.append((math.log(4), snap(max(1.0, best / 4), below)))
    if not options:
        return None
    return max(options)[1]


# ---------------------------------------------------------------- the generators


def sampled_stages(session: _Session, stages: Sequence[int]) -> Step:
    """Every allowed stage, in order: sampled, followed from the incumbent, or ruled out."""
    explored: list[int] = []
    for stage in lead_first(stages, session.settings.dp_size):
        if _top(session, stage) < 1:
            continue
        inc_mbs = _incumbent_size(session, explored)
        if inc_mbs is None:
            yield from _explore(session, stage)
            explored.append(stage)
            continue
        upside = _at_cap(session, explored, inc_mbs) and _top(session, stage) > inc_mbs
        if stage == 3 and not upside and any(s in (1, 2) for s in explored):
            lighter = max(_top(session, s) for s in explored if s in (1, 2))
            if _top(session, stage) < ZERO3_ROOM * lighter:
                continue  # ZeRO-3 moves more data than ZeRO-1/2 at equal size: it can only win on memory
            upside = True  # so much more memory free that it can win on memory pressure: explore it
        size = min(inc_mbs, _top(session, stage))
        value = yield from _measure(session, stage, size, f"z{stage}_follow_{size}")
        explored.append(stage)
        if value is not None and upside:
            yield from _explore(session, stage, floor=size)


def lead_first(stages: Sequence[int], dp_size: int) -> list[int]:
    """The order stages are searched in: ZeRO-1 first when data parallelism shards anything (it holds
    at least what ZeRO-0 holds, moves the same data and runs 1/dp of the optimizer step, so it is
    the stage most likely to win and its curve is the one worth sampling), then the rest in order."""
    ordered = list(stages)
    if dp_size > 1 and 1 in ordered:
        ordered.remove(1)
        ordered.insert(0, 1)
    return ordered


def _explore(session: _Session, stage: int, floor: int = 0) -> Step:
    """Sample and refine one stage, above `floor`, until `next_size` says done (or the guards)."""
    st = session.settings
    if not _values(session, stage):
        top = _top(session, stage)
        sizes = full_step_sizes(st.samples_per_step, top)
        low = snap(max(1.0, top / 4), sizes) if sizes else top
        if low < top:
            yield from _measure(session, stage, low, f"z{stage}_sample_{low}")
    while True:
        values = _values(session, stage)
        if len(values) >= MAX_POINTS:
            return
        sizes = [m for m in full_step_sizes(st.samples_per_step, _top(session, stage)) if m >= floor]
        size = next_size({m: v for m, v in values.items() if m >= floor}, sizes, st.maximize)
        if size is None:
            return
        yield from _measure(session, stage, size, f"z{stage}_sample_{size}")


def _measure(session: _Session, stage: int, mbs: int, label: str) -> Step:
    exp = session.experiment(stage, mbs, session.settings.gas_for(mbs))
    [record] = yield from session.measure(label, [exp])
    return metric_value(record, session.settings.metric)


def _top(session: _Session, stage: int) -> int:
    """The largest size worth probing now: the calibrated prediction, capped, kept below failures;
    after a failure above a success, the geometric midpoint between them; after MAX_FAILURES
    failures, the largest success."""
    values = _values(session, stage)
    ok = [m for m, v in values.items() if v is not None]
    failed = [m for m, v in values.items() if v is None]
    largest_ok = max(ok, default=0)
    predicted = session.predicted_max(stage, TOP_SAFETY)
    if failed:
        smallest_failed = min(failed)
        if len(failed) >= MAX_FAILURES:
            return largest_ok
        if largest_ok:
            mid = geometric_mid(largest_ok, smallest_failed)
            predicted = min(predicted, mid if mid is not None else largest_ok)
        else:
            predicted = min(predicted, smallest_failed // 2)
    return max(predicted, largest_ok)


def _values(session: _Session, stage: int) -> dict[int, float | None]:
    """size -> metric (None: failed) of the stage's measured sizes at their sampled gas."""
    st = session.settings
    out: dict[int, float | None] = {}
    for exp, record in session.stage_records(stage):
        if exp.name.endswith(REMEASURE_SUFFIX) or exp.tuning_space:
            continue
        if exp.gradient_accumulation_steps == st.gas_for(exp.micro_batch_size):
            out[exp.micro_batch_size] = metric_value(record, st.metric)
    return out


def _incumbent_size(session: _Session, stages: Sequence[int]) -> int | None:
    """The micro-batch size of the best config measured so far in `stages` (None: none succeeded)."""
    best: tuple[float, int] | None = None
    sign = 1 if session.settings.maximize else -1
    for stage in stages:
        for mbs, value in _values(session, stage).items():
            if value is not None and (best is None or sign * value > sign * best[0]):
                best = (value, mbs)
    return None if best is None else best[1]


def _at_cap(session: _Session, stages: Sequence[int], mbs: int) -> bool:
    """Whether `mbs` is the largest size measured ok in any stage so far: the curve was still
    rising where memory stopped it, so a stage holding larger sizes may do better."""
    largest = max((m for stage in stages for m, v in _values(session, stage).items() if v is not None), default=0)
    return mbs >= largest


def _relative(value: float, reference: float, maximize: bool) -> float:
    change = value - reference if maximize else reference - value
    return change / abs(reference) if reference else 0.0


def stages_near_leader(session: _Session, stages: Sequence[int]) -> list[tuple[int, int, int]]:
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
    return [(stage, mbs, st.gas_for(mbs)) for value, stage, mbs in bests
            if _relative(value, top, st.maximize) >= -FULL_MODE_BAND]


def to_remeasure(scored: Sequence[tuple[float, T]]) -> list[T]:
    """The items to measure once more: the best and those within RACE_BAND of it (at most RACE_SIZE),
    or none when the runner-up is further away. `scored`: (value, item), larger is better."""
    ordered = sorted(scored, key=lambda pair: -pair[0])
    if len(ordered) < 2:
        return []
    top = ordered[0][0]
    band = [item for value, item in ordered if value >= top - RACE_BAND * abs(top)][:RACE_SIZE]
    return band if len(band) >= 2 else []


def race(session: _Session) -> Step:
    """Re-measure the configs `to_remeasure` names, one per phase."""
    st = session.settings
    scored: list[tuple[float, Experiment]] = []
    for exp, record in list(session.measured.values()):
        value = metric_value(record, st.metric)
        if value is not None and not exp.name.endswith(REMEASURE_SUFFIX) and exp.space != PROFILE:
            scored.append((value if st.maximize else -value, exp))
    repeats = [Experiment(exp.name + REMEASURE_SUFFIX, exp.stage, exp.micro_batch_size,
                          exp.gradient_accumulation_steps, exp.ds_config, exp.num_nodes, exp.num_gpus,
                          exp.tuning_space) for exp in to_remeasure(scored)]
    for index, repeat in enumerate(repeats, 1):  # one at a time: the originals ran alone, so must the repeats
        yield from session.measure(f"race_{index}", [repeat])
