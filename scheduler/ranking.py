"""Which experiment was best, by the metric the user asked for.

Throughput and FLOPS are maximised, latency is minimised (DeepSpeed's autotuner maximises all of
them, so it picks the slowest config when asked for latency). Ties keep the earlier experiment.
"""
from __future__ import annotations

import math
from collections import Counter
from typing import Any


def metric_value(record: dict[str, Any], metric: str) -> float | None:
    """The experiment's value for `metric`, or None if it failed or did not report it."""
    if record.get("status") != "ok":
        return None
    value = (record.get("metrics") or {}).get(metric)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def best(records: list[dict[str, Any]], metric: str, maximize: bool) -> dict[str, Any] | None:
    """The best successful record, or None if none succeeded."""
    best_record, best_value = None, None
    for record in records:
        value = metric_value(record, metric)
        if value is None:
            continue
        if best_value is None or (value > best_value if maximize else value < best_value):
            best_record, best_value = record, value
    return best_record


def status_counts(records: list[dict[str, Any]]) -> Counter:
    return Counter(record.get("status", "lost") for record in records)
