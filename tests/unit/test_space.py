"""The search space (`scheduler.search.space`) and the script's argument list (`scheduler.inputs.arguments`)."""
from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from scheduler.inputs.arguments import with_config
from scheduler.inputs.config import load_config
from scheduler.search.space import Experiment, experiment_config, experiment_name, optimal_config

# ---------------------------------------------------------------- names


@pytest.mark.parametrize(
    ("stage", "gas", "mbs", "name"),
    [(0, 1, 1, "z0_gas1_tmbspg1"), (3, 4, 16, "z3_gas4_tmbspg16"), (2, 16, 128, "z2_gas16_tmbspg128")],
)
def test_experiment_name(stage: int, gas: int, mbs: int, name: str) -> None:
    assert experiment_name(stage, gas, mbs) == name


@pytest.mark.parametrize(
    ("num_nodes", "num_gpus", "world", "stage", "space"),
    [(1, 1, 1, 0, "z0"), (1, 4, 4, 3, "z3"), (2, 8, 16, 1, "z1")],
)
def test_experiment_world_size_and_space(num_nodes: int, num_gpus: int, world: int, stage: int, space: str) -> None:
    exp = Experiment("n", stage, 1, 1, {}, num_nodes=num_nodes, num_gpus=num_gpus)
    assert exp.world_size == world
    assert exp.space == space


# ---------------------------------------------------------------- user list


def tuning_config(tmp_path: Path, data: dict[str, Any]):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(data))
    return load_config(path, cwd=tmp_path)


USER_CONFIG: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": [8, 2, 4, 2],
    "gradient_accumulation_steps": 3,
    "zero_optimization": {"stage": [3, 1], "overlap_comm": True, "reduce_bucket_size": 5e8},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
    "fp16": {"enabled": True},
    "autotuning": {
        "enabled": True, "metric": "latency", "start_profile_step": 2, "end_profile_step": 7,
        "user_script": "train.py", "user_args": ["--steps", "10"], "results_dir": "res",
        "exps_dir": "exps", "overwrite": True, "fast": False,
    },
}


def _configs(cfg, dp_size: int) -> dict[tuple[int, int], dict[str, Any]]:
    return {(stage, mbs): experiment_config(cfg.ds_config, stage, mbs, cfg.gradient_accumulation_steps,
                                            dp_size, cfg.start_profile_step, cfg.end_profile_step)
            for stage in cfg.stages for mbs in cfg.micro_batch_sizes}


@pytest.mark.parametrize(
    ("dp_size", "mbs", "train_batch_size"),
    [(1, 2, 6), (2, 4, 24), (8, 8, 192)],  # mbs * gas(3) * data-parallel ranks
)
def test_experiment_ds_config(tmp_path: Path, dp_size: int, mbs: int, train_batch_size: int) -> None:
    cfg = tuning_config(tmp_path, USER_CONFIG)
    configs = _configs(cfg, dp_size)
    for stage in (1, 3):
        ds = configs[(stage, mbs)]
        assert ds["train_micro_batch_size_per_gpu"] == mbs
        assert ds["gradient_accumulation_steps"] == 3
        assert ds["train_batch_size"] == train_batch_size
        assert ds["zero_optimization"] == {"stage": stage, "overlap_comm": True, "reduce_bucket_size": 5e8}
        assert ds["optimizer"] == {"type": "AdamW", "params": {"lr": 1e-4}}
        assert ds["fp16"] == {"enabled": True}
        assert ds["autotuning"] == {
            "enabled": True, "metric": "latency", "start_profile_step": 2, "end_profile_step": 7,
            "overwrite": True, "fast": False,
        }
        for ours in ("user_script", "user_args", "results_dir", "exps_dir"):
            assert ours not in ds["autotuning"]


def test_experiment_configs_own_the_sections_they_pin(tmp_path: Path) -> None:
    """The sections an experiment sets (top level, zero_optimization, autotuning) are its own; the
    others are the user's objects, shared read-only rather than deep-copied thousands of times."""
    cfg = tuning_config(tmp_path, USER_CONFIG)
    configs = _configs(cfg, 1)
    configs[(1, 2)]["zero_optimization"]["overlap_comm"] = False
    configs[(1, 2)]["autotuning"]["metric_path"] = "/elsewhere"
    configs[(1, 2)]["gradient_accumulation_steps"] = 99
    assert configs[(1, 4)]["zero_optimization"]["overlap_comm"] is True
    assert cfg.ds_config["zero_optimization"]["overlap_comm"] is True
    assert "metric_path" not in configs[(1, 4)]["autotuning"] and "metric_path" not in cfg.ds_config["autotuning"]
    assert cfg.ds_config["gradient_accumulation_steps"] != 99
    assert configs[(1, 4)]["optimizer"] is cfg.ds_config["optimizer"]


def test_user_config_not_mutated(tmp_path: Path) -> None:
    cfg = tuning_config(tmp_path, USER_CONFIG)
    before = copy.deepcopy(cfg.ds_config)
    assert len(_configs(cfg, 4)) == 6
    assert cfg.ds_config == before
    assert cfg.ds_config["autotuning"]["user_script"] == "train.py"
    assert cfg.ds_config["zero_optimization"]["stage"] == [3, 1]
    assert cfg.ds_config["train_micro_batch_size_per_gpu"] == [8, 2, 4, 2]
    assert "train_batch_size" not in cfg.ds_config


def test_experiment_config_direct() -> None:
    user = {"zero_optimization": None, "autotuning": {"enabled": False, "exps_dir": "e"}}
    snapshot = copy.deepcopy(user)
    config = experiment_config(user, stage=2, mbs=5, gas=2, dp_size=3, start_profile_step=1,
                               end_profile_step=4)
    assert config == {
        "zero_optimization": {"stage": 2},
        "autotuning": {"enabled": True, "start_profile_step": 1, "end_profile_step": 4},
        "train_micro_batch_size_per_gpu": 5,
        "gradient_accumulation_steps": 2,
        "train_batch_size": 30,
    }
    assert user == snapshot


# ---------------------------------------------------------------- optimal config


def test_optimal_config_drops_autotuning_and_keeps_the_rest() -> None:
    ds = {
        "train_micro_batch_size_per_gpu": 4,
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True}},
        "autotuning": {"enabled": True, "start_profile_step": 3, "end_profile_step": 5},
    }
    snapshot = copy.deepcopy(ds)
    optimal = optimal_config(ds)
    assert optimal == {
        "train_micro_batch_size_per_gpu": 4,
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True}},
    }
    assert ds == snapshot
    optimal["zero_optimization"]["offload_optimizer"]["device"] = "nvme"
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"


def test_memory_breakdown_is_off_while_tuning_and_back_in_the_winners_config() -> None:
    """DeepSpeed's memory_breakdown resets the peak counters on rank 0 around forward, backward and
    step: the recorded peak would cover the optimizer step only."""
    user = {"memory_breakdown": True, "zero_optimization": {"stage": 1}, "autotuning": {"enabled": True}}
    experiment = experiment_config(user, 2, 8, 2, 4, 3, 5)
    assert experiment["memory_breakdown"] is False and user["memory_breakdown"] is True
    assert optimal_config(experiment)["memory_breakdown"] is True
    assert "memory_breakdown" not in experiment_config({"autotuning": {}}, 2, 8, 2, 4, 3, 5)
    assert "memory_breakdown" not in optimal_config(experiment_config({"autotuning": {}}, 2, 8, 2, 4, 3, 5))


def test_optimal_config_without_autotuning_section() -> None:
    assert optimal_config({"fp16": {"enabled": True}}) == {"fp16": {"enabled": True}}


# ---------------------------------------------------------------- script arguments

CFG = Path("/results/z1_gas1_tmbspg4/ds_config.json")


@pytest.mark.parametrize(
    ("base", "expected"),
    [
        (("--deepspeed_config", "ds.json"), ["--deepspeed_config", str(CFG)]),
        (("--steps", "5", "--deepspeed_config", "ds.json", "--lr", "0.1"),
         ["--steps", "5", "--deepspeed_config", str(CFG), "--lr", "0.1"]),
        (("--deepspeed_config=ds.json",), [f"--deepspeed_config={CFG}"]),
        (("--a", "1", "--deepspeed_config=old/ds.json", "--b"), ["--a", "1", f"--deepspeed_config={CFG}", "--b"]),
        (("--deepspeed", "ds.json", "--bf16"), ["--deepspeed", str(CFG), "--bf16"]),
        (("--deepspeed=ds.json",), [f"--deepspeed={CFG}"]),
        ((), ["--deepspeed_config", str(CFG)]),
        (("--steps", "5"), ["--steps", "5", "--deepspeed_config", str(CFG)]),
        (("--name", "a b", "--quote", "it's \"x\"", "--deepspeed_config", "c.json"),
         ["--name", "a b", "--quote", "it's \"x\"", "--deepspeed_config", str(CFG)]),
        (("--name", "a b", "--empty", ""), ["--name", "a b", "--empty", "", "--deepspeed_config", str(CFG)]),
        (("--deepspeed_configs", "x"), ["--deepspeed_configs", "x", "--deepspeed_config", str(CFG)]),
    ],
    ids=["flag-value", "flag-value-middle", "equals", "equals-middle", "hf-style", "hf-equals", "none",
         "none-appended", "spaces-and-quotes", "empty-arg", "similar-flag-not-matched"],
)
def test_with_config(base: tuple[str, ...], expected: list[str]) -> None:
    snapshot = tuple(base)
    assert with_config("train.py", base, CFG) == ["train.py", *expected]
    assert base == snapshot


def test_with_config_returns_fresh_lists() -> None:
    base = ("--steps", "5")
    first = with_config("t.py", base, Path("/a.json"))
    second = with_config("t.py", base, Path("/b.json"))
    first.append("--extra")
    assert second == ["t.py", "--steps", "5", "--deepspeed_config", "/b.json"]
    assert base == ("--steps", "5")


def test_with_config_only_first_occurrence_replaced() -> None:
    result = with_config("t.py", ("--deepspeed_config", "a.json", "--deepspeed_config", "b.json"), CFG)
    assert result == ["t.py", "--deepspeed_config", str(CFG), "--deepspeed_config", "b.json"]


def test_with_config_deepspeed_boolean_flag_then_deepspeed_config() -> None:
    result = with_config("t.py", ("--deepspeed", "--deepspeed_config", "ds.json"), CFG)
    assert result == ["t.py", "--deepspeed", "--deepspeed_config", str(CFG)]


def test_with_config_deepspeed_boolean_flag_then_other_option() -> None:
    result = with_config("t.py", ("--deepspeed", "--steps", "5"), CFG)
    assert result == ["t.py", "--deepspeed", "--steps", "5", "--deepspeed_config", str(CFG)]
