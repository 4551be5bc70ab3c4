"""Experiments that carry memory strategies: names, configs, JSON round trips, the script's argv and
the winner's files (`scheduler.search.space`, `scheduler.inputs.arguments`)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from scheduler.inputs.arguments import check_arg_mappings, checkpointing_given, with_mapped_args
from scheduler.errors import ConfigError
from scheduler.inputs.config import load_config
from scheduler.inputs.memory_strategies import MemoryStrategyKeys
from scheduler.search.memory import TrainingSetup
from scheduler.search.session import SearchSettings, Session
from scheduler.search.space import Experiment, experiment_config, experiment_name, optimal_config

USER = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": "all"},
        "autotuning": {"enabled": True, "memory_strategies": ["offload_optimizer", "activation_checkpointing"],
                       "arg_mappings": {"activation_checkpointing": "--gradient_checkpointing",
                                        "train_micro_batch_size_per_gpu": "--bs"}}}
MAPPINGS = {"activation_checkpointing": "--gradient_checkpointing", "train_micro_batch_size_per_gpu": "--bs"}


@pytest.mark.parametrize(("strategy", "name"), [
    ((), "z3_gas2_tmbspg8"),
    (("activation_checkpointing",), "z3_gas2_tmbspg8_ac"),
    (("activation_checkpointing", "offload_param", "offload_optimizer"), "z3_gas2_tmbspg8_oo_op_ac"),
])
def test_names_get_one_suffix_per_strategy_in_a_fixed_order(strategy: tuple[str, ...], name: str) -> None:
    assert experiment_name(3, 2, 8, strategy) == name


def test_offload_strategies_write_the_sections_and_the_marker() -> None:
    config = experiment_config(USER, 3, 4, 2, 2, 1, 2, ("offload_param", "offload_optimizer"))
    zero = config["zero_optimization"]
    assert zero["offload_optimizer"] == {"device": "cpu"} and zero["offload_param"] == {"device": "cpu"}
    assert config["autotuning"]["memory_strategy"] == ["offload_optimizer", "offload_param"]
    assert "memory_strategies" not in config["autotuning"]  # ours: DeepSpeed's engine never sees it
    assert "offload_optimizer" not in USER["zero_optimization"]  # the user's config is not touched
    setup = TrainingSetup.from_ds_config(config, world_size=2)
    assert setup.offload_optimizer and setup.offload_param
    assert experiment_config(USER, 3, 4, 2, 2, 1, 2, ("offload_optimizer",), nvme_path="/nvme")[
        "zero_optimization"]["offload_optimizer"] == {"device": "nvme", "nvme_path": "/nvme"}
    plain = experiment_config(USER, 3, 4, 2, 2, 1, 2)
    assert "memory_strategy" not in plain["autotuning"] and "offload_optimizer" not in plain["zero_optimization"]


def test_the_search_settings_carry_the_configs_strategy_keys(tmp_path: Path) -> None:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({**USER, "autotuning": {**USER["autotuning"], "nvme_path": "/nvme"}}))
    settings = SearchSettings.from_config(load_config(path, cwd=tmp_path), capacity_bytes=1 << 34, num_nodes=1,
                                          num_gpus=1)
    assert settings.memory_strategies == MemoryStrategyKeys(("offload_optimizer", "activation_checkpointing"), "/nvme")
    # the search's experiments and its profile run offload where the parsed keys say
    session = Session(settings)
    for exp in (session.experiment(3, 4, 2, ("offload_optimizer", "offload_param")),
                session.profile_experiment(("offload_param",))):
        zero = exp.ds_config["zero_optimization"]
        assert [zero[name] for name in exp.strategy] == [{"device": "nvme", "nvme_path": "/nvme"}] * len(exp.strategy)


def test_a_strategy_experiment_survives_json_and_old_records_load() -> None:
    settings = SearchSettings(ds_config=USER, capacity_bytes=1 << 34, stages=(3,))
    exp = Session(settings).experiment(3, 4, 2, ("activation_checkpointing",))
    assert exp.name == "z3_gas2_tmbspg4_ac" and exp.strategy == ("activation_checkpointing",)
    again = Experiment.from_json(json.loads(json.dumps(exp.to_json())))
    assert again == exp and again.strategy == ("activation_checkpointing",)
    old = {k: v for k, v in exp.to_json().items() if k != "strategy"}
    assert Experiment.from_json(old).strategy == ()


def test_the_checkpointing_switch_is_appended_only_where_the_experiment_checkpoints() -> None:
    base = ("--bs", "1", "--steps", "5")
    checkpointed = experiment_config(USER, 1, 8, 1, 1, 1, 2, ("activation_checkpointing",))
    plain = experiment_config(USER, 1, 8, 1, 1, 1, 2)
    assert with_mapped_args(base, MAPPINGS, checkpointed) == ("--bs", "8", "--steps", "5", "--gradient_checkpointing")
    assert with_mapped_args(base, MAPPINGS, plain) == ("--bs", "8", "--steps", "5")
    fixed = (*base, "--gradient_checkpointing")  # the user's own: kept, never doubled
    assert with_mapped_args(fixed, MAPPINGS, checkpointed).count("--gradient_checkpointing") == 1
    assert checkpointing_given(fixed, MAPPINGS) and not checkpointing_given(base, MAPPINGS)
    # the winner's command is built from the tuned experiment's config; its optimal config keeps the offload
    offloaded = experiment_config(USER, 2, 8, 1, 1, 1, 2, ("offload_optimizer", "activation_checkpointing"))
    assert optimal_config(offloaded)["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}


def test_the_switch_need_not_be_among_the_script_arguments() -> None:
    check_arg_mappings(MAPPINGS, ("--bs", "1"), "cfg.json")
    with pytest.raises(ConfigError, match="--bs"):
        check_arg_mappings(MAPPINGS, ("--other", "1"), "cfg.json")
