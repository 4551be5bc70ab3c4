"""The memory line of a stage under a memory strategy: where a strategy's probes are read off.

Why: a strategy is measured at the largest micro-batch its memory line holds, so the line decides
whether its first probe lands near the top or runs out of memory. A sample's activations are the
same at every stage, only the states differ: the line's slope is one for every stage (a least-squares
fit over the stages measured at two sizes or more, each about its own mean; the profile's figure
before that), at least what any stage's smallest size that ran out of memory proves (that size's line
must pass the budget), and a stage's intercept is fitted through its own measured peaks at that
slope (the analytical model's before it ran). Fitting each stage alone instead gives a stage
measured at one size the profile's slope, often well below the real one, and an intercept that
makes up the difference: the checkpointed line read off it promised twice the sizes that fit.
Under a strategy the line drops by what its offload frees and its slope is times the share of
activations checkpointing keeps, measured by any checkpointed run that reports its peak (at any
stage: what it keeps of a sample is the same everywhere), and at least what a checkpointed run out
of memory proves: without peaks the prior's line can promise a stacked strategy sizes that its own
checkpointed failures already rule out.
"""
from __future__ import annotations

from collections.abc import Sequence

from scheduler.search.memory import Observation, peak_grows
from scheduler.search.session import Session, peak_of, succeeded
from scheduler.search.space import PROFILE, Experiment
from scheduler.search.strategies import CHECKPOINT_KEEP_PRIOR, freed_bytes, measured_keep_share


def line(session: Session, stage: int) -> tuple[float, float]:
    """(intercept, slope) of the stage's memory under the search's own strategy (module docstring)."""
    budget = session.settings.budget_bytes
    observations = session.observations()
    slope = shared_slope(session, observations)
    for other in session.settings.stages:
        failed = failed_sizes(session, other)
        if failed:
            slope = max(slope, (budget - intercept(session, observations, other, slope)) / min(failed))
    return intercept(session, observations, stage, slope), slope


def line_top(session: Session, stage: int, strategy: Sequence[str], safety: float, extra_bytes: float = 0.0) -> int:
    """The largest micro-batch `stage`'s memory line holds, within the cap, with `strategy` on top of
    the search's own: what its offload frees taken off the intercept, checkpointing's keep share on
    the slope, and `extra_bytes` every run holds besides (states the search's own strategy moved
    off the device, brought back)."""
    st = session.settings
    intercept, slope = line(session, stage)
    intercept += extra_bytes - freed_bytes(session.model, [n for n in strategy if n not in st.strategy], stage)
    if "activation_checkpointing" in strategy and "activation_checkpointing" not in st.strategy:
        slope *= keep_share(session)
    fits = int((st.budget_bytes * safety - intercept) // slope) if slope > 0 else st.micro_batch_cap
    return min(st.micro_batch_cap, fits)


def shared_slope(session: Session, observations: dict[int, list[Observation]]) -> float:
    """The bytes per sample every stage shares: a least-squares slope over the stages measured at two
    sizes or more whose peaks grow as a device's do (`memory.peak_grows`), each about its own mean;
    else the profile's activation figure."""
    prior = float(session.model.info.activation_mem_per_gpu)
    numerator = denominator = 0.0
    for found in observations.values():
        points = [(o.micro_batch_size, o.peak_bytes) for o in found if o.peak_bytes and not o.oom]
        if len({x for x, _ in points}) < 2 or not peak_grows(found, prior):
            continue
        mean_x = sum(x for x, _ in points) / len(points)
        mean_y = sum(y for _, y in points) / len(points)
        numerator += sum((x - mean_x) * (y - mean_y) for x, y in points)
        denominator += sum((x - mean_x) ** 2 for x, _ in points)
    return numerator / denominator if denominator and numerator > 0 else prior


def intercept(session: Session, observations: dict[int, list[Observation]], stage: int, slope: float) -> float:
    """The stage's fixed bytes: its measured peaks less `slope` per sample (their mean), else the
    analytical model's."""
    points = [(o.micro_batch_size, o.peak_bytes) for o in observations.get(stage, []) if o.peak_bytes and not o.oom]
    if points:
        return sum(y - slope * x for x, y in points) / len(points)
    return float(session.model.fixed_bytes(stage))


def keep_share(session: Session) -> float:
    """The share of activations checkpointing keeps: the mean of what checkpointed runs that report
    their peak measured (each above its stage's line's intercept less the offload it adds), else the
    prior; at least what a checkpointed run out of memory proves (its size's line must pass the
    budget), the way the slope is at least what the plain runs out of memory prove."""
    st = session.settings
    shares, proven = [], 0.0
    lines: dict[int, tuple[float, float]] = {}  # one fit per stage: the observations do not change here
    for exp, record in session.measured.values():
        if "activation_checkpointing" not in exp.strategy or exp.space == PROFILE:
            continue
        if exp.stage not in lines:
            lines[exp.stage] = line(session, exp.stage)
        fixed, slope = lines[exp.stage]
        fixed -= freed_bytes(session.model, [n for n in exp.strategy if n not in st.strategy], exp.stage)
        if record.get("status") == "oom" and slope > 0:
            proven = max(proven, (st.budget_bytes - fixed) / (slope * exp.micro_batch_size))
        elif succeeded(record):
            share = measured_keep_share(peak_of(record, st.peak_memory_key) or 0, fixed, slope, exp.micro_batch_size)
            if share is not None:
                shares.append(share)
    return min(1.0, max(proven, sum(shares) / len(shares) if shares else CHECKPOINT_KEEP_PRIOR))


def failed_sizes(session: Session, stage: int, strategy: Sequence[str] | None = None) -> list[int]:
    """The sizes that ran out of memory at the stage with `strategy` (the search's own by default)."""
    strategy = session.settings.strategy if strategy is None else strategy
    return [exp.micro_batch_size for exp, record in strategy_records(session, stage, strategy)
            if record.get("status") == "oom"]


def strategy_records(session: Session, stage: int, strategy: Sequence[str] | None) -> list[tuple[Experiment, dict]]:
    """The stage's runs with `strategy` (with any strategy when None)."""
    return [(exp, record) for exp, record in session.measured.values()
            if exp.stage == stage and exp.name != PROFILE and (strategy is None or exp.strategy == tuple(strategy))]


def unchecked(session: Session, stage: int, strategy: tuple[str, ...], but: dict | None = None) -> bool:
    """Whether no run of `strategy` at `stage` (`but` aside) measured its peak or ran out of memory:
    its line is the prior's (without a peak, a checkpointed run measures no keep share)."""
    key = session.settings.peak_memory_key
    return not any(peak_of(record, key) is not None or record.get("status") == "oom"
                   for _, record in strategy_records(session, stage, strategy) if record is not but)
