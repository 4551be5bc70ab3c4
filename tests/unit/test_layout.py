"""`workers.files.layout`, the one list of what the tool writes, shared by the writers and the overwrite guard:
the real writers run into a marked folder and `"overwrite": true` must then empty
it; a writer that wrote a file the guard does not know makes these tests fail (the folder is
refused, naming the file), and so does a name dropped from the list (the writer itself refuses).
The rank's and the embedded cluster's writes are run for real in
tests/integration/test_overwrite.py."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from scheduler.errors import ConfigError
from scheduler.inputs import folders
from scheduler.report.outputs import cancelled_record, write_experiment_descriptions, write_results
from test_outputs import EXPS, RECORDS, make_exp, make_record, optimal_argv
from workers.files import layout
from workers.in_rank.device_memory import EXIT_REPORT_ENV, write_exit_report
from workers.in_rank.metrics import write_json_atomic


@pytest.fixture
def config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    path = work / "cfg.json"
    path.write_text("{}")
    return path


def _marked(config: Path, name: str) -> Path:
    folder = config.parent / name
    folders.prepare([("results_dir", folder)], config, overwrite=False)
    return folder


def _overwrite_empties(config: Path, folder: Path) -> None:
    """What the next run with `"overwrite": true` does: it must accept and empty the folder."""
    written = sorted(p.name for p in folder.iterdir())
    folders.prepare([("results_dir", folder)], config, overwrite=True)
    assert [p.name for p in folder.iterdir()] == [layout.MARKER], written


def _multi_node_winner() -> tuple[list, dict]:
    exp = make_exp(0, 2, num_nodes=2, num_gpus=1)
    record = make_record(exp, "ok", throughput=5.0)
    record["ranks"] = [{"rank": 0, "node": "a", "device": 0}, {"rank": 1, "node": "b", "device": 0}]
    return [exp], {exp.name: record}


@pytest.mark.parametrize("ending", ["finished", "interrupted", "multi-node", "nothing-succeeded"])
def test_what_the_report_writes_the_guard_knows(config: Path, ending: str) -> None:
    folder = _marked(config, "results")
    experiments, records, cancelled = EXPS, RECORDS, None
    if ending == "interrupted":
        records = {name: RECORDS[name] for name in (EXPS[0].name, EXPS[1].name)}
        cancelled = {EXPS[2].name: cancelled_record(EXPS[2], {"started": 1.0, "queues": ["n.gpu0"]}, 2.0),
                     EXPS[3].name: cancelled_record(EXPS[3], None, 2.0)}
    elif ending == "multi-node":
        experiments, records = _multi_node_winner()
    elif ending == "nothing-succeeded":
        records = {EXPS[1].name: RECORDS[EXPS[1].name]}
    write_results(folder, experiments, records, "throughput", True, 9.0, optimal_argv, cancelled=cancelled)
    names = {p.name for p in folder.iterdir()}
    expected = {"interrupted": layout.PARTIAL_FILES[:2], "finished": layout.OPTIMAL_FILES[:2],
                "multi-node": layout.OPTIMAL_FILES, "nothing-succeeded": ()}[ending]
    assert {layout.RESULTS_CSV, *expected} <= names  # each ending's files, from the real writers
    assert (layout.TIMELINE_PLOT in names) == (ending != "interrupted")  # a Ctrl-C draws no plots
    _overwrite_empties(config, folder)


def test_experiment_descriptions_are_known(config: Path) -> None:
    folder = _marked(config, "exps")
    write_experiment_descriptions(folder, EXPS)
    assert len(list(folder.glob("*.json"))) == len(EXPS)
    _overwrite_empties(config, folder)


def test_what_a_rank_process_writes_the_guard_knows(config: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The files the training process itself writes into its experiment folder, through our helpers:
    the exit report (and the interim report's temporary file an abrupt end leaves), the metric file's
    atomic write (and its temporary file), next to the slot's own ds_config.json."""
    folder = _marked(config, "results")
    experiment = folder / "z1_gas1_tmbspg2"
    experiment.mkdir()
    (experiment / layout.DS_CONFIG).write_text("{}")
    monkeypatch.setenv(EXIT_REPORT_ENV, str(experiment / "rank{rank}.exit.json"))
    monkeypatch.setenv("RANK", "3")
    write_exit_report({"peak": 1})
    (experiment / f"{layout.exit_report(3)}.4242.tmp").write_text("{")  # killed between write and rename
    write_json_atomic(str(experiment / layout.METRICS), {"throughput": 1.0})
    (experiment / ".tmp-k2j4x9.json").write_text("{")  # killed between write and rename
    assert {p.name for p in experiment.iterdir()} == {layout.DS_CONFIG, "rank3.exit.json", "rank3.exit.json.4242.tmp",
                                                      layout.METRICS, ".tmp-k2j4x9.json"}
    _overwrite_empties(config, folder)


@pytest.mark.parametrize("rank", [0, 1, 7])
def test_every_per_rank_file_is_known(rank: int) -> None:
    for stream in layout.RANK_STREAMS:
        assert layout.is_experiment_file(layout.rank_log(rank, stream))
    assert layout.is_experiment_file(Path(layout.rank_log(rank, "op_prebuild")).with_suffix(".json").name)
    assert layout.is_experiment_file(layout.exit_report(rank))
    assert layout.rank_log(0, "stdout") == "stdout.log" and layout.rank_log(2, "stderr") == "rank2.stderr.log"


@pytest.mark.parametrize(
    ("check", "folder_of", "name"),
    [(layout.result_file, "results", "notes.txt"), (layout.result_file, "results", "../summary.txt"),
     (layout.experiment_file, "exp", "checkpoint.pt"), (layout.experiment_file, "exp", "sub/metrics.json"),
     (layout.cluster_file, "cluster", "secrets.txt")],
)
def test_a_writer_cannot_write_a_name_the_list_lacks(tmp_path: Path, check, folder_of: str, name: str) -> None:
    with pytest.raises(ValueError, match="workers.files.layout"):
        check(tmp_path / folder_of, name)


def test_a_foreign_file_beside_what_the_writers_wrote_is_still_refused_and_kept(config: Path) -> None:
    folder = _marked(config, "results")
    write_results(folder, EXPS, RECORDS, "throughput", True, 9.0, optimal_argv)
    (folder / "results.csv.bak").write_text("mine")
    with pytest.raises(ConfigError, match="results.csv.bak was not written by celery-autotune"):
        folders.prepare([("results_dir", folder)], config, overwrite=True)
    assert (folder / "results.csv.bak").read_text() == "mine" and (folder / layout.SUMMARY).is_file()


def test_descriptions_keep_the_keys_the_guard_reads(tmp_path: Path) -> None:
    write_experiment_descriptions(tmp_path, EXPS[:1])
    assert set(json.loads((tmp_path / f"{EXPS[0].name}.json").read_text())) == layout.DESCRIPTION_KEYS
