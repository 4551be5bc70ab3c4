"""`scheduler.inputs.folders`: overwrite empties only folders we made and filled; everything else is refused."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from scheduler.inputs import folders
from scheduler.errors import ConfigError


def fill_like_a_run(results: Path) -> None:
    """What one finished tuning job leaves in a results folder."""
    for name in ("summary.txt", "results.jsonl", "results.csv", "ds_config_optimal.json", "cmd_optimal.txt",
                 "hostfile_optimal", "ds_config_best_partial.json", "cmd_best_partial.txt", "tuning.png",
                 "timeline.png", ".results.csv.x1y2z3_4"):
        (results / name).write_text("x")
    exp = results / "z0_gas1_tmbspg4"
    exp.mkdir()
    for name in ("exp.json", "ds_config.json", "cmd.txt", "stdout.log", "stderr.log", "metrics.json",
                 "result.json", "rank1.stdout.log", "rank1.stderr.log", ".result.json.ab12_x9", "op_prebuild.log",
                 "op_prebuild.json", "rank1.op_prebuild.log", "rank1.op_prebuild.json", "rank0.exit.json",
                 "rank1.exit.json.977.tmp", ".tmp-a8f_2kq.json"):
        (exp / name).write_text("{}")
    cluster = results / "cluster"
    cluster.mkdir()
    for name in ("redis.log", "gpu0.log", "control.log", "pids.json"):
        (cluster / name).write_text("")


@pytest.fixture
def config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    work = tmp_path / "work"
    (work / "configs").mkdir(parents=True)
    monkeypatch.chdir(work)
    path = work / "configs" / "cfg.json"
    path.write_text("{}")
    return path


def test_created_folder_is_marked_and_emptied_by_overwrite(config: Path) -> None:
    results = config.parent.parent / "out"
    folders.prepare([("results_dir", results)], config, overwrite=False)
    assert (results / folders.MARKER).is_file()
    fill_like_a_run(results)
    folders.prepare([("results_dir", results)], config, overwrite=True)
    assert [p.name for p in results.iterdir()] == [folders.MARKER]


def test_experiment_descriptions_are_ours(config: Path) -> None:
    exps = config.parent.parent / "exps"
    folders.prepare([("exps_dir", exps)], config, overwrite=False)
    (exps / "z1_gas1_tmbspg2.json").write_text(json.dumps(
        {"name": "z1_gas1_tmbspg2", "ds_config": {}, "num_gpus": 1, "num_nodes": 1}))
    folders.prepare([("exps_dir", exps)], config, overwrite=True)
    assert [p.name for p in exps.iterdir()] == [folders.MARKER]


@pytest.mark.parametrize(
    "plant",
    [
        lambda r: (r / "notes.txt").write_text("mine"),
        lambda r: (r / "data.json").write_text('{"name": "data"}'),
        lambda r: (r / "z0_gas1_tmbspg4" / "checkpoint.pt").write_text("w"),
        lambda r: (r / "cluster" / "secrets.txt").write_text("s"),
        lambda r: (r / "thesis").mkdir(),
        lambda r: (r / "link").symlink_to("/etc"),
    ],
    ids=["top-file", "json-not-ours", "file-in-experiment", "file-in-cluster", "foreign-folder", "symlink"],
)
def test_a_foreign_file_refuses_the_whole_overwrite(config: Path, plant) -> None:
    results = config.parent.parent / "out"
    folders.prepare([("results_dir", results)], config, overwrite=False)
    fill_like_a_run(results)
    plant(results)
    before = sorted(str(p) for p in results.rglob("*"))
    with pytest.raises(ConfigError, match="not written by celery-autotune") as info:
        folders.prepare([("results_dir", results)], config, overwrite=True)
    assert "autotuning.results_dir" in str(info.value)
    assert sorted(str(p) for p in results.rglob("*")) == before


def test_unmarked_folder_with_files_is_refused(config: Path) -> None:
    results = config.parent.parent / "old_results"
    results.mkdir()
    (results / "summary.txt").write_text("from an old run")
    with pytest.raises(ConfigError, match="not created by celery-autotune"):
        folders.prepare([("results_dir", results)], config, overwrite=True)
    assert (results / "summary.txt").read_text() == "from an old run"


@pytest.mark.parametrize("where", ["cwd", "cwd-parent", "config-folder", "home", "root"])
def test_protected_folders_are_refused(config: Path, where: str, monkeypatch: pytest.MonkeyPatch) -> None:
    home = config.parent.parent.parent / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    folder = {"cwd": Path("."), "cwd-parent": Path(".."), "config-folder": config.parent,
              "home": home, "root": Path("/")}[where]
    (folder / folders.MARKER).write_text("{}") if where != "root" else None
    with pytest.raises(ConfigError, match="would empty"):
        folders.prepare([("results_dir", folder)], config, overwrite=True)
    assert config.is_file()


def test_resume_keeps_everything(config: Path) -> None:
    results = config.parent.parent / "out"
    folders.prepare([("results_dir", results)], config, overwrite=False)
    fill_like_a_run(results)
    (results / "notes.txt").write_text("mine")
    folders.prepare([("results_dir", results)], config, overwrite=False)
    assert (results / "notes.txt").read_text() == "mine" and (results / "summary.txt").exists()


@pytest.mark.parametrize("shape", ["is-a-file", "under-a-file"])
def test_results_dir_that_is_or_sits_under_a_file(config: Path, shape: str) -> None:
    blocker = config.parent.parent / "blocker"
    blocker.write_text("user data")
    folder = blocker if shape == "is-a-file" else blocker / "sub" / "out"
    with pytest.raises(ConfigError, match="autotuning.results_dir .* file"):
        folders.prepare([("results_dir", folder)], config, overwrite=True)
    assert blocker.read_text() == "user data"


def test_uncreatable_folder_is_one_line(config: Path) -> None:
    with pytest.raises(ConfigError, match="autotuning.results_dir /proc/celery_autotune_x: cannot create"):
        folders.prepare([("results_dir", Path("/proc/celery_autotune_x"))], config, overwrite=False)


def test_nested_exps_inside_results_is_emptied(config: Path) -> None:
    results = config.parent.parent / "out"
    exps = results / "exps"
    folders.prepare([("results_dir", results), ("exps_dir", exps)], config, overwrite=False)
    fill_like_a_run(results)
    (exps / "a.json").write_text(json.dumps({"name": "a", "ds_config": {}, "num_gpus": 1, "num_nodes": 1}))
    folders.prepare([("results_dir", results), ("exps_dir", exps)], config, overwrite=True)
    assert sorted(p.name for p in results.iterdir()) == [folders.MARKER, "exps"]
    assert [p.name for p in exps.iterdir()] == [folders.MARKER]
