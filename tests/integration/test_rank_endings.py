"""How a rank's ending is read, through real processes (the embedded cluster, real ranks):

- a rank that hangs after its experiment measured: DeepSpeed's profiling exit()
  leaves NCCL communicators for the interpreter's teardown, which can hang. `workers.in_rank.entry` skips
  that teardown for a Python script; a script started through a wrapper cannot, so the slot's monitor
  stops such a rank a grace period after rank 0's metrics appear, and the measurement stands;
- a rank that aborts (torch's NCCL watchdog ends a process with SIGABRT, which
  writes no exit report at its end) after its allocator counted an out-of-memory is an `oom`, read
  from the interim report `workers.in_rank.entry` kept writing while the script ran.
"""
from __future__ import annotations

import json
import shlex
import sys

import pytest

from integration_helpers import SCRIPTS, run_autotune, write_config

pytestmark = pytest.mark.integration


def tune_one_size(tmp_path, script: str, args: list[str], env_extra: dict[str, str] | None = None):
    """`python -m scheduler.autotune` on an embedded cluster, ZeRO-0 and micro-batch 1 only (the
    model's size given, so no profile run): the run and its one experiment's record."""
    autotuning = {"enabled": True, "metric": "throughput", "user_script": script,
                  "model_info": {"num_params": 1000, "activation_mem_per_gpu": 1024}}
    write_config(tmp_path / "cfg.json", autotuning=autotuning)
    proc = run_autotune(["cfg.json", "--slot-memory", "1GiB", *args], tmp_path, env_extra)
    found = list(tmp_path.rglob("z0_gas1_tmbspg1/result.json"))
    return proc, json.loads(found[0].read_text()) if found else None


def test_a_wrapper_script_that_hangs_after_measuring_keeps_its_measurement(tmp_path):
    wrapper = tmp_path / "train.sh"
    wrapper.write_text(f"#!/bin/sh\n{shlex.quote(sys.executable)} {shlex.quote(str(SCRIPTS / 'fake_train.py'))} "
                       "\"$@\" || exit $?\nsleep 600  # every rank: a teardown that never ends\n")
    wrapper.chmod(0o755)
    proc, record = tune_one_size(tmp_path, "train.sh", ["--slots", "2", "--num_gpus", "2", "--exp-timeout", "90"],
                                 {"AUTOTUNE_MEASURED_GRACE_S": "2"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert record["status"] == "ok" and record["metrics"]["throughput"] > 0, record
    assert record["wall_s"] < 45, record["wall_s"]  # stopped after the grace, not at the 90 s limit
    assert [rank["stopped_after_measuring"] for rank in record["ranks"]] == [True, True], record["ranks"]


ABORTS_AFTER_AN_OOM = """\
import os, sys, time, types
stats = {"num_alloc_retries": 2, "num_ooms": 1}  # torch.cuda as a GPU rank whose allocator ran out shows it
sys.modules["torch"] = types.SimpleNamespace(cuda=types.SimpleNamespace(
    is_initialized=lambda: True, device_count=lambda: 1, memory_stats=lambda d: stats,
    max_memory_reserved=lambda d: 6 << 30, max_memory_allocated=lambda d: 5 << 30,
    memory_reserved=lambda d: 6 << 30, mem_get_info=lambda d: (1 << 30, 8 << 30)))
time.sleep(2.6)  # the interim report is written every 2 s
os.abort()  # as NCCL's watchdog ends the process: no traceback, no exit report
"""


def test_a_rank_that_aborts_after_its_allocator_ran_out_is_an_oom(tmp_path):
    (tmp_path / "train_abort.py").write_text(ABORTS_AFTER_AN_OOM)
    proc, record = tune_one_size(tmp_path, "train_abort.py", ["--slots", "1", "--exp-timeout", "60"])
    assert proc.returncode == 1 and "oom (1)" in proc.stderr, proc.stdout + proc.stderr  # nothing succeeded
    assert record["status"] == "oom", record
    assert record["cause"]["oom_from"] == "allocator counts" and "signal SIGABRT" == record["cause"]["exit"]
