"""The wall time of every optimizer step in the profiled window, measured inside the rank.

Why: DeepSpeed's autotuning metric is not a mean over the profiled steps. Its timers are reset at
every gradient-accumulation boundary, so the metric file holds the forward, backward and step times
of the *last* optimizer step only (`workers.in_rank.metrics` reproduces that). One step is one draw: on the
2-core machine ZeRO-0's steps of train_gpt.py alternate between ~1.0 s and 1.5-3 s while ZeRO-1's
stay at ~0.8 s, so a lucky last step made ZeRO-0 the winner of a tuning run whose real run trained
at half the speed. What a real run pays is the mean step time, the
time between optimizer steps with data loading and everything else included.

So `workers.in_rank.entry` installs `install_deepspeed_hook` before the user's script runs: when DeepSpeed's
engine module is imported, its `step` and `_autotuning_exit` are wrapped to note the moment each
optimizer step ends (`mark`), and the exit report carries those moments (`step_ends`). A script
that does not use DeepSpeed takes part through `workers.in_rank.metrics`, which marks its own steps. The
rank then turns the moments into the window's step times (`window_seconds`: the steps DeepSpeed's
profiler covers, from the first profiled step to the one after which the metric file is written)
and the metric record into wall-clock figures (`wall_clock_metrics`). The two pure functions have
no I/O and are tested directly. The same hook also tells `workers.in_rank.device_memory` when an engine has
been built (its `__init__` is wrapped too), so the build's memory transient stays out of the
training peak, and notes (`note`) when DeepSpeed finished importing and when the engine was ready:
with `workers.in_rank.entry`'s own "up" these are the rank's start-up phases (`workers.slot.timeline`).
"""
from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
import time
from types import ModuleType
from typing import Any, Mapping, Sequence

from workers.in_rank.device_memory import start_training_peak

#: Moments kept at most (the window is a handful of steps; a long run without autotuning keeps its
#: latest ones only).
MAX_MARKS = 256
ENGINE_MODULE = "deepspeed.runtime.engine"

_marks: list[tuple[int, float]] = []
_moments: dict[str, float] = {}


def note(moment: str) -> None:
    """Notes the wall-clock time of a start-up moment ("up", "imports", "engine"); the first wins
    (a script that builds two engines is ready with its first)."""
    _moments.setdefault(moment, time.time())


def moments() -> dict[str, float]:
    """The noted start-up moments, and `clock_offset`: what turns a `step_ends` moment (the
    process's `time.perf_counter`) into wall-clock time, so a rank's steps and its start-up sit on
    the launcher's clock."""
    return {**{name: round(at, 6) for name, at in _moments.items()},
            "clock_offset": round(time.time() - time.perf_counter(), 6)}


def mark(global_step: int) -> None:
    """Notes that optimizer step ``global_step`` (1 for the first) has just ended."""
    if _marks and _marks[-1][0] == global_step:
        return
    _synchronize_cuda()
    _marks.append((int(global_step), time.perf_counter()))
    del _marks[:-MAX_MARKS]


def synchronized_now() -> float:
    """The host clock once the device has finished what the host queued (`time.perf_counter` where
    CUDA is not in use): a phase timed between two of these readings is the device's time for it, as
    DeepSpeed's CUDA-event timers measure, not the time the host took to queue its kernels."""
    _synchronize_cuda()
    return time.perf_counter()


def _synchronize_cuda() -> None:
    """On a GPU the host queues kernels ahead of the device: without a synchronisation the moment a
    step "ends" on the host clock can precede the device's work by up to a queue of kernels, so
    the window's step times would be the launch times (DeepSpeed's own timers use CUDA events).
    Once per optimizer step, after the optimizer's kernels are queued: the cost is the wait the
    next step would have paid anyway. Each device this process's allocator holds memory on, not
    `torch.cuda.synchronize()`'s current device: a plain DDP script that moves its model to
    `LOCAL_RANK` without `set_device` keeps device 0 current, a gang peer's GPU, where a synchronize
    would open a CUDA context (hundreds of MiB) and wait on the wrong device."""
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is not None and cuda.is_initialized():
        for device in range(cuda.device_count()):
            if cuda.memory_reserved(device):  # a device this process uses: its own, not the current one
                cuda.synchronize(device)


def step_ends() -> list[list[float]]:
    """The noted moments as [[global_step, seconds], ...] (seconds on one process-local clock)."""
    return [[step, round(moment, 6)] for step, moment in _marks]


def install_deepspeed_hook() -> None:
    """Marks the end of every optimizer step of DeepSpeed engines created from now on: patches the
    engine class at once when DeepSpeed is already imported, else when it is (nothing is imported
    here, so a script without DeepSpeed pays nothing)."""
    module = sys.modules.get(ENGINE_MODULE)
    if module is not None:  # imported before the script ran (a warm start, workers.warm.warm_start)
        _patch_engine(module)
        note("imports")
    elif not any(isinstance(finder, _EngineImportHook) for finder in sys.meta_path):
        sys.meta_path.insert(0, _EngineImportHook())


class _EngineImportHook(importlib.abc.MetaPathFinder):
    """Finds DeepSpeed's engine module as the path finder would and patches it once it has run."""

    def find_spec(self, fullname: str, path: Any = None, target: ModuleType | None = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if fullname != ENGINE_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        run_module = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run_module(module)
            _patch_engine(module)
            note("imports")  # `import deepspeed` imports the engine: DeepSpeed is in

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _patch_engine(module: ModuleType) -> None:
    engine = getattr(module, "DeepSpeedEngine", None)
    if engine is None or getattr(engine, "_autotune_step_clock", False):
        return
    step, autotuning_exit = getattr(engine, "step", None), getattr(engine, "_autotuning_exit", None)
    build = engine.__init__

    @functools.wraps(build)
    def built(self: Any, *args: Any, **kwargs: Any) -> None:
        build(self, *args, **kwargs)
        note("engine")
        start_training_peak()  # the build's transient is not training's peak (workers.in_rank.device_memory)

    engine.__init__ = built
    if step is not None:
        @functools.wraps(step)
        def timed_step(self: Any, *args: Any, **kwargs: Any) -> Any:
            before = getattr(self, "global_steps", None)
            result = step(self, *args, **kwargs)
            after = getattr(self, "global_steps", None)
            if isinstance(after, int) and after != before:
                mark(after)
            return result

        engine.step = timed_step
    if autotuning_exit is not None:
        @functools.wraps(autotuning_exit)
        def timed_exit(self: Any, *args: Any, **kwargs: Any) -> Any:
            # The engine exits from inside step(), after the step that completes the window.
            if isinstance(getattr(self, "global_steps", None), int):
                mark(self.global_steps)
            return autotuning_exit(self, *args, **kwargs)

        engine._autotuning_exit = timed_exit
    engine._autotune_step_clock = True


def window_seconds(ends: Sequence[Sequence[float]], start_profile_step: int,
                   end_profile_step: int) -> list[float]:
    """Durations of optimizer steps start_profile_step + 1 .. end_profile_step + 1: the step the
    engine profiles first through the step after which it writes the metric file. A step's
    duration is the time from the end of the step before it; a step whose predecessor was not
    noted (or a clock that went backwards) is left out."""
    moment = {int(step): float(at) for step, at in ends}
    durations = []
    for step in range(start_profile_step + 1, end_profile_step + 2):
        if step in moment and step - 1 in moment and moment[step] > moment[step - 1]:
            durations.append(moment[step] - moment[step - 1])
    return durations


def wall_clock_metrics(metrics: Mapping[str, Any], durations: Sequence[float]) -> dict[str, Any]:
    """The metric record with latency, throughput and FLOPS_per_gpu taken from the mean step time
    over ``durations`` instead of the engine's last step. The engine's units are kept: latency in
    microseconds per optimizer step (DeepSpeed defines throughput = train_batch_size * 1e6 /
    latency), so throughput and FLOPS_per_gpu scale by engine latency / measured latency.
    Unchanged when there is no duration or no positive engine latency to scale from."""
    engine_latency_us = metrics.get("latency")
    if not durations or isinstance(engine_latency_us, bool) or not isinstance(engine_latency_us, (int, float)) \
            or engine_latency_us <= 0:
        return dict(metrics)
    latency_us = sum(durations) / len(durations) * 1e6
    scale = engine_latency_us / latency_us
    corrected = dict(metrics, latency=latency_us)
    for key in ("throughput", "FLOPS_per_gpu"):
        value = metrics.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            corrected[key] = value * scale
    return corrected
