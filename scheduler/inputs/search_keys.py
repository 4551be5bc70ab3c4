"""The `autotuning` keys that shape the search, checked once into a typed `SearchKeys`.

Why: the search reads these as typed fields (`scheduler.search.session.SearchSettings.from_config`),
never the raw section, so a bad value is refused where the config is read, as one `error:` line
naming the file and key (`ConfigError`), and the search stays free of config parsing. DeepSpeed's
defaults where DeepSpeed has the key; ours (`search`, `fast`) where it does not.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scheduler.errors import ConfigError
from scheduler.inputs.config_schema import TUNER_TYPES, shown

#: autotuning.search: our sampled search, or DeepSpeed's fast mode replayed.
SEARCHES = ("sampled", "deepspeed")


@dataclass(frozen=True)
class SearchKeys:
    """The search's keys of one config's autotuning section, with their defaults."""

    min_micro_batch_size: int = 1  #: min_train_micro_batch_size_per_gpu
    max_micro_batch_size: int = 1024  #: max_train_micro_batch_size_per_gpu
    mp_size: int = 1
    max_train_batch_size: int | None = None
    num_tuning_micro_batch_sizes: int = 3
    search: str = "sampled"
    fast: bool = True
    tuner_type: str = "gridsearch"
    tuner_num_trials: int = 50
    tuner_early_stopping: int = 5
    tuner_seed: int = 0
    #: autotuning.model_info as the schema checked it (`config_schema`): the model's size, no profile run
    model_info: Mapping[str, Any] | None = None


def parse_search_keys(path: Path, section: Mapping[str, Any]) -> SearchKeys:
    """`section` (the config's autotuning object) checked into `SearchKeys`; `path` names the file."""
    keys = SearchKeys(
        min_micro_batch_size=_positive(path, section, "min_train_micro_batch_size_per_gpu", 1),
        max_micro_batch_size=_positive(path, section, "max_train_micro_batch_size_per_gpu", 1024),
        mp_size=_positive(path, section, "mp_size", 1),
        max_train_batch_size=_positive(path, section, "max_train_batch_size", None),
        num_tuning_micro_batch_sizes=_positive(path, section, "num_tuning_micro_batch_sizes", 3),
        search=_one_of(path, section, "search", "sampled", SEARCHES),
        fast=bool(section.get("fast", True)),
        tuner_type=_one_of(path, section, "tuner_type", "gridsearch", TUNER_TYPES),
        tuner_num_trials=_positive(path, section, "tuner_num_trials", 50),
        tuner_early_stopping=non_negative_int(path, section, "tuner_early_stopping", 5),
        tuner_seed=non_negative_int(path, section, "tuner_seed", 0),
        model_info=section.get("model_info"),
    )
    if keys.min_micro_batch_size > keys.max_micro_batch_size:
        raise ConfigError(f"{path}: autotuning.min_train_micro_batch_size_per_gpu ({keys.min_micro_batch_size}) is "
                          f"above max_train_micro_batch_size_per_gpu ({keys.max_micro_batch_size}); make min <= max")
    return keys


def non_negative_int(path: Path, section: Mapping[str, Any], key: str, default: int) -> int:
    """autotuning.<key> as an int >= 0, or a ConfigError naming the file and key."""
    value = section.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{path}: autotuning.{key} must be a non-negative integer, got {json.dumps(value)}")
    return value


def positive_int(path: Path, field: str, value: Any, accepted: str = "") -> int:
    """`value` if it is an int >= 1 (JSON's true is not), else a ConfigError naming the file and field
    and showing the value as the file has it; `accepted` says what else the field takes."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{path}: {field} must be a positive integer{accepted}, got {shown(value)}")
    return value


def _positive(path: Path, section: Mapping[str, Any], key: str, default: int | None) -> Any:
    value = section.get(key, default)
    if value is None and default is None:
        return None
    return positive_int(path, f"autotuning.{key}", value)


def _one_of(path: Path, section: Mapping[str, Any], key: str, default: str, allowed: tuple[str, ...]) -> str:
    value = section.get(key, default)
    if value not in allowed:
        raise ConfigError(f"{path}: autotuning.{key} {value!r} is not one of {', '.join(allowed)}")
    return value
