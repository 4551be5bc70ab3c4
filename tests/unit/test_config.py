"""`load_config`: the user's DeepSpeed config with an "autotuning" section, checked field by field."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from scheduler.inputs.config import ALL_STAGES, load_config
from scheduler.errors import ConfigError, UsageError


def write(tmp_path: Path, data: Any, name: str = "ds_config.json") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def config_with(**top: Any) -> dict[str, Any]:
    """A minimal valid config, plus/overriding top-level keys."""
    base: dict[str, Any] = {"autotuning": {"enabled": True}}
    base.update(top)
    return base


def load_error(path: Path, cwd: Path | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, cwd=cwd or path.parent)
    message = str(info.value)
    assert "\n" not in message, f"multi-line error: {message!r}"
    assert str(path) in message, f"error does not name the file: {message!r}"
    return message


# ---------------------------------------------------------------- valid configs


def test_valid_json_defaults(tmp_path: Path) -> None:
    path = write(tmp_path, config_with())
    cfg = load_config(path, cwd=tmp_path)
    assert cfg.path == path
    assert cfg.metric == "throughput"
    assert cfg.maximize is True
    assert cfg.micro_batch_sizes == (1,)
    assert cfg.stages == (0,)
    assert cfg.gradient_accumulation_steps == 1
    assert cfg.results_dir == tmp_path / "autotuning_results"
    assert cfg.exps_dir == tmp_path / "autotuning_exps"
    assert cfg.overwrite is False
    assert (cfg.start_profile_step, cfg.end_profile_step) == (3, 5)
    assert cfg.user_script is None
    assert cfg.user_args == ()
    assert cfg.ds_config == {"autotuning": {"enabled": True}}


def test_valid_json_keeps_config_as_written(tmp_path: Path) -> None:
    data = {
        "train_micro_batch_size_per_gpu": [16, 4],
        "gradient_accumulation_steps": 2,
        "zero_optimization": {"stage": "all", "offload_optimizer": {"device": "cpu"}},
        "optimizer": {"type": "Adam", "params": {"lr": 0.001}},
        "autotuning": {"enabled": True, "metric": "latency", "start_profile_step": 2,
                       "end_profile_step": 4, "overwrite": True},
    }
    cfg = load_config(write(tmp_path, data), cwd=tmp_path)
    assert cfg.ds_config == data
    assert cfg.micro_batch_sizes == (4, 16)
    assert cfg.stages == (0, 1, 2, 3)
    assert cfg.gradient_accumulation_steps == 2
    assert cfg.metric == "latency"
    assert cfg.maximize is False
    assert (cfg.start_profile_step, cfg.end_profile_step) == (2, 4)
    assert cfg.overwrite is True


def test_valid_hjson_with_comments_and_unquoted_keys(tmp_path: Path) -> None:
    text = """{
  # hash comment
  // slash comment
  /* block
     comment */
  train_micro_batch_size_per_gpu: [8, 2, 8]
  zero_optimization: {
    stage: [2, 0]
  }
  autotuning: {
    enabled: true
    // quoteless strings run to the end of the line, so comments go on their own lines
    metric: flops
    user_args: ["--steps", "5"]
  }
}
"""
    cfg = load_config(write(tmp_path, text, "cfg.hjson"), cwd=tmp_path)
    assert cfg.micro_batch_sizes == (2, 8)
    assert cfg.stages == (0, 2)
    assert cfg.metric == "FLOPS_per_gpu"
    assert cfg.user_args == ("--steps", "5")
    assert cfg.ds_config["zero_optimization"] == {"stage": [2, 0]}
    assert type(cfg.ds_config) is dict  # plain dicts, not hjson's OrderedDict


def test_accepts_str_path(tmp_path: Path) -> None:
    path = write(tmp_path, config_with(train_micro_batch_size_per_gpu=3))
    assert load_config(str(path), cwd=tmp_path).micro_batch_sizes == (3,)


@pytest.mark.parametrize(
    ("mbs", "expected"),
    [
        (8, (8,)),
        (1, (1,)),
        ([8], (8,)),
        ([16, 4, 8], (4, 8, 16)),
        ([4, 4, 2, 4], (2, 4)),
        ([32, 1, 32, 1], (1, 32)),
    ],
    ids=["int", "one", "one-item-list", "unsorted", "duplicates", "duplicates-unsorted"],
)
def test_micro_batch_sizes(tmp_path: Path, mbs: Any, expected: tuple[int, ...]) -> None:
    cfg = load_config(write(tmp_path, config_with(train_micro_batch_size_per_gpu=mbs)), cwd=tmp_path)
    assert cfg.micro_batch_sizes == expected


@pytest.mark.parametrize(
    ("stage", "expected"),
    [
        (0, (0,)),
        (3, (3,)),
        ([1], (1,)),
        ([3, 1], (1, 3)),
        ([2, 2, 0], (0, 2)),
        ([0, 1, 2, 3], (0, 1, 2, 3)),
        ("all", (0, 1, 2, 3)),
    ],
    ids=["int-0", "int-3", "list-1", "unsorted", "duplicates", "full-list", "all"],
)
def test_stages(tmp_path: Path, stage: Any, expected: tuple[int, ...]) -> None:
    cfg = load_config(write(tmp_path, config_with(zero_optimization={"stage": stage})), cwd=tmp_path)
    assert cfg.stages == expected


def test_all_stages_constant() -> None:
    assert ALL_STAGES == (0, 1, 2, 3)


def test_zero_section_without_stage_means_stage_0(tmp_path: Path) -> None:
    path = write(tmp_path, config_with(zero_optimization={"overlap_comm": True}))
    assert load_config(path, cwd=tmp_path).stages == (0,)


@pytest.mark.parametrize(
    ("metric", "expected", "maximize"),
    [
        ("throughput", "throughput", True),
        ("latency", "latency", False),
        ("FLOPS_per_gpu", "FLOPS_per_gpu", True),
        ("flops", "FLOPS_per_gpu", True),
        ("FLOPS", "FLOPS_per_gpu", True),
    ],
)
def test_metric_and_aliases(tmp_path: Path, metric: str, expected: str, maximize: bool) -> None:
    cfg = load_config(write(tmp_path, {"autotuning": {"metric": metric}}), cwd=tmp_path)
    assert cfg.metric == expected
    assert cfg.maximize is maximize


@pytest.mark.parametrize(
    ("autotuning", "results", "exps"),
    [
        ({}, "autotuning_results", "autotuning_exps"),
        ({"results_dir": "out/res", "exps_dir": "out/exps"}, "out/res", "out/exps"),
        ({"results_dir": "r"}, "r", "autotuning_exps"),
    ],
)
def test_results_and_exps_dirs_relative_to_cwd(tmp_path: Path, autotuning: dict, results: str, exps: str) -> None:
    config_dir = tmp_path / "configs"
    config_dir.mkdir()
    cwd = tmp_path / "run"
    path = write(config_dir, {"autotuning": autotuning})
    cfg = load_config(path, cwd=cwd)
    assert cfg.results_dir == cwd / results
    assert cfg.exps_dir == cwd / exps


def test_absolute_results_dir_kept(tmp_path: Path) -> None:
    absolute = tmp_path / "elsewhere"
    path = write(tmp_path, {"autotuning": {"results_dir": str(absolute)}})
    assert load_config(path, cwd=tmp_path / "cwd").results_dir == absolute


def test_default_cwd_is_process_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    path = write(tmp_path, {"autotuning": {"results_dir": "res"}})
    monkeypatch.chdir(run_dir)
    assert load_config(path).results_dir.resolve() == (run_dir / "res").resolve()


@pytest.mark.parametrize(
    ("script", "relative_to_config"),
    [
        ("train.py", "train.py"),
        ("scripts/train.py", "scripts/train.py"),
        ("../train.py", "../train.py"),
    ],
)
def test_user_script_relative_to_config_folder(tmp_path: Path, script: str, relative_to_config: str) -> None:
    config_dir = tmp_path / "a" / "configs"
    config_dir.mkdir(parents=True)
    path = write(config_dir, {"autotuning": {"user_script": script}})
    cfg = load_config(path, cwd=tmp_path / "elsewhere")
    assert cfg.user_script == (config_dir / relative_to_config).resolve()
    assert cfg.user_script.is_absolute()


def test_absolute_user_script_kept(tmp_path: Path) -> None:
    script = tmp_path / "bin" / "train.py"
    path = write(tmp_path / "", {"autotuning": {"user_script": str(script)}})
    assert load_config(path, cwd=tmp_path).user_script == script.resolve()


@pytest.mark.parametrize(
    ("user_args", "expected"),
    [
        ([], ()),
        (["--steps", "50"], ("--steps", "50")),
        (["--steps", 50, "--lr", 0.5], ("--steps", "50", "--lr", "0.5")),
        (["--name", "a b"], ("--name", "a b")),
    ],
)
def test_user_args(tmp_path: Path, user_args: list, expected: tuple[str, ...]) -> None:
    path = write(tmp_path, {"autotuning": {"user_args": user_args}})
    assert load_config(path, cwd=tmp_path).user_args == expected


def test_every_deepspeed_autotuning_key_accepted(tmp_path: Path) -> None:
    autotuning = {
        "enabled": True, "fast": True, "overwrite": False, "metric_path": "m.json",
        "tuner_type": "gridsearch", "tuner_early_stopping": 5, "tuner_num_trials": 50,
        "arg_mappings": {}, "max_train_batch_size": 64, "min_train_batch_size": 1,
        "min_train_micro_batch_size_per_gpu": 1, "max_train_micro_batch_size_per_gpu": 32,
        "num_tuning_micro_batch_sizes": 3, "mp_size": 1, "model_info": {}, "model_info_path": "x",
    }
    cfg = load_config(write(tmp_path, {"autotuning": autotuning}), cwd=tmp_path)
    assert cfg.ds_config["autotuning"] == autotuning


@pytest.mark.parametrize("autotuning", [{"enabled": True}, {}], ids=["true", "absent"])
def test_enabled_true_or_absent_tunes(tmp_path: Path, autotuning: dict) -> None:
    """Absent, the experiments still get it true (scheduler.search.space), as DeepSpeed's profile run does."""
    assert load_config(write(tmp_path, {"autotuning": autotuning}), cwd=tmp_path).ds_config["autotuning"] == autotuning


def test_enabled_false_is_refused_saying_how_to_tune(tmp_path: Path) -> None:
    """DeepSpeed's engine writes no metrics with it false and DeepSpeed's tuner never reads it (it
    would train every experiment to its end and find no optimum): refused, not silently forced true."""
    message = load_error(write(tmp_path, {"autotuning": {"enabled": False, "metric": "latency"}}))
    assert "autotuning.enabled is false" in message
    assert 'set "enabled": true' in message and "deepspeed" in message


# ---------------------------------------------------------------- errors


def test_config_error_is_a_usage_error() -> None:
    assert issubclass(ConfigError, UsageError)


def test_missing_file(tmp_path: Path) -> None:
    message = load_error(tmp_path / "nope.json")
    assert "no such file" in message


def test_directory_instead_of_file(tmp_path: Path) -> None:
    folder = tmp_path / "cfg.json"
    folder.mkdir()
    message = load_error(folder)
    assert "cannot read it" in message
    assert "IsADirectoryError" in message


def test_undecodable_file(tmp_path: Path) -> None:
    path = tmp_path / "bin.json"
    path.write_bytes(b"\xff\xfe\x00garbage\xff")
    message = load_error(path)
    assert "cannot read it" in message


@pytest.mark.parametrize(
    ("text", "position", "problem"),
    [
        ('{"autotuning": {"enabled": true}', ":1:33:", "Expecting ',' delimiter"),
        ('{"autotuning": {"enabled": true},\n "x": }', ":2:7:", "Expecting value"),
        ('{"autotuning": {"enabled": true}}\n}', ":2:1:", "Extra data"),
    ],
    ids=["unclosed", "missing-value", "extra-brace"],
)
def test_invalid_json(tmp_path: Path, text: str, position: str, problem: str) -> None:
    path = write(tmp_path, text)
    message = load_error(path)
    assert message.startswith(f"{path}{position}")
    assert "invalid JSON/hjson" in message
    assert problem in message


@pytest.mark.parametrize(
    ("text", "type_name"),
    [("[1, 2]", "list"), ("42", "int"), ('"text"', "str"), ("null", "NoneType")],
)
def test_top_level_not_an_object(tmp_path: Path, text: str, type_name: str) -> None:
    message = load_error(write(tmp_path, text))
    assert "must be a JSON object" in message
    assert f"not {type_name}" in message


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ('{"autotuning": {"enabled": true}, "autotuning": {"enabled": false}}', "autotuning"),
        ('{"autotuning": {"metric": "latency", "metric": "throughput"}}', "metric"),
        ('{"autotuning": {}, "zero_optimization": {"stage": 1, "stage": 2}}', "stage"),
        ("{\n  // hjson\n  autotuning: {}\n  fp16: {}\n  fp16: {}\n}", "fp16"),
    ],
    ids=["top-level", "in-autotuning", "in-zero", "hjson"],
)
def test_duplicate_key(tmp_path: Path, text: str, key: str) -> None:
    message = load_error(write(tmp_path, text))
    assert f'duplicate key "{key}"' in message


@pytest.mark.parametrize(
    "data",
    [{}, {"train_micro_batch_size_per_gpu": 4}, {"autotuning": True}, {"autotuning": ["enabled"]},
     {"autotuning": None}],
    ids=["empty", "no-section", "bool", "list", "null"],
)
def test_missing_autotuning_section(tmp_path: Path, data: dict) -> None:
    message = load_error(write(tmp_path, data))
    assert 'no "autotuning" section' in message


@pytest.mark.parametrize(
    ("autotuning", "fragments"),
    [
        ({"metrc": "throughput"}, ['unknown autotuning key "metrc"', 'did you mean "metric"?']),
        ({"user_scrpt": "t.py"}, ['"user_scrpt"', 'did you mean "user_script"?']),
        ({"result_dir": "r"}, ['"result_dir"', 'did you mean "results_dir"?']),
        ({"zzzzqqq": 1}, ['unknown autotuning key "zzzzqqq"; remove or rename it']),
        ({"metrc": 1, "enabeld": True}, ["unknown autotuning keys", '"enabeld" (did you mean "enabled"?)',
                                         '"metrc" (did you mean "metric"?)']),
    ],
    ids=["metric", "user_script", "results_dir", "no-suggestion", "two-keys"],
)
def test_unknown_autotuning_key(tmp_path: Path, autotuning: dict, fragments: list[str]) -> None:
    message = load_error(write(tmp_path, {"autotuning": autotuning}))
    for fragment in fragments:
        assert fragment in message
    if "zzzzqqq" in autotuning:
        assert "did you mean" not in message


@pytest.mark.parametrize(
    "stage",
    [5, -1, "x", True, False, [], [0, 5], [1, True], "ALL", None],
    ids=["5", "negative", "str", "true", "false", "empty-list", "list-with-5", "list-with-bool", "ALL", "null"],
)
def test_bad_stage(tmp_path: Path, stage: Any) -> None:
    message = load_error(write(tmp_path, config_with(zero_optimization={"stage": stage})))
    assert f"zero_optimization.stage {json.dumps(stage)} is not valid" in message


def test_float_stage_rejected(tmp_path: Path) -> None:
    load_error(write(tmp_path, config_with(zero_optimization={"stage": 1.0})))


@pytest.mark.parametrize("zero", [1, "stage", [1]], ids=["int", "str", "list"])
def test_zero_section_not_an_object(tmp_path: Path, zero: Any) -> None:
    message = load_error(write(tmp_path, config_with(zero_optimization=zero)))
    assert "zero_optimization must be an object" in message


@pytest.mark.parametrize(
    ("mbs", "shown"),
    [(0, "0"), (-1, "-1"), ("8", '"8"'), (8.0, "8.0"), (True, "true"), (None, "null"), ([4, 0], "0"),
     ([4, "8"], '"8"')],
    ids=["zero", "negative", "string", "float", "bool", "null", "list-with-zero", "list-with-string"],
)
def test_bad_micro_batch_size(tmp_path: Path, mbs: Any, shown: str) -> None:
    message = load_error(write(tmp_path, config_with(train_micro_batch_size_per_gpu=mbs)))
    assert f"train_micro_batch_size_per_gpu must be a positive integer (or a list of them), got {shown}" in message


def test_empty_micro_batch_size_list(tmp_path: Path) -> None:
    message = load_error(write(tmp_path, config_with(train_micro_batch_size_per_gpu=[])))
    assert "train_micro_batch_size_per_gpu is an empty list" in message


@pytest.mark.parametrize("gas", [0, -2, "2", 1.5])
def test_bad_gradient_accumulation_steps(tmp_path: Path, gas: Any) -> None:
    message = load_error(write(tmp_path, config_with(gradient_accumulation_steps=gas)))
    assert "gradient_accumulation_steps must be a positive integer" in message


@pytest.mark.parametrize(("start", "end"), [(6, 5), (1, 0), (10, 3)])
def test_start_profile_step_after_end(tmp_path: Path, start: int, end: int) -> None:
    path = write(tmp_path, {"autotuning": {"start_profile_step": start, "end_profile_step": end}})
    message = load_error(path)
    assert f"autotuning.start_profile_step ({start}) is after end_profile_step ({end})" in message


def test_start_after_default_end(tmp_path: Path) -> None:
    message = load_error(write(tmp_path, {"autotuning": {"start_profile_step": 6}}))
    assert "start_profile_step (6) is after end_profile_step (5)" in message


@pytest.mark.parametrize(("start", "end"), [(0, 0), (5, 5), (0, 10)])
def test_profile_steps_ok(tmp_path: Path, start: int, end: int) -> None:
    path = write(tmp_path, {"autotuning": {"start_profile_step": start, "end_profile_step": end}})
    cfg = load_config(path, cwd=tmp_path)
    assert (cfg.start_profile_step, cfg.end_profile_step) == (start, end)


@pytest.mark.parametrize(
    ("key", "value"),
    [("start_profile_step", -1), ("start_profile_step", "3"), ("end_profile_step", True),
     ("end_profile_step", 2.5)],
)
def test_bad_profile_step(tmp_path: Path, key: str, value: Any) -> None:
    message = load_error(write(tmp_path, {"autotuning": {key: value}}))
    assert f"autotuning.{key} must be an integer from 0 to 100000, got {json.dumps(value)}" in message


@pytest.mark.parametrize("metric", ["speed", "Throughput", "", "flops_per_gpu", 3, None])
def test_bad_metric(tmp_path: Path, metric: Any) -> None:
    message = load_error(write(tmp_path, {"autotuning": {"metric": metric}}))
    assert f'autotuning.metric "{metric}" is not one of throughput, latency, FLOPS_per_gpu' in message


@pytest.mark.parametrize("metric", [["throughput"], {"name": "latency"}], ids=["list", "object"])
def test_unhashable_metric_is_a_config_error(tmp_path: Path, metric: Any) -> None:
    message = load_error(write(tmp_path, {"autotuning": {"metric": metric}}))
    assert "autotuning.metric" in message


@pytest.mark.parametrize(("key", "value"), [("results_dir", None), ("exps_dir", 5)])
def test_non_string_dirs_are_config_errors(tmp_path: Path, key: str, value: Any) -> None:
    message = load_error(write(tmp_path, {"autotuning": {key: value}}))
    assert f"autotuning.{key}" in message


@pytest.mark.parametrize(
    "user_args",
    ["--steps 50", {"steps": 50}, 5, ["--steps", None], ["--x", ["nested"]], ["--x", {"a": 1}]],
    ids=["string", "object", "int", "list-with-null", "list-with-list", "list-with-object"],
)
def test_user_args_not_a_list_of_strings(tmp_path: Path, user_args: Any) -> None:
    message = load_error(write(tmp_path, {"autotuning": {"user_args": user_args}}))
    assert "autotuning.user_args must be a list of strings" in message


# ---------------------------------------------------------------- the strict schema, bound by bound

from scheduler.inputs.search_keys import non_negative_int  # noqa: E402
from scheduler.inputs.config_schema import shown  # noqa: E402


@pytest.mark.parametrize(
    ("autotuning", "top"),
    [
        ({"tuner_seed": 2**32 - 1}, {}),
        ({"tuner_seed": 0, "tuner_early_stopping": 0}, {}),
        ({"tuner_num_trials": 1}, {}),
        ({"tuner_num_trials": 10_000, "tuner_early_stopping": 10_000}, {}),
        ({"start_profile_step": 100_000, "end_profile_step": 100_000}, {}),
        ({"max_train_batch_size": None, "min_train_batch_size": None}, {}),
        ({"max_train_batch_size": 2**31 - 1, "min_train_batch_size": 1}, {}),
        ({"min_train_micro_batch_size_per_gpu": 65536, "max_train_micro_batch_size_per_gpu": 65536}, {}),
        ({"num_tuning_micro_batch_sizes": 1024, "mp_size": 4096}, {}),
        ({"model_info": None}, {}),
        ({"model_info": {"num_params": 1, "trainable_num_params": 0, "activation_mem_per_gpu": 0,
                         "hidden_size": 1, "num_layers": 1, "profile": False}}, {}),
        ({"model_info": {"num_params": 10**15, "trainable_num_params": 10**15, "activation_mem_per_gpu": 2**50,
                         "hidden_size": 2**31 - 1, "num_layers": 2**31 - 1, "profile": True}}, {}),
        ({}, {"train_batch_size": "auto"}),
        ({}, {"train_batch_size": 1}),
        ({}, {"train_batch_size": 2**31 - 1}),
        ({}, {"fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"}}),
        ({}, {"fp16": {"enabled": False}, "bf16": {"enabled": True}}),
        ({}, {"fp16": {"loss_scale": 0}, "bf16": None}),
        ({}, {"train_micro_batch_size_per_gpu": 65536, "gradient_accumulation_steps": 65536}),
        ({"results_dir": "with space/and ~tilde", "exps_dir": "caf\u00e9 \x80"}, {}),
        ({"results_dir": "r" * 4096}, {}),
        ({"fast": False, "enabled": True, "overwrite": True}, {}),
        ({"mlflow": "http://mlflow-host:5000"}, {}),
        ({"mlflow": False}, {}),
    ],
    ids=["seed-max", "zero-lows", "one-trial", "trials-max", "profile-step-max", "nullable-batch", "batch-range",
         "micro-batch-range", "tuning-sizes-and-mp-max", "model-info-null", "model-info-lows", "model-info-highs",
         "train-batch-auto", "train-batch-one", "train-batch-max", "precision-auto", "precision-bools",
         "precision-without-enabled", "mbs-and-gas-max", "printable-paths", "path-4096-chars", "booleans",
         "mlflow-uri", "mlflow-off"],
)
def test_values_at_the_documented_bounds_are_accepted(tmp_path: Path, autotuning: dict, top: dict) -> None:
    data = {"autotuning": autotuning, **top}
    cfg = load_config(write(tmp_path, data), cwd=tmp_path)
    assert cfg.ds_config == data


@pytest.mark.parametrize(
    ("autotuning", "top", "expected"),
    [
        ({"tuner_seed": 2**32}, {}, "autotuning.tuner_seed must be an integer from 0 to 4294967295, got 4294967296"),
        ({"tuner_num_trials": 0}, {}, "autotuning.tuner_num_trials must be an integer from 1 to 10000, got 0"),
        ({"tuner_num_trials": None}, {}, "autotuning.tuner_num_trials must be an integer from 1 to 10000, got null"),
        ({"mp_size": 4097}, {}, "autotuning.mp_size must be an integer from 1 to 4096, got 4097"),
        ({"num_tuning_micro_batch_sizes": 1025}, {},
         "autotuning.num_tuning_micro_batch_sizes must be an integer from 1 to 1024, got 1025"),
        ({"max_train_batch_size": 0}, {},
         "autotuning.max_train_batch_size must be an integer from 1 to 2147483647, got 0"),
        ({"fast": "false"}, {}, 'autotuning.fast must be true or false (a JSON boolean, no quotes), got "false"'),
        ({"overwrite": 1}, {}, "autotuning.overwrite must be true or false (a JSON boolean, no quotes), got 1"),
        ({"tuner_type": "bayes"}, {}, 'autotuning.tuner_type "bayes" is not one of gridsearch, random, model_based'),
        ({"model_info": [1]}, {}, 'autotuning.model_info must be an object such as {"num_params": 1000000, '
                                  '"activation_mem_per_gpu": 4096}, got [1]'),
        ({"model_info": {"profile": "yes"}}, {}, 'autotuning.model_info.profile must be true or false, got "yes"'),
        ({"model_info": {"num_params": 0}}, {},
         "autotuning.model_info.num_params must be an integer from 1 to 1000000000000000, got 0"),
        ({"model_info": {"num_layers": 2**31}}, {},
         "autotuning.model_info.num_layers must be an integer from 1 to 2147483647, got 2147483648"),
        ({"model_info": {"activation_mem_per_gpu": -1}}, {},
         "autotuning.model_info.activation_mem_per_gpu must be an integer from 0 to 1125899906842624, got -1"),
        ({}, {"fp16": True}, 'fp16 must be an object such as {"enabled": true}, got true'),
        ({}, {"bf16": "auto"}, 'bf16 must be an object such as {"enabled": true}, got "auto"'),
        ({}, {"fp16": {"enabled": "AUTO"}}, 'fp16.enabled must be true, false or "auto", got "AUTO"'),
        ({}, {"bf16": {"enabled": 1}}, 'bf16.enabled must be true, false or "auto", got 1'),
        ({}, {"train_batch_size": 0}, "train_batch_size must be an integer from 1 to 2147483647, got 0"),
        ({}, {"train_batch_size": "AUTO"}, 'train_batch_size must be an integer from 1 to 2147483647, got "AUTO"'),
        ({}, {"train_batch_size": 2**31}, "train_batch_size must be an integer from 1 to 2147483647, got 2147483648"),
        ({}, {"train_micro_batch_size_per_gpu": 65537},
         "train_micro_batch_size_per_gpu must be at most 65536, got 65537; give a size that fits a device"),
        ({}, {"gradient_accumulation_steps": 65537},
         "gradient_accumulation_steps must be at most 65536, got 65537; give a size that fits a device"),
        ({"results_dir": ""}, {}, 'autotuning.results_dir must be a path (a non-empty string), got ""'),
        ({"exps_dir": ["x"]}, {}, 'autotuning.exps_dir must be a path (a non-empty string), got ["x"]'),
        ({"user_script": "train\n.py"}, {},
         "autotuning.user_script contains the control character '\\n'; use a path without newlines, tabs or NUL"),
        ({"metric_path": "m\x7f"}, {},
         "autotuning.metric_path contains the control character '\\x7f'; use a path without newlines, tabs or NUL"),
        ({"model_info_path": "a\x1fb"}, {},
         "autotuning.model_info_path contains the control character '\\x1f'; use a path without newlines, tabs "
         "or NUL"),
        ({"results_dir": "r" * 4097}, {},
         "autotuning.results_dir is 4097 characters long; use a path of at most 4096"),
        ({"tuner_type": "gridsearch", "zzz": 1}, {}, 'unknown autotuning key "zzz"; remove or rename it'),
        ({"mlflow": True}, {}, 'autotuning.mlflow must be an MLflow tracking URI such as "http://mlflow-host:5000" '
                               "(one line), or false to log nowhere, got true"),
        ({"mlflow": ""}, {}, 'autotuning.mlflow must be an MLflow tracking URI such as "http://mlflow-host:5000" '
                             '(one line), or false to log nowhere, got ""'),
        ({"mlflow": "http://h\n:5000"}, {}, 'autotuning.mlflow must be an MLflow tracking URI such as '
                                            '"http://mlflow-host:5000" (one line), or false to log nowhere, got '
                                            '"http://h\\n:5000"'),
        ({}, {"zero_optimization": {"stage": 4}},
         'zero_optimization.stage 4 is not valid; use 0-3, a list such as [0, 1], or "all"'),
    ],
)
def test_schema_errors_name_the_field_the_value_and_the_fix(tmp_path: Path, autotuning: dict, top: dict,
                                                            expected: str) -> None:
    path = write(tmp_path, {"autotuning": autotuning, **top})
    assert load_error(path) == f"{path}: {expected}"


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ({"k": 7}, 7),
        ({"k": 0}, 0),
        ({}, 5),
    ],
)
def test_non_negative_int(value: dict, expected: int) -> None:
    assert non_negative_int(Path("c.json"), value, "k", 5) == expected


@pytest.mark.parametrize(
    ("value", "got"),
    [(-1, "-1"), ("3", '"3"'), (True, "true"), (2.0, "2.0"), (None, "null"), ([1], "[1]")],
)
def test_non_negative_int_refusal(value: Any, got: str) -> None:
    with pytest.raises(ConfigError) as info:
        non_negative_int(Path("c.json"), {"k": value}, "k", 5)
    assert str(info.value) == f"c.json: autotuning.k must be a non-negative integer, got {got}"


@pytest.mark.parametrize(
    ("value", "limit", "expected"),
    [
        ("caf\u00e9", 60, '"caf\\u00e9"'),
        ("x" * 58, 60, '"' + "x" * 58 + '"'),
        ("x" * 59, 60, '"' + "x" * 59 + '...'),
        ([1, 2, 3], 4, "[1, ..."),
        ({1, 2}, 60, "{1, 2}"),
        (float("nan"), 60, "NaN"),
        (None, 60, "null"),
    ],
    ids=["ascii-escaped", "exactly-the-limit", "one-over-the-limit", "own-limit", "not-json", "nan", "null"],
)
def test_shown_is_json_cut_to_the_limit(value: Any, limit: int, expected: str) -> None:
    assert shown(value, limit) == expected


def test_shown_default_limit_is_60_characters() -> None:
    assert shown("y" * 58) == '"' + "y" * 58 + '"'
    assert shown("y" * 59) == '"' + "y" * 59 + "..."


def test_shown_falls_back_to_repr_for_circular_values() -> None:
    circular: list[Any] = []
    circular.append(circular)
    assert shown(circular) == "[[...]]"


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({"fp16": {}}, 'no "autotuning" section; add "autotuning": {"enabled": true} to the config to tune it'),
        ({"autotuning": {"user_args": "--steps 50"}},
         'autotuning.user_args must be a list of strings, e.g. ["--steps", "50"]'),
        ({"autotuning": {"metrc": 1, "zzzzqqq": 2}},
         'unknown autotuning keys "metrc" (did you mean "metric"?), "zzzzqqq"; remove or rename it'),
        ({"autotuning": {"start_profile_step": 9, "end_profile_step": 4}},
         "autotuning.start_profile_step (9) is after end_profile_step (4); make start <= end"),
    ],
    ids=["no-section", "user-args", "two-unknown-keys", "start-after-end"],
)
def test_whole_error_lines(tmp_path: Path, data: dict, expected: str) -> None:
    path = write(tmp_path, data)
    assert load_error(path) == f"{path}: {expected}"


def nested_lists(levels: int) -> str:
    return "[" * levels + "]" * levels


def test_nesting_of_exactly_64_levels_is_accepted(tmp_path: Path) -> None:
    # the top-level object is level 1, "x" level 2, so 63 lists reach level 64
    path = write(tmp_path, '{"autotuning": {}, "x": ' + nested_lists(63) + "}")
    assert load_config(path, cwd=tmp_path).ds_config["x"] == json.loads(nested_lists(63))
    deep_objects = {"autotuning": {}}
    inner: dict[str, Any] = deep_objects
    for _ in range(63):  # objects count the same as lists
        inner["k"] = {}
        inner = inner["k"]
    load_config(write(tmp_path, deep_objects, "objects.json"), cwd=tmp_path)


def test_nesting_of_65_levels_names_where(tmp_path: Path) -> None:
    path = write(tmp_path, '{"autotuning": {}, "x": ' + nested_lists(64) + "}")
    assert load_error(path) == (f"{path}: x{'[0]' * 63} is nested more than 64 levels deep; "
                                "a DeepSpeed config needs a few levels, check the file")


@pytest.mark.parametrize(
    ("text", "where", "value"),
    [
        ('{"autotuning": {}, "optimizer": {"params": {"lr": NaN}}}', "optimizer.params.lr", "nan"),
        ('{"autotuning": {}, "x": [1, Infinity]}', "x[1]", "inf"),
        ('{"autotuning": {}, "x": [{"y": -Infinity}]}', "x[0].y", "-inf"),
        ('{"autotuning": {"model_info": {"a": [[NaN]]}}}', "autotuning.model_info.a[0][0]", "nan"),
        ('{"autotuning": {}, "X.y": {"Xz": NaN}}', "X.y.Xz", "nan"),  # only the leading "." of the root goes
    ],
)
def test_non_finite_numbers_are_named_by_their_path(tmp_path: Path, text: str, where: str, value: str) -> None:
    path = write(tmp_path, text)
    assert load_error(path) == f"{path}: {where} is {value}, which JSON does not allow; give a finite number"


def test_read_error_lines(tmp_path: Path) -> None:
    missing = tmp_path / "nope.json"
    folder = tmp_path / "folder.json"
    folder.mkdir()
    undecodable = write(tmp_path, "", "bin.json")
    undecodable.write_bytes(b"\xff{}")
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    deep = write(tmp_path, '{"autotuning": {}, "x": ' + nested_lists(100_000) + "}", "deep.json")
    expected = {
        missing: 'no such file; give the path of your DeepSpeed config with an "autotuning" section',
        folder: "cannot read it (IsADirectoryError: Is a directory); check the path and its permissions",
        undecodable: "cannot read it (UnicodeDecodeError: 'utf-8' codec can't decode byte 0xff in position 0: "
                     "invalid start byte); check the path and its permissions",
        fifo: "not a regular file (a device, pipe or socket); give the path of your DeepSpeed config file",
        deep: "objects and lists are nested more than 64 levels deep; a DeepSpeed config needs a few levels, "
              "check the file",
    }
    for path, message in expected.items():
        assert load_error(path) == f"{path}: {message}"


def test_config_size_limit_is_16_mib_inclusive(tmp_path: Path) -> None:
    body = '{"autotuning": {}}'
    path = write(tmp_path, body + " " * (16 * 2**20 - len(body)))
    assert path.stat().st_size == 16 * 2**20
    assert load_config(path, cwd=tmp_path).ds_config == {"autotuning": {}}
    with open(path, "a") as handle:
        handle.write(" ")
    assert load_error(path) == (f"{path}: 16777217 bytes is too large for a DeepSpeed config (at most 16 MiB); "
                                "check that this is the right file")


def test_an_hjson_file_reports_hjson_s_error_and_a_json_file_json_s(tmp_path: Path) -> None:
    import hjson

    text = "{\n  autotuning: {\n    enabled: true\n  }\n  x: [1, 2\n}\n"
    with pytest.raises(hjson.HjsonDecodeError) as hjson_caught:
        hjson.loads(text)
    with pytest.raises(json.JSONDecodeError) as json_caught:
        json.loads(text)
    hjson_error, json_error = hjson_caught.value, json_caught.value
    assert (hjson_error.lineno, hjson_error.colno) != (json_error.lineno, json_error.colno)
    for name, error in (("cfg.hjson", hjson_error), ("cfg.json", json_error)):
        path = write(tmp_path, text, name)
        assert load_error(path) == (f"{path}:{error.lineno}:{error.colno}: invalid JSON/hjson: {error.msg}; "
                                    "fix the syntax there")
