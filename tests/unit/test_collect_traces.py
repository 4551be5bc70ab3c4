"""bench/collect_traces.py --add-to: a top-up from a machine that trains at another speed would bias
exactly the configs it adds launches to, so it checks the machine first (the launches are faked here:
what is tested is the decision, not DeepSpeed)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import collect_traces


def _launch(throughput: float) -> dict:
    return {"status": "ok", "peak_rss_bytes": 0, "readings": [{"step_seconds": [1.0], "throughput": throughput,
                                                                "engine_throughput": throughput}]}


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({
        "script": "examples/train_gpt.py", "script_args": ["--steps", "50"], "threads_per_rank": 1,
        "configs": [{"stage": 1, "mbs": 16, "gas": 1, "launches": [_launch(50.0), _launch(52.0)]},
                    {"stage": 0, "mbs": 4, "gas": 4, "launches": [_launch(48.0)]},
                    {"stage": 0, "mbs": 1, "gas": 1, "launches": [_launch(20.0)]}]}))
    return path


def _fake_machine(monkeypatch: pytest.MonkeyPatch, speed: float) -> list[tuple[int, int, int]]:
    launched = []

    def trace_config(work, stage, mbs, gas, *args):
        launched.append((stage, mbs, gas))
        return _launch({(1, 16, 1): 51.0, (0, 4, 4): 48.0, (0, 1, 1): 20.0}[(stage, mbs, gas)] * speed)

    monkeypatch.setattr(collect_traces, "trace_config", trace_config)
    return launched


def test_a_machine_at_half_the_traces_speed_tops_nothing_up(trace, monkeypatch, capsys) -> None:
    before = trace.read_text()
    launched = _fake_machine(monkeypatch, 0.5)
    assert collect_traces.top_up(trace, 0.10, 2) == 2
    assert launched == [(1, 16, 1)]  # the speed check only
    assert trace.read_text() == before
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"error: --add-to {trace}: this machine trains the trace's best config at 0.50x")


def test_a_machine_at_the_traces_speed_tops_up_the_configs_near_the_best(trace, monkeypatch) -> None:
    launched = _fake_machine(monkeypatch, 1.05)
    assert collect_traces.top_up(trace, 0.10, 2) == 0
    assert launched == [(1, 16, 1), (1, 16, 1), (0, 4, 4), (1, 16, 1), (0, 4, 4)]  # check, then 2 rounds
    configs = json.loads(trace.read_text())["configs"]
    assert [len(c["launches"]) for c in configs] == [4, 3, 1]  # the far config keeps its one launch
