"""The autotuner end to end on a hand-started cluster (two 1 GiB CPU slots): DeepSpeed's fast mode
over every stage against a script whose memory really grows with the micro-batch, full mode with each
tuner, resume after the scheduler is killed, --run, arg_mappings, and the bad inputs of the search."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from integration_helpers import SCRIPTS, run_autotune, wait_for, write_config
from scheduler.search.repeats import REPEAT_NAME
from workers.state import keys
from workers.warm.warm_start import NOTHING_TO_PRELOAD

pytestmark = pytest.mark.integration
LAW_ARGS = ["--law"]


def _config(tmp_path: Path, **autotuning) -> Path:
    cfg = write_config(tmp_path / "cfg.json", train_micro_batch_size_per_gpu=4,
                       zero_optimization={"stage": "all"})
    data = json.loads(cfg.read_text())
    data["autotuning"].update({"user_args": LAW_ARGS, "max_train_micro_batch_size_per_gpu": 64, **autotuning})
    cfg.write_text(json.dumps(data))
    return cfg


def _env(hand_cluster, **extra):
    return {"AUTOTUNE_REDIS_URL": hand_cluster["url"], "AUTOTUNE_LEASE_S": "15", **extra}


def _records(results: Path) -> dict[str, dict]:
    return {json.loads(line)["name"]: json.loads(line) for line in (results / "results.jsonl").read_text().splitlines()}


def test_fast_mode_all_stages(hand_cluster, tmp_path):
    cfg = _config(tmp_path)
    proc = run_autotune([str(cfg), "--num_gpus", "1"], tmp_path, _env(hand_cluster))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = tmp_path / "autotuning_results"
    records = _records(results)
    assert records["profile_model_info"]["status"] == "ok"
    summary = (results / "summary.txt").read_text()
    for stage in range(3):  # the sampled search runs ZeRO-3 only when its memory matters: not here
        assert f"| z{stage} " in summary
    # memory really limits the search: the script holds 24 MiB per sample, the slot cap is 1 GiB,
    # so every size above 42 that was tried ran out of memory and nothing above it succeeded
    tried = [r for r in records.values() if r["name"] != "profile_model_info"]
    assert all(r["status"] == "oom" for r in tried if r["ds_config"]["train_micro_batch_size_per_gpu"] > 42)
    ok = [r for r in tried if r["status"] == "ok"]
    assert 16 <= max(r["ds_config"]["train_micro_batch_size_per_gpu"] for r in ok) <= 42
    optimal = json.loads((results / "ds_config_optimal.json").read_text())
    assert optimal["zero_optimization"]["stage"] == 1  # the law makes ZeRO-1 20 % faster
    assert "autotuning" not in optimal
    # no experiment recorded twice, and no config measured twice but as a declared repeat of it
    # (`<name>_r<n>`: the winner's confirmation, scheduler.search.repeats)
    names = [json.loads(line)["name"] for line in (results / "results.jsonl").read_text().splitlines()]
    assert len(set(names)) == len(names), names
    repeats = {name: match["original"] for name in names
               if (match := REPEAT_NAME.match(name)) and match["original"] in records}
    assert repeats and all(records[name]["ds_config"] == records[original]["ds_config"]
                           for name, original in repeats.items()), repeats
    configs = [json.dumps(records[name]["ds_config"], sort_keys=True) for name in names if name not in repeats]
    assert len(set(configs)) == len(configs), names
    # every rank says how it started: this script imports the standard library alone at its top
    # level, so cold, and why, until a 2-rank run of it on the shared cluster's slot taught that
    # slot's warm path torch (test_warm_start runs a torch job warm)
    ranks = [rank for name in records for rank in json.loads((results / name / "result.json").read_text())["ranks"]]
    assert {rank.get("start_path") for rank in ranks} <= {"cold", "warm"}
    assert {rank.get("cold_because") for rank in ranks if rank["start_path"] == "cold"} <= {NOTHING_TO_PRELOAD}


@pytest.mark.parametrize("tuner", ["gridsearch", "random", "model_based"])
def test_full_mode_with_each_tuner(hand_cluster, tmp_path, tuner):
    cfg = _config(tmp_path, fast=False, tuner_type=tuner, tuner_num_trials=4, tuner_seed=7)
    data = json.loads(cfg.read_text())
    data["zero_optimization"] = {"stage": [0, 1], "overlap_comm": [False, True]}
    cfg.write_text(json.dumps(data))
    proc = run_autotune([str(cfg), "--num_gpus", "1"], tmp_path, _env(hand_cluster))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    trials = [line for line in proc.stdout.splitlines() if line.startswith("phase z1_") and "_trial" in line]
    assert trials, proc.stdout
    records = _records(tmp_path / "autotuning_results")
    full = [r for r in records.values() if "_oc" in r["name"] and not REPEAT_NAME.match(r["name"])]
    assert 1 <= len(full) <= 4  # the trial cap (the race's re-measurements are not trials)
    assert all(r["ds_config"]["zero_optimization"]["stage"] == 1 for r in full)


def _start_scheduler(hand_cluster, cfg: Path, tmp_path: Path) -> subprocess.Popen:
    env = {key: value for key, value in os.environ.items() if key != "AUTOTUNE_REDIS_URL"}
    env.update(_env(hand_cluster))
    return subprocess.Popen([sys.executable, "-m", "scheduler.autotune", str(cfg), "--num_gpus", "1"],
                            cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _started(results: Path) -> dict[str, float]:
    return {p.parent.name: json.loads(p.read_text())["started_at"] for p in results.glob("*/result.json")}


def _stop_scheduler(proc: subprocess.Popen, results: Path, finished: int, sig: int) -> None:
    try:
        wait_for(lambda: len(list(results.glob("*/result.json"))) >= finished, 120,
                 f"{finished} finished experiments")
    finally:
        proc.send_signal(sig)
        proc.wait()


def test_the_job_goes_on_after_the_scheduler_is_killed(hand_cluster, tmp_path):
    """The control worker's chord callbacks advance the phases: the job ends on its own."""
    cfg, results = _config(tmp_path), tmp_path / "autotuning_results"
    _stop_scheduler(_start_scheduler(hand_cluster, cfg, tmp_path), results, 3, signal.SIGKILL)
    killed_with = len(_started(results))
    wait_for(lambda: (results / "ds_config_optimal.json").exists(), 180, "the job to finish without its scheduler")
    assert not list(hand_cluster["client"].scan_iter(match=keys.gang("*")))  # no slot left reserved
    records = _records(results)
    assert len(records) > killed_with and all(r["status"] in ("ok", "oom") for r in records.values())
    assert {f"| z{stage} " in (results / "summary.txt").read_text() for stage in range(3)} == {True}
    before = _started(results)
    again = run_autotune([str(cfg), "--num_gpus", "1"], tmp_path, _env(hand_cluster))
    assert again.returncode == 0, again.stdout + again.stderr
    phases = [line for line in again.stdout.splitlines() if line.startswith("phase ")]
    assert phases and all(": 0 to run" in line and "already measured" in line for line in phases)
    assert _started(results) == before  # the re-run only reported: nothing ran again


def test_running_the_command_again_attaches_to_the_running_job(hand_cluster, tmp_path):
    cfg, results = _config(tmp_path), tmp_path / "autotuning_results"
    _stop_scheduler(_start_scheduler(hand_cluster, cfg, tmp_path), results, 2, signal.SIGKILL)
    before = _started(results)
    again = run_autotune([str(cfg), "--num_gpus", "1"], tmp_path, _env(hand_cluster))
    assert again.returncode == 0, again.stdout + again.stderr
    assert "still running on the cluster: watching it" in again.stdout
    after = _started(results)
    assert {name: after[name] for name in before} == before and len(after) > len(before)
    assert len(_records(results)) == len(after)  # one record per experiment: nothing ran twice


def test_resume_after_the_job_is_interrupted(hand_cluster, tmp_path):
    """Ctrl-C cancels the job on the cluster; the same command resumes it: finished experiments are
    reused, the interrupted ones run again."""
    hold = tmp_path / "hold"  # every experiment after the 4th to start waits for hold/release
    cfg, results = _config(tmp_path), tmp_path / "autotuning_results"
    data = json.loads(cfg.read_text())
    data["autotuning"]["user_args"] += ["--hold", str(hold), "--hold-after", "4"]
    cfg.write_text(json.dumps(data))
    proc = _start_scheduler(hand_cluster, cfg, tmp_path)
    try:  # interrupted while an experiment runs and more are to come
        wait_for(lambda: list(hold.glob("holding.*")), 120, "an experiment after the 4th to start")
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait()
    wait_for(lambda: not list(hand_cluster["client"].scan_iter(match=keys.gang("*"))), 30,
             "the cancelled job's slots to be released")
    before = _started(results)
    assert len(before) >= 3  # of the 4 started first, those not still running when interrupted
    (hold / "release").touch()
    again = run_autotune([str(cfg), "--num_gpus", "1"], tmp_path, _env(hand_cluster))
    assert again.returncode == 0, again.stdout + again.stderr
    assert "already measured" in again.stdout
    after = _started(results)
    assert {name: after[name] for name in before} == before  # nothing measured before ran again
    assert len(after) > len(before)


def test_run_trains_with_the_optimal_config(hand_cluster, tmp_path):
    cfg = write_config(tmp_path / "cfg.json", train_micro_batch_size_per_gpu=[2, 4],
                       zero_optimization={"stage": [0, 1]})
    proc = run_autotune([str(cfg), "--num_gpus", "2", "--run"], tmp_path, _env(hand_cluster))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir = tmp_path / "autotuning_results" / "run_optimal"
    trained = json.loads((run_dir / "trained.rank0").read_text())
    assert (run_dir / "trained.rank1").exists()  # both ranks trained
    optimal = json.loads((tmp_path / "autotuning_results" / "ds_config_optimal.json").read_text())
    assert trained == optimal and "autotuning" not in trained
    assert json.loads((run_dir / "result.json").read_text())["status"] == "ok"


def test_arg_mappings_set_the_script_flags(hand_cluster, tmp_path):
    cfg = write_config(tmp_path / "cfg.json", train_micro_batch_size_per_gpu=[2, 4])
    data = json.loads(cfg.read_text())
    data["autotuning"]["arg_mappings"] = {" train_micro_batch_size_per_gpu ": "--per_device_train_batch_size",
                                          "gradient_accumulation_steps": "--gradient_accumulation_steps "}
    data["autotuning"]["user_args"] = ["--per_device_train_batch_size", "1", "--gradient_accumulation_steps", "1"]
    cfg.write_text(json.dumps(data))
    proc = run_autotune([str(cfg), "--num_gpus", "1"], tmp_path, _env(hand_cluster))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name, (mbs, gas) in {"z0_gas2_tmbspg2": (2, 2), "z0_gas1_tmbspg4": (4, 1)}.items():
        argv = _records(tmp_path / "autotuning_results")[name]["metrics"]["argv"]
        assert argv[argv.index("--per_device_train_batch_size") + 1] == str(mbs)
        assert argv[argv.index("--gradient_accumulation_steps") + 1] == str(gas)

    data["autotuning"]["user_args"] = ["--gradient_accumulation_steps", "1"]
    cfg.write_text(json.dumps(data))
    missing = run_autotune([str(cfg)], tmp_path, _env(hand_cluster))
    assert missing.returncode == 2 and "--per_device_train_batch_size" in missing.stderr
    assert missing.stderr.count("\n") == 1


def test_no_stage_fits_says_by_how_much(hand_cluster, tmp_path):
    cfg = _config(tmp_path, model_info={"num_params": 2 * 10**9, "trainable_num_params": 2 * 10**9,
                                        "activation_mem_per_gpu": 2**20})
    proc = run_autotune([str(cfg), "--num_gpus", "1"], tmp_path, _env(hand_cluster))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "GiB" in proc.stderr and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


def test_a_metric_the_script_never_writes(hand_cluster, tmp_path):
    cfg = write_config(tmp_path / "cfg.json")
    data = json.loads(cfg.read_text())
    data["autotuning"]["metric"] = "flops"
    data["autotuning"]["user_args"] = []
    cfg.write_text(json.dumps(data))
    script = tmp_path / "no_flops.py"
    script.write_text((SCRIPTS / "fake_train.py").read_text().replace('"FLOPS_per_gpu": 1e9, ', ""))
    proc = run_autotune([str(cfg), "--", str(script)], tmp_path, _env(hand_cluster))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "FLOPS_per_gpu" in proc.stderr and "throughput" in proc.stderr


def test_a_port_taken_before_rank_0_binds_it_is_launched_again_and_never_a_result(hand_cluster, tmp_path):
    """The port rank 0 was given is taken by another process before its process
    group binds it (EADDRINUSE; here the script holds it itself, once). The experiment crashes,
    says nothing about its config, and is launched again at once with a new port: it runs, and the
    search goes on from that run (the crash bounds nothing and is not the result)."""
    taken = tmp_path / "taken_port"
    cfg = _config(tmp_path, user_args=[*LAW_ARGS, "--take-port-once", str(taken)])
    data = json.loads(cfg.read_text())  # one stage, small sizes: the clash, not the search, is tested
    data["zero_optimization"] = {"stage": 1}
    data["autotuning"]["max_train_micro_batch_size_per_gpu"] = 16
    cfg.write_text(json.dumps(data))
    proc = run_autotune([str(cfg), "--num_gpus", "2"], tmp_path, _env(hand_cluster))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = _records(tmp_path / "autotuning_results")
    crashed = [r for r in records.values() if r["status"] != "ok"]
    [first] = [r for r in crashed if r["status"] == "crashed"]
    assert "EADDRINUSE" in first["cause"]["stderr_tail"] or "ddress already in use" in first["cause"]["stderr_tail"]
    retry = records[f"{first['name']}_r2"]
    assert retry["status"] == "ok" and retry["ds_config"] == first["ds_config"]
    assert retry["metrics"]["master"].rsplit(":", 1)[1] != taken.read_text()  # a new port
    assert all(r["status"] == "oom" for r in crashed if r is not first)  # nothing else failed but memory
