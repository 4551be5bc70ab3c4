"""Memory strategies before the lead stage's refinement, where its curve rises into its memory top.

Why: without a strategy the lead stage's refinement below its top costs 3-10 launches, and where a
strategy lets a stage hold a micro-batch several times larger (activation checkpointing, offload),
the sizes below the top cannot lead: on bench/search_quality.py's needs-strategy family a strategy
won most searches, and those spent 4.4 launches on average (8-12 in the longest) refining the plain
curve first. So once the lead stage's top (its largest size that ran) leads its readings, the
strategies are tried from it (`strategy_search.try_strategies`, which measures only from a leader at
its stage's memory top). When two of their runs read `DECISIVE` times every reading without one,
they paid decisively: the lead stage's refinement stops there, and every other stage is probed at
its top only (what it holds and how fast it runs there: the stage the strategies are then tried
from, as before, is the best of those tops, not the lead stage's, which shards the least). Where
they do not pay decisively the refinement goes on as without them, their runs kept; the strategies
are tried again from the final leader, never measuring a size already measured within
`strategy_search.TOP_GAIN` (`strategy_search._ran_near`).

`DECISIVE` is set from what a plain curve can hide: the sizes below a top that leads can beat it only
by the memory pressure near the top, a few percent to a fifth on real curves, not by half.
"""
from __future__ import annotations

from scheduler.search.ranking import metric_value
from scheduler.search.session import Session, Step
from scheduler.search.space import PROFILE
from scheduler.search.stage_readings import stage_values
from scheduler.search.strategies import searchable
from scheduler.search.strategy_search import try_strategies

#: Strategies paid decisively when two of their runs read this many times every reading without one.
DECISIVE = 1.5


def strategies_pay_first(session: Session, stage: int) -> Step:
    """Try the strategies from `stage`'s top once it leads the stage's readings (two or more), unless
    a strategy was measured already; True when they paid decisively (module docstring)."""
    st = session.settings
    if not st.maximize or st.micro_batch_sizes or not searchable(
            st.memory_strategies, st.ds_config, st.host_memory, st.checkpointing_fixed):
        return False
    values = {m: v for m, v in stage_values(session, stage).items() if v is not None}
    if len(values) < 2 or max(values, key=lambda m: values[m]) != max(values):
        return False
    if not any(exp.space != PROFILE and exp.strategy != st.strategy for exp, _ in session.measured.values()):
        yield from try_strategies(session)
    plain, runs = _readings(session, plain=True), sorted(_readings(session, plain=False))
    return bool(plain) and len(runs) >= 2 and runs[-2] >= DECISIVE * max(plain)


def _readings(session: Session, plain: bool) -> list[float]:
    """The job's readings without a strategy beyond the search's own (`plain`), or with one."""
    st = session.settings
    values = [metric_value(record, st.metric) for exp, record in session.measured.values()
              if exp.space != PROFILE and (exp.strategy == st.strategy) == plain]
    return [value for value in values if value is not None]
