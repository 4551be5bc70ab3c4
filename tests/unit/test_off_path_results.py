"""A resumed search can take another path: what an earlier run measured off it stays in the results.

A job that gave an experiment up as `lost` is resumed by running its command again; the resume runs
the lost experiment, and with its reading the search may decide otherwise and never name the
re-measurements the first run made after it. Those readings are measurements all the same: they
are listed in results.jsonl and results.csv and named in summary.txt, never crowned (only what the
search itself confirmed can win).
"""
from __future__ import annotations

import json
from pathlib import Path

from scheduler.cluster.progress import measured_off_path
from scheduler.report.outputs import write_results
from scheduler.search.space import PROFILE
from workers.slot.records import ExperimentRecord
from test_outputs import make_exp, make_record, optimal_argv


def _folder(root: Path, exp, record: dict | None) -> None:
    """An experiment folder as a launch leaves it: exp.json is DeepSpeed's description (no stage or
    sizes: those are in the config), the record beside it once the experiment was recorded."""
    folder = root / exp.name
    folder.mkdir(parents=True)
    (folder / "exp.json").write_text(json.dumps({
        "name": exp.name, "exp_id": 3, "num_gpus": exp.num_gpus, "num_nodes": exp.num_nodes,
        "result_dir": str(folder), "slots": ["n.gpu0", "n.gpu1"], "user_script": "/x/train.py",
        "user_args": ["--deepspeed_config", str(folder / "ds_config.json")], "ds_config": exp.ds_config}))
    if record is not None:
        (folder / "result.json").write_text(json.dumps(record))


def test_only_recorded_folders_off_the_path_are_found(tmp_path: Path) -> None:
    on_path, off, unfinished, stale = make_exp(1, 2), make_exp(1, 4), make_exp(2, 2), make_exp(2, 4)
    given_up = make_exp(3, 2)
    _folder(tmp_path, given_up, make_record(given_up, "lost"))
    _folder(tmp_path, on_path, make_record(on_path, "ok", throughput=1.0))
    _folder(tmp_path, off, make_record(off, "ok", throughput=2.0))
    _folder(tmp_path, unfinished, None)
    _folder(tmp_path, stale, {**make_record(stale, "ok", throughput=3.0), "stale": True})
    profile = make_exp(0, 1)
    (tmp_path / PROFILE).mkdir()
    (tmp_path / PROFILE / "exp.json").write_text(json.dumps({"name": PROFILE, "ds_config": profile.ds_config}))
    (tmp_path / PROFILE / "result.json").write_text(json.dumps(make_record(profile, "ok")))

    found = measured_off_path(tmp_path, {on_path.name})
    assert [(exp, record["status"]) for exp, record in found] == [(off, "ok")]
    assert found[0][0].ds_config == off.ds_config and found[0][0].num_gpus == off.num_gpus == 2


def test_off_path_readings_are_listed_and_named_but_never_win(tmp_path: Path) -> None:
    kept, rechecked = make_exp(1, 2), make_exp(1, 4)
    records = {kept.name: make_record(kept, "ok", throughput=10.0)}
    earlier = make_record(rechecked, "ok", throughput=99.0)

    winner = write_results(tmp_path, [kept], records, "throughput", True, 5.0, optimal_argv,
                           off_path=[(rechecked, earlier)])

    assert winner == ExperimentRecord.from_json(records[kept.name])
    listed = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [(line["name"], line["status"], line.get("off_path")) for line in listed] == [
        (kept.name, "ok", None), (rechecked.name, "ok", True)]
    csv_names = [row.split(",")[0] for row in (tmp_path / "results.csv").read_text().splitlines()[1:]]
    assert csv_names == [kept.name, rechecked.name]
    summary = (tmp_path / "summary.txt").read_text()
    assert f"off this run's path (listed in results.jsonl, not ranked): {rechecked.name}" in summary
    assert json.loads((tmp_path / "ds_config_optimal.json").read_text())["train_micro_batch_size_per_gpu"] == 2
