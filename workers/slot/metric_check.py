"""Whether the metrics a training script wrote are numbers a search can rank.

Why: the metric file is the script's word, and JSON lets it say NaN, Infinity, -5 or "fast". Such a
value recorded `ok` would let a negative throughput win, and a NaN one would make the job report
"no experiment succeeded" with no cause anywhere. So rank 0's record is `bad_metrics`, with the
key and value named in its `error`: it never wins and the report says why.

Rules: the metric the config asks for (throughput, latency or FLOPS_per_gpu) must be a finite number
above 0 when present; DeepSpeed's other metric keys, when present, must be finite numbers >= 0. A file
without the asked-for key is left to the job (`scheduler.cluster.progress`): it ends with one `error:` line
naming the key, since every experiment would miss it. The model-info profile run's file must give
`num_params` as a positive number and `activation_mem_per_gpu` as a number >= 0.
"""
from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from workers.files.layout import MODEL_INFO

METRIC_KEYS = ("throughput", "latency", "FLOPS_per_gpu")
METRIC_ALIASES = {"flops": "FLOPS_per_gpu", "FLOPS": "FLOPS_per_gpu"}
MODEL_INFO_FILE = MODEL_INFO


def asked_metric(ds_config: Mapping[str, Any]) -> str:
    """The metric the experiment's config asks for (DeepSpeed's default: throughput)."""
    section = ds_config.get("autotuning")
    value = section.get("metric", "throughput") if isinstance(section, Mapping) else "throughput"
    return METRIC_ALIASES.get(value, value) if isinstance(value, str) else "throughput"


def metrics_problem(metrics: Mapping[str, Any], metric_file: str, metric: str) -> str | None:
    """What is wrong with `metrics` (read from `metric_file`), as one sentence; None when usable."""
    if metric_file == MODEL_INFO_FILE:
        return (_number_problem(metric_file, metrics, "num_params", positive=True, required=True)
                or _number_problem(metric_file, metrics, "activation_mem_per_gpu", positive=False, required=True)
                or _number_problem(metric_file, metrics, "trainable_num_params", positive=False, required=False))
    for key in (metric, *(k for k in METRIC_KEYS if k != metric)):
        problem = _number_problem(metric_file, metrics, key, positive=key == metric, required=False,
                                  allow_null=key != metric)
        if problem:
            return problem
    return None


def _number_problem(metric_file: str, metrics: Mapping[str, Any], key: str, *, positive: bool,
                    required: bool, allow_null: bool = False) -> str | None:
    if key not in metrics:
        return f"{metric_file} has no \"{key}\"" if required else None
    value = metrics[key]
    if value is None and allow_null:
        return None
    shown = _shown(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"{metric_file}: \"{key}\" is {shown}, not a number"
    if not math.isfinite(value):
        return f"{metric_file}: \"{key}\" is {shown}, not a finite number"
    if value < 0 or (positive and value == 0):
        return f"{metric_file}: \"{key}\" is {shown}; it must be {'above 0' if positive else '0 or more'}"
    return None


def _shown(value: Any) -> str:
    text = json.dumps(value)  # NaN, Infinity, -Infinity: as the file spells them
    return text if len(text) <= 60 else text[:60] + "..."
