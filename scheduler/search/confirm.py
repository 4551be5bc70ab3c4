"""Naming a winner under measurement noise: which config to measure again, and when to stop.

Why: one short measurement of a training run is noisy, and the noise differs per config (on shared
CPU slots one config's readings ranged over 2x while another's stayed within 2 %). Picking the best
single reading favours the configs whose readings spread most (the winner's curse): in one run of
bench/vs_deepspeed.py a config measured once won on a lucky reading and re-measured 2.6x slower
than the runner-up. So a winner is confirmed before it is named, as noise-aware tuners do:

- the leader (best mean so far) is always measured at least twice: no config wins on one reading,
  and the pair is the job's first measurement of its noise;
- the noise is measured, not assumed: the relative spread of every config measured more than once,
  pooled (`pooled_noise`); a config's own spread counts when it is larger (per-config noise), and so
  does the spread inside its runs where they give per-step times (`step_noise`: a reading is the mean
  of its window's steps, so one run of a config whose steps are bimodal already shows its reading is
  uncertain); `PRIOR_NOISE` stands in only until the first pair exists;
- a rival is not separated from the leader while their gap is within `SEPARATION_Z` standard errors
  of the difference of their means; the leader and the `MAX_RIVALS` best such rivals are then
  measured in turn, fewest readings first (interleaved: A B A B, so drift of shared machines hits
  both alike), until every rival is separated or `REPEAT_BUDGET` launches are spent; up to
  `READ_ONCE_GRACE` launches more go to a leader still read once, or to a config whose two readings
  are `torn` (one a straggler's or a lucky one: their mean says neither, a third reading's median
  does) while its better reading beats the leader, the leader's own pair included (not with a kept
  global batch, whose budget already runs to the job's launch cap); whenever nothing else is due, a
  leader still read once, or read twice more than TORN_RATIO apart or with its worse reading
  trailing the runner-up by over `MATERIAL_LOSS` (its lead rests on one reading), or a config that would lead on
  its readings but is ranked at its stage's curve (`ceiling`: `scheduler.search.ceilings`), is
  measured again, up to three readings each (`unsettled_leader`), so a torn pair's third reading that
  drops its config behind one read once cannot name that one, nor can a torn pair whose mean says
  neither reading be named;
- with a kept global batch (`scheduler.search.global_batch`) the budget is what is left of
  `KEPT_BATCH_LAUNCHES` when that is more (`repeat_budget`), and a config read once whose reading
  is at least half the leader's is a rival until read twice (`doubtful`): the divisors of the batch
  are searched in 6-8 launches, and on heavy-tailed readings the picks missed were near-equal
  divisors only more readings tell apart, or a config whose one reading was a straggler's;
- the choice is the best pooled value over every reading (`scheduler.search.ranking.pooled_value`:
  the mean, or the median from three readings on, which one outlier cannot move), and the summary
  says whether the winner was separated from the runner-up, and why (`verdict`: read once, within
  the noise, or separated, with the gap and its standard error it was judged on).

Pure decision logic; `scheduler.search.repeats.confirm` turns it into phases.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Generic, TypeVar

from scheduler.search.ranking import pooled_value

K = TypeVar("K")

#: Re-measurement launches a job spends on confirming its winner.
REPEAT_BUDGET = 2
#: Launches past REPEAT_BUDGET, spent only while the leader was read once (its repeat exposed the
#: previous leader's lucky reading, and the new one has a single reading of its own) or a config's
#: two readings are `torn`.
READ_ONCE_GRACE = 2
#: A gap within this many standard errors of the difference of two means is not a separation.
SEPARATION_Z = 2.0
#: With a kept global batch, confirmation may go on past REPEAT_BUDGET until the job made this many
#: launches, the profile run included (a kept batch's search stays within 14 launches in all).
KEPT_BATCH_LAUNCHES = 14
#: With a kept global batch, a config read once is chased as a rival while its reading is at least
#: this share of the leader's (`doubtful`): a straggler's reading (0.5-0.67x its config's on
#: bench/surfaces.py's heavy-tailed scripts) cannot rule out a config as good as the leader.
STRAGGLER_SHARE = 0.5
#: Two readings of one config further apart than this ratio are `torn`: one of them is an outlier (a
#: straggler's step 1.5-2x slower, a lucky window), so their mean is no estimate and a third reading,
#: ranked on the median, is worth a launch. 1.4, not less: two readings of one config in the real
#: CPU traces (bench/traces) differ by 1.10-1.17x at the median and 1.3-1.5x at the 90th percentile,
#: and at 1.15 the third readings there went to that noise and moved picks for the worse.
TORN_RATIO = 1.4
#: A leader read twice is read a third time when its worse reading trails the runner-up by more than
#: this share (`_rests_on_one_reading`): a smaller loss is not worth a launch.
MATERIAL_LOSS = 0.05
#: Relative noise assumed before any config was measured twice.
PRIOR_NOISE = 0.03
#: Relative noise never taken below this (two equal readings do not prove a noiseless machine).
MIN_NOISE = 0.01
#: Rivals chased besides the leader (the closest ones); the rest wait for a later round.
MAX_RIVALS = 2


@dataclass(frozen=True)
class Readings(Generic[K]):
    """Every successful measurement of one config, and the error of one reading seen inside its runs."""

    key: K
    values: tuple[float, ...]
    step_noise: float | None = None  #: relative standard error of one reading from its step times
    ceiling: float | None = None  #: what its stage's curve predicts, where that contradicts its readings

    @property
    def mean(self) -> float:
        return statistics.fmean(self.values)

    @property
    def value(self) -> float:
        """What the readings say together, the figure configs are ranked on (`ranking.pooled_value`),
        capped at the `ceiling` its stage's curve sets (`scheduler.search.ceilings`)."""
        value = pooled_value(self.values)
        return value if self.ceiling is None else min(value, self.ceiling)

    @property
    def count(self) -> int:
        return len(self.values)

    @property
    def own_noise(self) -> float | None:
        """The relative standard deviation of this config's readings (None: fewer than two)."""
        if self.count < 2 or not self.mean:
            return None
        return statistics.stdev(self.values) / abs(self.mean)


def step_noise(runs: Iterable[Sequence[float] | None]) -> float | None:
    """The relative standard error of one reading, estimated inside the runs that timed each step: a
    reading is the mean of its window's steps, so its error is the steps' relative spread over the
    square root of their number. Root mean square over the runs with two steps or more; None when no
    run has."""
    squares = []
    for steps in runs:
        if steps and len(steps) >= 2 and statistics.fmean(steps) > 0:
            relative = statistics.stdev(steps) / statistics.fmean(steps)
            squares.append(relative ** 2 / len(steps))
    return math.sqrt(statistics.fmean(squares)) if squares else None


def pooled_noise(groups: Sequence[Readings]) -> float | None:
    """The relative standard deviation pooled over every config read at least twice (None: none)."""
    squares, freedom = 0.0, 0
    for group in groups:
        if group.count >= 2 and group.mean:
            squares += sum((v / group.mean - 1.0) ** 2 for v in group.values)
            freedom += group.count - 1
    return math.sqrt(squares / freedom) if freedom else None


def noise_of(group: Readings, pooled: float | None) -> float:
    """The relative noise used for `group`: the pooled figure, or its own spread across readings or
    within its runs when larger."""
    base = PRIOR_NOISE if pooled is None else pooled
    own = [noise for noise in (group.own_noise, group.step_noise) if noise is not None]
    return max(MIN_NOISE, base, *own)


def separation(leader: Readings, rival: Readings, pooled: float | None,
               maximize: bool = True) -> tuple[float, float]:
    """(the gap by which `leader`'s pooled value beats `rival`'s, relative to the leader's; the relative
    standard error of that difference at the noise `noise_of` gives each)."""
    gap = (leader.value - rival.value) if maximize else (rival.value - leader.value)
    scale = abs(leader.value) or 1.0
    error = math.sqrt(noise_of(leader, pooled) ** 2 / leader.count + noise_of(rival, pooled) ** 2 / rival.count)
    return gap / scale, error


def separated(leader: Readings, rival: Readings, pooled: float | None, maximize: bool = True) -> bool:
    """Whether `leader`'s pooled value beats `rival`'s by more than SEPARATION_Z standard errors."""
    gap, error = separation(leader, rival, pooled, maximize)
    return gap > SEPARATION_Z * error


def ordered(groups: Sequence[Readings[K]], maximize: bool = True) -> list[Readings[K]]:
    """Best pooled value first; equal values keep the given order (the earlier measured config leads)."""
    indexed = list(enumerate(groups))
    indexed.sort(key=lambda pair: (-pair[1].value if maximize else pair[1].value, pair[0]))
    return [group for _, group in indexed]


def repeat_budget(launched: int, kept_batch: bool) -> int:
    """The launches confirmation may spend after `launched`: REPEAT_BUDGET, or with a kept global
    batch what is left of KEPT_BATCH_LAUNCHES when that is more."""
    return max(REPEAT_BUDGET, KEPT_BATCH_LAUNCHES - launched) if kept_batch else REPEAT_BUDGET


def doubtful(leader: Readings, group: Readings, maximize: bool = True) -> bool:
    """Whether `group`'s one reading may be a straggler's hiding a config as good as `leader`: read
    once, at least STRAGGLER_SHARE of the leader's value."""
    if group.count != 1:
        return False
    return group.value >= STRAGGLER_SHARE * leader.value if maximize else group.value * STRAGGLER_SHARE <= leader.value


def torn(group: Readings, leader: Readings, maximize: bool = True) -> bool:
    """Whether `group` was read exactly twice, the readings more than TORN_RATIO apart, and the better
    one beats `leader`'s pooled value: whether one more reading could change the winner, which the
    pair's mean cannot tell (a straggler's reading of the best config, or of its repeat, can lose
    it to a config read twice without one). The leader's own pair may be
    torn too: its lead then rests on a reading that may be the lucky one."""
    if group.count != 2 or min(group.values) <= 0:
        return False
    better = max(group.values) if maximize else min(group.values)
    beats = better > leader.value if maximize else better < leader.value
    return max(group.values) / min(group.values) > TORN_RATIO and beats


def next_repeat(groups: Sequence[Readings[K]], maximize: bool = True, doubt_once: bool = False) -> K | None:
    """The config to measure once more, or None when the leader is confirmed (see the module).
    `doubt_once`: every `doubtful` config is a rival too, until it is read twice."""
    if not groups:
        return None
    leader, *others = ordered(groups, maximize)
    if leader.count < 2:
        return leader.key
    pooled = pooled_noise(groups)
    rivals = [g for g in others if not separated(leader, g, pooled, maximize)][:MAX_RIVALS]
    if doubt_once:
        rivals += [g for g in others if doubtful(leader, g, maximize) and g not in rivals]
    if not rivals:
        return None
    return min([leader, *rivals], key=lambda g: g.count).key


def past_budget(groups: Sequence[Readings[K]], maximize: bool, kept_batch: bool) -> K | None:
    """What the READ_ONCE_GRACE launches past the budget measure: a leader still read once, else the
    `torn` config whose better reading is best, else nothing (the winner stands). With a kept global
    batch the budget already runs to KEPT_BATCH_LAUNCHES, the launches its goal allows: no torn
    config goes past it."""
    once = read_once_leader(groups, maximize)
    if once is not None:
        return once
    leader = ordered(groups, maximize)[0]
    split = [] if kept_batch else [group for group in groups if torn(group, leader, maximize)]
    if not split:
        return None
    return (max if maximize else min)(split, key=lambda group: (max if maximize else min)(group.values)).key


def unsettled_leader(groups: Sequence[Readings[K]], maximize: bool = True) -> K | None:
    """The leader when its readings cannot name it: read once (`read_once_leader`), or read twice
    more than TORN_RATIO apart (a straggler's or a lucky reading among them: their mean says
    neither, a third reading's median does); else the config that would lead on its readings but
    is ranked at its stage's curve (`Readings.ceiling`), whose further readings may settle it
    (`scheduler.search.ceilings.settled`); else None."""
    once = read_once_leader(groups, maximize)
    if once is not None or not groups:
        return once
    leader, *others = ordered(groups, maximize)
    low, high = min(leader.values), max(leader.values)
    if leader.count == 2 and low > 0 and high / low > TORN_RATIO:
        return leader.key
    if leader.count == 2 and others and _rests_on_one_reading(leader, others[0], maximize):
        return leader.key
    contender = ordered([replace(group, ceiling=None) for group in groups], maximize)[0]
    return contender.key if contender.key != leader.key else None


def _rests_on_one_reading(leader: Readings[K], runner_up: Readings[K], maximize: bool) -> bool:
    """Whether a leader read twice leads only by its better reading: its worse one loses to the
    runner-up's pooled value. Its mean then says which reading to believe no more than a torn pair's."""
    worse = min(leader.values) if maximize else max(leader.values)
    loss = (runner_up.value - worse) / runner_up.value if maximize else (worse - runner_up.value) / worse
    return loss > MATERIAL_LOSS


def read_once_leader(groups: Sequence[Readings[K]], maximize: bool = True) -> K | None:
    """The leader when it was read once, else None: past every budget, no config is named on one
    reading (a third reading of a torn pair can drop it behind a config read once)."""
    if not groups:
        return None
    leader = ordered(groups, maximize)[0]
    return leader.key if leader.count < 2 else None


#: Why a winner is or is not separated from its runner-up (`Verdict.reason`).
ALONE, READ_ONCE, WITHIN_NOISE, SEPARATED = "alone", "read once", "within the noise", "separated"


@dataclass(frozen=True)
class Verdict(Generic[K]):
    """The winner and the runner-up as a summary shows them, and the figures the judgement rests on."""

    winner: Readings[K]
    runner_up: Readings[K] | None
    is_separated: bool
    noise: float | None  #: the pooled relative noise measured (None: no config read twice)
    gap: float | None = None  #: the runner-up's gap behind the winner, relative to the winner's mean
    error: float | None = None  #: the relative standard error of that gap
    noises: tuple[float, float] | None = None  #: the noise of one reading `noise_of` gave each of the two

    @property
    def reason(self) -> str:
        """ALONE (no runner-up), READ_ONCE (the winner has one reading: its own noise is unknown, so
        no gap separates it), else SEPARATED or WITHIN_NOISE by the gap over its standard error."""
        if self.runner_up is None:
            return ALONE
        if self.winner.count < 2:
            return READ_ONCE
        return SEPARATED if self.is_separated else WITHIN_NOISE

    @property
    def standard_errors(self) -> float | None:
        """The gap in standard errors of the difference (None: no runner-up)."""
        if self.gap is None or self.error is None:
            return None
        return self.gap / self.error if self.error else math.inf


def verdict(groups: Sequence[Readings[K]], maximize: bool = True) -> Verdict[K] | None:
    """Who won, who came second, and whether the gap between them is more than the noise: only a
    winner read at least twice can be separated (one reading shows nothing of its own spread)."""
    if not groups:
        return None
    ranked = ordered(groups, maximize)
    pooled = pooled_noise(groups)
    if len(ranked) < 2:
        return Verdict(ranked[0], None, True, pooled)
    gap, error = separation(ranked[0], ranked[1], pooled, maximize)
    apart = ranked[0].count >= 2 and gap > SEPARATION_Z * error
    noises = (noise_of(ranked[0], pooled), noise_of(ranked[1], pooled))
    return Verdict(ranked[0], ranked[1], apart, pooled, gap, error, noises)


def group_readings(values: Mapping[K, Sequence[float]],
                   steps: Mapping[K, Sequence[Sequence[float] | None]] | None = None,
                   caps: Mapping[K, float] | None = None) -> list[Readings[K]]:
    """`Readings` per key, in the mapping's order, keys without a reading left out; `steps` holds the
    per-step times of each key's runs (None for a run that gave none), `caps` the ceiling of each
    config its stage's curve contradicts (`scheduler.search.ceilings`)."""
    steps, caps = steps or {}, caps or {}
    return [Readings(key, tuple(vals), step_noise(steps.get(key, ())), caps.get(key))
            for key, vals in values.items() if vals]
