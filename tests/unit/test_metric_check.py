"""`metrics_problem`: metric files whose values cannot be ranked make the experiment `bad_metrics`."""
from __future__ import annotations

import math
from typing import Any

import pytest

from scheduler.search.ranking import best
from workers.in_rank.failure import Status
from workers.slot.metric_check import asked_metric, metrics_problem


@pytest.mark.parametrize(
    ("metrics", "metric", "named"),
    [
        ({"throughput": math.nan}, "throughput", '"throughput" is NaN'),
        ({"throughput": math.inf}, "throughput", '"throughput" is Infinity'),
        ({"throughput": -math.inf}, "throughput", '"throughput" is -Infinity'),
        ({"throughput": -3.5}, "throughput", '"throughput" is -3.5'),
        ({"throughput": 0}, "throughput", '"throughput" is 0'),
        ({"throughput": "fast"}, "throughput", '"throughput" is "fast", not a number'),
        ({"throughput": True}, "throughput", '"throughput" is true, not a number'),
        ({"throughput": None}, "throughput", '"throughput" is null, not a number'),
        ({"throughput": [1]}, "throughput", '"throughput" is [1], not a number'),
        ({"latency": -1.0}, "latency", '"latency" is -1.0'),
        ({"FLOPS_per_gpu": math.nan, "throughput": 5}, "FLOPS_per_gpu", '"FLOPS_per_gpu" is NaN'),
        ({"throughput": 5, "latency": math.nan}, "throughput", '"latency" is NaN'),
        ({"throughput": 5, "latency": "x"}, "throughput", '"latency" is "x"'),
        ({"throughput": 5, "FLOPS_per_gpu": -1}, "throughput", '"FLOPS_per_gpu" is -1'),
    ],
)
def test_unusable_metric_values_are_named(metrics: dict[str, Any], metric: str, named: str) -> None:
    problem = metrics_problem(metrics, "metrics.json", metric)
    assert problem is not None and named in problem and problem.startswith("metrics.json")


@pytest.mark.parametrize(
    ("metrics", "metric"),
    [
        ({"throughput": 12.5, "latency": 80000.0, "FLOPS_per_gpu": 1e12, "rank": 0}, "throughput"),
        ({"latency": 3}, "latency"),
        ({"throughput": 5, "FLOPS_per_gpu": 0}, "throughput"),  # profiler off: 0 is not an error
        ({"throughput": 5, "FLOPS_per_gpu": None}, "throughput"),
        ({"latency": 10}, "throughput"),  # the missing key is the job's one-line error, not this
    ],
)
def test_usable_metrics_pass(metrics: dict[str, Any], metric: str) -> None:
    assert metrics_problem(metrics, "metrics.json", metric) is None


@pytest.mark.parametrize(
    ("metrics", "named"),
    [
        ({"activation_mem_per_gpu": 10}, 'has no "num_params"'),
        ({"num_params": -5, "activation_mem_per_gpu": 10}, '"num_params" is -5'),
        ({"num_params": 0, "activation_mem_per_gpu": 10}, '"num_params" is 0'),
        ({"num_params": 100, "activation_mem_per_gpu": math.nan}, '"activation_mem_per_gpu" is NaN'),
        ({"num_params": 100}, 'has no "activation_mem_per_gpu"'),
        ({"num_params": "100", "activation_mem_per_gpu": 1}, '"num_params" is "100"'),
    ],
)
def test_model_info_file(metrics: dict[str, Any], named: str) -> None:
    problem = metrics_problem(metrics, "model_info.json", "throughput")
    assert problem is not None and named in problem
    assert metrics_problem({"num_params": 100, "activation_mem_per_gpu": 0}, "model_info.json", "x") is None


@pytest.mark.parametrize(
    ("ds_config", "metric"),
    [({}, "throughput"), ({"autotuning": {"metric": "flops"}}, "FLOPS_per_gpu"),
     ({"autotuning": {"metric": "latency"}}, "latency"), ({"autotuning": None}, "throughput")],
)
def test_asked_metric(ds_config: dict[str, Any], metric: str) -> None:
    assert asked_metric(ds_config) == metric


def test_bad_metrics_never_win() -> None:
    """A negative throughput recorded as bad_metrics cannot beat a real one."""
    bad = {"name": "a", "status": Status.BAD_METRICS.value, "metrics": {"throughput": -1e9}}
    good = {"name": "b", "status": "ok", "metrics": {"throughput": 3.0}}
    assert best([bad, good], "throughput", maximize=False)["name"] == "b"
    assert best([bad], "throughput", maximize=False) is None
