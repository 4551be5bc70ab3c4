"""A large predicted top is probed at a multiple of 8 (`stage_space.ALIGN`), only where no step limit
fixes the sizes."""
from __future__ import annotations

from dataclasses import replace

import pytest

from scheduler.search import stage_space
from scheduler.search.memory import GiB, MemoryModel, ModelInfo
from scheduler.search.session import Session
from tests.unit.test_sampled_search import sampled


def _top(monkeypatch: pytest.MonkeyPatch, predicted: int, ran: int | None = None, **changes: object) -> int:
    session = Session(replace(sampled(), **changes))
    session.model = MemoryModel(ModelInfo(10**8, 10**8, 10**6), session.settings.setup, GiB)
    monkeypatch.setattr(session, "predicted_max", lambda *args, **kwargs: predicted)
    if ran is not None:
        exp = session.experiment(1, ran, 1)
        session.measured[exp.name] = (exp, {"name": exp.name, "status": "ok", "metrics": {"throughput": 1.0}})
    return stage_space.stage_top(session, 1)


def test_a_large_predicted_top_is_probed_at_the_multiple_of_8_below_it(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _top(monkeypatch, 300, max_train_batch_size=None) == 296
    assert _top(monkeypatch, 296, max_train_batch_size=None) == 296


def test_a_small_top_or_one_a_step_limit_fixes_is_left_as_predicted(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _top(monkeypatch, 127, max_train_batch_size=None) == 127
    assert _top(monkeypatch, 300, max_train_batch_size=4096) == 300


def test_the_aligned_top_never_falls_below_a_size_that_ran(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _top(monkeypatch, 300, ran=299, max_train_batch_size=None) == 299
