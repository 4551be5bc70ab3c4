"""Memory strategies in a search: the larger micro-batch one lets a leader at its memory top run.

Why: DeepSpeed's autotuner tunes neither offload nor activation checkpointing (`scheduler.search.
strategies` has what each frees and costs). The strategy a model needs to fit at all is chosen before
the search (`scheduler.search.strategy_fit`); here, a rule of the memory model rather than a guess
brings them in where the leader sits at its stage's memory top (`try_strategies`, after the sampled
search and before the winner is confirmed). When the leader is the largest size its stage ran at, the
curve was still rising where memory cut it; when the cost model fitted to the stage's readings predicts
that largest size within the noise of the stage's best (`_flat_to_top`: a leader below a flat top leads
on noise), the strategies start from the top's run. Each allowed strategy (one at a time, on top of the
leader's own; the leader within `TOP_SLACK` of the largest size its stage holds) whose memory line holds
a size at least `TOP_GAIN` above what the stage holds without it (its measured failures and the model)
is measured at its line's top, keeping the leader's samples per step (a larger micro-batch with less
accumulation; the kept global batch's share when one is kept). A top more than `CAUTIOUS_SPAN` times
that room is mostly the prior's (`_prior_line`: no run of the strategy at any stage measured a peak or
ran out of memory): its geometric middle is measured first. Strategies are tried in the order of the
sizes their lines hold, largest first, and stack: once a run with one more strategy beats the run it was
added to, the rest are tried only on top of it, while it sits at its own line's top (offload of the
optimizer, then of the parameters, then checkpointing each free memory the others do not; alone, one
freeing less holds a smaller size); one that applies only at ZeRO-3 (offload of the parameters) is
measured once there (`_stack`). Where the samples per step are held, a strategy whose time prior
(`strategies.step_cost_s`, with the leader's own step time as its compute) already adds the leader's
whole step is not measured: a larger micro-batch then saves at most the step's per-micro-step costs.
Each strategy's next size is its line's top again, kept below the geometric middle between its largest
size that ran and its smallest that ran out of memory, and, after a run that ran, at least `TOP_GAIN`
larger (a checkpointed run that ran measures the share of activations it keeps:
`strategies.measured_keep_share`). A run at its line's top that reads better than the leader measures
the sizes the safety margin kept out once (up to the line's own top: the curve still rises where the
margin cuts it); on a checkpointed line neither a peak nor a failure checked
(`strategy_lines.unchecked`: the prior's keep share), a size `UNBOUNDED_STEP` larger, then the middle if
it failed. `STRATEGY_PROBES` runs per strategy at most, none within `TOP_GAIN` of a size the strategy
ran at the stage (`_ran_near`: tried again from the final leader after `scheduler.search.strategy_first`
tried them from the lead stage's top, the line is measured there). The best strategy run, when it beat
the leader, is measured once more at the stage whose line holds the largest size with it
(`_roomier_stage`: one that shards more of the states has more room for a larger micro-batch with it; a
stage never measured, such as ZeRO-3 on few ranks, counts, its line the model's); when that run leads,
strategies stack on it too. The normal confirmation ranks every run with the rest.

The memory line of a stage under a strategy, which each probe is read off, is
`scheduler.search.strategy_lines`'s: one slope for every stage, each stage's intercept through its own peaks.
"""
from __future__ import annotations

import math
from dataclasses import replace

from scheduler.search.confirm import SEPARATION_Z
from scheduler.search.global_batch import largest_kept
from scheduler.search.memory import SAFETY
from scheduler.search.ranking import best, metric_value
from scheduler.search.repeats import is_repeat
from scheduler.search.session import Session, Step, succeeded
from scheduler.search.space import PROFILE, Experiment, strategy_label, strategy_of
from scheduler.search.stage_readings import flat_to_top, reading_noise
from scheduler.search.stage_space import gas_for
from scheduler.search.strategies import applies, searchable, step_cost_s
from scheduler.search.strategy_lines import failed_sizes, line_top, strategy_records, unchecked
from scheduler.search.strategy_time import step_facts

#: After a strategy's run that ran, its next size is measured only when this much larger.
TOP_GAIN = 1.05
#: The leader is at its stage's memory top when the stage holds at most this much more without a strategy.
TOP_SLACK = 1.25
#: A strategy's first size more than this many times the size the stage holds without it is
#: measured at their geometric middle first: its memory line there is mostly the prior's.
CAUTIOUS_SPAN = 2.0
#: Runs of the best strategy at the stage with more room for it (`_roomier_stage`) at most.
ROOMIER_PROBES = 1
#: A checkpointed run that paid at its line's top, where no peak was measured and no size failed,
#: is followed by a size this much larger: the keep share is the prior's, and only a failure bounds it.
UNBOUNDED_STEP = 1.25
#: Runs per strategy at most: its line's top, then bisection between what ran and what ran out of memory.
STRATEGY_PROBES = 4


def try_strategies(session: Session) -> Step:
    """Measure the leader's stage with each allowed strategy at the larger size it lets the stage
    hold (module docstring)."""
    st = session.settings
    leader = _leader(session)
    if leader is None or st.micro_batch_sizes:
        return
    exp, record, top = _base(session, *leader)
    #: what the stage holds without a further strategy: a strategy is measured where it holds more
    room = min([session.predicted_max(exp.stage, SAFETY)] + [m - 1 for m in failed_sizes(session, exp.stage)])
    room = max(exp.micro_batch_size, _step_size(session, exp, room))
    if exp.micro_batch_size < top or room > TOP_SLACK * exp.micro_batch_size:
        return  # not at its stage's memory top: a larger size ran and read worse, or much more fits
    yield from _stack(session, exp, record, room)
    moved = yield from _roomier_stage(session, *leader)
    if moved is not None:
        yield from _stack(session, *moved, moved[0].micro_batch_size)


def _stack(session: Session, exp: Experiment, record: dict, room: int) -> Step:
    """Each allowed strategy on top of `exp`'s own at the larger size it lets the stage hold (more
    than `room`), then on top of the run that paid while it sits at its own line's top (module
    docstring). One that applies only at ZeRO-3 (offload of the parameters) is measured once there,
    where it frees the parameters that `exp`'s stage keeps on the device."""
    st = session.settings
    while exp is not None:
        base = exp.strategy
        names = [name for name in searchable(st.memory_strategies, st.ds_config, st.host_memory,
                                             st.checkpointing_fixed)
                 if name not in base and not _too_slow(session, exp, record, name)]
        names.sort(key=lambda name: -_reach(session, exp, strategy_of((*base, name))))
        for name in names:
            strategy = strategy_of((*base, name))
            if applies(strategy, exp.stage):
                yield from _measure_strategy(session, exp, strategy, room)
                if _one_more_paid(session, exp, record):
                    break  # the rest are tried on top of the run that paid
            elif 3 in st.stages and applies(strategy, 3):
                yield from _measure_strategy(session, replace(exp, stage=3), strategy, room, ROOMIER_PROBES)
        exp, record = _stacking_base(session, exp, record) or (None, None)
        room = exp.micro_batch_size if exp is not None else room


def _reach(session: Session, exp: Experiment, strategy: tuple[str, ...]) -> int:
    """The largest size `strategy` lets `exp`'s stage hold by its memory line (ZeRO-3's for one that
    applies only there): the order strategies are tried in, the one freeing the most first."""
    stage = exp.stage if applies(strategy, exp.stage) else 3
    return _size(session, replace(exp, stage=stage), strategy)


def _one_more_winner(session: Session, below: Experiment, below_record: dict) -> tuple[Experiment, dict] | None:
    """The best run at `below`'s stage whose strategy is `below`'s plus one more, when it reads
    better than `below`; None otherwise."""
    st = session.settings
    pairs = [(exp, record) for exp, record in strategy_records(session, below.stage, None)
             if len(exp.strategy) == len(below.strategy) + 1 and set(below.strategy) < set(exp.strategy)]
    winner = best([below_record] + [record for _, record in pairs], st.metric, st.maximize)
    return next(((exp, record) for exp, record in pairs if record is winner), None)


def _one_more_paid(session: Session, below: Experiment, below_record: dict) -> bool:
    """Whether a run with one more strategy than `below` reads better than it."""
    return _one_more_winner(session, below, below_record) is not None


def _base(session: Session, exp: Experiment, record: dict) -> tuple[Experiment, dict, int]:
    """The run strategies start from, its record, and the largest size its stage ran: the leader, or
    the run at that size when the stage's curve is flat up to it (`_flat_to_top`)."""
    top = _largest_ok(session, exp.stage)
    if exp.micro_batch_size < top:
        exp, record = _flat_to_top(session, exp.stage, top) or (exp, record)
    return exp, record, top


def _roomier_stage(session: Session, leader: Experiment, leader_record: dict) -> Step:
    """The best strategy run, if it beat the leader, measured once more at the stage whose memory
    line holds the largest size with its strategy, `TOP_GAIN` above what its own stage's line holds
    at the same safety margin: a strategy frees the same bytes at every stage, but one sharding more
    of the states has more room left (the leader's stage was chosen on sizes without a strategy).
    Returns that stage's run with the strategy when it beat every run before, else None."""
    st = session.settings
    runs = [(exp, record) for exp, record in strategy_records(session, leader.stage, None)
            if exp.strategy != st.strategy and succeeded(record)]
    winner = best([leader_record] + [record for _, record in runs], st.metric, st.maximize)
    found = next((exp for exp, record in runs if record is winner), None)
    if found is None:
        return None
    own = min(found.micro_batch_size, _size(session, found, found.strategy))  # its line's, at the same margin
    options = []
    for stage in st.stages:
        base = _leader(session, stage) if stage != leader.stage and applies(found.strategy, stage) else None
        if base is None and stage != leader.stage and applies(found.strategy, stage) \
                and not session.stage_records(stage):
            base = (replace(found, stage=stage), {})  # a stage never measured: its line is the model's
        size = _size(session, base[0], found.strategy) if base is not None else 0
        if size >= TOP_GAIN * own:
            options.append((size, -stage, base[0]))
    if not options:
        return None
    roomier = max(options)[2]
    yield from _measure_strategy(session, roomier, found.strategy, own, ROOMIER_PROBES)
    runs = [(exp, record) for exp, record in strategy_records(session, roomier.stage, found.strategy)
            if succeeded(record)]
    top = best([winner] + [record for _, record in runs], st.metric, st.maximize)
    return next(((exp, record) for exp, record in runs if record is top), None)


def _stacking_base(session: Session, below: Experiment, below_record: dict) -> tuple[Experiment, dict] | None:
    """The strategy run that beat `below` (the run whose strategy it adds one to) and still sits at
    its own memory line's top, so one more strategy on top of its own may hold a larger size again:
    strategies are stacked one at a time while each pays (module docstring); None otherwise."""
    found = _one_more_winner(session, below, below_record)
    if found is None or _size(session, found[0], found[0].strategy) >= TOP_GAIN * found[0].micro_batch_size:
        return None
    return found


def _measure_strategy(session: Session, leader: Experiment, strategy: tuple[str, ...], room: int,
                      probes: int | None = None) -> Step:
    """The strategy's largest size above the leader's by its memory line, then, up to
    `STRATEGY_PROBES` runs in all, the line's next size (with the keep share a run measured) kept
    below the geometric middle between the largest size that ran (the leader's at first) and the
    smallest that ran out of memory; after a run that ran, only a size `TOP_GAIN` larger."""
    ran, failed = leader.micro_batch_size, None
    size = _size(session, leader, strategy)
    if size < TOP_GAIN * room:
        return  # it holds no size the stage does not hold without it
    if size > CAUTIOUS_SPAN * room and _prior_line(session, strategy):  # mostly prior: half way first
        size = _step_size(session, leader, round(math.sqrt(room * size)))
    for _ in range(STRATEGY_PROBES if probes is None else probes):
        if size <= ran or (failed is not None and size >= failed) or _ran_near(session, leader.stage, strategy, size):
            return
        record = yield from _run(session, leader, strategy, size)
        if succeeded(record) and ran > leader.micro_batch_size and _reads_below(session, record, leader, strategy, ran):
            record = yield from _run(session, leader, strategy, size, again=True)
        if succeeded(record):
            ran = size
        elif record.get("status") == "oom":
            failed = size
        else:
            return
        size = _next_size(session, leader, strategy, record, ran, failed)


def _prior_line(session: Session, strategy: tuple[str, ...]) -> bool:
    """Whether no run of `strategy` at any stage measured its peak or ran out of memory: every
    stage's line with it is the prior's (one slope for every stage, `strategy_lines`)."""
    return all(unchecked(session, stage, strategy) for stage in range(4))


def _ran_near(session: Session, stage: int, strategy: tuple[str, ...], size: int) -> bool:
    """Whether a run of `strategy` at `stage` within `TOP_GAIN` of `size` ran: that part of the line
    is measured (strategies tried again from another leader, `strategy_first`)."""
    return any(succeeded(record) and size / TOP_GAIN <= exp.micro_batch_size <= size * TOP_GAIN
               for exp, record in strategy_records(session, stage, strategy))


def _beats(session: Session, record: dict, leader: Experiment) -> bool:
    """Whether `record` reads better than the best reading of `leader`'s config."""
    st = session.settings
    value = metric_value(record, st.metric)
    ours = [metric_value(r, st.metric) for exp, r in session.measured.values() if exp.ds_config == leader.ds_config]
    ours = [v for v in ours if v is not None]
    if value is None or not ours:
        return False
    return value > max(ours) if st.maximize else value < min(ours)


def _reads_below(session: Session, record: dict, leader: Experiment, strategy: tuple[str, ...], smaller: int) -> bool:
    """Whether `record`, the strategy's run at a larger size than its run at `smaller`, reads worse
    than that run by more than two readings' noise can explain: with the step's samples held (or one
    micro-step a step), a larger micro-batch runs fewer micro-steps for the same strategy costs, so
    the reading contradicts the line and is a straggler's until a second reading says otherwise."""
    st = session.settings
    value = metric_value(record, st.metric)
    config = session.experiment(leader.stage, smaller, _gas(session, leader, smaller), strategy).ds_config
    before = [metric_value(r, st.metric) for exp, r in session.measured.values() if exp.ds_config == config]
    before = [v for v in before if v is not None]
    if value is None or not before:
        return False
    margin = SEPARATION_Z * math.sqrt(2) * reading_noise(session)
    return value < max(before) * (1 - margin) if st.maximize else value > min(before) * (1 + margin)


def _run(session: Session, leader: Experiment, strategy: tuple[str, ...], mbs: int, again: bool = False) -> Step:
    """The strategy's run at `mbs`; `again`: its second reading (`<name>_r2`), the first taken."""
    gas = _gas(session, leader, mbs)
    exp = session.experiment(leader.stage, mbs, gas, strategy)
    label = f"z{leader.stage}_strategy_{strategy_label(strategy)}_{mbs}"
    if again:
        exp, label = replace(exp, name=f"{exp.name}_r2"), f"{label}_recheck"
    [record] = yield from session.measure(label, [exp])
    return record


def _size(session: Session, leader: Experiment, strategy: tuple[str, ...], safety: float = SAFETY) -> int:
    """The largest size the stage holds with `strategy` by its memory line (module docstring),
    within the cap, below the strategy's own failures, filling the leader's step."""
    fits = line_top(session, leader.stage, strategy, safety)
    failed = failed_sizes(session, leader.stage, strategy)
    return _step_size(session, leader, min([fits] + [m - 1 for m in failed]))


def _next_size(session: Session, leader: Experiment, strategy: tuple[str, ...], record: dict, ran: int,
               failed: int | None) -> int:
    """The strategy's size after `record` (0: none): its line's top, kept below the geometric middle
    between `ran` and `failed`; after a run that ran, only a size TOP_GAIN larger, and where the
    line holds none, the sizes its safety margin kept out when the run paid. On a checkpointed line
    neither a peak nor a failure checked (`strategy_lines.unchecked`: the prior's keep share), once
    a run paid at its top, a size UNBOUNDED_STEP larger, then the middle if that failed."""
    size = _size(session, leader, strategy)
    if failed is not None:
        middle = _step_size(session, leader, round(math.sqrt(ran * failed)))
        size = middle if unchecked(session, leader.stage, strategy, but=record) else min(size, middle)
    if succeeded(record) and size < TOP_GAIN * ran:
        if not _beats(session, record, leader):
            return 0
        size = _size(session, leader, strategy, safety=1.0)  # it pays: the margin's sizes, up to the line's top
        if failed is None and "activation_checkpointing" in strategy and unchecked(session, leader.stage, strategy):
            size = max(size, _unbounded_size(session, leader, strategy, ran))
    return size


def _unbounded_size(session: Session, leader: Experiment, strategy: tuple[str, ...], ran: int) -> int:
    """The size after `ran`, a run that paid at its line's top where no peak was measured and no
    size failed: UNBOUNDED_STEP larger (the line is the prior's; with a kept global batch, the next
    size dividing its share), within the cap and below the strategy's failures at the stage."""
    kept = session.settings.kept_per_gpu
    step = min((m for m in range(ran + 1, kept + 1) if kept % m == 0), default=ran) if kept else \
        math.ceil(UNBOUNDED_STEP * ran)
    failed = failed_sizes(session, leader.stage, strategy)
    return _step_size(session, leader, min([session.settings.micro_batch_cap, step] + [m - 1 for m in failed]))


def _step_size(session: Session, leader: Experiment, limit: int) -> int:
    """The largest size up to `limit` of the leader's step: with a kept global batch a size dividing
    its share, else any (its accumulation fills the step as far as whole micro-batches go)."""
    kept = session.settings.kept_per_gpu
    if kept:
        return largest_kept(kept, limit) if limit >= 1 else 0
    return max(0, limit)


def _gas(session: Session, leader: Experiment, mbs: int) -> int:
    st = session.settings
    if st.samples_per_step:
        return st.gas_for(mbs)
    return max(1, leader.micro_batch_size * leader.gradient_accumulation_steps // mbs)


def _too_slow(session: Session, leader: Experiment, record: dict, name: str) -> bool:
    """Whether the strategy's time prior alone adds the leader's whole step (module docstring). Only
    where the samples per step are held (a kept batch, or accumulation a larger micro-batch replaces):
    at one micro-step per step a larger micro-batch also spreads the step's fixed costs over more samples."""
    if leader.gradient_accumulation_steps == 1 and not session.settings.kept_per_gpu:
        return False
    facts = step_facts(session, leader, record)
    return facts is not None and step_cost_s((name,), facts) >= facts.compute_s


def _leader(session: Session, stage: int | None = None) -> tuple[Experiment, dict] | None:
    """The best experiment so far with the search's own strategy (repeats pooled), of `stage` or of
    any, and its record."""
    st = session.settings
    pairs = [(exp, record) for exp, record in session.measured.values()
             if exp.name != PROFILE and not exp.tuning_space and exp.strategy == st.strategy
             and (stage is None or exp.stage == stage)]
    winner = best([record for _, record in pairs], st.metric, st.maximize)
    return next(((exp, record) for exp, record in pairs if record is winner), None)


def _flat_to_top(session: Session, stage: int, top: int) -> tuple[Experiment, dict] | None:
    """The stage's run at its largest size that ran, `top`, when the curve is flat up to it
    (`stage_readings.flat_to_top`): the leader's lead is noise, and a strategy's larger size (a
    larger step, its fixed costs spread over more samples) may pay. None otherwise."""
    if flat_to_top(session, stage) != top:
        return None
    found = _top_run(session, stage, top)
    return (found, session.measured[found.name][1]) if found is not None else None


def _top_run(session: Session, stage: int, top: int) -> Experiment | None:
    """The stage's first run at size `top` and its space's accumulation that ran, or None."""
    return next((exp for exp, record in session.stage_records(stage)
                 if exp.micro_batch_size == top and exp.gradient_accumulation_steps == gas_for(session, stage, top)
                 and not exp.tuning_space and succeeded(record) and not is_repeat(exp.name, session.measured)), None)


def _largest_ok(session: Session, stage: int) -> int:
    return max((exp.micro_batch_size for exp, record in session.stage_records(stage) if succeeded(record)), default=0)
