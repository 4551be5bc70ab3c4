"""The memory line a strategy's probes are read off (`scheduler.search.strategy_lines`): one slope
shared by every stage, each stage's intercept through its own peaks, and the checkpointing keep
share measured at one stage used at every stage."""
from __future__ import annotations

from dataclasses import replace

import pytest

from scheduler.search.memory import GiB, MemoryModel, ModelInfo
from scheduler.search.session import Session
from scheduler.search.strategy_lines import keep_share, line
from tests.unit.test_strategy_search import Law, settings

#: 1e8 parameters, 4 GB of activations per sample; the profile says 40 % of that.
LAW = Law(num_params=100_000_000, activation=4_000_000_000, keep=0.35)


def session_with(*runs: tuple[int, int, tuple[str, ...]]) -> Session:
    """A session whose (stage, micro-batch, strategy) runs ran with the peaks `LAW` gives them."""
    understated = ModelInfo(LAW.num_params, LAW.num_params, int(0.4 * LAW.activation))
    search_settings = replace(settings(LAW, ["activation_checkpointing"]), model_info=understated)
    session = Session(search_settings)
    session.model = MemoryModel(understated, search_settings.setup, GiB)
    for stage, mbs, strategy in runs:
        exp = session.experiment(stage, mbs, 1, strategy)
        session.measured[exp.name] = (exp, LAW.run(exp))
    return session


def test_a_stage_run_at_one_size_takes_the_slope_another_stage_measured() -> None:
    """ZeRO-1 ran at 1 and 2 (its peaks give the real 4 GB a sample), ZeRO-2 at 2 only: ZeRO-2's
    line has that slope and passes through its own peak, not the profile's 1.6 GB slope with an
    intercept making up the rest (which read a checkpointed top about twice too large)."""
    session = session_with((1, 1, ()), (1, 2, ()), (2, 2, ()))
    intercept, slope = line(session, 2)
    assert slope == pytest.approx(LAW.activation, rel=1e-6)
    probe = session.experiment(2, 2, 1)
    assert intercept == pytest.approx(LAW.memory(probe) - 2 * LAW.activation, rel=1e-6)
    assert intercept < line(session, 1)[0]  # ZeRO-2 shards the gradients too: fewer fixed bytes


def test_what_checkpointing_keeps_is_measured_once_for_every_stage() -> None:
    session = session_with((1, 1, ()), (1, 2, ()), (2, 2, ()), (2, 3, ("activation_checkpointing",)))
    assert keep_share(session) == pytest.approx(LAW.keep, rel=1e-6)


def test_without_a_checkpointed_run_the_keep_share_is_the_prior() -> None:
    session = session_with((1, 1, ()), (1, 2, ()))
    assert keep_share(session) == pytest.approx(0.3)
    assert line(session, 1)[1] == pytest.approx(LAW.activation, rel=1e-6)
    assert LAW.memory(session.experiment(1, 2, 1)) < 15 * GiB  # the runs above did run


def test_a_checkpointed_run_out_of_memory_raises_the_keep_share_to_what_it_proves() -> None:
    """No checkpointed run reports its peak (the prior 0.3 stands), but one ran out of memory at a
    size the prior says fits: the share is at least what makes that size's line pass the budget, so
    a strategy stacked on checkpointing is not read off the prior's line again."""
    session = session_with((1, 1, ()), (1, 2, ()))
    fixed, slope = line(session, 1)
    budget = session.settings.budget_bytes
    fits_by_prior = int((budget - fixed) // (0.3 * slope))
    failed = session.experiment(1, fits_by_prior, 1, ("activation_checkpointing",))
    session.measured[failed.name] = (failed, {"name": failed.name, "status": "oom", "ds_config": failed.ds_config})
    assert keep_share(session) == pytest.approx((budget - fixed) / (slope * fits_by_prior), rel=1e-6)
    assert keep_share(session) > 0.3
