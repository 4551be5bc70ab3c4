"""What a tuning job leaves behind (`scheduler.report.outputs`): summary table, results.jsonl, optimal config/command."""
from __future__ import annotations

import dataclasses
import json
import math
import shlex
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from scheduler.inputs.arguments import with_config
from scheduler.report.outputs import (
    FAILURE_CLASSES,
    RECORD_KEYS,
    launch_command,
    print_table,
    summary_text,
    write_experiment_descriptions,
    write_results,
)
from scheduler.search.space import Experiment, experiment_name
from workers.slot.records import ExperimentRecord

RESULT_KEYS = ["name", "status", "metrics", "ds_config", "wall_s", "started_at", "ended_at", "peak_rss_bytes",
               "slots", "cause", "exit_after_metrics"]


def make_exp(stage: int, mbs: int, gas: int = 1, num_nodes: int = 1, num_gpus: int = 2) -> Experiment:
    ds_config = {
        "train_micro_batch_size_per_gpu": mbs,
        "gradient_accumulation_steps": gas,
        "train_batch_size": mbs * gas * num_nodes * num_gpus,
        "zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu"}},
        "autotuning": {"enabled": True, "start_profile_step": 3, "end_profile_step": 5},
    }
    return Experiment(experiment_name(stage, gas, mbs), stage, mbs, gas, ds_config, num_nodes, num_gpus)


def make_record(exp: Experiment, status: str, wall_s: float | None = 1.0, **metrics: float) -> dict[str, Any]:
    record: dict[str, Any] = {
        "name": exp.name, "exp_id": f"id-{exp.name}", "status": status,
        "metrics": metrics if status == "ok" else None, "ds_config": exp.ds_config, "slots": ["n.gpu0", "n.gpu1"],
        "started_at": 100.0, "ended_at": 100.0 + (wall_s or 0.0), "wall_s": wall_s, "peak_rss_bytes": 2**30,
        "ranks": [{"rank": 0}],
    }
    if status != "ok":
        record["cause"] = {"rank": 1, "exit": 1}
    return record


def table_rows(text: str) -> list[list[str]]:
    """The body rows of a tabulate 'pipe' table, cells stripped."""
    lines = [line for line in text.splitlines() if line.startswith("|")]
    header, separator, *body = lines
    assert set(separator) <= set("|:- ")
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in body]


def num(cell: str) -> float | None:
    return float(cell) if cell else None


# z0: mbs 1 ok (10.5), mbs 2 oom; z1: mbs 1 crashed, mbs 2 ok (20)
EXPS = [make_exp(0, 1), make_exp(0, 2), make_exp(1, 1), make_exp(1, 2)]
RECORDS = {
    EXPS[0].name: make_record(EXPS[0], "ok", 2.0, throughput=10.5, latency=0.4),
    EXPS[1].name: make_record(EXPS[1], "oom", 1.5),
    EXPS[2].name: make_record(EXPS[2], "crashed", 1.0),
    EXPS[3].name: make_record(EXPS[3], "ok", 3.0, throughput=20.0, latency=0.6),
}

# ---------------------------------------------------------------- summary


def test_summary_header() -> None:
    text = summary_text(EXPS, RECORDS, "throughput", True, 10.0)
    header = [cell.strip() for cell in text.splitlines()[0].strip("|").split("|")]
    assert header == ["tuning_space", "num_experiments", "best_metric_val", "best_exp_name", "experiment_s",
                      "failures"]


@pytest.mark.parametrize(
    ("metric", "maximize", "expected"),
    [
        ("throughput", True, [
            ["z0", 2, 10.5, "z0_gas1_tmbspg1", 3.5, "oom=1"],
            ["z1", 2, 20.0, "z1_gas1_tmbspg2", 4.0, "crashed=1"],
            ["global", 4, 20.0, "z1_gas1_tmbspg2", 7.5, "oom=1, crashed=1"],
        ]),
        ("latency", False, [
            ["z0", 2, 0.4, "z0_gas1_tmbspg1", 3.5, "oom=1"],
            ["z1", 2, 0.6, "z1_gas1_tmbspg2", 4.0, "crashed=1"],
            ["global", 4, 0.4, "z0_gas1_tmbspg1", 7.5, "oom=1, crashed=1"],
        ]),
    ],
)
def test_summary_rows_per_stage_then_global(metric: str, maximize: bool, expected: list[list[Any]]) -> None:
    text = summary_text(EXPS, RECORDS, metric, maximize, 10.0)
    rows = table_rows(text)
    parsed = [[r[0], int(r[1]), num(r[2]), r[3], num(r[4]), r[5]] for r in rows]
    assert parsed == expected
    assert f"Metric: {metric} ({'max' if maximize else 'min'})." in text


def test_summary_shows_the_mean_the_winner_was_picked_on() -> None:
    original = EXPS[3]
    repeat = Experiment(original.name + "_r2", 1, 2, 1, original.ds_config, 1, 2)
    records = {**RECORDS, repeat.name: make_record(repeat, "ok", 3.0, throughput=22.0, latency=0.6)}
    rows = {r[0]: r for r in table_rows(summary_text([*EXPS, repeat], records, "throughput", True, 10.0))}
    assert num(rows["global"][2]) == 21.0 and rows["global"][3] == f"{original.name} (mean of 2)"
    assert num(rows["z0"][2]) == 10.5 and rows["z0"][3] == EXPS[0].name


def test_summary_total_line() -> None:
    text = summary_text(EXPS, RECORDS, "throughput", True, 65.0)
    assert text.endswith("\n\nTuning completed in 0:01:05. Total number of experiments: 4. "
                         "Metric: throughput (max).\n")


@pytest.mark.parametrize(("elapsed", "shown"), [(0.0, "0:00:00"), (59.96, "0:01:00"), (3725.0, "1:02:05"),
                                                (90000.0, "1 day, 1:00:00")])
def test_summary_elapsed(elapsed: float, shown: str) -> None:
    assert f"Tuning completed in {shown}." in summary_text(EXPS, RECORDS, "throughput", True, elapsed)


def test_summary_nothing_succeeded() -> None:
    records = {e.name: make_record(e, status, None) for e, status in zip(EXPS, ["oom", "timeout", "lost", "oom"])}
    text = summary_text(EXPS, records, "throughput", True, 1.0)
    rows = table_rows(text)
    assert [r[0] for r in rows] == ["z0", "z1", "global"]
    assert [(r[2], r[3]) for r in rows] == [("", ""), ("", ""), ("", "")]
    assert [num(r[4]) for r in rows] == [0.0, 0.0, 0.0]
    assert [r[5] for r in rows] == ["oom=1, timeout=1", "oom=1, lost=1", "oom=2, timeout=1, lost=1"]


def test_summary_failure_columns_in_class_order() -> None:
    statuses = ["lost", "aborted", "rendezvous_failed", "no_metrics", "crashed", "timeout", "oom", "crashed"]
    exps = [make_exp(2, mbs) for mbs in range(1, len(statuses) + 1)]
    records = {e.name: make_record(e, s) for e, s in zip(exps, statuses)}
    rows = table_rows(summary_text(exps, records, "throughput", True, 1.0))
    expected = "oom=1, timeout=1, crashed=2, no_metrics=1, rendezvous_failed=1, aborted=1, lost=1"
    assert [r[5] for r in rows] == [expected, expected]
    assert FAILURE_CLASSES == ["oom", "timeout", "crashed", "no_metrics", "bad_metrics", "rendezvous_failed",
                               "aborted", "lost"]


def test_summary_no_failures_dash() -> None:
    exps = [make_exp(3, 4)]
    records = {exps[0].name: make_record(exps[0], "ok", 1.25, throughput=3.0)}
    rows = table_rows(summary_text(exps, records, "throughput", True, 1.0))
    assert [r[0] for r in rows] == ["z3", "global"]
    assert [r[5] for r in rows] == ["-", "-"]
    assert [r[3] for r in rows] == ["z3_gas1_tmbspg4", "z3_gas1_tmbspg4"]


def test_summary_spaces_follow_experiment_order_and_skip_unrecorded() -> None:
    exps = [make_exp(3, 1), make_exp(3, 2), make_exp(0, 1), make_exp(2, 1)]
    records = {e.name: make_record(e, "ok", 1.0, throughput=float(i)) for i, e in enumerate(exps[:3])}
    text = summary_text(exps, records, "throughput", True, 1.0)
    rows = table_rows(text)
    assert [(r[0], int(r[1])) for r in rows] == [("z3", 2), ("z0", 1), ("global", 3)]
    assert rows[0][3] == "z3_gas1_tmbspg2"
    assert rows[2][3] == "z0_gas1_tmbspg1"
    assert "Total number of experiments: 3." in text


def test_summary_tie_keeps_earlier_experiment() -> None:
    exps = [make_exp(1, 1), make_exp(1, 2)]
    records = {e.name: make_record(e, "ok", 1.0, throughput=5.0) for e in exps}
    rows = table_rows(summary_text(exps, records, "throughput", True, 1.0))
    assert [r[3] for r in rows] == ["z1_gas1_tmbspg1", "z1_gas1_tmbspg1"]


# ---------------------------------------------------------------- write_results


def optimal_argv(exp: Experiment, path: Path) -> list[str]:
    return with_config("/x/train.py", ("--steps", "5", "--name", "a b"), path)


def test_results_lines_hold_fields_of_the_record_type(tmp_path: Path) -> None:
    """results.jsonl's keys are `ExperimentRecord`'s own: a field renamed in the type would leave a
    column of None here."""
    assert set(RECORD_KEYS) <= {spec.name for spec in dataclasses.fields(ExperimentRecord)} - {"extra"}
    written = json.loads((Path(__file__).parent / "records" / "tuning_ok.json").read_text())
    exp = Experiment(written["name"], 1, 35, 1, written["ds_config"])
    write_results(tmp_path, [exp], {exp.name: written}, "throughput", True, 1.0, optimal_argv)
    line = json.loads((tmp_path / "results.jsonl").read_text())
    record = ExperimentRecord.from_json(written)
    assert line == {key: record.to_json().get(key) for key in RECORD_KEYS}
    assert (line["status"], line["wall_s"], line["slots"]) == (record.status.value, record.wall_s, record.slots)


def test_write_results_files(tmp_path: Path) -> None:
    results_dir = tmp_path / "deep" / "results"
    winner = write_results(results_dir, EXPS, RECORDS, "throughput", True, 12.0, optimal_argv)
    assert winner == ExperimentRecord.from_json(RECORDS[EXPS[3].name])

    lines = (results_dir / "results.jsonl").read_text().splitlines()
    assert len(lines) == len(EXPS)
    parsed = [json.loads(line) for line in lines]
    assert [p["name"] for p in parsed] == [e.name for e in EXPS]
    assert all(list(p) == RESULT_KEYS for p in parsed)
    assert [p["status"] for p in parsed] == ["ok", "oom", "crashed", "ok"]
    assert parsed[0]["metrics"] == {"throughput": 10.5, "latency": 0.4}
    assert parsed[0]["cause"] is None
    assert parsed[1]["cause"] == {"rank": 1, "exit": 1}
    assert parsed[3]["ds_config"] == EXPS[3].ds_config
    assert "ranks" not in parsed[0] and "exp_id" not in parsed[0]

    summary = (results_dir / "summary.txt").read_text()
    assert [[r[0], int(r[1]), num(r[2]), r[3], num(r[4]), r[5]] for r in table_rows(summary)] == [
        ["z0", 2, 10.5, "z0_gas1_tmbspg1", 3.5, "oom=1"],
        ["z1", 2, 20.0, "z1_gas1_tmbspg2", 4.0, "crashed=1"],
        ["global", 4, 20.0, "z1_gas1_tmbspg2", 7.5, "oom=1, crashed=1"],
    ]
    assert summary.endswith("Tuning completed in 0:00:12. Total number of experiments: 4. Metric: throughput (max).\n")
    assert_drawn_png(results_dir / "tuning.png")

    optimal_path = (results_dir / "ds_config_optimal.json").resolve()
    optimal = json.loads(optimal_path.read_text())
    assert "autotuning" not in optimal
    assert optimal == {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "train_batch_size": 4,
        "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}},
    }
    assert "autotuning" in EXPS[3].ds_config  # the experiment's own config is untouched

    command_text = (results_dir / "cmd_optimal.txt").read_text()
    assert command_text.endswith("\n") and command_text.count("\n") == 1
    assert shlex.split(command_text) == [
        "deepspeed", "--num_nodes", "1", "--num_gpus", "2", "/x/train.py", "--steps", "5", "--name", "a b",
        "--deepspeed_config", str(optimal_path),
    ]
    assert optimal_path.is_absolute()


def test_write_results_latency_winner_and_argv_arguments(tmp_path: Path) -> None:
    calls: list[tuple[Experiment, Path]] = []

    def argv(exp: Experiment, path: Path) -> list[str]:
        calls.append((exp, path))
        return ["train.py", "--deepspeed_config", str(path)]

    winner = write_results(tmp_path, EXPS, RECORDS, "latency", False, 1.0, argv)
    assert winner == ExperimentRecord.from_json(RECORDS[EXPS[0].name])
    assert len(calls) == 1
    assert calls[0][0] is EXPS[0]
    assert calls[0][1] == (tmp_path / "ds_config_optimal.json").resolve()
    optimal = json.loads((tmp_path / "ds_config_optimal.json").read_text())
    assert optimal["train_micro_batch_size_per_gpu"] == 1
    assert optimal["zero_optimization"]["stage"] == 0


def test_write_results_multi_node_command(tmp_path: Path) -> None:
    exps = [make_exp(2, 8, gas=2, num_nodes=2, num_gpus=4)]
    records = {exps[0].name: make_record(exps[0], "ok", throughput=1.0)}
    write_results(tmp_path, exps, records, "throughput", True, 1.0, optimal_argv)
    command = shlex.split((tmp_path / "cmd_optimal.txt").read_text())
    assert command[:5] == ["deepspeed", "--num_nodes", "2", "--num_gpus", "4"]
    assert json.loads((tmp_path / "ds_config_optimal.json").read_text())["train_batch_size"] == 128  # 8 * 2 * 2 * 4


def test_write_results_only_recorded_experiments(tmp_path: Path) -> None:
    records = {EXPS[2].name: RECORDS[EXPS[2].name], EXPS[0].name: RECORDS[EXPS[0].name]}
    write_results(tmp_path, EXPS, records, "throughput", True, 1.0, optimal_argv)
    names = [json.loads(line)["name"] for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert names == [EXPS[0].name, EXPS[2].name]  # experiment order, not dict order


def test_write_results_nothing_succeeded_removes_stale_optimal_files(tmp_path: Path) -> None:
    (tmp_path / "ds_config_optimal.json").write_text('{"stale": true}\n')
    (tmp_path / "cmd_optimal.txt").write_text("deepspeed stale.py\n")
    records = {e.name: make_record(e, "crashed") for e in EXPS}
    calls: list[Any] = []
    result = write_results(tmp_path, EXPS, records, "throughput", True, 1.0,
                           lambda exp, path: calls.append(exp) or [])
    assert result is None
    assert calls == []
    assert not (tmp_path / "ds_config_optimal.json").exists()
    assert not (tmp_path / "cmd_optimal.txt").exists()
    assert len((tmp_path / "results.jsonl").read_text().splitlines()) == 4
    assert "crashed=4" in (tmp_path / "summary.txt").read_text()


def test_write_results_no_records(tmp_path: Path) -> None:
    assert write_results(tmp_path, EXPS, {}, "throughput", True, 0.0, optimal_argv) is None
    assert (tmp_path / "results.jsonl").read_text() == ""
    assert "Total number of experiments: 0." in (tmp_path / "summary.txt").read_text()
    assert not (tmp_path / "cmd_optimal.txt").exists()


def test_write_results_overwrites_previous_winner(tmp_path: Path) -> None:
    write_results(tmp_path, EXPS, RECORDS, "throughput", True, 1.0, optimal_argv)
    write_results(tmp_path, EXPS, RECORDS, "latency", False, 1.0, optimal_argv)
    optimal = json.loads((tmp_path / "ds_config_optimal.json").read_text())
    assert optimal["train_micro_batch_size_per_gpu"] == 1
    assert optimal["zero_optimization"]["stage"] == 0


# ---------------------------------------------------------------- smaller pieces


def _ranks(*placed: tuple[str, int, int | None]) -> dict[str, Any]:
    """A winner's record whose rank i ran on node placed[i][0], slot device placed[i][1], GPU placed[i][2]."""
    return {"name": "winner", "ranks": [{"rank": i, "node": node, "device": device,
                       **({"cuda_index": cuda} if cuda is not None else {})}
                      for i, (node, device, cuda) in enumerate(placed)]}


def _threads(record: dict[str, Any], *threads: int) -> dict[str, Any]:
    """`record` with rank i's slot giving it threads[i] CPU threads."""
    return {**record, "ranks": [{**rank, "threads": count} for rank, count in zip(record["ranks"], threads)]}


def _nccl(record: dict[str, Any], *interfaces: str) -> dict[str, Any]:
    """`record` with rank i's NCCL_SOCKET_IFNAME interfaces[i]."""
    return {**record, "ranks": [{**rank, "nccl_socket_ifname": name}
                                for rank, name in zip(record["ranks"], interfaces)]}


@pytest.mark.parametrize(
    ("argv", "nodes", "gpus", "record", "local_rank_arg", "expected", "hostfile"),
    [
        (["t.py"], 1, 1, None, True, ["deepspeed", "--num_nodes", "1", "--num_gpus", "1", "t.py"], None),
        (["t.py", "--a", "b c"], 2, 8, None, True,
         ["deepspeed", "--num_nodes", "2", "--num_gpus", "8", "t.py", "--a", "b c"], None),
        # CPU slots: counts, as before; the local rank only in the environment on both sides
        (["t.py"], 1, 2, _ranks(("n", 0, None), ("n", 1, None)), False,
         ["deepspeed", "--num_nodes", "1", "--num_gpus", "2", "--no_local_rank", "t.py"], None),
        # CUDA: exactly the GPUs the winner used, not every GPU of the node
        (["t.py"], 1, 2, _ranks(("gpu-a", 1, 5), ("gpu-a", 2, 3)), True,
         ["CUDA_DEVICE_ORDER=PCI_BUS_ID", "deepspeed", "--include", "localhost:5,3", "t.py"], None),
        # two nodes: a hostfile of the nodes used, in rank order, and their GPUs
        (["t.py"], 2, 2, _ranks(("b", 0, 2), ("b", 1, 3), ("a", 0, 0), ("a", 1, 1)), False,
         ["CUDA_DEVICE_ORDER=PCI_BUS_ID", "deepspeed", "--hostfile", "/r/hostfile_optimal", "--include", "b:2,3@a:0,1",
          "--no_local_rank", "t.py"],
         "b slots=4\na slots=2\n"),
        (["t.py"], 2, 1, _ranks(("b", 0, None), ("a", 0, None)), True,
         ["deepspeed", "--hostfile", "/r/hostfile_optimal", "--num_nodes", "2", "--num_gpus", "1", "t.py"],
         "b slots=1\na slots=1\n"),
        # two nodes over one named interface: the final run's NCCL uses the network the winner was measured on
        (["t.py"], 2, 1, _nccl(_ranks(("b", 0, 2), ("a", 0, 0)), "=eth1", "=eth1"), True,
         ["CUDA_DEVICE_ORDER=PCI_BUS_ID", "NCCL_SOCKET_IFNAME==eth1", "deepspeed", "--hostfile", "/r/hostfile_optimal",
          "--include", "b:2@a:0", "t.py"], "b slots=3\na slots=1\n"),
        # interfaces named differently per node cannot go on one command line; one node never needs it
        (["t.py"], 2, 1, _nccl(_ranks(("b", 0, 2), ("a", 0, 0)), "=eth1", "=ib0"), True,
         ["CUDA_DEVICE_ORDER=PCI_BUS_ID", "deepspeed", "--hostfile", "/r/hostfile_optimal", "--include", "b:2@a:0",
          "t.py"], "b slots=3\na slots=1\n"),
        (["t.py"], 1, 2, _nccl(_ranks(("gpu-a", 1, 5), ("gpu-a", 2, 3)), "=lo", "=lo"), True,
         ["CUDA_DEVICE_ORDER=PCI_BUS_ID", "deepspeed", "--include", "localhost:5,3", "t.py"], None),
        # the threads every rank had on its slot: the winner was measured with them
        (["t.py"], 1, 2, _threads(_ranks(("n", 0, None), ("n", 1, None)), 1, 1), True,
         ["OMP_NUM_THREADS=1", "MKL_NUM_THREADS=1", "deepspeed", "--num_nodes", "1", "--num_gpus", "2", "t.py"], None),
        # slots that differ (a record from before the field, or unequal nodes): nothing is claimed
        (["t.py"], 1, 2, _threads(_ranks(("n", 0, None), ("n", 1, None)), 1, 2), True,
         ["deepspeed", "--num_nodes", "1", "--num_gpus", "2", "t.py"], None),
    ],
)
def test_launch_command(argv: list[str], nodes: int, gpus: int, record: dict[str, Any] | None,
                        local_rank_arg: bool, expected: list[str], hostfile: str | None) -> None:
    typed = ExperimentRecord.from_json(record) if record is not None else None
    assert launch_command(argv, nodes, gpus, record=typed, local_rank_arg=local_rank_arg,
                          hostfile=Path("/r/hostfile_optimal")) == (expected, hostfile)


def test_write_results_writes_the_hostfile_the_command_names(tmp_path: Path) -> None:
    exps = [make_exp(2, 8, gas=2, num_nodes=2, num_gpus=1)]
    placed = _ranks(("n2", 0, 1), ("n1", 0, 0))["ranks"]
    records = {exps[0].name: {**make_record(exps[0], "ok", throughput=1.0), "ranks": placed}}
    write_results(tmp_path, exps, records, "throughput", True, 1.0, optimal_argv, local_rank_arg=False)
    command = shlex.split((tmp_path / "cmd_optimal.txt").read_text())
    assert command[:7] == ["CUDA_DEVICE_ORDER=PCI_BUS_ID", "deepspeed", "--hostfile",
                           str((tmp_path / "hostfile_optimal").resolve()),
                           "--include", "n2:1@n1:0", "--no_local_rank"]
    assert (tmp_path / "hostfile_optimal").read_text() == "n2 slots=2\nn1 slots=1\n"
    records[exps[0].name]["status"] = "crashed"
    write_results(tmp_path, exps, records, "throughput", True, 1.0, optimal_argv)
    assert not (tmp_path / "hostfile_optimal").exists()  # no winner: no stale hostfile either


def test_write_experiment_descriptions(tmp_path: Path) -> None:
    exps = [make_exp(0, 1), make_exp(3, 4, num_nodes=2, num_gpus=4)]
    write_experiment_descriptions(tmp_path / "exps", exps)
    assert sorted(p.name for p in (tmp_path / "exps").iterdir()) == ["z0_gas1_tmbspg1.json", "z3_gas1_tmbspg4.json"]
    assert json.loads((tmp_path / "exps" / "z3_gas1_tmbspg4.json").read_text()) == {
        "name": "z3_gas1_tmbspg4", "ds_config": exps[1].ds_config, "num_gpus": 4, "num_nodes": 2,
    }


def test_write_experiment_descriptions_refuses_unsafe_names(tmp_path: Path) -> None:
    bad = Experiment("../escape", 0, 1, 1, {})
    with pytest.raises(ValueError):
        write_experiment_descriptions(tmp_path / "exps", [bad])
    assert not (tmp_path / "escape.json").exists()


def test_print_table_marks_winner() -> None:
    console = Console(record=True, width=200, color_system=None)
    winner = RECORDS[EXPS[3].name]
    print_table(console, EXPS, RECORDS, "throughput", winner)
    text = console.export_text()
    assert f"{EXPS[3].name} *" in text
    assert f"{EXPS[0].name} *" not in text
    assert "10.50" in text and "20.00" in text
    assert "oom" in text and "crashed" in text
    assert "1,024" in text  # 1 GiB peak RSS in MiB


def assert_drawn_png(path: Path) -> None:
    """The file decodes as a PNG image of a real size with something drawn on it (not one flat colour)."""
    from matplotlib import image

    pixels = image.imread(path)
    assert pixels.ndim == 3 and pixels.shape[0] >= 200 and pixels.shape[1] >= 200
    assert len({tuple(row) for row in pixels.reshape(-1, pixels.shape[2])[::97].tolist()}) > 2


def test_plot_without_any_success_is_still_drawn(tmp_path: Path) -> None:
    from scheduler.report.plot import write_plot

    failed = {e.name: ExperimentRecord.from_json({"name": e.name, "status": "oom", "metrics": None}) for e in EXPS}
    write_plot(tmp_path / "tuning.png", EXPS, failed, "throughput", None)
    write_plot(tmp_path / "empty.png", [], {}, "latency", None)
    assert_drawn_png(tmp_path / "tuning.png")
    assert_drawn_png(tmp_path / "empty.png")


# ---------------------------------------------------------------- the space searched, the winner confirmed


def test_summary_states_the_space_searched_per_stage() -> None:
    text = summary_text(EXPS, RECORDS, "throughput", True, 1.0)
    assert ("  z0: micro-batch 1-2, up to 2 samples per GPU per step (without max_train_batch_size: DeepSpeed's "
            "rule, the stage's top size times gas 1); gas = samples per step // micro-batch") in text.splitlines()
    limited = make_exp(1, 4, gas=8)
    limited.ds_config["autotuning"]["max_train_batch_size"] = 64
    text = summary_text([limited], {limited.name: make_record(limited, "ok", throughput=1.0)}, "throughput", True, 1.0)
    assert ("  z1: micro-batch 4-4, up to 32 samples per GPU per step (from max_train_batch_size 64); "
            "gas = samples per step // micro-batch") in text.splitlines()


def test_summary_gives_winner_and_runner_up_with_their_readings() -> None:
    """z1 mbs 2 read 20 and 22 (mean 21), z0 mbs 1 read 10.5: the pooled noise is z1's own,
    sqrt(2 * (1 / 21)^2) = 6.7 %; the gap (50 %) is 50 / sqrt(6.7^2 / 2 + 6.7^2) = 6.1 standard errors."""
    repeat = Experiment(EXPS[3].name + "_r2", 1, 2, 1, EXPS[3].ds_config, 1, 2)
    records = {**RECORDS, repeat.name: make_record(repeat, "ok", throughput=22.0)}
    lines = summary_text([*EXPS, repeat], records, "throughput", True, 1.0).splitlines()
    assert "Winner: z1_gas1_tmbspg2: 21 throughput, mean of 2 readings (range 20-22)" in lines
    assert "Runner-up: z0_gas1_tmbspg1: 10.5 throughput, mean of 1 reading (range 10.5-10.5)" in lines
    assert ("Separated: the gap, 50.0 %, is 6.1 standard errors of the difference (8.2 %, from a noise per "
            "reading of 6.7 % for the winner and 6.7 % for the runner-up; the configs read more than once spread "
            "6.7 % pooled; a config's noise is that, at least 1 %, or its own spread where larger), more than 2.") in lines


#: (the winner's readings, the runner-up's, metric, the reason the sentence must give). The first row is
#: the README example's: a 32 % gap with the winner read once, which "within 2 standard errors" would misstate.
SEPARATION_CASES = [
    ([28.07], [21.25], "throughput", "read once"),
    ([28.07, 27.5], [21.25], "throughput", "separated"),
    ([20.0, 22.0], [10.5], "throughput", "separated"),
    ([100.0, 101.0], [100.2], "throughput", "within"),
    ([100.0, 100.0], [99.9, 99.9], "throughput", "within"),  # no spread: never below 1 % noise
    ([100.0, 100.0], [96.0, 96.0], "throughput", "separated"),  # 4 % at the 1 % floor: 4 standard errors
    ([100.0, 130.0], [100.0], "throughput", "within"),  # a wide spread of the winner's own
    ([0.40, 0.41], [0.60], "latency", "separated"),  # minimised: the lower mean wins
    ([0.40], [0.401, 0.402], "latency", "read once"),
    ([5.0], [], "throughput", "alone"),
    ([100.0, 101.0, 150.0], [99.0, 99.5], "throughput", "within"),  # three readings: the median, 101
    ([100.0, 101.0, 102.0, 101.5], [90.0, 90.5, 91.0], "throughput", "separated"),
]


def _summary_of(winner: list[float], runner_up: list[float], metric: str) -> list[str]:
    exps, records = [], {}
    for stage, values in ((1, winner), (0, runner_up)):
        base = make_exp(stage, 4)
        for index, value in enumerate(values):
            exp = base if index == 0 else Experiment(f"{base.name}_r{index + 1}", stage, 4, 1, base.ds_config, 1, 2)
            exps.append(exp)
            records[exp.name] = make_record(exp, "ok", **{metric: value})
    return summary_text(exps, records, metric, metric != "latency", 1.0).splitlines()


@pytest.mark.parametrize(("winner", "runner_up", "metric", "reason"), SEPARATION_CASES)
def test_the_separation_sentence_gives_its_reason_and_agrees_with_its_figures(
        winner: list[float], runner_up: list[float], metric: str, reason: str) -> None:
    """The sentence names why (read once / within the noise / separated), and its figures are the
    ones beside it: the gap is the Winner and Runner-up lines' means, and the word follows from the
    gap over its standard error and the winner's count of readings."""
    import re

    lines = _summary_of(winner, runner_up, metric)
    means = {line.split(":")[0]: float(line.split(": ")[2].split(" ")[0])
             for line in lines if line.startswith(("Winner:", "Runner-up:"))}
    [sentence] = [line for line in lines if line.startswith(("Separated", "Not separated", "Not confirmed", "No other"))]
    if reason == "alone":
        assert sentence == "No other config ran, so there is nothing to separate it from." and "Runner-up" not in means
        return
    found = re.search(r"the gap, (-?[0-9.]+) %, is (-?[0-9.]+|inf) standard errors of the difference \(([0-9.]+) %, "
                      r"from a noise per reading of ([0-9.]+) % for the winner and ([0-9.]+) % for the runner-up", sentence)
    assert found, sentence
    gap, z, error, winner_noise, runner_noise = (float(found[i]) for i in (1, 2, 3, 4, 5))
    assert error == pytest.approx(math.hypot(winner_noise / math.sqrt(len(winner)),
                                             runner_noise / math.sqrt(len(runner_up))), abs=0.11)  # rounded
    expected_gap = 100 * abs(means["Winner"] - means["Runner-up"]) / means["Winner"]
    assert gap == pytest.approx(expected_gap, abs=0.06)
    assert z == pytest.approx(gap / error, abs=0.06 + 0.06 * z)
    assert ("mean of 1 reading " in next(l for l in lines if l.startswith("Winner:"))) == (len(winner) == 1)
    if reason == "read once":
        assert sentence.startswith("Not confirmed, read once: the winner was measured once") and len(winner) == 1
    elif reason == "separated":
        assert sentence.startswith("Separated: ") and sentence.endswith("more than 2.") and z > 2
    else:
        assert sentence.startswith("Not separated: ") and ", within 2; " in sentence and z <= 2


def test_a_config_read_three_times_is_given_and_judged_by_its_median() -> None:
    """A lucky 150 among the winner's readings; the summary gives the median it was ranked on."""
    lines = _summary_of([100.0, 150.0, 101.0], [99.0, 99.5], "throughput")
    assert "Winner: z1_gas1_tmbspg4: 101 throughput, median of 3 readings (range 100-150)" in lines
    assert "Runner-up: z0_gas1_tmbspg4: 99.25 throughput, mean of 2 readings (range 99-99.5)" in lines
    assert next(line for line in lines if line.startswith("Not separated")).endswith("the winner by its median.")
    assert any(line.startswith("| global") and "z1_gas1_tmbspg4 (median of 3)" in line for line in lines)


def test_summary_gives_the_error_of_one_reading_from_its_step_times() -> None:
    """z1 mbs 2's one run timed steps 1, 2 and 1 s: the summary says one reading is +-25 %."""
    timed = {**RECORDS, EXPS[3].name: {**make_record(EXPS[3], "ok", throughput=40.0), "step_seconds": [1.0, 2.0, 1.0]}}
    lines = summary_text(EXPS, timed, "throughput", True, 1.0).splitlines()
    assert ("Winner: z1_gas1_tmbspg2: 40 throughput, mean of 1 reading (range 40-40, 25.0 % error of one "
            "reading from its step times)") in lines


@pytest.mark.parametrize(("record", "expected", "hostfile"), [
    (_ranks(("node2", 1, 3)),
     ["CUDA_DEVICE_ORDER=PCI_BUS_ID", "deepspeed", "--hostfile", "/r/hostfile_optimal", "--include", "node2:3", "t.py"],
     "node2 slots=4\n"),
    (_ranks(("node2", 0, None)),
     ["deepspeed", "--hostfile", "/r/hostfile_optimal", "--num_nodes", "1", "--num_gpus", "1", "t.py"],
     "node2 slots=1\n"),
])
def test_a_pool_bounded_winner_names_its_host_even_on_one_node(record: dict[str, Any], expected: list[str],
                                                               hostfile: str) -> None:
    """A tuning bounded by --hostfile/--include/--exclude may win on another node than this
    one; cmd_optimal.txt names it (not localhost), as DeepSpeed's names its pool's hosts."""
    assert launch_command(["t.py"], 1, 1, record=ExperimentRecord.from_json(record), hostfile=Path("/r/hostfile_optimal"),
                          name_hosts=True) == (expected, hostfile)
    winner = ExperimentRecord.from_json(_ranks(("node2", 1, 3)))
    assert "localhost" in " ".join(launch_command(["t.py"], 1, 1, record=winner,
                                                  hostfile=Path("/r/hostfile_optimal"))[0])


def test_the_summary_says_a_config_was_ranked_at_its_stages_curve() -> None:
    """ZeRO-1 at micro-batch 1, 2, 4 and 16 reads 10, 18, 30 and 30; 8 reads 80 and 78, far above
    what the four others predict (in the thirties): it is ranked there, behind ZeRO-2's 8 (60 and
    61), and the summary says why the config with the best readings did not win."""
    exps, records = [], {}
    for stage, mbs, values in ((1, 1, [10.0]), (1, 2, [18.0]), (1, 4, [30.0]), (1, 16, [30.0]),
                               (1, 8, [80.0, 78.0]), (2, 8, [60.0, 61.0])):
        base = make_exp(stage, mbs)
        for index, value in enumerate(values):
            exp = base if index == 0 else Experiment(f"{base.name}_r{index + 1}", stage, mbs, 1, base.ds_config, 1, 2)
            exps.append(exp)
            records[exp.name] = make_record(exp, "ok", throughput=value)
    lines = summary_text(exps, records, "throughput", True, 1.0).splitlines()
    assert "Winner: z2_gas1_tmbspg8: 60.5 throughput, mean of 2 readings (range 60-61)" in lines
    [runner_up] = [line for line in lines if line.startswith("Runner-up:")]
    assert runner_up.startswith("Runner-up: z1_gas1_tmbspg8: 79 throughput, mean of 2 readings (range 78-80; ranked at ")
    assert "what its stage's other sizes predict: its readings beat that curve by over 20 %" in runner_up
