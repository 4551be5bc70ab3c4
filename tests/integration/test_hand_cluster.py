"""Experiments on a cluster started by hand (redis-server + `celery -A tasks worker -Q gpuN`):
every failure class for real, a failing experiment never stopping the others, a 2-rank
rendezvous with a real gloo all-reduce, and nothing left running or reserved afterwards."""
from __future__ import annotations

import json
from urllib.parse import urlparse

import psutil
import pytest

from integration_helpers import SCRIPTS, outside_workers, processes_with_marker, run_autotune, wait_for, write_config
from workers.state import keys

pytestmark = pytest.mark.integration


def _result(results, name):
    return json.loads((results / name / "result.json").read_text())


def test_every_failure_class_and_the_others_still_run(hand_cluster, tmp_path):
    cfg = write_config(tmp_path / "cfg.json", train_micro_batch_size_per_gpu=[1, 2, 3, 4, 5, 6],
                       zero_optimization={"stage": 1})
    behaviour = "2=oom,3=crash,4=no_metrics,5=hang,6=memory_error"
    proc = run_autotune([str(cfg), "--num_gpus", "1", "--exp-timeout", "6", "--",
                         str(cfg.parent.parent / "unused"), "--behaviour", behaviour],
                        tmp_path, {"AUTOTUNE_REDIS_URL": hand_cluster["url"]})
    assert proc.returncode == 2 and "not found" in proc.stderr  # the script after -- must exist

    script = tmp_path / "train.py"
    script.write_text((SCRIPTS / "fake_train.py").read_text())
    proc = run_autotune([str(cfg), "--num_gpus", "1", "--exp-timeout", "12", "--", str(script),
                         "--behaviour", behaviour], tmp_path, {"AUTOTUNE_REDIS_URL": hand_cluster["url"]})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = tmp_path / "autotuning_results"
    # a listed set of micro-batch sizes keeps the global batch: gas = max(list) // mbs (DeepSpeed's rule)
    names = {mbs: f"z1_gas{max(1, 6 // mbs)}_tmbspg{mbs}" for mbs in range(1, 7)}
    statuses = {mbs: _result(results, name)["status"] for mbs, name in names.items()}
    assert statuses == {1: "ok", 2: "oom", 3: "crashed", 4: "no_metrics", 5: "timeout", 6: "oom"}
    profile = _result(results, "profile_model_info")
    assert profile["status"] == "ok" and profile["metrics"]["num_params"] == 1000

    oom = _result(results, names[2])
    assert oom["peak_rss_bytes"] > 2**30 * 0.9  # killed by the monitor near the 1 GiB slot cap
    assert oom["ranks"][0]["exit"] == "signal SIGTERM"
    crash = _result(results, names[3])
    assert crash["cause"]["exit"] == "exit 3"
    assert _result(results, names[6])["ranks"][0]["exit"] == "exit 86"
    ok = _result(results, names[1])
    assert ok["metrics"]["throughput"] == 50.0  # 1 * 100 / (1 + stage 1)
    assert json.loads((results / names[1] / "metrics.json").read_text()) == ok["metrics"]

    # the hung experiment's process was killed with its group, not left behind
    hung_pid = int((results / names[5] / "started.rank0").read_text())
    assert not psutil.pid_exists(hung_pid) or psutil.Process(hung_pid).status() == psutil.STATUS_ZOMBIE
    summary = (results / "summary.txt").read_text()
    assert names[1] in summary and "oom=2" in summary and "profile_model_info" not in summary
    optimal = json.loads((results / "ds_config_optimal.json").read_text())
    assert optimal["train_micro_batch_size_per_gpu"] == 1 and "autotuning" not in optimal
    # no slot stays reserved once the job is over
    assert list(hand_cluster["client"].scan_iter(match=keys.gang("*"))) == []


def test_two_rank_experiment_meets_through_redis(hand_cluster, tmp_path):
    cfg = write_config(tmp_path / "cfg.json", train_micro_batch_size_per_gpu=[2, 4],
                       zero_optimization={"stage": [0, 2]})
    proc = run_autotune([str(cfg), "--num_gpus", "2"], tmp_path,
                        {"AUTOTUNE_REDIS_URL": hand_cluster["url"]})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = tmp_path / "autotuning_results"
    # each config, and the winner read again to confirm it (scheduler.search.repeats.confirm)
    for name in ("z0_gas2_tmbspg2", "z0_gas1_tmbspg4", "z2_gas2_tmbspg2", "z2_gas1_tmbspg4", "z0_gas1_tmbspg4_r2"):
        record = _result(results, name)
        assert record["status"] == "ok", record
        assert sorted(r["slot"] for r in record["ranks"]) == ["testnode.gpu0", "testnode.gpu1"]
        assert record["metrics"]["world_size"] == 2
        assert {r["master"] for r in record["ranks"]} == {record["metrics"]["master"]}
        assert record["ds_config"]["train_batch_size"] == 8  # 2 ranks x max(list) 4
    winner = json.loads((results / "ds_config_optimal.json").read_text())
    assert (winner["zero_optimization"]["stage"], winner["train_micro_batch_size_per_gpu"]) == (0, 4)

    # resume: the same command again measures nothing new
    again = run_autotune([str(cfg), "--num_gpus", "2"], tmp_path, {"AUTOTUNE_REDIS_URL": hand_cluster["url"]})
    assert again.returncode == 0, again.stdout + again.stderr
    phases = [line for line in again.stdout.splitlines() if line.startswith("phase ")]
    assert [line.split(":")[0] for line in phases] == ["phase profile_model_info", "phase z0_list", "phase z2_list",
                                                      "phase confirm_1"], again.stdout
    assert all(": 0 to run, " in line and line.endswith(" already measured") for line in phases), again.stdout


def test_bad_redis_credentials_are_one_clear_line(hand_cluster, tmp_path):
    cfg = write_config(tmp_path / "cfg.json")
    password = urlparse(hand_cluster["url"]).password
    wrong = hand_cluster["url"].replace(f":{password}@", f":wrong{password}@")
    assert wrong != hand_cluster["url"]
    proc = run_autotune([str(cfg)], tmp_path, {"AUTOTUNE_REDIS_URL": wrong})
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "credentials" in proc.stderr and "Traceback" not in proc.stderr


def test_workers_leave_no_training_process(hand_cluster):
    # A training process is told its slot in AUTOTUNE_SLOT; the workers themselves never are (a slot's
    # warm interpreter is, for the clean-ups that find a rank by it, but it is the worker's own).
    def training() -> list[int]:
        found = []
        for proc in outside_workers(processes_with_marker(hand_cluster["marker"])):
            try:
                if "AUTOTUNE_SLOT" in proc.environ():
                    found.append(proc.pid)
            except psutil.Error:
                continue
        return found
    assert processes_with_marker(hand_cluster["marker"])  # the workers carry the marker: the check can see
    wait_for(lambda: training() == [], 10, "no training process to remain")
