"""Where an experiment's seconds go: the rank's phases from its own clocks, the
summary's start-up share and the timeline's hatched start-up."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from scheduler.report.plot import startup_of
from scheduler.report.rows import cancelled_record
from scheduler.report.startup import startup_summary, startup_text
from scheduler.search.space import Experiment
from workers.in_rank.device_memory import read_exit_report
from workers.slot.records import ExperimentRecord
from workers.slot.timeline import launch_timeline, rank_timeline, startup_share

ROOT = Path(__file__).resolve().parents[2]


def test_the_phases_are_seconds_since_the_launch_in_order() -> None:
    moments = {"up": 101.0, "imports": 103.5, "engine": 106.0, "clock_offset": 1000.0}
    steps = [[1, -893.0], [2, -892.0], [3, -891.5]]  # perf_counter + 1000 = 107, 108, 108.5
    timeline = rank_timeline(100.0, 110.0, moments, steps, start_profile_step=1, end_profile_step=1)
    assert timeline == {"launched": 0.0, "up": 1.0, "imports": 3.5, "engine": 6.0, "first_step": 7.0,
                        "window_start": 7.0, "window_end": 8.0, "ended": 10.0}


def test_moments_not_noted_or_outside_the_launch_are_left_out() -> None:
    timeline = rank_timeline(100.0, 110.0, {"up": 99.0, "engine": 250.0}, [], 1, 1)
    assert timeline == {"launched": 0.0, "ended": 10.0}
    # a window the steps do not cover (the rank died in step 2) has no window marks
    partial = rank_timeline(100.0, 110.0, {"clock_offset": 100.0}, [[1, 5.0]], 1, 1)
    assert partial == {"launched": 0.0, "first_step": 5.0, "ended": 10.0}


def test_the_window_is_the_one_the_config_sets() -> None:
    steps = [[step, float(step)] for step in range(1, 8)]
    timeline = launch_timeline(0.0, 20.0, {"clock_offset": 10.0}, steps,
                               {"autotuning": {"start_profile_step": 3, "end_profile_step": 5}})
    assert (timeline["window_start"], timeline["window_end"]) == (13.0, 16.0)


def test_the_start_up_share_is_what_the_profiled_steps_do_not_explain() -> None:
    assert startup_share(10.0, 1.5e6, end_profile_step=1) == pytest.approx(0.7)
    assert startup_share(0.0, 1.5e6, 1) is None and startup_share(10.0, None, 1) is None


def _record(name: str, wall: float, latency_us: float, readies: list[float], path: str = "cold") -> ExperimentRecord:
    return ExperimentRecord.from_json({"name": name, "status": "ok", "wall_s": wall, "started_at": 50.0, "metrics": {"latency": latency_us},
            "ds_config": {"autotuning": {"start_profile_step": 1, "end_profile_step": 1}},
            "ranks": [{"rank": r, "started_at": 50.0 + r, "start_path": path,
                       "timeline": {"launched": 0.0, "engine": ready}} for r, ready in enumerate(readies)]})


def test_the_summary_gives_the_jobs_medians_and_the_slowest_ranks_start_up() -> None:
    records = [_record("a", 10.0, 1e6, [6.0, 7.0]), _record("b", 20.0, 2e6, [12.0], "warm"),
               _record("c", 4.0, 1e6, [1.0]),
               ExperimentRecord.from_json({"name": "d", "status": "oom", "metrics": None, "wall_s": 3.0})]
    summary = startup_summary(records)
    assert summary == {"measured": 3, "startup_share": pytest.approx(0.8), "startup_s": 7.0,
                       "ranks_warm": 1, "ranks_cold": 3}
    assert "0.80 of an experiment's wall" in startup_text(records) and "7.0 s from launch" in startup_text(records)
    assert startup_text([records[-1]]) == ""


def test_the_timeline_hatches_up_to_the_slowest_ranks_engine() -> None:
    assert startup_of(_record("a", 10.0, 1e6, [6.0, 7.0])) == 8.0  # rank 1 launched 1 s later
    assert startup_of(ExperimentRecord.from_json(
        {"name": "b", "started_at": 1.0, "ranks": [{"started_at": 1.0, "timeline": {"launched": 0.0}}]})) is None
    cut_off = cancelled_record(Experiment("c", 0, 1, 1, {}), {"started": 1.0, "queues": ["n.gpu0"]}, 9.0)
    assert startup_of(cut_off) is None  # an experiment an interrupt cut off recorded no rank


def test_a_rank_notes_when_it_was_up_had_deepspeed_and_its_engine(tmp_path: Path) -> None:
    """The clocks a real rank has: workers.in_rank.entry's start, the engine module's import and the engine's
    build (workers.in_rank.step_clock's hook, on a stand-in DeepSpeed), and its steps."""
    (tmp_path / "deepspeed" / "runtime").mkdir(parents=True)
    for package in ("deepspeed", "deepspeed/runtime"):
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "deepspeed" / "runtime" / "engine.py").write_text(textwrap.dedent("""
        import time
        time.sleep(0.3)  # an import that takes a while
        class DeepSpeedEngine:
            def __init__(self):
                time.sleep(0.4)
                self.global_steps = 0
            def step(self):
                time.sleep(0.2)
                self.global_steps += 1
    """))
    script = tmp_path / "train.py"
    script.write_text("from deepspeed.runtime.engine import DeepSpeedEngine\n"
                      "engine = DeepSpeedEngine()\nfor _ in range(3):\n    engine.step()\n")
    launched = time.time()
    done = subprocess.run([sys.executable, "-m", "workers.in_rank.entry", str(script)], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{ROOT}:{tmp_path}",
                                                      "AUTOTUNE_EXIT_REPORT": str(tmp_path / "exit.json")})
    assert done.returncode == 0, done.stderr
    report = read_exit_report(tmp_path / "exit.json")
    timeline = rank_timeline(launched, time.time(), report["moments"], report["step_ends"], 1, 1)
    assert list(timeline) == ["launched", "up", "imports", "engine", "first_step", "window_start", "window_end",
                              "ended"]
    assert timeline["imports"] - timeline["up"] >= 0.3 - 0.002  # rounded to the millisecond
    assert timeline["engine"] - timeline["imports"] >= 0.4 - 0.002
    assert timeline["window_end"] - timeline["window_start"] >= 0.2 - 0.002
