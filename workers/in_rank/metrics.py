"""Autotuning metrics for training scripts that do not use DeepSpeed.

A DeepSpeed engine measures itself when its config enables ``autotuning``: it
times forward, backward and step, writes a metric file on rank 0 after optimizer
step ``end_profile_step + 1`` and exits, and in model-info mode it writes
``model_info.json`` after the first forward.  The autotuner only ever reads
those files.  A plain-torch script can take part in the same tuning run if it
produces identical files at the identical moment; this module reproduces the
engine-side semantics (DeepSpeed 0.19, ``DeepSpeedEngine._autotuning_exit`` and
``SynchronizedWallClockTimer.get_mean``) so such a script needs only a handful
of calls (on a GPU each phase is timed between device synchronisations, the
CUDA-event timing DeepSpeed's timers give, not the host's kernel-queueing time):

* ``load_ds_config`` reads ``--deepspeed_config`` the way DeepSpeed does (a file
  path or base64-encoded JSON);
* ``AutotuningMetrics`` times ``fwd``/``bwd``/``step``, counts optimizer steps
  and writes the metric file, then raises ``SystemExit(0)`` on every rank;
* ``write_model_info`` writes DeepSpeed's ``model_info.json``.

Semantics copied from DeepSpeed: ``global_steps`` counts optimizer steps, not
micro-batches; the timers are reset at every gradient-accumulation boundary, so
the reported ``fwd``, ``bwd`` and ``step`` are the 10 %-trimmed means, in
microseconds, over the micro-steps of the last optimizer step; ``latency`` is
their sum times ``gradient_accumulation_steps`` (microseconds per optimizer
step) and ``throughput = train_batch_size * 1e6 / latency`` in samples/s.
DeepSpeed measures FLOPs with its profiler; here the script supplies an
estimate per optimizer step and rank, and ``FLOPS_per_gpu`` is omitted when it
does not.

Every optimizer step's end is also noted on `workers.in_rank.step_clock`, so that under `workers.in_rank.entry`
the run's metric is its window's mean step time, as for a DeepSpeed script.

Only the standard library (and `workers.in_rank.step_clock`, which imports nothing else) is imported at module level; torch is touched only
through the model object a caller passes in, so importing this module is cheap.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

from workers.in_rank import step_clock

TIMER_NAMES = ("fwd", "bwd", "step")
DEFAULT_START_PROFILE_STEP = 3
DEFAULT_END_PROFILE_STEP = 5
DEFAULT_METRIC_FILENAME = "autotuning_metric.json"
DEFAULT_MODEL_INFO_FILENAME = "autotuning_model_info.json"
TRIM_FRACTION = 0.1


def load_ds_config(value: str) -> dict[str, Any]:
    """Returns the DeepSpeed config named by ``value``: a JSON/hjson file path or base64 JSON."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as config_file:
            return _parse_config_object(config_file.read(), f"config file {value!r}")
    text = _decode_base64(value)
    if text is not None:
        try:
            return _parse_config_object(text, "decoded base64")
        except ValueError:
            pass
    raise ValueError(
        f"DeepSpeed config {_shorten(value)} is neither an existing file nor base64-encoded JSON"
    )


def _decode_base64(value: str) -> str | None:
    """Decodes standard or URL-safe base64 (DeepSpeed's autotuner uses the latter); None if it is not."""
    standard_alphabet = value.strip().replace("-", "+").replace("_", "/")
    padded = standard_alphabet + "=" * (-len(standard_alphabet) % 4)
    try:
        return base64.b64decode(padded, validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        return None


def _parse_config_object(text: str, source: str) -> dict[str, Any]:
    try:
        config = json.loads(text)
    except json.JSONDecodeError as json_error:
        try:
            import hjson
        except ImportError:
            raise ValueError(f"{source} is not valid JSON: {json_error}") from json_error
        try:
            config = hjson.loads(text)
        except hjson.HjsonDecodeError as hjson_error:
            raise ValueError(f"{source} is not valid JSON or hjson: {hjson_error}") from hjson_error
    if not isinstance(config, dict):
        raise ValueError(f"{source} holds a {type(config).__name__}, not a JSON object")
    return config


def _shorten(value: str, limit: int = 120) -> str:
    return repr(value if len(value) <= limit else value[:limit] + "...")


@dataclass(frozen=True)
class BatchSizes:
    """DeepSpeed's three batch settings, completed from whichever ones the config gives."""

    train_batch_size: int
    micro_batch_per_gpu: int
    gradient_accumulation_steps: int

    @classmethod
    def from_ds_config(cls, config: Mapping[str, Any], world_size: int) -> BatchSizes:
        total, micro, accumulation = (
            _optional_int(config, key)
            for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
        )
        if micro is None and total is None:
            raise ValueError(
                "the DeepSpeed config sets neither train_batch_size nor train_micro_batch_size_per_gpu"
            )
        if micro is None:
            accumulation = accumulation or 1
            micro = total // world_size // accumulation
        elif accumulation is None:
            accumulation = 1 if total is None else total // micro // world_size
        if total is None:
            total = micro * accumulation * world_size
        if total != micro * accumulation * world_size or min(total, micro, accumulation) < 1:
            raise ValueError(
                f"inconsistent batch settings: train_batch_size={total}"
                f" != train_micro_batch_size_per_gpu={micro}"
                f" * gradient_accumulation_steps={accumulation} * world_size={world_size}"
            )
        return cls(total, micro, accumulation)


def _optional_int(config: Mapping[str, Any], key: str) -> int | None:
    value = config.get(key)
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise ValueError(f"{key} must be an integer, got {value!r} (tuning lists are expanded by the autotuner)")


@dataclass(frozen=True)
class AutotuningSettings:
    """The ``autotuning`` section of a DeepSpeed config, with DeepSpeed's defaults."""

    enabled: bool = False
    start_profile_step: int = DEFAULT_START_PROFILE_STEP
    end_profile_step: int = DEFAULT_END_PROFILE_STEP
    metric_path: str = DEFAULT_METRIC_FILENAME
    model_info_path: str = DEFAULT_MODEL_INFO_FILENAME
    profile_model_info: bool = False

    @classmethod
    def from_ds_config(cls, config: Mapping[str, Any]) -> AutotuningSettings:
        section = config.get("autotuning") or {}
        enabled = bool(section.get("enabled", False))
        model_info = section.get("model_info") or {}
        working_directory = os.getcwd()
        return cls(
            enabled=enabled,
            start_profile_step=int(section.get("start_profile_step", DEFAULT_START_PROFILE_STEP)),
            end_profile_step=int(section.get("end_profile_step", DEFAULT_END_PROFILE_STEP)),
            metric_path=section.get("metric_path")
            or os.path.join(working_directory, DEFAULT_METRIC_FILENAME),
            model_info_path=section.get("model_info_path")
            or os.path.join(working_directory, DEFAULT_MODEL_INFO_FILENAME),
            profile_model_info=enabled and bool(model_info.get("profile", False)),
        )


def trimmed_mean(values: list[float], trim_fraction: float = TRIM_FRACTION) -> float:
    """Mean after dropping ``round(n * trim_fraction)`` values from each end, as DeepSpeed's timers do."""
    if not values:
        return 0.0
    ordered = sorted(values)
    cut = int(round(len(ordered) * trim_fraction))
    kept = ordered[cut : len(ordered) - cut]
    return sum(kept) / len(kept)


def summarise_window(
    durations_s: Mapping[str, list[float]],
    gradient_accumulation_steps: int,
    train_batch_size: int,
    flops_per_optimizer_step: float | None = None,
) -> dict[str, float]:
    """DeepSpeed's metric record from the per-micro-step durations (seconds) of one optimizer step."""
    record: dict[str, float] = {
        name: trimmed_mean(durations_s[name]) * 1e6 for name in TIMER_NAMES if durations_s.get(name)
    }
    latency_us = sum(record.values()) * gradient_accumulation_steps
    if latency_us <= 0:
        raise ValueError("no fwd/bwd/step time was recorded during the profiled optimizer step")
    record["latency"] = latency_us
    if flops_per_optimizer_step is not None:
        record["FLOPS_per_gpu"] = flops_per_optimizer_step * 1e6 / latency_us
    record["throughput"] = train_batch_size * 1e6 / latency_us
    return record


def write_json_atomic(path: str, payload: Mapping[str, Any]) -> None:
    """Writes ``payload`` so that readers see either the old file or the complete new one."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    descriptor, temporary_path = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=directory)
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8") as temporary_file:
            json.dump(payload, temporary_file)
            temporary_file.flush()
            os.fsync(temporary_file.fileno())
        os.replace(temporary_path, path)
    except BaseException:
        if os.path.exists(temporary_path):
            os.unlink(temporary_path)
        raise


class AutotuningMetrics:
    """Engine-side autotuning bookkeeping for a training loop that is not a DeepSpeed engine.

    Per micro-step the loop times its forward, backward and step phases with
    ``timed`` (the step phase is timed on every micro-step, doing the optimizer
    step only when ``is_gradient_accumulation_boundary``), then calls
    ``end_micro_step``.  At the boundary that completes optimizer step
    ``end_profile_step + 1`` rank 0 writes the metric file and every rank
    raises ``SystemExit(0)``.  When autotuning is disabled only the step
    counters are kept.
    """

    def __init__(
        self,
        settings: AutotuningSettings,
        batch_sizes: BatchSizes,
        rank: int,
        flops_per_optimizer_step: float | None = None,
        clock: Callable[[], float] = step_clock.synchronized_now,
    ) -> None:
        self.settings = settings
        self.batch_sizes = batch_sizes
        self.rank = rank
        self.flops_per_optimizer_step = flops_per_optimizer_step
        self.clock = clock
        self.micro_steps = 0
        self.global_steps = 0
        self._window: dict[str, list[float]] = {name: [] for name in TIMER_NAMES}

    @classmethod
    def from_ds_config(
        cls,
        config: Mapping[str, Any],
        rank: int,
        world_size: int,
        flops_per_optimizer_step: float | None = None,
        clock: Callable[[], float] = step_clock.synchronized_now,
    ) -> AutotuningMetrics:
        return cls(
            AutotuningSettings.from_ds_config(config),
            BatchSizes.from_ds_config(config, world_size),
            rank,
            flops_per_optimizer_step,
            clock,
        )

    @property
    def enabled(self) -> bool:
        return self.settings.enabled

    @property
    def is_gradient_accumulation_boundary(self) -> bool:
        """True when the current micro-step is the last one before an optimizer step."""
        return (self.micro_steps + 1) % self.batch_sizes.gradient_accumulation_steps == 0

    @contextmanager
    def timed(self, name: str) -> Iterator[None]:
        """Times the enclosed block as one ``fwd``, ``bwd`` or ``step`` record of this micro-step."""
        started = self.clock()
        try:
            yield
        finally:
            self.record(name, self.clock() - started)

    def record(self, name: str, seconds: float) -> None:
        if name not in self._window:
            raise ValueError(f"unknown timer {name!r}; expected one of {TIMER_NAMES}")
        if self.enabled:
            self._window[name].append(seconds)

    def window_metrics(self) -> dict[str, float]:
        """The metric record DeepSpeed would write now (without the ``rank`` key)."""
        return summarise_window(
            self._window,
            self.batch_sizes.gradient_accumulation_steps,
            self.batch_sizes.train_batch_size,
            self.flops_per_optimizer_step,
        )

    def end_micro_step(self) -> None:
        """Advances the counters; may write the metric file and raise ``SystemExit(0)``."""
        boundary = self.is_gradient_accumulation_boundary
        self.micro_steps += 1
        if not boundary:
            return
        self.global_steps += 1
        step_clock.mark(self.global_steps)
        if self.enabled and self.global_steps == self.settings.end_profile_step + 1:
            if self.rank == 0:
                write_json_atomic(self.settings.metric_path, {**self.window_metrics(), "rank": 0})
            raise SystemExit(0)
        for durations in self._window.values():
            durations.clear()


def resident_memory_bytes() -> int:
    """This process's current resident set size, from /proc on Linux (peak RSS elsewhere)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as statm:
            resident_pages = int(statm.read().split()[1])
        return resident_pages * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import resource
        import sys

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


def write_model_info(path: str, model: Any, activation_mem_per_gpu: int) -> dict[str, int]:
    """Writes DeepSpeed's model_info.json for ``model`` (a torch.nn.Module) and returns the record."""
    parameters = list(model.parameters())
    record = {
        "num_params": sum(p.numel() for p in parameters),
        "trainable_num_params": sum(p.numel() for p in parameters if p.requires_grad),
        "activation_mem_per_gpu": int(activation_mem_per_gpu),
        "rank": 0,
    }
    write_json_atomic(path, record)
    return record
