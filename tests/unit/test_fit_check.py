"""The cost model's check in the results: rows per config, leave one out, the summary section, the plot."""
from __future__ import annotations

from pathlib import Path

import pytest

from scheduler.report.model_fit import fit_text, write_fit_plot
from scheduler.search.fit_check import fit_checks, median_error
from scheduler.search.space import Experiment


def speed(mbs: int, gas: int) -> float:
    return 1.0 / (0.004 / mbs + 0.0004 + 0.06 / (mbs * gas))


def job(lucky: float = 1.0) -> tuple[list[Experiment], dict[str, dict]]:
    """ZeRO-1 at five full-step sizes of a 64-sample step, 16 read twice, 8's reading `lucky` times true."""
    experiments, records = [], {}
    for mbs in (2, 4, 8, 16, 32):
        gas = 64 // mbs
        names = [f"z1_gas{gas}_tmbspg{mbs}"] + ([f"z1_gas{gas}_tmbspg{mbs}_r2"] if mbs == 16 else [])
        for name in names:
            experiments.append(Experiment(name, 1, mbs, gas, {}))
            value = speed(mbs, gas) * (lucky if mbs == 8 else 1.0)
            records[name] = {"name": name, "status": "ok", "metrics": {"throughput": value}}
    experiments.append(Experiment("z1_gas1_tmbspg64", 1, 64, 1, {}))
    records["z1_gas1_tmbspg64"] = {"name": "z1_gas1_tmbspg64", "status": "oom"}
    return experiments, records


def test_every_measured_config_is_predicted_from_the_others_of_its_space() -> None:
    experiments, records = job()
    rows = fit_checks(experiments, records, "throughput", maximize=True)
    assert [(row.mbs, row.readings) for row in rows] == [(2, 1), (4, 1), (8, 1), (16, 2), (32, 1)]
    for row in rows:
        assert row.predicted == pytest.approx(speed(row.mbs, row.gas), rel=0.02)
    assert median_error(rows) < 0.02


def test_a_lucky_reading_shows_in_its_ratio_and_the_summary() -> None:
    experiments, records = job(lucky=1.5)
    rows = fit_checks(experiments, records, "throughput", maximize=True)
    eight = next(row for row in rows if row.mbs == 8)
    assert eight.ratio == pytest.approx(1.5, rel=0.05)
    text = fit_text(rows)
    assert "z1_gas8_tmbspg8" in text and "Median error" in text


def test_a_latency_or_too_few_configs_give_no_section(tmp_path: Path) -> None:
    experiments, records = job()
    assert fit_checks(experiments, records, "latency", maximize=False) == []
    few = fit_checks(experiments[:3], records, "throughput", maximize=True)
    assert all(row.predicted is None for row in few) and fit_text(few) == ""
    assert not write_fit_plot(tmp_path / "model_fit.png", few, "throughput")
    assert not (tmp_path / "model_fit.png").exists()


def test_the_plot_is_drawn(tmp_path: Path) -> None:
    experiments, records = job()
    path = tmp_path / "model_fit.png"
    assert write_fit_plot(path, fit_checks(experiments, records, "throughput", maximize=True), "throughput")
    assert path.stat().st_size > 1000
