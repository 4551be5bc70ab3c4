"""The `autotuning.memory_strategies` and `nvme_path` keys: which memory strategies the search may use,
checked against the config's stages and its script's flags, and typed once (`MemoryStrategyKeys`).

Apart from the schema (`scheduler.inputs.config_schema`) because the check spans keys (the ZeRO
stages, `arg_mappings`); the search reads the typed keys (`scheduler.search.strategies`), never the
raw section.
"""
from __future__ import annotations

import difflib
import json
from pathlib import Path
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from scheduler.errors import ConfigError
from scheduler.inputs.config_schema import shown

#: The memory strategies `autotuning.memory_strategies` may allow (docs/config.md, "Memory strategies").
MEMORY_STRATEGIES = ("offload_optimizer", "offload_param", "activation_checkpointing")
#: The arg_mappings key naming the script's flag that turns activation checkpointing on.
CHECKPOINTING_FLAG_KEY = "activation_checkpointing"


@dataclass(frozen=True)
class MemoryStrategyKeys:
    """The strategies one config allows the search, and where its offload goes."""

    allowed: tuple[str, ...] = ()  #: autotuning.memory_strategies, in MEMORY_STRATEGIES' order
    nvme_path: str | None = None  #: autotuning.nvme_path: offload to NVMe there, not to the CPU


def parse_memory_strategies(path: Path, autotuning: Mapping[str, Any], stages: tuple[int, ...]) -> MemoryStrategyKeys:
    """The autotuning section's strategy keys, checked (`check_memory_strategies`; nvme_path by the schema)."""
    check_memory_strategies(path, autotuning, stages)
    given = set(autotuning.get("memory_strategies") or ())
    return MemoryStrategyKeys(allowed=tuple(name for name in MEMORY_STRATEGIES if name in given),
                              nvme_path=autotuning.get("nvme_path") or None)


def check_memory_strategies(path: Path, autotuning: Mapping[str, Any], stages: tuple[int, ...]) -> None:
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
