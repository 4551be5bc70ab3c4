"""`celery-autotune --autotuning tune` end to end: the resource pool bounds where
experiments run, and a cluster still starting is waited for. Real redis-server, real Celery workers,
the stand-in training script."""
from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import redis

from integration_helpers import ROOT, SCRIPTS, processes_with_marker, stop_group, wait_for, write_config
from scheduler.embedded.worker_command import worker_argv

CLI = [sys.executable, "-m", "scheduler.cli"]


def _env(**extra: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key != "AUTOTUNE_REDIS_URL"}
    return {**env, **extra}


def _records(results: Path) -> list[dict]:
    return [json.loads(line) for line in (results / "results.jsonl").read_text().splitlines() if line.strip()]


def test_include_keeps_every_experiment_on_the_selected_slot(tmp_path: Path) -> None:
    """Three embedded CPU slots, `--include localhost:1`: every experiment runs on slot 1 only (the
    placement would otherwise take slot 0 first), and cmd_optimal.txt names that host."""
    cfg = write_config(tmp_path / "cfg.json", train_micro_batch_size_per_gpu=[1, 2, 3])
    del_script = json.loads(cfg.read_text())
    del del_script["autotuning"]["user_script"]  # the script comes from the command line, as for deepspeed
    cfg.write_text(json.dumps(del_script))
    proc = subprocess.run(
        [*CLI, "--autotuning", "tune", "--slots", "3", "--slot-memory", "1GiB", "--include", "localhost:1",
         str(SCRIPTS / "fake_train.py"), "--deepspeed_config", "cfg.json"],
        cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = _records(tmp_path / "autotuning_results")
    ran = [r for r in records if r.get("status") == "ok"]
    assert len(ran) >= 3, records
    allowed = f"{socket.gethostname()}.gpu1"
    assert {slot for r in records for slot in r.get("slots") or []} == {allowed}, records
    command = (tmp_path / "autotuning_results" / "cmd_optimal.txt").read_text()
    assert "--hostfile" in command and "--num_gpus 1" in command and "fake_train.py" in command, command
    hostfile = (tmp_path / "autotuning_results" / "hostfile_optimal").read_text()
    assert hostfile == f"{socket.gethostname()} slots=1\n"


def test_a_selection_matching_no_live_slot_is_one_error(tmp_path: Path) -> None:
    cfg = write_config(tmp_path / "cfg.json")
    proc = subprocess.run(
        [*CLI, "--autotuning", "tune", "--slots", "2", "--include", "elsewhere:0",
         str(SCRIPTS / "fake_train.py"), "--deepspeed_config", str(cfg)],
        cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "elsewhere" in lines[0], proc.stderr
    assert not (tmp_path / "autotuning_results").exists()  # refused before any folder


def test_workers_started_after_the_command_are_waited_for(redis_url: str, tmp_path: Path) -> None:
    """As a user types it: the command first, the workers a few seconds later; it waits, then tunes."""
    url = redis_url.rsplit("/", 1)[0] + "/5"  # a database no other fixture's workers register in
    redis.Redis.from_url(url).flushdb()
    cfg = write_config(tmp_path / "cfg.json", train_micro_batch_size_per_gpu=[1, 2])
    marker = secrets.token_hex(8)
    env = _env(AUTOTUNE_REDIS_URL=url, AUTOTUNE_CLUSTER_WAIT_S="240", AUTOTUNE_NODE="waitnode",
               AUTOTUNE_SLOT_MEMORY="1GiB", AUTOTUNE_SLOTS_PER_NODE="1", AUTOTUNE_TEST_MARKER=marker)
    command = subprocess.Popen(
        [*CLI, "--autotuning", "tune", str(SCRIPTS / "fake_train.py"), "--deepspeed_config", str(cfg)],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    workers: list[subprocess.Popen] = []
    try:
        time.sleep(5)
        assert command.poll() is None, command.communicate()
        for queue, name in (("gpu0", "gpu0@waitnode"), ("control", "control@waitnode")):
            with open(tmp_path / f"{queue}.log", "wb") as log:
                workers.append(subprocess.Popen(worker_argv(queue, name), cwd=ROOT, env=env, stdout=log,
                                                stderr=subprocess.STDOUT, start_new_session=True))
        out, err = command.communicate(timeout=480)
        assert command.returncode == 0, out[-3000:] + err[-3000:]
        assert "waiting up to 240s (AUTOTUNE_CLUSTER_WAIT_S)" in err, err
        assert {r["status"] for r in _records(tmp_path / "autotuning_results")} == {"ok"}
    finally:
        if command.poll() is None:
            stop_group(command)
        for worker in workers:
            stop_group(worker, signal.SIGQUIT)
        wait_for(lambda: not processes_with_marker(marker), 30, "worker processes to exit")


def test_without_workers_the_wait_ends_in_one_error(redis_url: str, tmp_path: Path) -> None:
    url = redis_url.rsplit("/", 1)[0] + "/6"
    redis.Redis.from_url(url).flushdb()
    cfg = write_config(tmp_path / "cfg.json")
    started = time.monotonic()
    proc = subprocess.run(
        [*CLI, "--autotuning", "tune", str(SCRIPTS / "fake_train.py"), "--deepspeed_config", str(cfg)],
        cwd=tmp_path, env=_env(AUTOTUNE_REDIS_URL=url, AUTOTUNE_CLUSTER_WAIT_S="3"),
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert time.monotonic() - started >= 3
    lines = proc.stderr.strip().splitlines()
    assert lines[0].startswith("waiting up to 3s") and lines[-1].startswith("error: no slot workers"), proc.stderr
    assert len(lines) == 2, proc.stderr
