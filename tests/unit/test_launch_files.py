"""Each launch of an experiment writes its config, metrics and exit reports under its own name
(`workers.layout.LAUNCH_FILES`), and its script is pointed at its own config (`workers.rank`): two
launches of one experiment (a node cut off while its launch ran on, and the relaunch elsewhere)
never read each other's metrics, and `"overwrite": true` still knows every file either wrote."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from workers import layout
from workers.launch_files import LaunchFiles, with_metric_path

LAUNCH = "0123456789ab"


def test_a_launch_names_its_own_files() -> None:
    assert layout.launch_id("0123456789abcdef0123") == LAUNCH
    assert layout.launch_id("att") == layout.launch_id("att") != layout.launch_id("att-2")  # any other token: a digest
    assert len(layout.launch_id("att")) == layout.LAUNCH_ID_CHARS
    assert layout.launch_file(layout.METRICS, LAUNCH) == f"metrics.{LAUNCH}.json"
    assert layout.launch_file(layout.DS_CONFIG, LAUNCH) == f"ds_config.{LAUNCH}.json"
    assert layout.launch_file(layout.MODEL_INFO, LAUNCH) == f"model_info.{LAUNCH}.json"
    assert layout.exit_report(3, LAUNCH) == f"rank3.{LAUNCH}.exit.json" and layout.exit_report(3) == "rank3.exit.json"
    with pytest.raises(ValueError):
        layout.launch_file(layout.RESULT, LAUNCH)  # one record per experiment: the adopted launch's


@pytest.mark.parametrize("name, known", [
    (f"metrics.{LAUNCH}.json", True), (f"ds_config.{LAUNCH}.json", True), (f"model_info.{LAUNCH}.json", True),
    (f"rank2.{LAUNCH}.exit.json", True), (f"rank2.{LAUNCH}.exit.json.4242.tmp", True),
    (f".metrics.{LAUNCH}.json.x1y2", True),
    (f"result.{LAUNCH}.json", False), ("metrics.0123.json", False), (f"metrics.{LAUNCH.upper()}.json", False),
    (f"notes.{LAUNCH}.json", False),
])
def test_overwrite_knows_exactly_the_launch_files(name: str, known: bool) -> None:
    assert layout.is_experiment_file(name) is known
    if known and not name.startswith("."):
        assert layout.experiment_file(Path("/r/x"), name) == Path("/r/x") / name


@pytest.mark.parametrize("form", [["--deepspeed_config", "{}"], ["--deepspeed_config={}"], ["--deepspeed", "{}"],
                                  ["--deepspeed={}"]])
def test_the_script_is_given_its_launchs_own_config(form: list[str]) -> None:
    files = LaunchFiles.of(Path("/r/exp"), LAUNCH + "cdef0123", "")
    shared, own = Path("/r/exp/ds_config.json"), Path(f"/r/exp/ds_config.{LAUNCH}.json")
    assert files.config_path == own and files.metric_path == Path(f"/r/exp/metrics.{LAUNCH}.json")
    argv = ["train.py", "--lr", "1", *[part.format(shared) for part in form], "--out", "/r/exp/ds_config.jsonl"]
    assert files.argv(argv) == ["train.py", "--lr", "1", *[part.format(own) for part in form],
                                "--out", "/r/exp/ds_config.jsonl"]


def test_each_launchs_config_points_at_its_own_metric_file(tmp_path: Path) -> None:
    config = {"train_micro_batch_size_per_gpu": 2, "autotuning": {"enabled": True}}
    own = with_metric_path(config, tmp_path / f"metrics.{LAUNCH}.json", layout.METRICS)
    assert own["autotuning"]["metric_path"] == str(tmp_path / f"metrics.{LAUNCH}.json")
    profile = with_metric_path(config, tmp_path / f"model_info.{LAUNCH}.json", layout.MODEL_INFO)
    assert profile["autotuning"]["model_info_path"] == str(tmp_path / f"model_info.{LAUNCH}.json")
    assert "metric_path" not in profile["autotuning"] and config["autotuning"] == {"enabled": True}
    assert json.dumps(config)  # the experiment's own config is left as it was


def test_a_launch_writes_the_shared_config_and_its_own(tmp_path: Path) -> None:
    files = LaunchFiles.of(tmp_path, LAUNCH + "0000", "model_info.json")
    shared, own = files.write_configs({"autotuning": {"enabled": True}})
    assert json.loads((tmp_path / "ds_config.json").read_text()) == shared
    assert shared["autotuning"]["model_info_path"] == str(tmp_path / "model_info.json")
    assert json.loads(files.config_path.read_text()) == own
    assert own["autotuning"]["model_info_path"] == str(tmp_path / f"model_info.{LAUNCH}.json") == str(files.metric_path)
    assert files.exit_report(2) == tmp_path / f"rank2.{LAUNCH}.exit.json"
