"""`python -m scheduler.run` for real: ranks on slot workers started by hand (the `hand_cluster`) and
on an embedded cluster, a real gloo all-reduce between two ranks, arguments that must survive
untouched, the root-cause exit code, `--include` pinning, and Ctrl-C/SIGTERM leaving nothing behind."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from integration_helpers import processes_with_marker, wait_for
from workers.state import keys

pytestmark = pytest.mark.integration

TRICKY_ARGS = ["--label", "two words", "--quote", 'say "hi"', "it's", "$HOME;`x`"]

SCRIPT = r'''
import json, os, sys, time
from pathlib import Path

mode, out = sys.argv[1], Path(sys.argv[2])
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
(out / f"pid.rank{rank}").write_text(str(os.getpid()))
if mode == "fail":
    if rank == 1:
        sys.exit(7)
    time.sleep(120)
if mode == "sleep":
    while True:
        time.sleep(1)
reduced = None
if mode == "allreduce":
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method="env://")
    tensor = torch.tensor([rank + 1.0])
    dist.all_reduce(tensor)
    reduced = tensor.item()
    dist.destroy_process_group()
(out / f"rank{rank}.json").write_text(json.dumps({
    "rank": rank, "world_size": world, "argv": sys.argv[3:], "reduced": reduced,
    "env": {k: os.environ.get(k) for k in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "AUTOTUNE_SLOT")}}))
'''


@pytest.fixture
def job(tmp_path):
    """A training script, its output folder and a one-host hostfile naming the hand cluster's node."""
    (tmp_path / "train.py").write_text(SCRIPT)
    (tmp_path / "out").mkdir()
    (tmp_path / "hostfile").write_text("testnode slots=2\n")
    return tmp_path


def start_run(job: Path, args: list[str], env_extra: dict[str, str]) -> subprocess.Popen:
    env = {key: value for key, value in os.environ.items() if key != "AUTOTUNE_REDIS_URL"}
    env.update(env_extra)
    return subprocess.Popen([sys.executable, "-m", "scheduler.run", "--log_dir", str(job / "logs"), *args],
                            cwd=job, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def run_to_end(job: Path, args: list[str], redis_url: str) -> subprocess.CompletedProcess:
    proc = start_run(job, ["--hostfile", "hostfile", *args], {"AUTOTUNE_REDIS_URL": redis_url})
    stdout, stderr = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def result(job: Path) -> dict:
    return json.loads((job / "logs" / "run" / "result.json").read_text())


def test_two_ranks_all_reduce_with_arguments_intact(hand_cluster, job):
    proc = run_to_end(job, ["train.py", "allreduce", "out", *TRICKY_ARGS], hand_cluster["url"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ranks = [json.loads((job / "out" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [(r["rank"], r["world_size"], r["reduced"]) for r in ranks] == [(0, 2, 3.0), (1, 2, 3.0)]
    assert all(r["argv"] == TRICKY_ARGS for r in ranks)
    assert [r["env"]["LOCAL_RANK"] for r in ranks] == ["0", "1"]
    assert "rank 0 on testnode.gpu0: ok" in proc.stdout and "rank 1 on testnode.gpu1: ok" in proc.stdout
    assert str(job / "logs" / "run") in proc.stdout
    assert (job / "logs" / "run" / "stdout.log").exists() and (job / "logs" / "run" / "rank1.stderr.log").exists()


def test_a_failing_rank_sets_the_exit_code(hand_cluster, job):
    proc = run_to_end(job, ["train.py", "fail", "out"], hand_cluster["url"])
    assert proc.returncode == 7, proc.stdout + proc.stderr
    assert "rank 1 on testnode.gpu1: crashed (exit 7" in proc.stdout
    assert "rank 0 on testnode.gpu0: aborted" in proc.stdout  # stopped because its peer failed
    assert list(hand_cluster["client"].scan_iter(match=keys.gang("*"))) == []


def test_include_pins_the_run_to_one_device(hand_cluster, job):
    proc = run_to_end(job, ["--include", "testnode:1", "train.py", "env", "out"], hand_cluster["url"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    record = result(job)
    assert record["slots"] == ["testnode.gpu1"] and record["ranks"][0]["device"] == 1
    dumped = json.loads((job / "out" / "rank0.json").read_text())
    assert dumped["world_size"] == 1 and dumped["env"]["AUTOTUNE_SLOT"] == "testnode.gpu1"


def test_missing_slot_worker_is_one_line(hand_cluster, job):
    (job / "hostfile").write_text("testnode slots=4\n")
    proc = run_to_end(job, ["--include", "testnode:3", "train.py", "env", "out"], hand_cluster["url"])
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [proc.stderr.strip()], proc.stderr
    assert proc.stderr.startswith("error: no live slot worker for testnode.gpu3")


def _interrupt_when_ranks_started(proc: subprocess.Popen, job: Path, ranks: int, sig: int) -> tuple[float, str]:
    """How long the command took to end after `sig`, and its stderr."""
    wait_for(lambda: all((job / "out" / f"pid.rank{r}").exists() for r in range(ranks)) or proc.poll() is not None,
             90, "the ranks to start")
    assert proc.poll() is None, proc.communicate()
    proc.send_signal(sig)
    started = time.monotonic()
    _, stderr = proc.communicate(timeout=30)
    return time.monotonic() - started, stderr


def _rank_pids(job: Path, ranks: int) -> list[int]:
    return [int((job / "out" / f"pid.rank{r}").read_text()) for r in range(ranks)]


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_ctrl_c_stops_the_embedded_cluster_and_every_rank(job):
    marker = f"run-{os.getpid()}-{time.monotonic_ns()}"
    proc = start_run(job, ["--slots", "2", "train.py", "sleep", "out"], {"AUTOTUNE_TEST_MARKER": marker})
    took, stderr = _interrupt_when_ranks_started(proc, job, 2, signal.SIGINT)
    assert proc.returncode == 130 and took < 30, stderr
    assert processes_with_marker(marker) == []  # ranks, slot and control workers, redis-server
    assert all(_gone(pid) for pid in _rank_pids(job, 2))


def test_sigterm_stops_ranks_on_running_workers(hand_cluster, job):
    proc = start_run(job, ["--hostfile", "hostfile", "train.py", "sleep", "out"],
                     {"AUTOTUNE_REDIS_URL": hand_cluster["url"]})
    took, stderr = _interrupt_when_ranks_started(proc, job, 2, signal.SIGTERM)
    assert proc.returncode == 130 and took < 30, stderr
    wait_for(lambda: all(_gone(pid) for pid in _rank_pids(job, 2)), 15, "the revoked ranks to be killed")
    assert list(hand_cluster["client"].scan_iter(match=keys.gang("*"))) == []
