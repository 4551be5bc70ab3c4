"""The search's own optimizer offload revisited: parameter offload at ZeRO-3 in its place.

Why: when nothing fits without offload, the search's own strategy is the cheapest combination the
memory model says fits (`scheduler.search.strategy_fit`), which is offloading the optimizer, and
every later strategy stacks on it. But CPU Adam over the rank's whole shard, with the gradients
down and the weights up each step, can cost more than fetching the parameters at ZeRO-3 and
recomputing activations (needs-strategy scripts whose best config is parameter offload with
checkpointing, named at 0.77-0.81 of it while the optimizer stayed offloaded). Once the strategies
were tried, the best run is measured once more at ZeRO-3 with the optimizer back on the device and
the parameters (and, when allowed, the activations) offloaded or checkpointed instead, when the
time priors (`strategies.step_cost_s`) say that costs less and the memory line, with the
optimizer's states added back, holds its size (`swap_own_offload`). A run of that combination,
failed or not, is never repeated.
"""
from __future__ import annotations

from dataclasses import replace

from scheduler.search.global_batch import largest_kept
from scheduler.search.memory import SAFETY
from scheduler.search.ranking import best
from scheduler.search.session import Session, Step, succeeded
from scheduler.search.space import PROFILE, Experiment, strategy_label, strategy_of
from scheduler.search.strategies import searchable, step_cost_s
from scheduler.search.strategy_lines import line_top, strategy_records
from scheduler.search.strategy_time import step_facts

#: The swapped combination is measured only where its line holds at least this share of the best
#: run's micro-batch (then at the size it holds): a smaller one trains a different step.
SIZE_SHARE = 0.8


def swap_own_offload(session: Session) -> Step:
    """Measure the best run's config once at ZeRO-3 with the parameters offloaded instead of the
    optimizer (module docstring), when the priors say it is faster and its line holds the size."""
    st = session.settings
    allowed = searchable(st.memory_strategies, st.ds_config, st.host_memory, st.checkpointing_fixed)
    if "offload_optimizer" not in st.strategy or "offload_param" not in allowed or 3 not in st.stages:
        return
    runs = [(exp, record) for exp, record in session.measured.values()
            if exp.name != PROFILE and not exp.tuning_space and succeeded(record)]
    winner = best([record for _, record in runs], st.metric, st.maximize)
    found = next(((exp, record) for exp, record in runs if record is winner), None)
    if found is None:
        return
    exp, record = found
    names = [n for n in exp.strategy if n != "offload_optimizer"] + ["offload_param"]
    strategy = strategy_of((*names, "activation_checkpointing") if "activation_checkpointing" in allowed else names)
    if strategy_records(session, 3, strategy) or not _cheaper(session, exp, record, strategy):
        return
    size = min(exp.micro_batch_size, _holds(session, strategy))
    if st.kept_per_gpu:
        size = largest_kept(st.kept_per_gpu, size) if size >= 1 else 0
    if size < 1 or size < SIZE_SHARE * exp.micro_batch_size:
        return
    step = exp.micro_batch_size * exp.gradient_accumulation_steps
    gas = st.gas_for(size) if st.samples_per_step else max(1, step // size)
    swapped = session.experiment(3, size, gas, strategy)
    yield from session.measure(f"z3_swap_{strategy_label(strategy)}_{size}", [swapped])


def _cheaper(session: Session, exp: Experiment, record: dict, strategy: tuple[str, ...]) -> bool:
    """Whether the time priors put `strategy` at ZeRO-3 below `exp`'s own strategies."""
    own, swapped = step_facts(session, exp, record), step_facts(session, exp, record, stage=3)
    if own is None or swapped is None:
        return False
    return step_cost_s(strategy, swapped) < step_cost_s(exp.strategy, own)


def _holds(session: Session, strategy: tuple[str, ...]) -> int:
    """The largest size ZeRO-3's memory line holds with `strategy`: the search's own line (the
    optimizer offloaded) with the optimizer's states added back and what `strategy` frees taken off."""
    model = session.model
    on_device = replace(model, setup=replace(model.setup, offload_optimizer=False))
    return max(0, line_top(session, 3, strategy, SAFETY, extra_bytes=on_device.held_bytes(3) - model.held_bytes(3)))
