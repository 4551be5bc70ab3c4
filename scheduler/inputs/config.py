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

import difflib
import json
import math
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Mapping
from typing import Any

import hjson

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
#: The memory strategies `autotuning.memory_strategies` may allow (docs/config.md, "Memory strategies").
MEMORY_STRATEGIES = ("offload_optimizer", "offload_param", "activation_checkpointing")
#: The arg_mappings key naming the script's flag that turns activation checkpointing on.
CHECKPOINTING_FLAG_KEY = "activation_checkpointing"
#: Metric name -> whether bigger is better. `flops` is accepted for FLOPS_per_gpu (DeepSpeed crashes).
METRICS = {"throughput": True, "FLOPS_per_gpu": True, "latency": False}
METRIC_ALIASES = {"flops": "FLOPS_per_gpu", "FLOPS": "FLOPS_per_gpu"}
ALL_STAGES = (0, 1, 2, 3)

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
MAX_DEPTH = 64  #: nesting of objects/lists; DeepSpeed configs are 4 deep
MAX_CONFIG_BYTES = 16 * 2**20
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

    @property
    def maximize(self) -> bool:
        return METRICS[self.metric]


def load_config(path: str | Path, cwd: Path | None = None) -> TuningConfig:
    """Load and check `path`; relative results/exps dirs are relative to `cwd` (DeepSpeed's rule)."""
    path = Path(path)
    return parse_config(_read(path), path, cwd)


def parse_config(raw: dict[str, Any], path: Path, cwd: Path | None = None) -> TuningConfig:
    """Check a config already read (a control worker rebuilds a job's config this way); `path` names
    it in error messages."""
    autotuning = raw.get("autotuning")
    if not isinstance(autotuning, dict):
        raise ConfigError(f'{path}: no "autotuning" section; add "autotuning": {{"enabled": true}} '
                          "to the config to tune it")
    _check_known_keys(path, autotuning)
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
    _check_memory_strategies(path, autotuning, stages)
    start = non_negative_int(path, autotuning, "start_profile_step", 3)
    end = non_negative_int(path, autotuning, "end_profile_step", 5)
    if start > end:
        raise ConfigError(f"{path}: autotuning.start_profile_step ({start}) is after "
                          f"end_profile_step ({end}); make start <= end")
    return TuningConfig(
        path=path,
        ds_config=raw,
        metric=_metric(path, autotuning.get("metric", "throughput")),
        micro_batch_sizes=_micro_batch_sizes(path, raw.get("train_micro_batch_size_per_gpu", 1)),
        stages=stages,
        gradient_accumulation_steps=_positive_int(
            path, "gradient_accumulation_steps", raw.get("gradient_accumulation_steps", 1)),
        results_dir=cwd / _directory(path, autotuning, "results_dir", "autotuning_results"),
        exps_dir=cwd / _directory(path, autotuning, "exps_dir", "autotuning_exps"),
        overwrite=autotuning.get("overwrite", False) is True,
        start_profile_step=start,
        end_profile_step=end,
        user_script=(path.parent / script).resolve() if isinstance(script, str) and script else None,
        user_args=tuple(str(a) for a in user_args),
    )


def _read(path: Path) -> dict[str, Any]:
    try:
        mode = os.stat(path).st_mode
    except OSError:
        mode = None  # read_text below reports it with the usual message
    if mode is not None and not stat.S_ISDIR(mode) and not stat.S_ISREG(mode):
        raise ConfigError(f"{path}: not a regular file (a device, pipe or socket); give the path of "
                          "your DeepSpeed config file")
    if mode is not None and stat.S_ISREG(mode) and os.stat(path).st_size > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: {os.stat(path).st_size} bytes is too large for a DeepSpeed config "
                          f"(at most {MAX_CONFIG_BYTES // 2**20} MiB); check that this is the right file")
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file; give the path of your DeepSpeed config "
                          'with an "autotuning" section') from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read it ({exc.__class__.__name__}: "
                          f"{getattr(exc, 'strerror', None) or exc}); check the path and its permissions") from None
    too_deep = ConfigError(f"{path}: objects and lists are nested more than {MAX_DEPTH} levels deep; "
                           "a DeepSpeed config needs a few levels, check the file")
    try:
        data = json.loads(text, object_pairs_hook=_no_duplicate_keys(path))
    except RecursionError:
        raise too_deep from None
    except json.JSONDecodeError as json_error:
        try:
            data = hjson.loads(text, object_pairs_hook=_no_duplicate_keys(path))
        except RecursionError:
            raise too_deep from None
        except hjson.HjsonDecodeError as hjson_error:
            error = hjson_error if path.suffix == ".hjson" else json_error
            raise ConfigError(f"{path}:{error.lineno}:{error.colno}: invalid JSON/hjson: "
                              f"{error.msg}; fix the syntax there") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the config must be a JSON object {{...}}, not {type(data).__name__}")
    _check_tree(path, data)
    return json.loads(json.dumps(data))


def _check_tree(path: Path, data: Any) -> None:
    """Every value of the config: nesting depth at most MAX_DEPTH, numbers finite (JSON has no NaN)."""
    stack: list[tuple[str, Any, int]] = [("", data, 1)]
    while stack:
        where, value, depth = stack.pop()
        if isinstance(value, (dict, list)):
            if depth > MAX_DEPTH:
                raise ConfigError(f"{path}: {where or 'the config'} is nested more than {MAX_DEPTH} "
                                  "levels deep; a DeepSpeed config needs a few levels, check the file")
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                child = f"{where}.{key}" if isinstance(value, dict) else f"{where}[{key}]"
                stack.append((child.lstrip("."), item, depth + 1))
        elif isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{path}: {where} is {value}, which JSON does not allow; give a finite number")


def _no_duplicate_keys(path: Path):
    def build(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        seen: dict[str, Any] = {}
        for key, value in pairs:
            if key in seen:
                raise ConfigError(f'{path}: duplicate key "{key}"; keep one of them')
            seen[key] = value
        return seen
    return build


def _check_known_keys(path: Path, autotuning: dict[str, Any]) -> None:
    unknown = sorted(set(autotuning) - KNOWN_AUTOTUNING_KEYS)
    if unknown:
        hints = []
        for key in unknown:
            close = difflib.get_close_matches(key, KNOWN_AUTOTUNING_KEYS, n=1)
            hints.append(f'"{key}"' + (f' (did you mean "{close[0]}"?)' if close else ""))
        raise ConfigError(f"{path}: unknown autotuning key{'s' if len(unknown) > 1 else ''} "
                          f"{', '.join(hints)}; remove or rename it")


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
    sizes = [_positive_int(path, "train_micro_batch_size_per_gpu", v) for v in values]
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


def _positive_int(path: Path, field: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{path}: {field} must be a positive integer (or a list of them), "
                          f"got {shown(value)}")
    largest = MAX_MICRO_BATCH if field == "train_micro_batch_size_per_gpu" else MAX_GRADIENT_ACCUMULATION
    if value > largest:
        raise ConfigError(f"{path}: {field} must be at most {largest}, got {shown(value)}; "
                          "give a size that fits a device")
    return value


def _directory(path: Path, autotuning: dict[str, Any], key: str, default: str) -> str:
    return check_path_text(path, f"autotuning.{key}", autotuning.get(key, default))


def non_negative_int(path: Path, autotuning: Mapping[str, Any], key: str, default: int) -> int:
    """autotuning.<key> as an int >= 0, or a ConfigError naming the file and key."""
    value = autotuning.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{path}: autotuning.{key} must be a non-negative integer, got {json.dumps(value)}")
    return value


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


def _check_memory_strategies(path: Path, autotuning: Mapping[str, Any], stages: tuple[int, ...]) -> None:
    """autotuning.memory_strategies: a list of distinct names from MEMORY_STRATEGIES; parameter
    offload needs ZeRO-3 among the stages, activation checkpointing the script's flag in arg_mappings."""
    if "memory_strategies" not in autotuning:
        return
    value = autotuning["memory_strategies"]
    example = json.dumps(list(MEMORY_STRATEGIES[:1]))
    if not isinstance(value, list) or not all(isinstance(name, str) for name in value):
        raise ConfigError(f"{path}: autotuning.memory_strategies must be a list of strategy names such as "
                          f"{example} (any of {', '.join(MEMORY_STRATEGIES)}), got {shown(value)}")
    for name in value:
        if name not in MEMORY_STRATEGIES:
            close = difflib.get_close_matches(name, MEMORY_STRATEGIES, n=1)
            hint = f' (did you mean "{close[0]}"?)' if close else ""
            raise ConfigError(f"{path}: autotuning.memory_strategies names {shown(name)}{hint}, which is not one "
                              f"of {', '.join(MEMORY_STRATEGIES)}; remove or rename it")
    if len(set(value)) != len(value):
        raise ConfigError(f"{path}: autotuning.memory_strategies {shown(value)} names a strategy twice; keep one")
    if "offload_param" in value and 3 not in stages:
        raise ConfigError(f"{path}: autotuning.memory_strategies allows offload_param, which needs ZeRO-3, but "
                          f"zero_optimization.stage allows {list(stages)}; add 3 to the stages or remove offload_param")
    mappings = autotuning.get("arg_mappings")
    flag = mappings.get(CHECKPOINTING_FLAG_KEY) if isinstance(mappings, dict) else None
    if "activation_checkpointing" in value and not (isinstance(flag, str) and flag.strip()):
        raise ConfigError(f"{path}: autotuning.memory_strategies allows activation_checkpointing but "
                          f'autotuning.arg_mappings names no flag for it; add "{CHECKPOINTING_FLAG_KEY}": '
                          '"--gradient_checkpointing" (the flag your script turns checkpointing on with) to '
                          "autotuning.arg_mappings")
