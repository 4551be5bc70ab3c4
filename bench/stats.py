"""Summary statistics the benches print, defined once so that a p10 means the same in every bench.

Why: the replays (search_quality, heldout, fixed_batch, trace_replay, rule_ablation) each print a
10th and a 90th percentile of their searches, and a p10 must mean the same in each; heldout also
counts, script by script, the picks below another tool's.
"""
from __future__ import annotations

from collections.abc import Sequence

#: A value below this share of its paired reference counts as below it (`below`): 2 % is within
#: one reading's noise on the replays' machines.
BELOW = 0.98


def quantile(values: Sequence[float], q: float) -> float:
    """The q-quantile of `values` by the nearest rank, without interpolation: the value at index
    round(q (n - 1)) of the sorted values (p10 of 60 values is the 7th smallest), so it is always
    one of the values measured."""
    if not values:
        raise ValueError("quantile of no values")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def below(values: Sequence[float], reference: Sequence[float], ratio: float = BELOW) -> int:
    """How many of `values` fall below `ratio` times the `reference` value paired with them (the
    same script searched by two tools): a count of losses that noise alone also produces, which is
    why a bench prints it both ways."""
    return sum(value < ratio * ref for value, ref in zip(values, reference, strict=True))
