"""An interrupted search's outputs say so (`scheduler.report.outputs`): cancelled lines, a partial best under
a partial name, "interrupted" in summary.txt; results.csv beside results.jsonl; the slot timeline."""
from __future__ import annotations

import csv
import json
from pathlib import Path

from rich.console import Console

from scheduler.report.outputs import OPTIMAL_FILES, PARTIAL_FILES, cancelled_record, print_table, write_results
from scheduler.report.rows import CancelledRecord, row_of
from scheduler.search.ranking import best, metric_value, status_counts
from test_outputs import EXPS, RECORDS, make_exp, make_record, optimal_argv
from workers.slot.records import ExperimentRecord

PNG = b"\x89PNG\r\n\x1a\n"


def _interrupted(tmp_path: Path) -> tuple[dict, dict]:
    """Two of four experiments measured; one was running on two slots, one still queued."""
    records = {name: RECORDS[name] for name in (EXPS[0].name, EXPS[1].name)}
    running = {"started": 150.0, "queues": ["n.gpu0", "n.gpu1"]}
    cancelled = {EXPS[2].name: cancelled_record(EXPS[2], running, 160.0),
                 EXPS[3].name: cancelled_record(EXPS[3], None, 160.0)}
    write_results(tmp_path, EXPS, records, "throughput", True, 60.0, optimal_argv, cancelled=cancelled)
    return records, cancelled


def test_interrupted_search_is_not_called_optimal(tmp_path: Path) -> None:
    _interrupted(tmp_path)
    assert not any((tmp_path / name).exists() for name in OPTIMAL_FILES)
    partial = json.loads((tmp_path / PARTIAL_FILES[0]).read_text())
    assert partial["train_micro_batch_size_per_gpu"] == 1 and "autotuning" not in partial  # z0 mbs 1, the only ok
    assert str((tmp_path / PARTIAL_FILES[0]).resolve()) in (tmp_path / PARTIAL_FILES[1]).read_text()
    summary = (tmp_path / "summary.txt").read_text()
    assert "Tuning interrupted" in summary and "Tuning completed" not in summary
    assert "Experiments measured: 2; cancelled while running or queued: 2" in summary
    assert PARTIAL_FILES[0] in summary


def test_cancelled_experiments_have_results_lines(tmp_path: Path) -> None:
    _interrupted(tmp_path)
    lines = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [(line["name"], line["status"]) for line in lines] == [
        (EXPS[0].name, "ok"), (EXPS[1].name, "oom"), (EXPS[2].name, "cancelled"), (EXPS[3].name, "cancelled")]
    running, queued = lines[2], lines[3]
    assert running["slots"] == ["n.gpu0", "n.gpu1"] and running["wall_s"] == 10.0
    assert running["cause"] == {"error": "cancelled while running"}
    assert queued["slots"] == [] and queued["started_at"] is None and queued["ds_config"] == EXPS[3].ds_config
    rows = list(csv.DictReader((tmp_path / "results.csv").open()))
    assert [row["status"] for row in rows] == ["ok", "oom", "cancelled", "cancelled"]


def test_a_complete_search_removes_a_stale_partial_best(tmp_path: Path) -> None:
    _interrupted(tmp_path)
    write_results(tmp_path, EXPS, RECORDS, "throughput", True, 90.0, optimal_argv)
    assert all((tmp_path / name).exists() for name in OPTIMAL_FILES[:2])
    assert not any((tmp_path / name).exists() for name in PARTIAL_FILES)
    assert "Tuning completed" in (tmp_path / "summary.txt").read_text()


def test_an_interrupted_search_draws_no_plots_and_leaves_no_stale_ones(tmp_path: Path) -> None:
    """A Ctrl-C is not kept waiting for matplotlib; an earlier run's plots would describe another search."""
    write_results(tmp_path, EXPS, RECORDS, "throughput", True, 90.0, optimal_argv)
    assert (tmp_path / "tuning.png").read_bytes()[:8] == PNG == (tmp_path / "timeline.png").read_bytes()[:8]
    _interrupted(tmp_path)
    assert not (tmp_path / "tuning.png").exists() and not (tmp_path / "timeline.png").exists()


def test_interrupted_before_anything_succeeded(tmp_path: Path) -> None:
    cancelled = {e.name: cancelled_record(e, None, 1.0) for e in EXPS}
    assert write_results(tmp_path, EXPS, {}, "throughput", True, 5.0, optimal_argv, cancelled=cancelled) is None
    summary = (tmp_path / "summary.txt").read_text()
    assert "Experiments measured: 0; cancelled while running or queued: 4" in summary
    assert "No experiment succeeded yet" in summary and "Total number of experiments" not in summary
    assert not any((tmp_path / name).exists() for name in (*OPTIMAL_FILES, *PARTIAL_FILES))


def test_results_csv_has_the_knobs_and_every_metric(tmp_path: Path) -> None:
    write_results(tmp_path, EXPS, RECORDS, "throughput", True, 12.0, optimal_argv)
    rows = list(csv.DictReader((tmp_path / "results.csv").open()))
    assert [row["name"] for row in rows] == [e.name for e in EXPS]
    assert [(row["zero_stage"], row["micro_batch_size"]) for row in rows] == [("0", "1"), ("0", "2"), ("1", "1"), ("1", "2")]
    assert rows[3]["throughput"] == "20.0" and rows[3]["metrics.latency"] == "0.6" and rows[1]["throughput"] == ""
    assert rows[0]["slots"] == "n.gpu0 n.gpu1" and rows[0]["peak_rss_mib"] == "1024.0"


def test_timeline_draws_one_row_per_slot(tmp_path: Path) -> None:
    from matplotlib import pyplot

    from scheduler.report import plot

    exps = [make_exp(0, 1), make_exp(0, 2), make_exp(1, 1)]
    oom = {**make_record(exps[1], "oom", 3.0), "slots": ["n.gpu1"], "started_at": 106.0, "ended_at": 109.0}
    ok = make_record(exps[0], "ok", 5.0, throughput=1.0)
    records = [ExperimentRecord.from_json(ok), ExperimentRecord.from_json(oom),
               cancelled_record(exps[2], {"started": 101.0, "queues": ["n.gpu2"]}, 109.0)]
    drawn: list = []
    original = pyplot.Figure.savefig
    pyplot.Figure.savefig = lambda self, *a, **k: (drawn.append(self), original(self, *a, **k))[1]
    try:
        plot.write_timeline(tmp_path / "timeline.png", records, records[0])
    finally:
        pyplot.Figure.savefig = original
    assert (tmp_path / "timeline.png").read_bytes()[:8] == PNG
    axes = drawn[0].axes[0]
    assert [t.get_text() for t in axes.get_yticklabels()] == ["n.gpu0", "n.gpu1", "n.gpu2"]
    bars = [(p.get_y() + p.get_height() / 2, p.get_x(), p.get_width()) for p in axes.patches]
    # z0 mbs 1 on gpu0 and gpu1 from 0 s for 5 s; the OOM on gpu1 from 6 s; the cancelled one on gpu2 from 1 s
    assert sorted((round(y), x, w) for y, x, w in bars) == [(0, 0.0, 5.0), (1, 0.0, 5.0), (1, 6.0, 3.0), (2, 1.0, 8.0)]
    colours = {round(p.get_y() + p.get_height() / 2) * 100 + int(p.get_x()): p.get_facecolor()[:3] for p in axes.patches}
    assert colours[106] != colours[100] and colours[201] != colours[100]  # oom, cancelled, ok: three classes


def test_a_cancelled_row_is_typed_and_round_trips_through_its_json() -> None:
    running = cancelled_record(EXPS[2], {"started": 150.0, "queues": ["n.gpu0", "n.gpu1"]}, 160.0)
    queued = cancelled_record(EXPS[3], None, 160.0)
    assert running.to_json() == {"name": EXPS[2].name, "status": "cancelled", "metrics": None,
                                 "ds_config": EXPS[2].ds_config, "slots": ["n.gpu0", "n.gpu1"], "started_at": 150.0,
                                 "ended_at": 160.0, "wall_s": 10.0, "cause": {"error": "cancelled while running"}}
    assert queued.to_json() == {"name": EXPS[3].name, "status": "cancelled", "metrics": None,
                                "ds_config": EXPS[3].ds_config, "slots": [], "started_at": None, "ended_at": None,
                                "wall_s": None, "cause": {"error": "cancelled while queued"}}
    launched_unstarted = cancelled_record(EXPS[1], {"started": None, "queues": None}, 1.0)
    for row in (running, queued, launched_unstarted):
        assert CancelledRecord.from_json(row.to_json()) == row
        assert row_of(row.to_json()) == row and row_of(row) is row
    assert launched_unstarted.cause == {"error": "cancelled while running"} and launched_unstarted.slots == []
    assert isinstance(row_of(RECORDS[EXPS[0].name]), ExperimentRecord)


def test_a_cancelled_row_is_never_ranked_nor_counted_as_a_failure() -> None:
    row = cancelled_record(EXPS[0], {"started": 1.0, "queues": ["n.gpu0"]}, 2.0)
    measured = ExperimentRecord.from_json(RECORDS[EXPS[3].name])
    assert metric_value(row, "throughput") is None and row.metrics is None and row.peak_rss_bytes is None
    assert best([row, measured], "throughput", True) is measured
    assert best([row], "throughput", True) is None
    assert status_counts([row, measured]) == {"cancelled": 1, "ok": 1}


def test_the_terminal_table_lists_cancelled_rows_beside_the_records_json() -> None:
    records = {name: RECORDS[name] for name in (EXPS[0].name, EXPS[1].name)}
    cancelled = {EXPS[2].name: cancelled_record(EXPS[2], {"started": 150.0, "queues": ["n.gpu0"]}, 160.0)}
    console = Console(record=True, width=200, color_system=None)
    print_table(console, EXPS, {**records, **cancelled}, "throughput", records[EXPS[0].name])
    lines = {line.split()[1]: line for line in console.export_text().splitlines() if "z" in line[:4]}
    assert "cancelled" in lines[EXPS[2].name] and "10.0" in lines[EXPS[2].name]
    assert "*" in lines[EXPS[0].name] and "10.50" in lines[EXPS[0].name]
    assert "oom" in lines[EXPS[1].name] and "*" not in lines[EXPS[1].name] + lines[EXPS[2].name]
