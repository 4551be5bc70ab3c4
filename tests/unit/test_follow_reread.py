"""A followed stage's one reading that trails the incumbent by more than `TORN_RATIO` is read again
before it rules the stage out (`stage_follow._follow`): a straggler's reading (1.5-2x slower) at the
follow would otherwise drop the stage holding the optimum."""
from __future__ import annotations

import math

from scheduler.search.ranking import best
from tests.unit.test_sampled_search import play, scripted_settings, stages_of


class Curve(dict):
    """Throughput by (stage, mbs): the smaller the micro-batch the faster; ZeRO-2 a tenth faster."""

    def __missing__(self, key: tuple[int, int]) -> float:
        stage, mbs = key
        return (60.0 - 2.0 * math.log2(mbs)) * (1.1 if stage == 2 else 1.0)


def _search(stragglers: dict[str, float]):
    return play(stages_of((1, 2)), Curve(), {1: 32, 2: 48}, scripted_settings(stages=(1, 2)), stragglers=stragglers)


def test_a_straggling_follow_is_read_again_and_its_stage_wins() -> None:
    _, plain, session = _search({})
    follow = [p for p in plain if p.name.startswith("z2_follow_")]
    assert len(follow) == 1 and not any("recheck" in p.name for p in plain)
    name = follow[0].experiments[0].name
    _, phases, session = _search({name: 0.5})
    assert [p.name for p in phases if p.name.startswith("z2_follow_")] == [follow[0].name, f"{follow[0].name}_recheck"]
    winner = best([record for _, record in session.measured.values()], "throughput", True)
    assert winner["name"].startswith("z2_")


def test_a_follow_trailing_within_the_ratio_is_read_once() -> None:
    _, plain, _ = _search({})
    name = next(p for p in plain if p.name.startswith("z2_follow_")).experiments[0].name
    _, phases, _ = _search({name: 0.8})
    assert not any("recheck" in p.name for p in phases)
