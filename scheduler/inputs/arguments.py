"""The user script's argument list for one experiment, built from an immutable base.

DeepSpeed's autotuner edits one shared argument list from several threads; here every experiment
gets a fresh list. The config argument is pointed at the experiment's own config file:
`--deepspeed_config X` or `--deepspeed_config=X` wherever it is; otherwise the Hugging Face style
`--deepspeed X.json` (DeepSpeed's rule: only a next token naming a .json file is a config, since
plain `--deepspeed` is DeepSpeed's on/off switch); otherwise `--deepspeed_config X` is appended.

`autotuning.arg_mappings` serves scripts that take the batch settings as their own flags (Hugging
Face Trainer: `--per_device_train_batch_size`, `--gradient_accumulation_steps`): each mapped flag
is set to the experiment's value, again on a fresh copy of the base arguments. Its key
`activation_checkpointing` names a switch instead (`--gradient_checkpointing`): appended for an
experiment the search runs with activation checkpointing (`STRATEGY_KEY` in its config's autotuning
section lists its memory strategies), left as the user wrote it otherwise.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from scheduler.errors import ConfigError
from scheduler.inputs.memory_strategies import CHECKPOINTING_FLAG_KEY

#: The autotuning key of an experiment's config that lists the memory strategies it runs with
#: (`scheduler.search.space.experiment_config` writes it; DeepSpeed ignores autotuning keys it does not know).
STRATEGY_KEY = "memory_strategy"


def with_config(script: str, base_args: tuple[str, ...], config_path: Path) -> list[str]:
    """[script, *args] with the config argument set to `config_path`."""
    args = list(base_args)
    for index, arg in enumerate(args):
        if arg == "--deepspeed_config" and index + 1 < len(args):
            args[index + 1] = str(config_path)
            return [script, *args]
        if arg.startswith("--deepspeed_config="):
            args[index] = f"--deepspeed_config={config_path}"
            return [script, *args]
    for index, arg in enumerate(args):
        if arg.startswith("--deepspeed=") and ".json" in arg:
            args[index] = f"--deepspeed={config_path}"
            return [script, *args]
        following = args[index + 1] if index + 1 < len(args) else ""
        if arg == "--deepspeed" and ".json" in following and not following.startswith("-"):
            args[index + 1] = str(config_path)
            return [script, *args]
    return [script, *args, "--deepspeed_config", str(config_path)]


def config_argument(args: Sequence[str]) -> str | None:
    """The DeepSpeed config the script's arguments name, as DeepSpeed's autotuner finds it
    (`Autotuner._get_user_config`): `--deepspeed_config X`, else `--deepspeed X` with `.json` in X;
    the `=` forms too (`with_config` points the same argument at each experiment's config)."""
    args = list(args)
    for index, arg in enumerate(args):
        if arg == "--deepspeed_config" and index + 1 < len(args):
            return args[index + 1]
        if arg.startswith("--deepspeed_config="):
            return arg.split("=", 1)[1]
    for index, arg in enumerate(args):
        following = args[index + 1] if index + 1 < len(args) else ""
        if arg.startswith("--deepspeed=") and ".json" in arg:
            return arg.split("=", 1)[1]
        if arg == "--deepspeed" and ".json" in following and not following.startswith("-"):
            return following
    return None


def parse_arg_mappings(mappings: object, source: str) -> dict[str, str]:
    """autotuning.arg_mappings as {ds_config key (dotted for nested): script flag}, whitespace stripped."""
    if mappings is None:
        return {}
    if not isinstance(mappings, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                 for k, v in mappings.items()):
        raise ConfigError(f'{source}: autotuning.arg_mappings must map config keys to script flags, e.g. '
                          '{"train_micro_batch_size_per_gpu": "--per_device_train_batch_size"}')
    return {key.strip(): flag.strip() for key, flag in mappings.items()}


def check_arg_mappings(mappings: dict[str, str], base_args: tuple[str, ...], source: str) -> None:
    """Every mapped flag must be among the script's arguments: its value is what gets replaced (not
    the checkpointing switch, which is appended where an experiment checkpoints)."""
    missing = [flag for key, flag in mappings.items()
               if key != CHECKPOINTING_FLAG_KEY and _flag_index(list(base_args), flag) is None]
    if missing:
        raise ConfigError(f"{source}: autotuning.arg_mappings names {', '.join(missing)} but the script "
                          f"arguments {list(base_args)} do not contain {'them' if len(missing) > 1 else 'it'}; "
                          "add the flag with any value to the script arguments")


def with_mapped_args(base_args: tuple[str, ...], mappings: dict[str, str],
                     ds_config: dict[str, Any]) -> tuple[str, ...]:
    """The script arguments with each mapped flag set to the experiment's config value (a new tuple),
    and the checkpointing switch appended when the experiment checkpoints and the user did not give it."""
    args = list(base_args)
    for key, flag in mappings.items():
        if key == CHECKPOINTING_FLAG_KEY:
            if checkpoints(ds_config) and not checkpointing_given(base_args, mappings):
                args.append(flag)
            continue
        value = _lookup(ds_config, key)
        index = _flag_index(args, flag)
        if value is None or index is None:
            continue
        if args[index] == flag:
            args[index + 1] = str(value)
        else:
            args[index] = f"{flag}={value}"
    return tuple(args)


def checkpoints(ds_config: dict[str, Any]) -> bool:
    """Whether an experiment's config says it runs with activation checkpointing (`STRATEGY_KEY`)."""
    section = ds_config.get("autotuning")
    strategy = section.get(STRATEGY_KEY) if isinstance(section, dict) else None
    return isinstance(strategy, list) and "activation_checkpointing" in strategy


def checkpointing_given(base_args: Sequence[str], mappings: dict[str, str]) -> bool:
    """Whether the user's own script arguments already turn checkpointing on (the mapped switch is
    among them, alone or as `flag=value`): then every experiment checkpoints, and the search keeps it fixed."""
    flag = mappings.get(CHECKPOINTING_FLAG_KEY)
    return bool(flag) and any(arg == flag or arg.startswith(flag + "=") for arg in base_args)


def _flag_index(args: list[str], flag: str) -> int | None:
    for index, arg in enumerate(args):
        if (arg == flag and index + 1 < len(args)) or arg.startswith(flag + "="):
            return index
    return None


def _lookup(config: dict[str, Any], dotted: str) -> Any:
    value: Any = config
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value
