"""The user script's argument list for one experiment, built from an immutable base.

DeepSpeed's autotuner edits one shared argument list from several threads; here every experiment
gets a fresh list. The config argument is pointed at the experiment's own config file:
`--deepspeed_config X` or `--deepspeed_config=X` wherever it is; otherwise the Hugging Face style
`--deepspeed X.json` (DeepSpeed's rule: only a next token naming a .json file is a config, since
plain `--deepspeed` is DeepSpeed's on/off switch); otherwise `--deepspeed_config X` is appended.
"""
from __future__ import annotations

from pathlib import Path


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
