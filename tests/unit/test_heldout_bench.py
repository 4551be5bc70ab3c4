"""bench/heldout.py's script families keep the record contract the search and DeepSpeed's replay read.

Why: the held-out bench is only a fair measure if its records look like what a real run (and
bench/surfaces.py) leaves: an `ok` run with throughput, latency and FLOPS, an out-of-memory run with
no metrics, a profile run with num_params and activation_mem_per_gpu, and a space with an optimum.
Two scripts of each family, every search run once on each.
"""
from __future__ import annotations

import math
from typing import Any

import pytest

from bench.heldout import FAMILIES, GPUS, Machine, Script, deepspeed, every_config_once, make_script, ours

SEEDS = (0, 1)


def _config(script: Script, stage: int, mbs: int, gas: int = 1) -> dict[str, Any]:
    return {**script.user_config(), "train_micro_batch_size_per_gpu": mbs, "gradient_accumulation_steps": gas,
            "zero_optimization": {"stage": stage}}


def _check_ok(script: Script, record: dict[str, Any]) -> None:
    assert record["status"] == "ok" and "exit_code" not in record
    metrics = record["metrics"]
    assert metrics["throughput"] > 0 and metrics["latency"] > 0 and metrics["FLOPS_per_gpu"] > 0
    assert math.isfinite(metrics["throughput"])
    assert isinstance(record["peak_rss_bytes"], int)
    if script.reports_peak:
        assert 0 < record["peak_device_bytes"] <= script.gpu.memory
    else:
        assert "peak_device_bytes" not in record


@pytest.mark.parametrize("family", FAMILIES)
def test_records_space_and_optimum_keep_the_contract(family: str) -> None:
    for seed in SEEDS:
        script = make_script(family, seed)
        assert script.gpu in GPUS.values() and script.world in (4, 8, 16)
        assert script.optimum > 0
        spaces = {stage: script.space(stage) for stage in range(4)}
        assert sum(map(len, spaces.values())) > 0, "DeepSpeed's fast-mode space is empty"
        machine = Machine(script)
        profile = machine.run("profile_model_info", _config(script, 3, 1), profile=True)
        assert profile["status"] == "ok"
        assert profile["metrics"]["num_params"] == script.params > 0
        assert 0 < profile["metrics"]["activation_mem_per_gpu"] < script.activation()[0]
        for stage, space in spaces.items():
            for mbs, gas in space[:: max(1, len(space) // 5)]:
                record = machine.run(f"z{stage}_gas{gas}_tmbspg{mbs}", _config(script, stage, mbs, gas))
                assert record["name"] == f"z{stage}_gas{gas}_tmbspg{mbs}"
                assert record["ds_config"]["train_micro_batch_size_per_gpu"] == mbs
                _check_ok(script, record)
        oom = machine.run("z0_gas1_tmbspg100000", _config(script, 0, 100_000))
        assert oom["status"] == "oom" and oom["exit_code"] == 1 and "metrics" not in oom
        assert (oom.get("oom_from") == "stderr") == (script.failure_status == "crashed")


@pytest.mark.parametrize("family", FAMILIES)
def test_every_search_runs_and_is_measured_against_the_optimum(family: str) -> None:
    for seed in SEEDS:
        script = make_script(family, seed)
        for search in (ours, deepspeed, every_config_once):
            outcome = search(script)
            assert outcome.launches >= 1 and 0 <= outcome.failed <= outcome.launches
            assert outcome.fraction is None or 0 < outcome.fraction < 1.5


def test_user_config_and_the_drifting_machine() -> None:
    script = make_script("drifting", 0)
    config = script.user_config()
    assert config["autotuning"]["enabled"] and config["autotuning"]["fast"]
    assert config["zero_optimization"] == {"stage": "all"}
    assert config["autotuning"].get("max_train_batch_size") == script.max_train_batch_size
    stage, (mbs, gas) = 3, script.space(3)[0]
    runs = [[Machine(script).run(f"r{i}", _config(script, stage, mbs, gas))["metrics"]["throughput"]
             for i in range(12)] for _ in range(2)]
    assert runs[0] == runs[1], "one seed, one machine: the same readings in the same order"
    true = script.throughput(stage, mbs, gas)
    assert all(0.3 * true < value < 2 * true for value in runs[0]) and len(set(runs[0])) > 1
