"""The slots' store interface (`workers.state.store.BaseSlotStore`) is what both stores implement and
what the contract tests: a method added to one store or to the interface alone fails here, before a
decision tested over the in-memory twin meets a Redis store that lacks it."""
from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from workers.state.memory_store import InMemorySlotStore
from workers.state.store import BaseSlotStore, RedisSlotStore

ROOT = Path(__file__).resolve().parents[2]
CONTRACT = ROOT / "tests" / "redis" / "test_slot_store_contract.py"
METHODS = sorted(name for name, member in vars(BaseSlotStore).items()
                 if callable(member) and not name.startswith("_"))


def test_the_interface_names_the_operations() -> None:
    assert {"live_slots", "withdrawn", "read_view", "unhealthy", "reserve", "keep", "holds", "release"} <= set(METHODS)


@pytest.mark.parametrize("store", [RedisSlotStore, InMemorySlotStore])
@pytest.mark.parametrize("name", METHODS)
def test_each_store_has_each_method_with_the_interfaces_parameters(store: type, name: str) -> None:
    wanted = list(inspect.signature(getattr(BaseSlotStore, name)).parameters.values())
    found = list(inspect.signature(getattr(store, name)).parameters.values())
    assert [(p.name, p.default) for p in found] == [(p.name, p.default) for p in wanted]


def test_the_contract_calls_every_method() -> None:
    called = {node.func.attr for node in ast.walk(ast.parse(CONTRACT.read_text()))
              if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)}
    assert sorted(set(METHODS) - called) == []
