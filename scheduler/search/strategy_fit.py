"""Memory strategies when nothing fits without one: the strategy a model needs, before the search.

Why: DeepSpeed's autotuner cannot start tuning a model whose states no stage holds (its estimate
ignores offload: a 30B model cannot start). The memory model says which of the allowed strategies
would let a stage hold micro-batch 1:

**Nothing fits without one** (`stages_that_fit`). When no allowed ZeRO stage fits micro-batch 1, the
combinations of the allowed strategies are tried cheapest first (`strategies.ordered_combinations`)
and the first the memory model says fits micro-batch 1 at some allowed stage becomes the search's
own (`SearchSettings.strategy`): every experiment runs with it, its memory lines are measured under
it, and the search goes on as it would on a larger device. Without permission the job ends with one
line naming the cheapest combination the model says would fit and the config line that allows it (a
`NoStageFits`). A profile run (ZeRO-3, micro-batch 1) that ran out of memory proves that no stage
holds the states: it runs once more with every allowed offload (`profile_offloaded`), and only
combinations with an offload are candidates (the model, which may have called that profile a fit, is
not trusted without); the profile's own offload always fits (it ran at ZeRO-3).

A strategy that lets a leader at its memory top run a larger micro-batch is
`scheduler.search.strategy_search`'s; an offloaded optimizer swapped for offloaded parameters at
ZeRO-3, once the strategies were tried, `scheduler.search.strategy_swap`'s.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from scheduler.inputs.memory_strategies import MEMORY_STRATEGIES
from scheduler.search.memory import MemoryModel, ModelInfo
from scheduler.search.session import NoStageFits, Session, Step, peak_of, succeeded
from scheduler.search.space import PROFILE, Experiment
from scheduler.search.strategies import (
    allow_line, applies, freed_bytes, ordered_combinations, searchable, strategy_model,
)


def stages_that_fit(session: Session, feasible: Callable[[Session], tuple[int, ...]]) -> tuple[int, ...]:
    """`feasible(session)` (the stages fitting micro-batch 1), or, when it raises `NoStageFits`, the
    stages that fit with the cheapest allowed strategy, which becomes the search's own (module
    docstring). Without one allowed, the refusal names the strategy that would fit."""
    offloaded = _offloaded_profile(session)
    try:
        if offloaded is None:
            return feasible(session)
        raise NoStageFits("the profile run ran out of memory at ZeRO-3, micro-batch 1", 0)
    except NoStageFits as refusal:
        st = session.settings
        if st.estimator != "calibrated":
            raise
        allowed = searchable(st.memory_strategies, st.ds_config, st.host_memory, st.checkpointing_fixed)
        possible = searchable(st.memory_strategies, st.ds_config, st.host_memory, st.checkpointing_fixed,
                              names=MEMORY_STRATEGIES)
        base = session.model
        for strategy in ordered_combinations(possible):
            if offloaded is not None and not any(name.startswith("offload_") for name in strategy):
                continue  # no stage holds the states without offload: the profile proved it at ZeRO-3
            model = strategy_model(base, strategy)
            stages = tuple(s for s in st.stages if applies(strategy, s) and model.gate(s, st.budget_bytes).feasible)
            if offloaded is not None and strategy == offloaded.strategy:
                stages = stages or (3,)  # the offloaded profile ran there
            if not stages:
                continue
            if set(strategy) <= set(allowed):
                session.settings = replace(st, strategy=strategy)
                session.model = model
                return stages
            raise NoStageFits(f"{refusal}; the memory model says it fits with {' + '.join(strategy)} at ZeRO-"
                              f"{stages[0]}: allow it with {allow_line(strategy)} in the config",
                              refusal.shortfall_bytes) from None
        raise


def _offloaded_profile(session: Session) -> Experiment | None:
    """The offloaded profile run (`profile_offloaded`) when the plain one ran out of memory and it ran."""
    return next((exp for exp, record in session.measured.values()
                 if exp.space == PROFILE and exp.strategy and succeeded(record)), None)


def profile_offloaded(session: Session) -> Step:
    """After the profile run ran out of memory, the profile once more with every allowed offload
    (ZeRO-3's states leave the device; its activation figure is the same). Returns its record with the
    peak it would have had without the offload (for the overhead: `memory.overhead_from_profile`), or
    None when no offload is allowed."""
    st = session.settings
    allowed = searchable(st.memory_strategies, st.ds_config, st.host_memory, st.checkpointing_fixed)
    strategy = tuple(name for name in allowed if name.startswith("offload_"))
    if not strategy:
        return None
    [record] = yield from session.measure("profile_offloaded", [session.profile_experiment(strategy)])
    info = ModelInfo.from_mapping(record.get("metrics")) if succeeded(record) else None
    peak = peak_of(record, st.peak_memory_key)
    if info is None or peak is None:
        return record
    return {**record, st.peak_memory_key: peak + freed_bytes(MemoryModel(info, st.setup, 0), strategy, 3)}
