"""A stage holding larger sizes is explored when the incumbent stage's fitted curve still rises at
its cap, though noise put the best single reading just below it (`stage_readings.rising_at_cap`)."""
from __future__ import annotations

from scheduler.search.stage_readings import rising_at_cap
from tests.unit.test_sampled_search import play, scripted_settings, stages_of

#: ZeRO-1 rises to its cap 16, but 10's reading came out above 16's; ZeRO-2 holds 32 and is faster there.
SPEED = {(1, 4): 40.0, (1, 8): 60.0, (1, 10): 76.0, (1, 16): 75.0, (2, 10): 74.0, (2, 32): 90.0}


def test_a_stage_holding_more_is_explored_when_the_fit_rises_at_the_incumbents_cap() -> None:
    launched, _, session = play(stages_of((1, 2)), {**SPEED, (2, 16): 80.0, (2, 22): 85.0},
                                {1: 16, 2: 32}, scripted_settings(stages=(1, 2)))
    assert rising_at_cap(session, 1)
    assert (2, 32, 1) in launched, launched


def test_a_plateau_at_the_cap_gives_no_upside() -> None:
    """Flat from 10 on (within the noise): no stage is explored above the incumbent's size."""
    flat = {**SPEED, (1, 16): 75.5, (1, 10): 76.0, (1, 8): 74.0, (1, 4): 70.0}
    launched, _, session = play(stages_of((1, 2)), flat, {1: 16, 2: 32}, scripted_settings(stages=(1, 2)))
    assert not rising_at_cap(session, 1)
    assert not [config for config in launched if config[0] == 2 and config[1] > 10], launched
