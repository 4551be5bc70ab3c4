"""The user script's argument list for one experiment, built from an immutable base.

DeepSpeed's autotuner edits one shared argument list from several threads; here every experiment
gets a fresh list. The config argument (`--deepspeed_config X`, `--deepspeed_config=X`, or the
Hugging Face style `--deepspeed X`) is pointed at the experiment's own config file, or appended
when the script was given none.
"""
from __future__ import annotations

from pathlib import Path

CONFIG_FLAGS = ("--deepspeed_config", "--deepspeed")


def with_config(script: str, base_args: tuple[str, ...], config_path: Path) -> list[str]:
    """[script, *args] with the config argument set to `config_path`."""
    args = list(base_args)
    for index, arg in enumerate(args):
        for flag in CONFIG_FLAGS:
            if arg == flag and index + 1 < len(args):
                args[index + 1] = str(config_path)
                return [script, *args]
            if arg.startswith(flag + "="):
                args[index] = f"{flag}={config_path}"
                return [script, *args]
    return [script, *args, "--deepspeed_config", str(config_path)]
