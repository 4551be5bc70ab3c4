"""A measured run's step as the memory strategies' time priors read it.

Why: the priors (`scheduler.search.strategies.step_cost_s`) price a strategy against the compute
of one optimizer step, the micro-steps in it and the parameters a rank holds and updates. Both the
strategy probes (`strategy_search`: is a strategy's cost alone a whole step?) and the offload swap
(`strategy_swap`: is parameter offload at ZeRO-3 cheaper than the optimizer's?) read those facts
off a run's record the same way, here.
"""
from __future__ import annotations

from scheduler.search.ranking import metric_value
from scheduler.search.session import Session
from scheduler.search.space import Experiment
from scheduler.search.strategies import StepFacts


def step_facts(session: Session, exp: Experiment, record: dict, stage: int | None = None) -> StepFacts | None:
    """What a strategy's time prior needs of `exp`'s step, read from its `record` (None: no step
    time there), as if run at `stage` (the parameters a ZeRO-3 rank holds are its shard)."""
    st = session.settings
    value = metric_value(record, st.metric)
    if not value:
        return None
    samples = exp.micro_batch_size * exp.gradient_accumulation_steps * st.world_size
    step_s = samples / value if st.metric == "throughput" else value / 1e6 if st.metric == "latency" else None
    if step_s is None:
        return None
    info, setup = session.model.info, session.model.setup
    stage = exp.stage if stage is None else stage
    shard = -(-info.trainable_num_params // (setup.dp_size * setup.mp_size))
    rank = -(-info.num_params // (setup.mp_size * (setup.dp_size if stage >= 3 else 1)))
    return StepFacts(compute_s=step_s, micro_steps=exp.gradient_accumulation_steps, shard_params=shard,
                     rank_params=rank, width=2 if setup.mixed_precision else 4)
