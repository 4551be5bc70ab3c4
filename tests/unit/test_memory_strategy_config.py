"""`autotuning.memory_strategies` and `nvme_path` in the config: accepted shapes, and one-line refusals."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from scheduler.errors import ConfigError
from scheduler.inputs.config import load_config

FLAG = {"activation_checkpointing": "--gradient_checkpointing"}


def load(tmp_path: Path, autotuning: dict[str, Any], stage: Any = "all"):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": stage}, "autotuning": {"enabled": True, **autotuning}}))
    return path, load_config(path, cwd=tmp_path)


@pytest.mark.parametrize("autotuning", [
    {"memory_strategies": []},
    {"memory_strategies": ["offload_optimizer"]},
    {"memory_strategies": ["offload_optimizer", "offload_param"], "nvme_path": "/local_nvme"},
    {"memory_strategies": ["activation_checkpointing"], "arg_mappings": FLAG},
])
def test_allowed_strategies_load_as_written(tmp_path: Path, autotuning: dict[str, Any]) -> None:
    _, cfg = load(tmp_path, autotuning)
    assert cfg.ds_config["autotuning"]["memory_strategies"] == autotuning["memory_strategies"]
    assert set(cfg.memory_strategies.allowed) == set(autotuning["memory_strategies"])
    assert cfg.memory_strategies.nvme_path == autotuning.get("nvme_path")


def test_the_typed_keys_list_the_strategies_in_one_order(tmp_path: Path) -> None:
    _, cfg = load(tmp_path, {"memory_strategies": ["activation_checkpointing", "offload_optimizer"],
                             "arg_mappings": FLAG})
    assert cfg.memory_strategies.allowed == ("offload_optimizer", "activation_checkpointing")
    assert cfg.memory_strategies.nvme_path is None


@pytest.mark.parametrize(("autotuning", "stage", "expected"), [
    ({"memory_strategies": "offload_optimizer"}, "all",
     'autotuning.memory_strategies must be a list of strategy names such as ["offload_optimizer"] (any of '
     'offload_optimizer, offload_param, activation_checkpointing), got "offload_optimizer"'),
    ({"memory_strategies": [1]}, "all", "autotuning.memory_strategies must be a list of strategy names such as "
     '["offload_optimizer"] (any of offload_optimizer, offload_param, activation_checkpointing), got [1]'),
    ({"memory_strategies": ["offload_optimiser"]}, "all",
     'autotuning.memory_strategies names "offload_optimiser" (did you mean "offload_optimizer"?), which is not one '
     "of offload_optimizer, offload_param, activation_checkpointing; remove or rename it"),
    ({"memory_strategies": ["offload_param", "offload_param"]}, "all",
     'autotuning.memory_strategies ["offload_param", "offload_param"] names a strategy twice; keep one'),
    ({"memory_strategies": ["offload_param"]}, [1, 2],
     "autotuning.memory_strategies allows offload_param, which needs ZeRO-3, but zero_optimization.stage allows "
     "[1, 2]; add 3 to the stages or remove offload_param"),
    ({"memory_strategies": ["activation_checkpointing"]}, "all",
     "autotuning.memory_strategies allows activation_checkpointing but autotuning.arg_mappings names no flag for "
     'it; add "activation_checkpointing": "--gradient_checkpointing" (the flag your script turns checkpointing on '
     "with) to autotuning.arg_mappings"),
    ({"memory_strategies": ["offload_optimizer"], "nvme_path": ""}, "all",
     'autotuning.nvme_path must be a path (a non-empty string), got ""'),
])
def test_bad_strategies_are_one_line_refusals(tmp_path: Path, autotuning: dict[str, Any], stage: Any,
                                              expected: str) -> None:
    path = tmp_path / "ds_config.json"
    with pytest.raises(ConfigError) as caught:
        load(tmp_path, autotuning, stage)
    assert str(caught.value) == f"{path}: {expected}"
