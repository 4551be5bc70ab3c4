"""Reading the user's DeepSpeed config and its "autotuning" section into a checked `TuningConfig`.

Users bring the config they give `deepspeed --autotuning`; it must load unchanged. Every problem is
reported as one line naming the file and field and saying how to fix it (`ConfigError`), so the
command exits 2 without a traceback.

`"enabled": false` is refused: DeepSpeed's engine writes its metrics (and stops after the profiled
steps) only when it is true, and DeepSpeed's own tuner never reads it, so `deepspeed --autotuning
tune` with it false trains every experiment to its end and finds no optimum. Left out, it is
taken as true (the experiments get it set, as DeepSpeed's profile run does).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Mapping
from typing import Any

from scheduler.errors import ConfigError
from scheduler.inputs.batch_keys import BatchKeys, parse_batch_keys
from scheduler.inputs.config_file import read_config
from scheduler.inputs.config_schema import (MAX_GRADIENT_ACCUMULATION, MAX_MICRO_BATCH, check_known_keys,
                                            check_path_text, check_schema, shown)
from scheduler.inputs.full_mode import FullModeKeys, parse_full_mode
from scheduler.inputs.memory_strategies import MemoryStrategyKeys, parse_memory_strategies
from scheduler.inputs.search_keys import SearchKeys, non_negative_int, parse_search_keys, positive_int

#: Metric name -> whether bigger is better. `flops` is accepted for FLOPS_per_gpu (DeepSpeed crashes).
METRICS = {"throughput": True, "FLOPS_per_gpu": True, "latency": False}
METRIC_ALIASES = {"flops": "FLOPS_per_gpu", "FLOPS": "FLOPS_per_gpu"}
ALL_STAGES = (0, 1, 2, 3)


@dataclass(frozen=True)
class TuningConfig:
    """What to tune and how, from one config file."""

    path: Path
    ds_config: dict[str, Any]  #: the user's config as written (lists and "all" included)
    metric: str  #: throughput | latency | FLOPS_per_gpu
    micro_batch_sizes: tuple[int, ...]
    stages: tuple[int, ...]
    gradient_accumulation_steps: int
    results_dir: Path
    exps_dir: Path
    overwrite: bool
    start_profile_step: int
    end_profile_step: int
    user_script: Path | None  #: from autotuning.user_script, resolved against the config's folder
    user_args: tuple[str, ...]
    search_keys: SearchKeys = field(default_factory=SearchKeys)  #: the autotuning keys that shape the search
    batch_keys: BatchKeys = field(default_factory=BatchKeys)  #: the keys that decide the global batch kept
    full_mode: FullModeKeys = field(default_factory=FullModeKeys)  #: the zero section as full mode searches it
    memory_strategies: MemoryStrategyKeys = field(default_factory=MemoryStrategyKeys)  #: what the search may use

    @property
    def maximize(self) -> bool:
        return METRICS[self.metric]


def load_config(path: str | Path, cwd: Path | None = None) -> TuningConfig:
    """Load and check `path`; relative results/exps dirs are relative to `cwd` (DeepSpeed's rule)."""
    path = Path(path)
    return parse_config(read_config(path), path, cwd)


def parse_config(raw: dict[str, Any], path: Path, cwd: Path | None = None) -> TuningConfig:
    """Check a config already read (a control worker rebuilds a job's config this way); `path` names
    it in error messages."""
    autotuning = raw.get("autotuning")
    if not isinstance(autotuning, dict):
        raise ConfigError(f'{path}: no "autotuning" section; add "autotuning": {{"enabled": true}} '
                          "to the config to tune it")
    check_known_keys(path, autotuning)
    check_schema(path, raw)
    if autotuning.get("enabled") is False:
        raise ConfigError(f'{path}: autotuning.enabled is false, so DeepSpeed\'s engine would write no metrics '
                          "and no experiment could be measured (DeepSpeed's own tuner would train each to the "
                          'end and find no optimum); set "enabled": true (or leave it out) to tune, or train '
                          "without tuning with deepspeed itself")
    cwd = cwd or Path.cwd()
    script = autotuning.get("user_script")
    user_args = autotuning.get("user_args", [])
    if not isinstance(user_args, list) or not all(isinstance(a, (str, int, float)) and not isinstance(a, bool)
                                                  for a in user_args):
        raise ConfigError(f"{path}: autotuning.user_args must be a list of strings, e.g. "
                          '["--steps", "50"]')
    stages = _stages(path, raw.get("zero_optimization", {}))
    strategies = parse_memory_strategies(path, autotuning, stages)
    start = non_negative_int(path, autotuning, "start_profile_step", 3)
    end = non_negative_int(path, autotuning, "end_profile_step", 5)
    if start > end:
        raise ConfigError(f"{path}: autotuning.start_profile_step ({start}) is after "
                          f"end_profile_step ({end}); make start <= end")
    metric = _metric(path, autotuning.get("metric", "throughput"))
    sizes = _micro_batch_sizes(path, raw.get("train_micro_batch_size_per_gpu", 1))
    return TuningConfig(
        path=path,
        ds_config=raw,
        metric=metric,
        micro_batch_sizes=sizes,
        stages=stages,
        gradient_accumulation_steps=_bounded(path, "gradient_accumulation_steps",
                                             raw.get("gradient_accumulation_steps", 1), MAX_GRADIENT_ACCUMULATION),
        results_dir=cwd / _directory(path, autotuning, "results_dir", "autotuning_results"),
        exps_dir=cwd / _directory(path, autotuning, "exps_dir", "autotuning_exps"),
        overwrite=autotuning.get("overwrite", False) is True,
        start_profile_step=start,
        end_profile_step=end,
        user_script=(path.parent / script).resolve() if isinstance(script, str) and script else None,
        user_args=tuple(str(a) for a in user_args),
        search_keys=parse_search_keys(path, autotuning),
        batch_keys=parse_batch_keys(path, raw, sizes),
        full_mode=parse_full_mode(path, raw, stages, fast=autotuning.get("fast", True)),
        memory_strategies=strategies,
    )


def _metric(path: Path, value: Any) -> str:
    name = METRIC_ALIASES.get(value, value) if isinstance(value, str) else value
    if not isinstance(name, str) or name not in METRICS:
        raise ConfigError(f'{path}: autotuning.metric "{value}" is not one of throughput, latency, '
                          "FLOPS_per_gpu (or flops)")
    return name


def _micro_batch_sizes(path: Path, value: Any) -> tuple[int, ...]:
    values = value if isinstance(value, list) else [value]
    if not values:
        raise ConfigError(f"{path}: train_micro_batch_size_per_gpu is an empty list; give sizes such as [4, 8]")
    sizes = [_bounded(path, "train_micro_batch_size_per_gpu", v, MAX_MICRO_BATCH, " (or a list of them)")
             for v in values]
    return tuple(sorted(set(sizes)))


def _stages(path: Path, zero: Any) -> tuple[int, ...]:
    if not isinstance(zero, dict):
        raise ConfigError(f'{path}: zero_optimization must be an object such as {{"stage": 1}}')
    value = zero.get("stage", 0)
    if value == "all":
        return ALL_STAGES
    values = value if isinstance(value, list) else [value]
    if not values or any(type(v) is not int or v not in ALL_STAGES for v in values):
        raise ConfigError(f'{path}: zero_optimization.stage {json.dumps(value)} is not valid; use 0-3, '
                          'a list such as [0, 1], or "all"')
    return tuple(sorted(set(values)))


def _bounded(path: Path, field: str, value: Any, largest: int, accepted: str = "") -> int:
    value = positive_int(path, field, value, accepted)
    if value > largest:
        raise ConfigError(f"{path}: {field} must be at most {largest}, got {shown(value)}; "
                          "give a size that fits a device")
    return value


def _directory(path: Path, autotuning: dict[str, Any], key: str, default: str) -> str:
    return check_path_text(path, f"autotuning.{key}", autotuning.get(key, default))
