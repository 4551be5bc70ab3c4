"""Each launch of an experiment writes its config, metrics and exit reports under its own name
(`workers.files.layout.LAUNCH_FILES`), and its script is pointed at its own config (`workers.slot.rank`): two
launches of one experiment (a node cut off while its launch ran on, and the relaunch elsewhere)
never read each other's metrics, and `"overwrite": true` still knows every file either wrote."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from workers.files import layout
from workers.process.launch_files import LaunchFiles, with_metric_path

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
    (f"stderr.{LAUNCH}.log", True), (f"rank2.stdout.{LAUNCH}.log", True), (f"rank1.op_prebuild.{LAUNCH}.log", True),
    (f"op_prebuild.{LAUNCH}.json", True), (f"exp.{LAUNCH}.json", True), (f"cmd.{LAUNCH}.txt", True),
    (f".stderr.{LAUNCH}.log.x1y2", True), ("stderr.0123.log", False), (f"cmd.{LAUNCH}.json", False),
    (f"notes.{LAUNCH}.log", False), (f"rank1.exp.{LAUNCH}.json", False),
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


def test_a_launch_names_its_logs_description_and_command() -> None:
    files = LaunchFiles.of(Path("/r/exp"), LAUNCH + "0000", "")
    assert files.log(0, "stderr") == Path(f"/r/exp/stderr.{LAUNCH}.log")
    assert files.log(3, "stdout") == Path(f"/r/exp/rank3.stdout.{LAUNCH}.log")
    assert files.own(layout.EXP_JSON) == Path(f"/r/exp/exp.{LAUNCH}.json")
    assert files.own(layout.CMD) == Path(f"/r/exp/cmd.{LAUNCH}.txt")
    assert [(own.name, plain.name) for own, plain in files.rank_logs(1, ("op_prebuild",))] == [
        (f"rank1.op_prebuild.{LAUNCH}.log", "rank1.op_prebuild.log"),
        (f"rank1.op_prebuild.{LAUNCH}.json", "rank1.op_prebuild.json")]


def _launch(folder: Path, launch: str, written: dict[str, str]) -> LaunchFiles:
    files = LaunchFiles(folder, launch, layout.METRICS)
    for name, text in written.items():
        (folder / name.format(launch=launch)).write_text(text)
    return files


def test_adopting_a_launch_shows_exactly_its_files_under_the_plain_names(tmp_path: Path) -> None:
    """The earlier launch built the ops and wrote its description; the counted one found the ops
    built: its logs replace the earlier ones, the earlier op_prebuild log goes, and a description
    the counted launch's rank 0 did not write stays (the experiment's)."""
    earlier = _launch(tmp_path, "a" * 12, {"stderr.{launch}.log": "earlier", "op_prebuild.{launch}.log": "built",
                                           "exp.{launch}.json": '{"slots": ["n.gpu0"]}'})
    earlier.adopt(2)
    assert (tmp_path / "op_prebuild.log").read_text() == "built" and (tmp_path / "stderr.log").read_text() == "earlier"
    counted = _launch(tmp_path, "b" * 12, {"stderr.{launch}.log": "counted", "rank1.stdout.{launch}.log": "one"})
    counted.adopt(2)
    assert (tmp_path / "stderr.log").read_text() == "counted" and (tmp_path / "rank1.stdout.log").read_text() == "one"
    assert (tmp_path / "stderr.log").samefile(counted.log(0, "stderr"))  # a link: no copy of a big log
    assert not (tmp_path / "op_prebuild.log").exists()
    assert (tmp_path / "exp.json").read_text() == '{"slots": ["n.gpu0"]}'
    assert all(layout.is_experiment_file(path.name) for path in tmp_path.iterdir())
    assert not [path for path in tmp_path.iterdir() if path.name.startswith(".")]  # no temporary left


def test_where_links_are_refused_the_adopted_files_are_copied(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refused(*args: object) -> None:
        raise PermissionError("links not supported here")

    counted = _launch(tmp_path, LAUNCH, {"stderr.{launch}.log": "counted", "cmd.{launch}.txt": "python train.py\n"})
    monkeypatch.setattr("os.link", refused)
    counted.show_while_running(counted.rank_logs(0, ("stderr",)))  # a log is linked or not shown at all
    assert not (tmp_path / "stderr.log").exists()
    counted.show_while_running(counted.descriptions())  # a finished file: a copy will do
    assert (tmp_path / "cmd.txt").read_text() == "python train.py\n"
    counted.adopt(1)
    assert (tmp_path / "stderr.log").read_text() == "counted"


def test_once_a_record_is_written_a_late_launch_shows_nothing(tmp_path: Path) -> None:
    """A stale launch whose script starts after the experiment was recorded leaves the plain names
    to the counted launch."""
    counted = _launch(tmp_path, "b" * 12, {"stderr.{launch}.log": "counted"})
    counted.adopt(1)
    (tmp_path / layout.RESULT).write_text("{}")
    late = _launch(tmp_path, "a" * 12, {"stderr.{launch}.log": "late"})
    late.show_while_running(late.rank_logs(0))
    assert (tmp_path / "stderr.log").read_text() == "counted"


def test_a_stale_record_does_not_hide_the_launch_that_holds_the_experiment(tmp_path: Path) -> None:
    """A fenced launch leaves its record marked stale where nothing was counted yet; the launch that
    replaced it, still running, shows its own logs under the plain names all the same."""
    (tmp_path / layout.RESULT).write_text('{"name": "x", "status": "ok", "stale": true}')
    holder = _launch(tmp_path, "c" * 12, {"stderr.{launch}.log": "holder"})
    holder.show_while_running(holder.rank_logs(0, ("stderr",)))
    assert (tmp_path / "stderr.log").read_text() == "holder"
    (tmp_path / layout.RESULT).write_text('{"name": "x", "status": "ok"}')  # counted: the names are its
    late = _launch(tmp_path, "d" * 12, {"stderr.{launch}.log": "late"})
    late.show_while_running(late.rank_logs(0, ("stderr",)))
    assert (tmp_path / "stderr.log").read_text() == "holder"
