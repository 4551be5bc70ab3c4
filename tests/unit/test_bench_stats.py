"""bench/stats.py: the quantile every replay prints, and the paired count of picks below another tool's."""
from __future__ import annotations

import pytest

from bench.stats import BELOW, below, quantile


def test_quantile_is_the_nearest_rank_on_n_minus_1_and_always_a_measured_value() -> None:
    values = [float(v) for v in range(60, 0, -1)]  # unsorted on purpose: 60 .. 1
    assert quantile(values, 0.1) == 7.0  # index round(0.1 x 59) = round(5.9) = 6 of 1..60
    assert quantile(values, 0.9) == 54.0  # index round(53.1) = 53
    assert quantile(values, 0.0) == 1.0 and quantile(values, 1.0) == 60.0
    assert quantile([0.5, 0.7, 0.6], 0.5) == 0.6
    assert quantile([3.0], 0.1) == 3.0


def test_quantile_of_nothing_is_an_error_not_a_guess() -> None:
    with pytest.raises(ValueError):
        quantile([], 0.1)


def test_below_counts_pairs_more_than_the_tolerance_apart_one_way_only() -> None:
    ours = [1.00, 0.97, 0.99, 0.0, 0.90]
    theirs = [1.00, 1.00, 1.00, 0.95, 0.80]
    # 0.97 < 0.98 x 1.00 is below; 0.99 is within 2 %; an aborted search (0) is below any pick; 0.90 beats 0.80
    assert below(ours, theirs) == 2
    assert below(theirs, ours) == 1  # 0.80 < 0.98 x 0.90 (and 0.95 against the aborted 0 is not below)
    assert BELOW == 0.98 and below([0.95], [1.0], ratio=0.9) == 0
    assert below([0.98], [1.0]) == 0  # exactly at the tolerance: not below


def test_below_refuses_unpaired_lists() -> None:
    with pytest.raises(ValueError):
        below([1.0, 0.9], [1.0])
