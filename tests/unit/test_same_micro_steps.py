"""ZeRO-0 beside a ZeRO-1 incumbent: both reduce gradients only at the accumulation boundary, so
their micro-steps are the same work and their best sizes coincide; ZeRO-0 is measured once, at the
incumbent's own config, and explored only where it holds more than the incumbent's stage at that stage's cap."""
from __future__ import annotations

import math

from scheduler.search.ranking import best
from scheduler.search.sampled_search import widen_step
from scheduler.search.stage_follow import sampled_stages
from scheduler.search.session import Session
from tests.unit.test_sampled_search import play, scripted_settings, stages_of


class Curve(dict):
    """Throughput by (stage, mbs): the smaller the micro-batch (the more accumulation) the faster, as
    the real GPT example ran on CPU slots; ZeRO-0 a little faster than ZeRO-1 at every size."""

    def __missing__(self, key: tuple[int, int]) -> float:
        stage, mbs = key
        return 60.0 - 2.0 * math.log2(mbs) + (1.0 if stage == 0 else 0.0)


def test_zero_0_is_measured_once_at_the_zero_1_incumbents_config_and_named_there() -> None:
    launched, phases, session = play(stages_of((0, 1)), Curve(), {0: 32, 1: 32}, scripted_settings(stages=(0, 1)))
    zero_1 = [(mbs, gas) for stage, mbs, gas in launched if stage == 1]
    leader = max(zero_1, key=lambda config: Curve()[(1, config[0])])
    assert [(mbs, gas) for stage, mbs, gas in launched if stage == 0] == [leader]
    assert [p.name for p in phases if p.experiments[0].stage == 0] == [f"z0_compare_{leader[0]}"]
    winner = best([record for _, record in session.measured.values()], "throughput", True)
    assert winner["name"] == f"z0_gas{leader[1]}_tmbspg{leader[0]}"


def test_a_zero_0_leader_measured_at_zero_1s_config_does_not_probe_its_own_top() -> None:
    """Without max_train_batch_size the leader, ZeRO-0 at 1 x 32 (ZeRO-1's step of 32), already fills
    the step its top would give: widening would launch that top for nothing."""
    def search(session: Session):
        yield from sampled_stages(session, (0, 1))
        yield from widen_step(session, (0, 1))

    launched, phases, _ = play(search, Curve(), {0: 32, 1: 32},
                               scripted_settings(stages=(0, 1), max_train_batch_size=None, host_memory=True))
    assert (0, 1, 32) in launched
    assert [(mbs, gas) for stage, mbs, gas in launched if stage == 0] == [(1, 32)]
    assert not [p.name for p in phases if "widen" in p.name]


class Rising(dict):
    """Throughput by (stage, mbs): rising with the micro-batch up to every stage's memory top."""

    def __missing__(self, key: tuple[int, int]) -> float:
        return 10.0 * key[1]


def test_zero_0_holding_more_than_a_zero_1_incumbent_at_its_cap_is_explored() -> None:
    """ZeRO-1 tops out at 8 with its curve still rising there; ZeRO-0 holds 16 (the model counts
    ZeRO-1's gradient bucket): like any stage holding larger sizes where the curve still rose, it is
    explored, and the larger size it holds wins."""
    launched, _, session = play(stages_of((0, 1)), Rising(), {0: 16, 1: 8}, scripted_settings(stages=(0, 1)))
    assert max(mbs for stage, mbs, _ in launched if stage == 0) == 16
    winner = best([record for _, record in session.measured.values()], "throughput", True)
    assert winner["name"].startswith("z0_") and "tmbspg16" in winner["name"], winner["name"]


def test_zero_0_predicted_a_few_percent_above_the_incumbents_cap_is_not_explored() -> None:
    """ZeRO-1 tops out at 16, ZeRO-0 is predicted to hold 17 (and really holds 16): a top less than
    `sampling.TOP_GAIN` above the incumbent's is mostly the model's error, so ZeRO-0 is measured once
    at the incumbent's config and its top is not probed."""
    launched, _, _ = play(stages_of((0, 1)), Rising(), {0: 16, 1: 16},
                          scripted_settings(stages=(0, 1), max_train_batch_size=None), predicted={0: 17, 1: 16})
    assert [mbs for stage, mbs, _ in launched if stage == 0] == [16], launched
