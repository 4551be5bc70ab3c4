"""Which experiment was best, by the metric the user asked for.

Throughput and FLOPS are maximised, latency is minimised (DeepSpeed's autotuner maximises all of
them, so it picks the slowest config when asked for latency). Ties keep the earlier experiment.
A config measured more than once (the sampled search confirms its winner with repeats `<name>_r2`,
`<name>_r3`, ...: scheduler.search.confirm) is judged on its pooled value (`pooled_value`: the mean of
one or two readings, the median of three or more), and the winner named is its first experiment, so
the optimal config is always one that ran under its own name. Each helper reads a record's JSON (the
searches') or its type (`Ranked`: the report's), and `best` answers with one of the records it was given.

Why the median from three readings on: readings of real training runs have rare outliers (one
config of the GPT trace read 17.7-42.4; bench/surfaces.py's heavy-tailed scripts read a straggler's
0.5-0.67x and a lucky 1.3-1.8x), and one such reading moves a mean of three by 15-25 %, far more
than the gaps confirmation has to decide; the median of three ignores one. With two readings the median is the mean. On bench/fixed_batch.py's heavy-tailed
surfaces, with a kept batch's larger confirmation budget, it took the share of picks within 3 % of
the best config from 90 to 92 % (seeds 0-59).
"""
from __future__ import annotations

import json
import math
import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from enum import Enum
from typing import Any, Protocol, TypeVar, Union

from scheduler.search.ceilings import Point, ceilings, firm_bounds, point, settled, torn, unsettled_readings

#: From this many readings on, a config's pooled value is their median (a straggler's or a lucky
#: reading among them moves it no more than its neighbour's); below, their mean.
MEDIAN_FROM = 3


class Ranked(Protocol):
    """A record as the ranking reads it, typed (`workers.slot.records.ExperimentRecord`, or a report's row
    of an experiment that never ran): the searches rank the records' JSON, the report their types."""

    @property
    def name(self) -> str: ...

    @property
    def status(self) -> str: ...  # `workers.in_rank.failure.Status` is a str

    @property
    def metrics(self) -> Mapping[str, Any] | None: ...

    @property
    def ds_config(self) -> Mapping[str, Any] | None: ...


#: A record the helpers below rank: its JSON or its type; `best` answers with one of those it was given.
Record = TypeVar("Record", bound=Union[Mapping[str, Any], Ranked])
K = TypeVar("K")


def _field(record: Mapping[str, Any] | Ranked, key: str) -> Any:
    """One of `Ranked`'s fields, from the record's JSON (None where it lacks the key) or its type."""
    if isinstance(record, (dict, Mapping)):  # a dict first: the searches' hot path skips the ABC's check
        return record.get(key)
    return getattr(record, key)


def metric_value(record: Mapping[str, Any] | Ranked, metric: str) -> float | None:
    """The experiment's value for `metric`, or None if it failed or did not report it."""
    if _field(record, "status") != "ok":
        return None
    value = (_field(record, "metrics") or {}).get(metric)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def pooled_value(values: Sequence[float]) -> float:
    """What a config's readings say together: their mean, or from MEDIAN_FROM readings on, their median."""
    return statistics.median(values) if len(values) >= MEDIAN_FROM else statistics.fmean(values)


def pooled_word(count: int) -> str:
    """How a summary names the pooled value of `count` readings ("mean" or "median")."""
    return "median" if count >= MEDIAN_FROM else "mean"


def best(records: Sequence[Record], metric: str, maximize: bool) -> Record | None:
    """The first record of the config with the best pooled metric (`pooled_value`), or None if none succeeded."""
    return pooled_best(records, metric, maximize)[0]


def pooled_best(records: Sequence[Record], metric: str, maximize: bool) -> tuple[Record | None, float | None, int]:
    """(the first record of the best config, its pooled metric, how many measurements it pools):
    what a summary must show, since the winner was picked on the pooled value, not on one measurement.
    A config whose stage's curve contradicts its readings is ranked, and answered, at that curve's
    prediction (`curve_ceilings`)."""
    groups: dict[str, tuple[Record, list[float]]] = {}  #: config -> (first successful record, values)
    for record in records:
        value = metric_value(record, metric)
        if value is None:
            continue
        key = config_key(record)
        if key in groups:
            groups[key][1].append(value)
        else:
            groups[key] = (record, [value])
    caps = curve_ceilings({key: (_field(record, "ds_config"), values) for key, (record, values) in groups.items()},
                          maximize)
    best_record, best_value, count = None, None, 0
    for key, (record, values) in groups.items():
        value = min(pooled_value(values), caps.get(key, math.inf))
        if best_value is None or (value > best_value if maximize else value < best_value):
            best_record, best_value, count = record, value, len(values)
    return best_record, best_value, count


def curve_ceilings(configs: Mapping[K, tuple[Mapping[str, Any] | None, Sequence[float]]],
                   maximize: bool) -> dict[K, float]:
    """key -> the value a config read more than once is ranked at when its stage's curve contradicts
    its pooled readings and they are not `settled` (`scheduler.search.ceilings`), or, settled or
    not, a `firm` dominance bound does; three readings or more that disagree, at the one nearest the
    curve (`unsettled_readings`), from each config's DeepSpeed config and readings; none for a
    metric minimised (the cost model is of seconds per sample). A config read once is left as read:
    our searches measure a leader again before naming it (`scheduler.search.confirm`), and
    `"search": "deepspeed"` keeps DeepSpeed's best single reading."""
    if not maximize:
        return {}
    points = curve_points(configs)
    caps = {key: cap for key, cap in ceilings(points).items()
            if len(configs[key][1]) >= 2 and not settled(configs[key][1])}
    for key, bound in firm_bounds(points).items():
        if len(configs[key][1]) >= 2:
            caps[key] = min(bound, caps.get(key, math.inf))
    for key, reading in unsettled_readings(points).items():
        caps[key] = min(reading, caps.get(key, math.inf))
    return caps


def curve_points(configs: Mapping[K, tuple[Mapping[str, Any] | None, Sequence[float]]]) -> list[Point]:
    """The `scheduler.search.ceilings.Point` of each config read, from its DeepSpeed config and readings."""
    points = (point(key, ds_config, pooled_value(values), not torn(values), len(values), values)
              for key, (ds_config, values) in configs.items() if values)
    return [p for p in points if p is not None]


def config_key(record: Mapping[str, Any] | Ranked) -> str:
    """The identity of a record's config: repeats of one config share it."""
    config = _field(record, "ds_config")
    if isinstance(config, dict):
        return "c:" + json.dumps(config, sort_keys=True, default=str)
    return "n:" + str(_field(record, "name"))


def status_word(record: Mapping[str, Any] | Ranked) -> str:
    """The record's status as its JSON says it ("lost" where the JSON has none)."""
    status = record.get("status", "lost") if isinstance(record, Mapping) else record.status
    return status.value if isinstance(status, Enum) else status


def status_counts(records: Sequence[Mapping[str, Any] | Ranked]) -> Counter[str]:
    return Counter(status_word(record) for record in records)
