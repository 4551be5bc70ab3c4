"""A second round of refinement when confirming moved the leader.

Why: the refinement of a stage follows its best reading, and one reading can be a straggler's or a
lucky one the cost model could not contradict (three sizes, one of them lucky, fit any curve).
Confirming measures the leader again; when that moves the lead to another config, the sizes around
the new leader were never refined for it: on a mid-peak surface (bench/lucky_stage.py, mid-peak
seed 1), a lucky reading at micro-batch 51 held the refinement between 36 and 73, confirming put 36
ahead, and the optimum at 8 was never measured (0.63 of it named). So once the confirmed leader is
not the leader the search confirmed from, its stage is refined again on the pooled readings
(`stage_readings.stage_values`: a config read three times or more reads its median) and the new
leader is confirmed; at most `MAX_ROUNDS` times, as each round measures new configs. A leader that
moved to another stage is not refined again (that stage's curve is the first stage's, already
refined), but with either move the memory strategies are tried from the new leader
(`strategy_search.try_strategies`, which measures only from a leader at its stage's memory top):
they were tried from the leader before confirming, which a lucky reading may have made (bench/
search_quality.py's needs-strategy script 2021: a lucky 0.82 at ZeRO-2's micro-batch 4, below its
top, kept checkpointing untried; confirming put ZeRO-0's top ahead, and the optimum, checkpointed
at 23, was never measured: 0.60 named).

Pure decision logic on a `Session`; the refinement is `sampled_search.explore_stage`'s.
"""
from __future__ import annotations

from collections.abc import Sequence

from scheduler.search.repeats import confirm
from scheduler.search.sampled_search import explore_stage
from scheduler.search.session import Session, Step
from scheduler.search.stage_readings import leader_of
from scheduler.search.strategy_search import try_strategies

#: Rounds of refinement and confirmation after the first confirmation.
MAX_ROUNDS = 2


def confirm_and_refine(session: Session, stages: Sequence[int]) -> Step:
    """Confirm the leader (`repeats.confirm`); while that moves the lead to another config of
    `stages`, refine the new leader's stage (when the lead stayed in its stage), try the strategies
    from it, and confirm again, up to MAX_ROUNDS times."""
    before = leader_of(session, stages)
    yield from confirm(session)
    for _ in range(MAX_ROUNDS):
        after = leader_of(session, stages)
        if after is None or before is None or after == before:
            return
        measured = len(session.measured)
        if after[0] == before[0]:
            yield from explore_stage(session, after[0])
        yield from try_strategies(session)
        if len(session.measured) == measured:
            return
        before = leader_of(session, stages)
        yield from confirm(session)
