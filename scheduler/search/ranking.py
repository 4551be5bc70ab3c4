"""Which experiment was best, by the metric the user asked for.

Throughput and FLOPS are maximised, latency is minimised (DeepSpeed's autotuner maximises all of
them, so it picks the slowest config when asked for latency). Ties keep the earlier experiment.
A config measured more than once (the sampled search confirms its winner with repeats `<name>_r2`,
`<name>_r3`, ...: scheduler.search.confirm) is judged on the mean of its measurements, and the winner
named is its first experiment, so the optimal config is always one that ran under its own name.
"""
from __future__ import annotations

import json
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
    """The first record of the config with the best mean metric, or None if none succeeded."""
    return pooled_best(records, metric, maximize)[0]


def pooled_best(records: list[dict[str, Any]], metric: str,
                maximize: bool) -> tuple[dict[str, Any] | None, float | None, int]:
    """(the first record of the best config, its mean metric, how many measurements the mean pools):
    what a summary must show, since the winner was picked on the mean, not on one measurement."""
    groups: dict[str, list[Any]] = {}  #: config -> [first successful record, values]
    for record in records:
        value = metric_value(record, metric)
        if value is None:
            continue
        key = config_key(record)
        if key in groups:
            groups[key][1].append(value)
        else:
            groups[key] = [record, [value]]
    best_record, best_value, count = None, None, 0
    for record, values in groups.values():
        value = sum(values) / len(values)
        if best_value is None or (value > best_value if maximize else value < best_value):
            best_record, best_value, count = record, value, len(values)
    return best_record, best_value, count


def config_key(record: dict[str, Any]) -> str:
    """The identity of a record's config: repeats of one config share it."""
    config = record.get("ds_config")
    if isinstance(config, dict):
        return "c:" + json.dumps(config, sort_keys=True, default=str)
    return "n:" + str(record.get("name"))


def status_counts(records: list[dict[str, Any]]) -> Counter:
    return Counter(record.get("status", "lost") for record in records)
