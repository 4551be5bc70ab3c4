"""A stage whose top no probe checked: on a script whose allocator reports no peak, a stage's
predicted top is another stage's bracket moved by the analytical difference of their fixed bytes.
Where the stage leads with its curve still rising at that top, the size above is probed
(`stage_readings.above_unchecked_top`), up to the analytical model's own top."""
from __future__ import annotations

from dataclasses import dataclass

from scheduler.search.ranking import best
from tests.unit.test_sampled_search import play, scripted_settings, stages_of


class Rising(dict):
    """Throughput by (stage, mbs): rising with the micro-batch up to the memory top."""

    def __missing__(self, key: tuple[int, int]) -> float:
        return 100.0 + 10.0 * key[1]


@dataclass
class AnalyticalTop:
    """The analytical memory model's own top (the profile's bytes per sample), per stage."""

    tops: dict[int, int]

    def max_micro_batch_size(self, stage: int, capacity_bytes: int) -> int:
        return self.tops[stage]

    def held_bytes(self, stage: int) -> int:
        return 0  # a small model's states: its activations fill the device


def _search_with_model(tops: dict[int, int]):
    def search(session):
        session.model = AnalyticalTop(tops)
        yield from stages_of((3,))(session)
    return search


def test_a_leading_top_that_no_probe_checked_is_probed_above_until_memory_says_no() -> None:
    """ZeRO-3 is predicted to hold 10 (a moved bracket) and holds 30; the analytical model says 50.
    10 leads on a rising curve: 23 (the geometric middle of 10 and 51) runs, 34 (of 23 and 51)
    fails, 28 (of 23 and 34) runs, 31 fails; the refinement fills in below each new top. The named
    size is 28, not 10."""
    settings = scripted_settings(stages=(3,), max_train_batch_size=None)
    launched, _, session = play(_search_with_model({3: 50}), Rising(), {3: 30}, settings, predicted={3: 10})
    sizes = [mbs for stage, mbs, _ in launched if stage == 3]
    assert max(sizes) > 10 and 34 in sizes, sizes
    assert sum(mbs > 30 for mbs in sizes) <= 2, sizes  # MAX_FAILURES failures above a success, no more
    winner = best([record for _, record in session.measured.values()], "throughput", True)
    assert int(winner["name"].rsplit("tmbspg", 1)[1]) >= 28, winner["name"]


def test_a_top_the_analytical_model_agrees_with_is_not_probed_above() -> None:
    """The analytical model's own top is the predicted one: nothing above it is launched."""
    settings = scripted_settings(stages=(3,), max_train_batch_size=None)
    launched, _, _ = play(_search_with_model({3: 10}), Rising(), {3: 30}, settings, predicted={3: 10})
    assert max(mbs for stage, mbs, _ in launched if stage == 3) == 10, launched
