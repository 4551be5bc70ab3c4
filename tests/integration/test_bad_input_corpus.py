"""Bad input through real processes: `python -m scheduler.autotune` / `scheduler.run` as a user runs them.

The in-process corpus (tests/unit/test_bad_inputs.py) covers the breadth; this file checks what only a
real interpreter shows (argparse's own exit path, recursion limits, signal handlers, the exit status)
and the cases that need real servers: a results folder whose name would break or inject into
redis-server's configuration, and a training script whose metrics are not numbers.
"""
from __future__ import annotations

import hashlib
import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from integration_helpers import ROOT, SCRIPTS, processes_with_marker, wait_for
from scheduler.embedded.local_cluster import free_tcp_port, redis_config
from scheduler.inputs.folders import MARKER
from test_op_prebuild_child import failing_compiler

pytestmark = pytest.mark.integration

BASE = {"train_micro_batch_size_per_gpu": [1], "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 0},
        "autotuning": {"enabled": True, "metric": "throughput", "user_script": str(SCRIPTS / "fake_train.py")}}


def _config(folder: Path, **autotuning) -> str:
    data = json.loads(json.dumps(BASE))
    data["autotuning"].update(autotuning)
    path = folder / "cfg.json"
    path.write_text(json.dumps(data))
    return str(path)


def _snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): ("dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(root.rglob("*"))}


def _run(module: str, args: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k != "AUTOTUNE_REDIS_URL"}
    full.update(env or {})
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=full, capture_output=True,
                          text=True, timeout=60)


CASES = [
    ("autotune", lambda w: [_config(w), "--bogus"], {}, "unrecognized arguments"),
    ("autotune", lambda w: [_config(w), "--slots", "x"], {}, "--slots"),
    ("autotune", lambda w: [_config(w), "--slots", "10000"], {}, "at most"),
    ("autotune", lambda w: [_config(w), "--exp-timeout", "nan"], {}, "--exp-timeout"),
    ("autotune", lambda w: [_config(w), "--exp-timeout", "inf"], {}, "--exp-timeout"),
    ("autotune", lambda w: [_config(w, results_dir=".", overwrite=True)], {}, "the working folder"),
    ("autotune", lambda w: [_config(w, results_dir="..", overwrite=True)], {}, "the working folder"),
    ("autotune", lambda w: [_config(w, results_dir="data", overwrite="false")], {}, "autotuning.overwrite"),
    ("autotune", lambda w: [_config(w, results_dir="data", overwrite=True)], {}, "not created by celery-autotune"),
    ("autotune", lambda w: [_config(w, results_dir="notes.txt")], {}, "is a file"),
    ("autotune", lambda w: [_config(w, results_dir="r\nport 1")], {}, "control character"),
    ("autotune", lambda w: [_config(w, fast=None)], {}, "autotuning.fast"),
    ("autotune", lambda w: [_config(w, tuner_num_trials=10**30)], {}, "autotuning.tuner_num_trials"),
    ("autotune", lambda w: [str(_deep(w))], {}, "nested more than"),
    # full mode names experiments by their ZeRO values: one that cannot name a folder is refused up front
    ("autotune", lambda w: [str(_full_mode(w, {"stage": [1], "reduce_bucket_size": ["a/b", 5e8]}))], {},
     "zero_optimization.reduce_bucket_size value \"a/b\""),
    ("autotune", lambda w: [_config(w)], {"AUTOTUNE_REDIS_URL": "redis://:pw@h:99999/0"}, "AUTOTUNE_REDIS_URL"),
    ("autotune", lambda w: [_config(w)], {"AUTOTUNE_REDIS_URL": "not a url"}, "AUTOTUNE_REDIS_URL"),
    ("autotune", lambda w: [_config(w)], {"AUTOTUNE_REDIS_URL": "redis://h:1/x"}, "database"),
    ("autotune", lambda w: [_config(w)], {"AUTOTUNE_LEASE_S": "x"}, "AUTOTUNE_LEASE_S"),
    ("autotune", lambda w: [_config(w), "--", str(_not_executable(w))], {}, "not executable"),
    ("scheduler.run", lambda w: ["--timeout", "nan", "x.py"], {}, "--timeout"),
    ("scheduler.run", lambda w: ["--bogus", "x.py"], {}, "--bogus"),
    ("scheduler.run", lambda w: ["--hostfile", str(_hostfile(w, "h slots=1000000000")), "x.py"], {}, "at most 1024"),
    ("scheduler.run", lambda w: ["--hostfile", str(_hostfile(w, f"h slots={10**20}")), "x.py"], {}, "at most 1024"),
    ("scheduler.run", lambda w: ["--slots", "10000", str(SCRIPTS / "fake_train.py")], {}, "at most"),
]


def _deep(folder: Path) -> Path:
    path = folder / "deep.json"
    path.write_text('{"autotuning": {}, "x": ' + "[" * 10000 + "]" * 10000 + "}")
    return path


def _full_mode(folder: Path, zero: dict) -> Path:
    data = json.loads(json.dumps(BASE))
    data["zero_optimization"] = zero
    data["autotuning"]["fast"] = False
    path = folder / "full.json"
    path.write_text(json.dumps(data))
    return path


def _not_executable(folder: Path) -> Path:
    path = folder / "train.sh"
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(0o644)
    return path


def _hostfile(folder: Path, text: str) -> Path:
    path = folder / "hostfile"
    path.write_text(text + "\n")
    return path


@pytest.mark.parametrize(("module", "make", "env", "needle"), CASES,
                         ids=[f"{i}-{c[0]}-{c[3][:20]}" for i, c in enumerate(CASES)])
def test_real_process_refuses_bad_input(tmp_path, module, make, env, needle):
    work = tmp_path / "work"
    (work / "data").mkdir(parents=True)
    (work / "data" / "dataset.csv").write_text("1,2\n")
    (work / "notes.txt").write_text("notes")
    args = make(work)
    before = _snapshot(tmp_path)
    proc = _run("scheduler.autotune" if module == "autotune" else module, args, work, env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert _snapshot(tmp_path) == before


@pytest.mark.parametrize("folder_name", ['with space "quote\' é', "newline\nrequirepass injected"])
def test_redis_settings_cannot_be_injected(tmp_path, folder_name):
    """What LocalCluster writes to redis-server's stdin: a value is one setting whatever it holds."""
    folder = tmp_path / folder_name
    folder.mkdir()
    port = free_tcp_port()
    proc = subprocess.Popen(["redis-server", "-"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, cwd=folder, start_new_session=True)
    try:
        proc.stdin.write(redis_config([("port", str(port)), ("bind", "127.0.0.1"), ("dir", str(folder)),
                                       ("save", ""), ("appendonly", "no")]))
        proc.stdin.close()
        client = redis.Redis(port=port, socket_timeout=2)
        wait_for(client.ping, 10, "redis-server")
        assert client.config_get("dir")["dir"] == str(folder)
        assert client.config_get("requirepass")["requirepass"] == ""  # nothing injected
    finally:
        proc.terminate()
        proc.wait(timeout=10)


BAD_METRICS_SCRIPT = '''
import argparse, json, pathlib
parser = argparse.ArgumentParser()
parser.add_argument("--deepspeed_config")
config = json.loads(pathlib.Path(parser.parse_known_args()[0].deepspeed_config).read_text())
text = {1: '{"throughput": NaN}', 2: '{"throughput": -5.0, "latency": 1.0}', 3: '{"throughput": "fast"}'}
pathlib.Path(config["autotuning"]["metric_path"]).write_text(text[config["train_micro_batch_size_per_gpu"]])
'''


def test_unusable_metrics_never_win_and_the_report_says_why(tmp_path):
    """A results folder named with a space, quotes and non-ASCII works (redis-server starts); metrics
    of NaN, a negative number and a string are each `bad_metrics`, and the report names them."""
    marker = secrets.token_hex(8)
    (tmp_path / "train_bad.py").write_text(BAD_METRICS_SCRIPT)
    results = tmp_path / 'res "a\' é'
    data = json.loads(json.dumps(BASE))
    data["train_micro_batch_size_per_gpu"] = [1, 2, 3]
    data["autotuning"].update(user_script="train_bad.py", results_dir=str(results), exps_dir=str(results / "exps"),
                              model_info={"num_params": 1000, "activation_mem_per_gpu": 1024})
    (tmp_path / "cfg.json").write_text(json.dumps(data))
    env = {k: v for k, v in os.environ.items() if k != "AUTOTUNE_REDIS_URL"}
    env["AUTOTUNE_TEST_MARKER"] = marker
    proc = subprocess.run([sys.executable, "-m", "scheduler.autotune", "cfg.json", "--slots", "1",
                           "--slot-memory", "1GiB", "--exp-timeout", "120"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr  # the script's reporting: input to fix
    assert "Traceback" not in proc.stderr
    records = {p.parent.name: json.loads(p.read_text()) for p in results.glob("*/result.json")}
    assert {name: r["status"] for name, r in records.items()} == {
        "z0_gas3_tmbspg1": "bad_metrics", "z0_gas1_tmbspg2": "bad_metrics", "z0_gas1_tmbspg3": "bad_metrics"}
    assert not (results / "ds_config_optimal.json").exists()
    assert proc.stderr.startswith("error: no experiment succeeded"), proc.stderr
    assert "bad_metrics (3)" in proc.stderr and '"throughput" is' in proc.stderr, proc.stderr
    assert (results / MARKER).is_file() and (results / "cluster" / "redis.log").is_file()
    wait_for(lambda: not processes_with_marker(marker), 20, "every process of the run to exit")


def test_a_model_no_stage_holds_once_profiled_is_refused_saying_so_and_the_next_run_resumes(tmp_path):
    """Without autotuning.model_info, whether any stage holds the model is known only once
    the profile run measured it. The refusal says so (exit 2, one `error:` line); the results folder
    keeps the profile's record, and the same command again resumes: it reuses that record (no new
    profile run) and refuses again, leaving no process behind."""
    (tmp_path / "train_huge.py").write_text(
        "import argparse, json, pathlib\n"
        "parser = argparse.ArgumentParser()\nparser.add_argument('--deepspeed_config')\n"
        "parser.add_argument('--local_rank')\nargs = parser.parse_args()\n"
        "autotuning = json.loads(pathlib.Path(args.deepspeed_config).read_text())['autotuning']\n"
        "if autotuning.get('model_info', {}).get('profile'):\n"
        "    pathlib.Path(autotuning['model_info_path']).write_text(json.dumps(\n"
        "        {'num_params': 10**10, 'trainable_num_params': 10**10, 'activation_mem_per_gpu': 1024}))\n")
    data = json.loads(json.dumps(BASE))
    data["train_micro_batch_size_per_gpu"] = 1
    data["autotuning"].update(user_script="train_huge.py")
    (tmp_path / "cfg.json").write_text(json.dumps(data))
    marker = secrets.token_hex(8)
    env = {**{k: v for k, v in os.environ.items() if k != "AUTOTUNE_REDIS_URL"}, "AUTOTUNE_TEST_MARKER": marker,
           "AUTOTUNE_DEVICE_KIND": "cpu"}
    argv = [sys.executable, "-m", "scheduler.autotune", "cfg.json", "--slots", "1", "--slot-memory", "1GiB",
            "--exp-timeout", "120"]
    profile = tmp_path / "autotuning_results" / "profile_model_info" / "result.json"
    outputs = []
    for _ in range(2):
        proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: no allowed ZeRO stage fits micro-batch 1"), proc.stderr
        assert "known only from the profile run's measurement" in lines[0], lines[0]
        assert json.loads(profile.read_text())["status"] == "ok"
        outputs.append((profile.stat().st_mtime_ns, proc.stdout))
        wait_for(lambda: not processes_with_marker(marker), 20, "every process of the run to exit")
    assert outputs[1][0] == outputs[0][0], "the second run ran the profile again instead of resuming"
    assert (tmp_path / "autotuning_results" / MARKER).is_file()


def test_a_script_that_never_writes_its_metrics_is_input_to_fix(tmp_path):
    """Held-out corpus case: a script that trains and exits 0 without ever writing
    the metrics file. Every experiment is `no_metrics`: the summary goes to stderr after an `error:`
    line, with how the metric is written, and the exit status is 2, as docs/failures.md says."""
    (tmp_path / "train_silent.py").write_text("print('trained, reported nothing')\n")
    data = json.loads(json.dumps(BASE))
    data["train_micro_batch_size_per_gpu"] = [1, 2]
    data["autotuning"].update(user_script="train_silent.py", model_info={"num_params": 1000, "activation_mem_per_gpu": 1024})
    (tmp_path / "cfg.json").write_text(json.dumps(data))
    env = {k: v for k, v in os.environ.items() if k != "AUTOTUNE_REDIS_URL"}
    proc = subprocess.run([sys.executable, "-m", "scheduler.autotune", "cfg.json", "--slots", "1",
                           "--slot-memory", "1GiB", "--exp-timeout", "120"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.startswith("error: no experiment succeeded"), proc.stderr
    assert "no_metrics (2)" in proc.stderr and "never reported 'throughput'" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and "no experiment succeeded" not in proc.stdout


def test_an_op_that_cannot_be_built_stops_the_job_at_its_first_experiment(tmp_path):
    """A script whose op cannot be built (here torch compiling a C++ extension that
    includes a CUDA header the node lacks, as FusedAdam fails on a node without the toolkit) fails every experiment alike. The job stops
    after the first phase with one `error:` line naming the op and the fix, exit 2; the next stage
    is never launched, and the record keeps the build's failure."""
    (tmp_path / "needed_op.cpp").write_text("#include <cuda_runtime_not_installed.h>\nint f() { return 1; }\n")
    (tmp_path / "train_op.py").write_text(
        "import pathlib, torch.utils.cpp_extension as cpp\n"
        "cpp.load(name='needed_op', sources=[str(pathlib.Path(__file__).with_name('needed_op.cpp'))])\n")
    data = json.loads(json.dumps(BASE))
    data["zero_optimization"] = {"stage": [0, 1]}
    data["autotuning"].update(user_script="train_op.py", model_info={"num_params": 1000, "activation_mem_per_gpu": 1024})
    (tmp_path / "cfg.json").write_text(json.dumps(data))
    env = {k: v for k, v in os.environ.items() if k != "AUTOTUNE_REDIS_URL"}
    env["TORCH_EXTENSIONS_DIR"] = str(tmp_path / "ext")
    proc = subprocess.run([sys.executable, "-m", "scheduler.autotune", "cfg.json", "--slots", "1",
                           "--slot-memory", "2GiB", "--exp-timeout", "240"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    [line] = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert line.startswith("error: z0_gas1_tmbspg1 could not build or load an op DeepSpeed needs on slot "), line
    assert "(needed_op: RuntimeError: Error building extension 'needed_op'" in line and "nvcc" in line, line
    assert "Traceback" not in proc.stderr
    results = next(p.parent.parent for p in tmp_path.rglob("z0_gas1_tmbspg1/result.json"))
    record = json.loads((results / "z0_gas1_tmbspg1" / "result.json").read_text())
    assert record["status"] == "crashed" and record["op_build_failed"].startswith("needed_op: ")
    assert not list(results.glob("z1_*")), "the job went on after the op failed"


def test_an_op_the_config_names_is_built_before_the_script_and_a_failed_build_is_only_advice(tmp_path):
    """Ops built once per node before tuning: the config's Adam (without torch_adam)
    makes DeepSpeed load FusedAdam, so the slot worker builds it before the script starts, outside the
    slot's memory cap and time limit (workers.slot.op_prebuild). Here the node's compiler fails every
    compile (as FusedAdam's fails without the CUDA toolkit), but this script hands DeepSpeed no such optimizer
    (as a script passing its own optimizer to deepspeed.initialize does): the build's failure is
    kept in each rank's record and its log, the ranks of each 2-rank experiment start the script
    together, and the job finishes."""
    data = json.loads(json.dumps(BASE))
    data["train_micro_batch_size_per_gpu"] = [1, 2]
    data["optimizer"] = {"type": "Adam", "params": {"lr": 0.001}}
    data["autotuning"].update(model_info={"num_params": 1000, "activation_mem_per_gpu": 1024})
    (tmp_path / "cfg.json").write_text(json.dumps(data))
    env = {k: v for k, v in os.environ.items() if k != "AUTOTUNE_REDIS_URL"}
    env.update(TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"), CXX=str(failing_compiler(tmp_path)), DS_ACCELERATOR="cpu")
    proc = subprocess.run([sys.executable, "-m", "scheduler.autotune", "cfg.json", "--slots", "2", "--num_gpus", "2",
                           "--slot-memory", "1GiB", "--exp-timeout", "120"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    folders = [p.parent for p in tmp_path.rglob("z0_gas*_tmbspg*/result.json")]
    # both listed configs, and the winner's confirmation (scheduler.search.repeats.confirm): a third
    # experiment on the same workers, which builds nothing again either
    assert sorted(folder.name for folder in folders) == ["z0_gas1_tmbspg2", "z0_gas1_tmbspg2_r2", "z0_gas2_tmbspg1"]
    for folder in folders:
        record = json.loads((folder / "result.json").read_text())
        assert record["status"] == "ok"
        failures = sorted(rank["op_prebuild_failed"] for rank in record["ranks"])
        # both ranks built, waited for each other, and started the script; a rank that found the other
        # building waits on torch's lock and then imports what it takes for the other's result, so it
        # fails at the import (the missing .so), not at the compile
        compiled = "fused_adam: RuntimeError: Error building extension"
        assert len(failures) == 2 and any(f.startswith(compiled) for f in failures), failures
        assert all(f.startswith(compiled) or (f.startswith("fused_adam: ImportError: ")
                                              and "cannot open shared object" in f) for f in failures), failures
    # built once per worker: the failure is remembered, not compiled again before every experiment
    logs = [log for folder in folders for log in folder.glob("*op_prebuild.log")]
    assert sorted(log.name for log in logs) == ["op_prebuild.log", "rank1.op_prebuild.log"]
    texts = [log.read_text() for log in logs]  # the builder's log has the compile error; a waiter's, its import
    assert any("cuda_runtime.h: No such file" in text for text in texts)
    assert all("cuda_runtime.h: No such file" in text or "cannot open shared object" in text for text in texts)
