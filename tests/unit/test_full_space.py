"""Full mode's search spaces (`scheduler.inputs.full_mode`, checked as the config is read) and experiments
(`scheduler.search.full_space`): DeepSpeed's names, spaces and grid order."""
from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from scheduler.inputs.config import load_config
from scheduler.errors import ConfigError
from scheduler.inputs.experiment_names import abbreviation, canonical_name
from scheduler.inputs.full_mode import DEFAULT_SPACES, TEMPLATES, zero_overrides, zero_space
from scheduler.search.full_space import full_experiments, space_name
from scheduler.search.session import SearchAborted

AUTOTUNING = {"enabled": True, "fast": False, "user_script": "train.py", "start_profile_step": 2,
              "end_profile_step": 4}


def tuning_config(tmp_path: Path, zero: dict[str, Any] | None = None, **extra: Any):
    data = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero or {"stage": 1},
            "autotuning": dict(AUTOTUNING), **extra}
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(data))
    return load_config(path, cwd=tmp_path)


def names(tmp_path: Path, zero: dict[str, Any], stage: int, mbs: list[int], mtbpg: int = 60) -> list[str]:
    return [e.name for e in full_experiments(tuning_config(tmp_path, zero), stage, mbs, mtbpg, 1, 4)]


# ---------------------------------------------------------------- canonical_name


Z1 = {"zero_optimization": {"stage": 1, "reduce_bucket_size": 5e7, "allgather_bucket_size": 1e9},
      "train_micro_batch_size_per_gpu": 60, "gradient_accumulation_steps": 1}


@pytest.mark.parametrize(
    ("config", "keys", "prefix", "name"),
    [
        (Z1, ["reduce_bucket_size", "allgather_bucket_size"], "z1_", "z1_rbs5.0e+07_abs1.0e+09_tmbspg60_gas1"),
        (Z1, ["allgather_bucket_size"], "z1_", "z1_abs1.0e+09_tmbspg60_gas1"),
        (Z1, [], "z1_", "z1_tmbspg60_gas1"),
        ({"zero_optimization": {"overlap_comm": True, "reduce_scatter": False}, "gradient_accumulation_steps": 4,
          "train_micro_batch_size_per_gpu": 8}, ["overlap_comm", "reduce_scatter"], "z2_",
         "z2_ocT_rsF_gas4_tmbspg8"),
        ({"zero_optimization": {"sub_group_size": 9000}, "train_micro_batch_size_per_gpu": 1},
         ["sub_group_size"], "", "sgs9000_tmbspg1"),
        ({"zero_optimization": {"sub_group_size": 9001}, "train_micro_batch_size_per_gpu": 1},
         ["sub_group_size"], "", "sgs9.0e+03_tmbspg1"),
        ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True,
                                                                  "buffer_size": 1e8}},
          "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, [], "z3_",
         "z3_oo_dcpu_pmT_bs1.0e+08_tmbspg4_gas2"),
        ({"zero_optimization": {"offload_param": None}, "train_micro_batch_size_per_gpu": 1,
          "gradient_accumulation_steps": 1}, [], "z3_", "z3_op_None_tmbspg1_gas1"),
        ({"autotuning": {"arg_mappings": {"train_micro_batch_size_per_gpu": "--bs"}},
          "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1}, [], "z0_", "z0_tmbspg2_gas1"),
        ({"fp16": {"enabled": True}}, [], "z0_", "z0_exp"),
    ],
)
def test_canonical_name(config: dict[str, Any], keys: list[str], prefix: str, name: str) -> None:
    assert canonical_name(config, keys, prefix) == name


def test_canonical_name_omit_val_names_the_space() -> None:
    space = {"zero_optimization": {"stage": 1, "reduce_bucket_size": [5e7, 5e8], "allgather_bucket_size": [5e7, 1e9]},
             "train_micro_batch_size_per_gpu": [30, 60]}
    keys = ["reduce_bucket_size", "allgather_bucket_size"]
    assert canonical_name(space, keys, "z1_", omit_val=True) == "z1_rbs_abs_tmbspg"


def test_canonical_name_does_not_mutate_the_keys() -> None:
    keys = ["reduce_bucket_size"]
    canonical_name(Z1, keys, "z1_")
    assert keys == ["reduce_bucket_size"]


@pytest.mark.parametrize(
    ("key", "short"),
    [("reduce_bucket_size", "rbs"), ("allgather_bucket_size", "abs"), ("overlap_comm", "oc"),
     ("reduce_scatter", "rs"), ("contiguous_gradients", "cg"), ("allgather_partitions", "ap"),
     ("train_micro_batch_size_per_gpu", "tmbspg"), ("gradient_accumulation_steps", "gas"),
     ("stage3_prefetch_bucket_size", "spbs")],
)
def test_abbreviation(key: str, short: str) -> None:
    assert abbreviation(key) == short


# ---------------------------------------------------------------- spaces and grid order


@pytest.mark.parametrize(
    ("stage", "name"),
    [(1, "z1_rbs_abs_tmbspg"), (2, "z2_oc_rs_rbs_abs_cg_tmbspg"), (3, "z3_oc_rs_rbs_ap_abs_cg_tmbspg")],
)
def test_default_space_names(stage: int, name: str) -> None:
    assert space_name(zero_overrides({"stage": stage}), stage, [30, 60]) == name
    assert space_name({}, stage, [30]) == name  # one mbs is still a tuning key, as in DeepSpeed


@pytest.mark.parametrize(("stage", "combos"), [(1, 9), (2, 72), (3, 144)])
@pytest.mark.parametrize("mbs", [[30], [30, 60], [16, 32, 48]])
def test_product_size(tmp_path: Path, stage: int, combos: int, mbs: list[int]) -> None:
    exps = full_experiments(tuning_config(tmp_path, {"stage": stage}), stage, mbs, 60, 1, 4)
    assert len(exps) == combos * len(mbs)
    assert len({e.name for e in exps}) == len(exps)
    assert {e.tuning_space for e in exps} == {space_name({}, stage, mbs)}


def test_stage1_grid_order_and_names(tmp_path: Path) -> None:
    got = names(tmp_path, {"stage": 1}, 1, [30, 60])
    assert got[:4] == ["z1_rbs5.0e+07_abs5.0e+07_tmbspg30_gas2", "z1_rbs5.0e+07_abs5.0e+07_tmbspg60_gas1",
                       "z1_rbs5.0e+07_abs5.0e+08_tmbspg30_gas2", "z1_rbs5.0e+07_abs5.0e+08_tmbspg60_gas1"]
    assert got[5] == "z1_rbs5.0e+07_abs1.0e+09_tmbspg60_gas1"
    assert got[-1] == "z1_rbs1.0e+09_abs1.0e+09_tmbspg60_gas1"


def test_stage2_and_3_names_follow_the_template_key_order(tmp_path: Path) -> None:
    assert names(tmp_path, {"stage": 2}, 2, [30])[0] == "z2_abs5.0e+07_ocT_rsF_rbs5.0e+07_cgF_tmbspg30_gas2"
    assert names(tmp_path, {"stage": 3}, 3, [30])[-1] == "z3_apF_abs1.0e+09_ocF_rsT_rbs1.0e+09_cgT_tmbspg30_gas2"


def test_grid_order_is_the_same_on_every_call(tmp_path: Path) -> None:
    assert names(tmp_path, {"stage": 2}, 2, [30, 60]) == names(tmp_path, {"stage": 2}, 2, [30, 60])


# ---------------------------------------------------------------- user overrides


def test_user_scalar_fixes_a_key(tmp_path: Path) -> None:
    zero = {"stage": "all", "reduce_bucket_size": 2e8}
    exps = full_experiments(tuning_config(tmp_path, zero), 1, [30, 60], 60, 1, 4)
    assert len(exps) == 3 * 2
    assert {e.ds_config["zero_optimization"]["reduce_bucket_size"] for e in exps} == {2e8}
    assert exps[0].name == "z1_abs5.0e+07_tmbspg30_gas2"
    assert exps[0].tuning_space == "z1_abs_tmbspg"


def test_user_list_is_searched_in_the_users_order(tmp_path: Path) -> None:
    zero = {"stage": 1, "allgather_bucket_size": [1e9, 2e8]}
    got = names(tmp_path, zero, 1, [60])
    assert len(got) == 3 * 2
    assert got[:2] == ["z1_rbs5.0e+07_abs1.0e+09_tmbspg60_gas1", "z1_rbs5.0e+07_abs2.0e+08_tmbspg60_gas1"]


def test_user_list_of_a_new_key_and_one_element_list(tmp_path: Path) -> None:
    zero = {"stage": 3, "stage3_prefetch_bucket_size": [1e7, 1e8], "overlap_comm": [True]}
    exps = full_experiments(tuning_config(tmp_path, zero), 3, [8], 8, 1, 1)
    assert len(exps) == 144 // 2 * 2  # overlap_comm fixed, the new key doubles the space
    assert exps[0].tuning_space == "z3_rs_rbs_ap_abs_cg_spbs_tmbspg"
    assert exps[0].name == "z3_apT_abs5.0e+07_rsF_rbs5.0e+07_cgF_spbs1.0e+07_tmbspg8_gas1"
    assert {e.ds_config["zero_optimization"]["overlap_comm"] for e in exps} == {True}


def test_user_offload_is_kept_and_named(tmp_path: Path) -> None:
    zero = {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}}
    exps = full_experiments(tuning_config(tmp_path, zero), 2, [4], 4, 1, 2)
    assert all(e.ds_config["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
               for e in exps)
    assert exps[0].name == "z2_abs5.0e+07_ocT_rsF_rbs5.0e+07_cgF_oo_dcpu_pmT_tmbspg4_gas1"
    assert exps[0].tuning_space == "z2_oc_rs_rbs_abs_cg_oo_tmbspg"


def test_user_can_search_offload_on_and_off(tmp_path: Path) -> None:
    zero = {"stage": 1, "reduce_bucket_size": 5e8, "allgather_bucket_size": 5e8,
            "offload_optimizer": [None, {"device": "cpu"}]}
    exps = full_experiments(tuning_config(tmp_path, zero), 1, [4], 4, 1, 1)
    assert [e.name for e in exps] == ["z1_tmbspg4_gas1", "z1_oo_dcpu_tmbspg4_gas1"]
    assert "offload_optimizer" not in exps[0].ds_config["zero_optimization"]


def test_user_null_removes_a_template_key(tmp_path: Path) -> None:
    exps = full_experiments(tuning_config(tmp_path, {"stage": 3, "sub_group_size": None}), 3, [4], 4, 1, 1)
    assert all("sub_group_size" not in e.ds_config["zero_optimization"] for e in exps)


def test_zero_space_ignores_the_users_stage() -> None:
    space = zero_space(zero_overrides({"stage": [1, 2], "overlap_comm": False}), 2)
    assert space["stage"] == 2
    assert space["overlap_comm"] is False
    assert space["reduce_bucket_size"] == [5e7, 5e8, 1e9]


# ---------------------------------------------------------------- duplicates


def test_duplicates_pruned_keeping_first_occurrence(tmp_path: Path) -> None:
    zero = {"stage": 1, "allgather_bucket_size": 5e8, "reduce_bucket_size": [5e8, 5e7, 500000000, 5e8]}
    got = names(tmp_path, zero, 1, [60, 30, 60])
    assert got == ["z1_rbs5.0e+08_tmbspg60_gas1", "z1_rbs5.0e+08_tmbspg30_gas2",
                   "z1_rbs5.0e+07_tmbspg60_gas1", "z1_rbs5.0e+07_tmbspg30_gas2"]


def test_booleans_and_numbers_are_different_values(tmp_path: Path) -> None:
    zero = {"stage": 1, "reduce_bucket_size": 5e8, "allgather_bucket_size": 5e8, "overlap_comm": [True, 1]}
    assert names(tmp_path, zero, 1, [4], 4) == ["z1_ocT_tmbspg4_gas1", "z1_oc1_tmbspg4_gas1"]


def test_values_that_name_alike_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="same name z1_rbs5.0e\\+08"):
        names(tmp_path, {"stage": 1, "reduce_bucket_size": [5e8, 5.01e8]}, 1, [4])


def test_empty_list_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="zero_optimization.reduce_bucket_size is an empty list"):
        names(tmp_path, {"stage": 1, "reduce_bucket_size": []}, 1, [4])


# ---------------------------------------------------------------- the experiment configs


def test_configs_come_from_the_users_config_unmutated(tmp_path: Path) -> None:
    cfg = tuning_config(tmp_path, {"stage": "all", "reduce_bucket_size": [5e7, 5e8]},
                        optimizer={"type": "AdamW", "params": {"betas": [0.9, 0.99]}}, fp16={"enabled": True})
    before = copy.deepcopy(cfg.ds_config)
    exps = full_experiments(cfg, 3, [16, 32], 64, 2, 4)
    assert cfg.ds_config == before
    exp = exps[0]
    config = exp.ds_config
    assert (exp.stage, exp.micro_batch_size, exp.gradient_accumulation_steps) == (3, 16, 4)
    assert (exp.num_nodes, exp.num_gpus) == (2, 4)
    assert config["train_micro_batch_size_per_gpu"] == 16
    assert config["gradient_accumulation_steps"] == 4
    assert config["train_batch_size"] == 16 * 4 * 8
    assert config["optimizer"] == {"type": "AdamW", "params": {"betas": [0.9, 0.99]}}
    assert config["fp16"] == {"enabled": True}
    assert config["autotuning"]["start_profile_step"] == 2
    assert "user_script" not in config["autotuning"]
    zero = config["zero_optimization"]
    assert list(zero)[:7] == list(TEMPLATES[3])[:7]
    assert zero["stage"] == 3 and zero["sub_group_size"] == 1e12
    assert exps[0].ds_config["zero_optimization"] is not exps[1].ds_config["zero_optimization"]


def test_hidden_size_sizes_the_stage3_template(tmp_path: Path) -> None:
    exps = full_experiments(tuning_config(tmp_path, {"stage": 3}), 3, [4], 4, 1, 1, hidden_size=1024)
    zero = exps[0].ds_config["zero_optimization"]
    assert zero["stage3_prefetch_bucket_size"] == 0.9 * 1024 * 1024
    assert zero["stage3_param_persistence_threshold"] == 10 * 1024
    assert zero["reduce_bucket_size"] == 5e7  # the searched value wins over the template's


def test_gas_is_at_least_one(tmp_path: Path) -> None:
    exps = full_experiments(tuning_config(tmp_path), 1, [30, 60], 40, 1, 1)
    assert {(e.micro_batch_size, e.gradient_accumulation_steps) for e in exps} == {(30, 1), (60, 1)}


def test_stage0_and_empty_mbs_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="stages 1-3"):
        full_experiments(tuning_config(tmp_path), 0, [4], 4, 1, 1)
    with pytest.raises(ValueError, match="micro-batch size"):
        full_experiments(tuning_config(tmp_path), 1, [], 4, 1, 1)


def test_defaults_are_read_only() -> None:
    with pytest.raises(TypeError):
        DEFAULT_SPACES[1]["reduce_bucket_size"] = (1,)  # type: ignore[index]
    with pytest.raises(TypeError):
        TEMPLATES[1]["stage"] = 2  # type: ignore[index]


# ---------------------------------------------------------------- values that cannot name a folder


@pytest.mark.parametrize(
    ("zero", "fast", "refused"),
    [
        ({"stage": [1, 2], "reduce_bucket_size": ["a/b", 5e8]}, False, 'zero_optimization.reduce_bucket_size value "a/b"'),
        ({"stage": 3, "offload_param": {"device": ["cpu", "../x"]}}, False, 'zero_optimization.offload_param.device'),
        ({"stage": [1], "reduce_bucket_size": [5e7, 5e8]}, False, None),
        ({"stage": [1], "reduce_bucket_size": ["a/b", 5e8]}, True, None),  # fast mode names no knob
    ],
    ids=["slash", "nested-dot-dot", "numbers", "fast-mode"],
)
def test_a_value_that_cannot_name_an_experiment_is_refused_up_front(tmp_path: Path, zero: dict[str, Any], fast: bool,
                                                                    refused: str | None) -> None:
    if refused is None:
        tuning_config(tmp_path, zero, autotuning={**AUTOTUNING, "fast": fast})
        return
    with pytest.raises(ConfigError, match="cannot be part of an experiment name") as caught:
        tuning_config(tmp_path, zero, autotuning={**AUTOTUNING, "fast": fast})
    assert refused in str(caught.value) and str(tmp_path / "ds_config.json") in str(caught.value)


def test_a_name_that_cannot_be_a_folder_is_refused_naming_it(tmp_path: Path) -> None:
    zero = {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme"}}
    with pytest.raises(ConfigError, match="full mode would name an experiment 'z2_.*_oo_dnvme_np/local_nvme_.*"
                                          "which cannot be a folder name"):
        tuning_config(tmp_path, zero)
    tuning_config(tmp_path, zero, autotuning={**AUTOTUNING, "fast": True})  # fast mode names no knob


def test_an_empty_list_is_refused_in_full_mode_only(tmp_path: Path) -> None:
    zero = {"stage": 1, "offload_optimizer": {"device": ["cpu", "nvme"], "buffer_count": []}}
    with pytest.raises(ConfigError, match="^zero_optimization.offload_optimizer.buffer_count is an empty list"):
        tuning_config(tmp_path, zero)
    tuning_config(tmp_path, zero, autotuning={**AUTOTUNING, "fast": True})
    tuning_config(tmp_path, {"stage": 0, "reduce_bucket_size": []})  # no full-mode stage


def test_sizes_that_name_alike_end_the_search(tmp_path: Path) -> None:
    """Micro-batch sizes above 9000 keep two significant digits in a name: the config's check, at
    size 1, cannot see it; the search refuses rather than merge two experiments."""
    with pytest.raises(SearchAborted, match="same name z1_rbs5.0e\\+07_abs5.0e\\+07_tmbspg1.0e\\+04_gas1"):
        full_experiments(tuning_config(tmp_path), 1, [10000, 10001], 1, 1, 1)
