"""A model that fits only with a memory strategy, learned from the probes rather than predicted.

Why: `strategy_fit.stages_that_fit` picks a strategy before the search when the memory model
says no allowed stage holds micro-batch 1. The model is calibrated from the profile run, which
trains no optimizer step: on a real trace of the GPT example (bench/traces/train_gpt_ckpt.json,
host memory) the profile peaked at 517 MiB and micro-batch 1 at 587, so in a 570 MiB slot the model
said micro-batch 1 fits, the probe ran out of memory, and the job ended with no winner although the
user allowed checkpointing, which holds micro-batch 2 there. So when the sampled search ends with
nothing run but out-of-memory failures, the allowed combinations are tried, cheapest first
(`strategies.ordered_combinations`), each becoming the search's own strategy as the model's choice
would (`SearchSettings.strategy`) and the stages searched again with it, until one runs. Pure
decision logic over a `Session`; the search is `stage_follow.sampled_stages`'.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from scheduler.search.stage_follow import sampled_stages
from scheduler.search.session import Session, Step, succeeded
from scheduler.search.space import PROFILE
from scheduler.search.strategies import applies, ordered_combinations, searchable, strategy_model


def only_out_of_memory(session: Session) -> bool:
    """Whether every experiment but the profile failed, and at least one ran out of memory."""
    records = [record for exp, record in session.measured.values() if exp.space != PROFILE]
    return bool(records) and not any(succeeded(record) for record in records) \
        and any(record.get("status") == "oom" for record in records)


def strategy_after_failures(session: Session, stages: Sequence[int]) -> Step:
    """After a sampled search that ran nothing but out of memory, the allowed strategies in turn
    (module docstring); returns the stages searched with the one that ran (empty: none did, or none
    was allowed, or the search already had a strategy of its own)."""
    st = session.settings
    if st.strategy or st.estimator != "calibrated" or not only_out_of_memory(session):
        return ()
    allowed = searchable(st.memory_strategies, st.ds_config, st.host_memory, st.checkpointing_fixed)
    base = session.model
    for strategy in ordered_combinations(allowed):
        usable = tuple(stage for stage in st.stages if applies(strategy, stage))
        if not usable:
            continue
        session.settings = replace(st, strategy=strategy)
        session.model = strategy_model(base, strategy)
        yield from sampled_stages(session, usable)
        if any(succeeded(record) for stage in usable for _, record in session.stage_records(stage)):
            return usable
    session.settings, session.model = st, base
    return ()
