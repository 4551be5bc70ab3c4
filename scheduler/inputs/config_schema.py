"""The strict part of the config's schema: which `autotuning` keys exist, and each known key's JSON
type and documented range (docs/command.md, "Bad input").

Apart from `scheduler.inputs.config`, which builds the `TuningConfig` from the checked values,
because these are rules over the raw JSON: a value of the wrong type is refused naming the key
where DeepSpeed would coerce it (`bool("false")` is true), so what runs is what the user meant.
"""
from __future__ import annotations

import difflib
import json
from pathlib import Path
from collections.abc import Mapping
from typing import Any

from scheduler.errors import ConfigError

TUNER_TYPES = ("gridsearch", "random", "model_based")  #: DeepSpeed's autotuning.tuner_type values

#: DeepSpeed's autotuning keys (deepspeed/autotuning/constants.py), plus ours: user_script,
#: user_args (the script, when not given after `--`), tuner_seed (random/model-based tuners),
#: search ("sampled", ours, or "deepspeed", DeepSpeed's algorithm; checked by scheduler.search.session)
#: keep_train_batch_size (keep or free the user's global batch: scheduler.search.global_batch),
#: mlflow (a tracking URI to log the job to, or false: scheduler.report.mlflow_log), memory_strategies
#: and nvme_path (the memory strategies the search may use, and where offload goes when not to the CPU:
#: scheduler.search.strategies).
KNOWN_AUTOTUNING_KEYS = frozenset({
    "enabled", "fast", "results_dir", "exps_dir", "overwrite", "start_profile_step",
    "end_profile_step", "metric", "metric_path", "tuner_type", "tuner_early_stopping",
    "tuner_num_trials", "arg_mappings", "max_train_batch_size", "min_train_batch_size",
    "min_train_micro_batch_size_per_gpu", "max_train_micro_batch_size_per_gpu",
    "num_tuning_micro_batch_sizes", "mp_size", "model_info", "model_info_path",
    "user_script", "user_args", "tuner_seed", "search", "keep_train_batch_size", "mlflow",
    "memory_strategies", "nvme_path",
})
#: Documented ranges (docs/command.md, "Bad input"): a value outside them is a typo, not a wish, and some
#: (a micro-batch of 10**30) would really be run. Upper bounds are inclusive.
MAX_MICRO_BATCH = 65536
MAX_GRADIENT_ACCUMULATION = 65536
MAX_PROFILE_STEP = 100_000
MAX_TRIALS = 10_000
MAX_MP_SIZE = 4096
MAX_TRAIN_BATCH = 2**31 - 1
MAX_SEED = 2**32 - 1
MAX_NUM_PARAMS = 10**15
MAX_ACTIVATION_BYTES = 2**50
MAX_PATH_CHARS = 4096
#: autotuning keys holding a JSON boolean; DeepSpeed reads "false" (a string) as true.
BOOLEAN_KEYS = ("enabled", "fast", "overwrite", "keep_train_batch_size")
#: autotuning key -> (smallest, largest) integer; null means "not set" only where marked in NULLABLE.
INTEGER_RANGES: dict[str, tuple[int, int]] = {
    "start_profile_step": (0, MAX_PROFILE_STEP),
    "end_profile_step": (0, MAX_PROFILE_STEP),
    "tuner_early_stopping": (0, MAX_TRIALS),
    "tuner_num_trials": (1, MAX_TRIALS),
    "tuner_seed": (0, MAX_SEED),
    "max_train_batch_size": (1, MAX_TRAIN_BATCH),
    "min_train_batch_size": (1, MAX_TRAIN_BATCH),
    "min_train_micro_batch_size_per_gpu": (1, MAX_MICRO_BATCH),
    "max_train_micro_batch_size_per_gpu": (1, MAX_MICRO_BATCH),
    "num_tuning_micro_batch_sizes": (1, 1024),
    "mp_size": (1, MAX_MP_SIZE),
}
NULLABLE = frozenset({"max_train_batch_size", "min_train_batch_size", "model_info"})
PATH_KEYS = ("results_dir", "exps_dir", "metric_path", "model_info_path", "user_script", "nvme_path")
#: autotuning.model_info field -> (smallest, largest); "profile" is a boolean.
MODEL_INFO_RANGES: dict[str, tuple[int, int]] = {
    "num_params": (1, MAX_NUM_PARAMS), "trainable_num_params": (0, MAX_NUM_PARAMS),
    "activation_mem_per_gpu": (0, MAX_ACTIVATION_BYTES), "hidden_size": (1, 2**31 - 1),
    "num_layers": (1, 2**31 - 1),
}


def check_known_keys(path: Path, autotuning: dict[str, Any]) -> None:
    """Every `autotuning` key is one of KNOWN_AUTOTUNING_KEYS, or a ConfigError naming the closest."""
    unknown = sorted(set(autotuning) - KNOWN_AUTOTUNING_KEYS)
    if unknown:
        hints = []
        for key in unknown:
            close = difflib.get_close_matches(key, KNOWN_AUTOTUNING_KEYS, n=1)
            hints.append(f'"{key}"' + (f' (did you mean "{close[0]}"?)' if close else ""))
        raise ConfigError(f"{path}: unknown autotuning key{'s' if len(unknown) > 1 else ''} "
                          f"{', '.join(hints)}; remove or rename it")


def shown(value: Any, limit: int = 60) -> str:
    """A value as JSON for an error message, cut to `limit` characters so the message stays one line."""
    try:
        text = json.dumps(value, ensure_ascii=True)
    except (TypeError, ValueError, RecursionError):
        text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def check_schema(path: Path, raw: Mapping[str, Any]) -> None:
    """The strict part of the schema: every known key has its JSON type and documented range.

    DeepSpeed coerces (`bool("false")` is true, `null` switches fast mode off); here a value of the
    wrong type is refused naming the key, so what runs is what the user meant. Keys owned by other
    modules (the search's own) are left to them.
    """
    autotuning = raw["autotuning"]
    for key in BOOLEAN_KEYS:
        if key in autotuning and not isinstance(autotuning[key], bool):
            raise ConfigError(f"{path}: autotuning.{key} must be true or false (a JSON boolean, no quotes), "
                              f"got {shown(autotuning[key])}")
    for key, (low, high) in INTEGER_RANGES.items():
        if key in autotuning and not (autotuning[key] is None and key in NULLABLE):
            _integer_in(path, f"autotuning.{key}", autotuning[key], low, high)
    for key in PATH_KEYS:
        if key in autotuning:
            check_path_text(path, f"autotuning.{key}", autotuning[key])
    if "tuner_type" in autotuning:
        if autotuning["tuner_type"] not in TUNER_TYPES:
            raise ConfigError(f"{path}: autotuning.tuner_type {shown(autotuning['tuner_type'])} is not one of "
                              f"{', '.join(TUNER_TYPES)}")
    _check_model_info(path, autotuning.get("model_info"))
    uri = autotuning.get("mlflow", False)
    if uri is not False and (not isinstance(uri, str) or not uri or any(ord(c) < 32 or ord(c) == 127 for c in uri)):
        raise ConfigError(f'{path}: autotuning.mlflow must be an MLflow tracking URI such as "http://mlflow-host:5000" '
                          f"(one line), or false to log nowhere, got {shown(uri)}")
    for section in ("fp16", "bf16"):
        value = raw.get(section)
        if value is not None and not isinstance(value, dict):
            raise ConfigError(f'{path}: {section} must be an object such as {{"enabled": true}}, got {shown(value)}')
        if isinstance(value, dict) and "enabled" in value and not (isinstance(value["enabled"], bool) or value["enabled"] == "auto"):
            raise ConfigError(f"{path}: {section}.enabled must be true, false or \"auto\", got {shown(value['enabled'])}")
    if "train_batch_size" in raw and raw["train_batch_size"] != "auto":
        _integer_in(path, "train_batch_size", raw["train_batch_size"], 1, MAX_TRAIN_BATCH)


def check_path_text(path: Path, field: str, value: Any) -> str:
    """A path given in the config: a non-empty string without control characters (a newline in a
    folder name is a mistake, and it is how settings get injected into other programs' files)."""
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{path}: {field} must be a path (a non-empty string), got {shown(value)}")
    bad = next((char for char in value if ord(char) < 32 or ord(char) == 127), None)
    if bad is not None:
        raise ConfigError(f"{path}: {field} contains the control character {bad!r}; "
                          "use a path without newlines, tabs or NUL")
    if len(value) > MAX_PATH_CHARS:
        raise ConfigError(f"{path}: {field} is {len(value)} characters long; use a path of at most "
                          f"{MAX_PATH_CHARS}")
    return value


def _integer_in(path: Path, field: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ConfigError(f"{path}: {field} must be an integer from {low} to {high}, got {shown(value)}")
    return value


def _check_model_info(path: Path, info: Any) -> None:
    if info is None:
        return
    if not isinstance(info, dict):
        raise ConfigError(f'{path}: autotuning.model_info must be an object such as {{"num_params": 1000000, '
                          f'"activation_mem_per_gpu": 4096}}, got {shown(info)}')
    if "profile" in info and not isinstance(info["profile"], bool):
        raise ConfigError(f"{path}: autotuning.model_info.profile must be true or false, got {shown(info['profile'])}")
    for key, (low, high) in MODEL_INFO_RANGES.items():
        if key in info:
            _integer_in(path, f"autotuning.model_info.{key}", info[key], low, high)
