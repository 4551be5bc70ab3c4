"""The profiled window's step times (`workers.in_rank.step_clock`): which steps count, how the metric record
becomes the window's mean, and the DeepSpeed engine hook seen through a real `workers.in_rank.entry` run
(with a stand-in engine module that steps and exits from inside step(), as DeepSpeed's does)."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from workers.in_rank.device_memory import read_exit_report
from workers.slot.rank_record import timed_metrics
from workers.slot.records import aggregate
from workers.in_rank.step_clock import wall_clock_metrics, window_seconds

ROOT = Path(__file__).resolve().parents[2]


def test_the_window_runs_from_the_first_profiled_step_to_the_metric_step() -> None:
    ends = [[step, 10.0 + step * step] for step in range(1, 9)]  # step k lasts 2k - 1 seconds
    assert window_seconds(ends, 3, 5) == [7.0, 9.0, 11.0]  # steps 4, 5, 6: exit after step 6
    assert window_seconds(ends, 1, 1) == [3.0]
    assert window_seconds(ends, 0, 0) == []  # step 1 has no predecessor to time it from


def test_steps_without_a_predecessor_or_with_a_clock_going_back_are_left_out() -> None:
    assert window_seconds([[3, 1.0], [5, 2.0], [6, 2.5]], 3, 5) == [0.5]
    assert window_seconds([[3, 1.0], [4, 0.5], [5, 1.5], [6, 2.5]], 3, 5) == [1.0, 1.0]
    assert window_seconds([], 3, 5) == []


def test_the_metric_becomes_the_window_mean_in_the_engines_units() -> None:
    engine = {"fwd": 1.0, "bwd": 2.0, "step": 0.5, "latency": 1_000_000.0, "throughput": 32.0,
              "FLOPS_per_gpu": 4e10}  # one 1.0 s last step of 32 samples
    timed = wall_clock_metrics(engine, [1.0, 2.0, 3.0])  # the window's mean step: 2.0 s
    assert timed["latency"] == pytest.approx(2_000_000.0)
    assert timed["throughput"] == pytest.approx(16.0)
    assert timed["FLOPS_per_gpu"] == pytest.approx(2e10)
    assert {key: timed[key] for key in ("fwd", "bwd", "step")} == {"fwd": 1.0, "bwd": 2.0, "step": 0.5}


@pytest.mark.parametrize("engine", [{"throughput": 5.0}, {"throughput": 5.0, "latency": 0},
                                    {"throughput": 5.0, "latency": True}])
def test_without_an_engine_latency_to_scale_from_the_metric_is_kept(engine: dict) -> None:
    assert wall_clock_metrics(engine, [1.0]) == engine
    assert wall_clock_metrics({"throughput": 5.0, "latency": 10.0}, []) == {"throughput": 5.0, "latency": 10.0}


def test_a_rank_record_carries_the_window_and_the_engines_figures() -> None:
    config = {"autotuning": {"enabled": True, "start_profile_step": 1, "end_profile_step": 2}}
    engine = {"latency": 500_000.0, "throughput": 8.0}
    fields = timed_metrics(engine, [[1, 0.0], [2, 1.0], [3, 2.0]], config)
    assert fields == {"metrics": {"latency": 1_000_000.0, "throughput": 4.0}, "engine_metrics": engine,
                      "step_seconds": [1.0, 1.0]}
    assert timed_metrics(engine, None, config) == {"metrics": engine}
    ranks = [{"rank": 0, "status": "ok", **fields}, {"rank": 1, "status": "ok"}]
    record = aggregate({"name": "z1_gas1_tmbspg4", "world_size": 2}, ranks)
    assert record["metrics"]["throughput"] == 4.0 and record["engine_metrics"] == engine
    assert record["step_seconds"] == [1.0, 1.0]


STAND_IN_ENGINE = """
    import time

    class DeepSpeedEngine:
        def __init__(self, durations, end_profile_step):
            self.global_steps, self.durations, self.end = 0, durations, end_profile_step

        def step(self):
            time.sleep(self.durations[self.global_steps])
            self.global_steps += 1
            if self.global_steps == self.end + 1:
                self._autotuning_exit()

        def _autotuning_exit(self):
            exit()
"""


def _run_entry(tmp_path: Path, body: str) -> tuple[int, dict]:
    (tmp_path / "deepspeed" / "runtime").mkdir(parents=True)
    for package in ("deepspeed", "deepspeed/runtime"):
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "deepspeed" / "runtime" / "engine.py").write_text(textwrap.dedent(STAND_IN_ENGINE))
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(body))
    report = tmp_path / "exit{rank}.json"
    done = subprocess.run([sys.executable, "-m", "workers.in_rank.entry", str(script)], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{ROOT}:{tmp_path}",
                                                      "AUTOTUNE_EXIT_REPORT": str(report), "RANK": "0"})
    assert done.returncode == 0, done.stderr
    return done.returncode, read_exit_report(tmp_path / "exit0.json")


def test_entry_times_every_step_of_a_deepspeed_engine_through_its_profiling_exit(tmp_path: Path) -> None:
    _, report = _run_entry(tmp_path, """
        from deepspeed.runtime.engine import DeepSpeedEngine
        engine = DeepSpeedEngine([0.01, 0.01, 0.01, 0.2, 0.01, 0.3], end_profile_step=5)
        while True:
            engine.step()
    """)
    assert [step for step, _ in report["step_ends"]] == [1, 2, 3, 4, 5, 6]
    durations = window_seconds(report["step_ends"], 3, 5)
    assert len(durations) == 3 and durations[0] >= 0.2 and durations[2] >= 0.3 and durations[1] < 0.15


def test_entry_times_an_engine_imported_before_the_hook_sees_it(tmp_path: Path) -> None:
    _, report = _run_entry(tmp_path, """
        import importlib, sys
        from workers.in_rank import step_clock
        sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != "_EngineImportHook"]
        engine_module = importlib.import_module("deepspeed.runtime.engine")
        assert not hasattr(engine_module.DeepSpeedEngine, "_autotune_step_clock")
        step_clock.install_deepspeed_hook()  # already imported: the class is patched at once
        engine = engine_module.DeepSpeedEngine([0.01] * 4, end_profile_step=2)
        while True:
            engine.step()
    """)
    assert [step for step, _ in report["step_ends"]] == [1, 2, 3]


class _FakeCuda:
    """torch.cuda as a rank on a GPU sees it: initialised or not; three visible devices (its gang's),
    of which its allocator uses device 1 only; synchronisations counted, and which device each was."""

    def __init__(self, initialized: bool) -> None:
        self.initialized, self.synchronized, self.devices = initialized, 0, []

    def is_initialized(self) -> bool:
        return self.initialized

    def device_count(self) -> int:
        return 3

    def memory_reserved(self, device: int) -> int:
        return 5 << 30 if device == 1 else 0

    def synchronize(self, device: int | None = None) -> None:
        self.synchronized += 1
        self.devices.append(device)


@pytest.mark.parametrize("initialized", [True, False])
def test_a_step_end_on_a_gpu_waits_for_the_device(monkeypatch: pytest.MonkeyPatch, initialized: bool) -> None:
    """Host clocks without a synchronisation time kernel launches, not steps."""
    import types

    from workers.in_rank import step_clock

    cuda = _FakeCuda(initialized)
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    monkeypatch.setattr(step_clock, "_marks", [])
    step_clock.mark(1)
    step_clock.mark(1)  # the same step noted twice (step() then the profiling exit): one wait
    step_clock.mark(2)
    assert cuda.synchronized == (2 if initialized else 0)
    assert set(cuda.devices) <= {1}  # its own device; the current one (0, a peer's GPU) is left alone
    assert [step for step, _ in step_clock.step_ends()] == [1, 2]


def test_a_plain_torch_scripts_phases_are_timed_on_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """`workers.in_rank.metrics`: each fwd/bwd/step phase begins and ends after the device
    caught up, so a phase's time is the device's, not the time to queue its kernels."""
    import types

    from workers.in_rank.metrics import AutotuningMetrics

    cuda = _FakeCuda(True)
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    metrics = AutotuningMetrics.from_ds_config({"train_micro_batch_size_per_gpu": 1}, rank=0, world_size=1)
    with metrics.timed("fwd"):
        assert cuda.synchronized == 1  # the kernels queued before the phase are not its own
    assert cuda.synchronized == 2  # nor does the phase end before its kernels have run
