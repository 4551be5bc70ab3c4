"""`load_config`: the user's DeepSpeed config with an "autotuning" section, checked field by field."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from scheduler.config import ALL_STAGES, load_config
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
