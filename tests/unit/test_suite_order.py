"""The order tests/conftest.py gives the suite's processes (`dealt`): each file that holds a long
test starts a share of its own while the shares' seconds allow, whole and in its own order; every
test is run once; the others keep their collection order."""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

# tests/conftest.py by its path: `import conftest` finds whichever folder's conftest pytest loaded last
_SPEC = importlib.util.spec_from_file_location("suite_conftest", Path(__file__).resolve().parents[1] / "conftest.py")
_CONFTEST = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(_CONFTEST)
dealt = _CONFTEST.dealt


@dataclass(frozen=True)
class Item:
    nodeid: str


def _items(files: dict[str, int]) -> list[Item]:
    return [Item(f"{name}.py::t{i}") for name, count in files.items() for i in range(count)]


def _shares(order: list[Item], workers: int) -> list[list[Item]]:
    """Cut as worksteal hands a collection out at the start: equal shares, in order."""
    shares, left = [], list(order)
    for share in range(workers):
        size = len(left) // (workers - share)
        shares.append(left[:size])
        left = left[size:]
    return shares


SECONDS = {"a.py::t0": 10, "c.py::t1": 100, "c.py::t2": 20, "e.py::t0": 90, "f.py::t0": 15}


def _seconds(item: Item) -> int:
    return SECONDS.get(item.nodeid, 0)


def test_the_long_files_start_the_shares_longest_first_each_whole_and_in_its_order() -> None:
    items = _items({"a": 3, "b": 10, "c": 4, "d": 10, "e": 2, "f": 1, "g": 10})
    order = dealt(items, 3, _seconds)
    assert sorted(item.nodeid for item in order) == sorted(item.nodeid for item in items)  # each test once
    heads = [[item.nodeid for item in share[:4]] for share in _shares(order, 3)]
    assert heads[0] == ["c.py::t0", "c.py::t1", "c.py::t2", "c.py::t3"]  # 120 s: a share of its own
    assert heads[1][:2] == ["e.py::t0", "e.py::t1"]  # 90 s
    assert heads[2][:1] == ["f.py::t0"] and heads[2][1:4] == ["a.py::t0", "a.py::t1", "a.py::t2"]  # 15, then 10
    # the other files fill the shares in collection order
    rest = [item.nodeid for item in order if item.nodeid.split(".")[0] in "bdg"]
    assert rest == [item.nodeid for item in items if item.nodeid.split(".")[0] in "bdg"]


def test_without_long_tests_or_with_one_process_the_order_is_the_collections_but_for_the_long_files() -> None:
    items = _items({"a": 3, "b": 5, "c": 4})
    assert dealt(items, 3, lambda item: 0) == items
    assert [item.nodeid for item in dealt(items, 1, _seconds)][:7] == [
        "c.py::t0", "c.py::t1", "c.py::t2", "c.py::t3", "a.py::t0", "a.py::t1", "a.py::t2"]
    assert dealt([], 3, _seconds) == []
