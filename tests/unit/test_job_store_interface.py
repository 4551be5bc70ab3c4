"""The job store's interfaces (`scheduler.cluster.stores.BaseJobStore`, one job; `BaseActiveJobs`,
every active job at once) are what both stores implement and what the contracts test: a method added
to one store or to the interface alone fails here, before a decision tested over the in-memory twin
meets a Redis store that lacks it."""
from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from scheduler.cluster.dispatch_reads import RedisActiveJobs
from scheduler.cluster.job_store import JobStore
from scheduler.cluster.memory_store import InMemoryActiveJobs, InMemoryJobStore
from scheduler.cluster.stores import BaseActiveJobs, BaseJobStore

ROOT = Path(__file__).resolve().parents[2]
CONTRACT = ROOT / "tests" / "redis" / "test_job_store_contract.py"
METHODS = sorted(name for name, member in vars(BaseJobStore).items()
                 if callable(member) and not name.startswith("_"))


def test_the_interface_names_the_operations() -> None:
    assert len(METHODS) >= 30 and {"start", "finish", "requeue", "misfit_since", "step_reads"} <= set(METHODS)


@pytest.mark.parametrize("store", [JobStore, InMemoryJobStore])
@pytest.mark.parametrize("name", METHODS)
def test_each_store_has_each_method_with_the_interfaces_parameters(store: type, name: str) -> None:
    """The same parameters, in the same order, with the same defaults; the Redis store may take more
    after them, each with a default (`pipe`: a pipeline of the caller's)."""
    wanted = list(inspect.signature(getattr(BaseJobStore, name)).parameters.values())
    found = list(inspect.signature(getattr(store, name)).parameters.values())
    assert [(p.name, p.default) for p in found[:len(wanted)]] == [(p.name, p.default) for p in wanted]
    assert all(p.default is not inspect.Parameter.empty for p in found[len(wanted):])


def test_the_contract_calls_every_method() -> None:
    called = {node.func.attr for node in ast.walk(ast.parse(CONTRACT.read_text()))
              if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)}
    assert sorted(set(METHODS) - called) == []


ACROSS_JOBS = sorted(name for name, member in vars(BaseActiveJobs).items()
                     if callable(member) and not name.startswith("_"))
ACROSS_CONTRACT = ROOT / "tests" / "redis" / "test_active_jobs_contract.py"


@pytest.mark.parametrize("store", [RedisActiveJobs, InMemoryActiveJobs])
@pytest.mark.parametrize("name", ACROSS_JOBS)
def test_each_store_of_the_active_jobs_has_each_method_with_the_interfaces_parameters(store: type, name: str) -> None:
    """What a dispatch pass calls across jobs (`stores.BaseActiveJobs`), the same on both stores."""
    wanted = list(inspect.signature(getattr(BaseActiveJobs, name)).parameters.values())
    found = list(inspect.signature(getattr(store, name)).parameters.values())
    assert [(p.name, p.default) for p in found] == [(p.name, p.default) for p in wanted]


def test_the_active_jobs_contract_calls_every_method() -> None:
    called = {node.func.attr for node in ast.walk(ast.parse(ACROSS_CONTRACT.read_text()))
              if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)}
    assert len(ACROSS_JOBS) >= 8 and sorted(set(ACROSS_JOBS) - called) == []
