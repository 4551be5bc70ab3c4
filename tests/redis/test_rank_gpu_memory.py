"""A rank on a GPU others hold memory on (workers.slot.rank with workers.device.device_idle and workers.state.slot_health):
run in this process against a real redis-server, a real script subprocess
and the fake nvidia-smi (tests/fake_gpu), whose usage file the test and the script write.

Before a launch: others' memory that stays past the wait means the script never starts, the slot is
marked out of tuning and the launch's peers are told to stop. After a run: memory still held a wait
after the script's processes ended keeps the slot out of tuning before it is freed, and the record
says how much; memory that goes within the wait (a context torn down slowly) does neither.
"""
from __future__ import annotations

import json
import os
import stat
import threading
import time
from pathlib import Path

import pytest
import redis

from workers.state import keys
from workers.slot import rank as rank_module
from workers.device.device_idle import FreeMemoryWaiter
from workers.device.gpus import memory_used
from workers.slot.rank import run_rank
from workers.slot.rank_spec import RankSpec
from workers.device.slot import Slot

GiB = 2**30
FAKE_GPU_DIR = Path(__file__).resolve().parents[1] / "fake_gpu"
UUID = "GPU-00000000-0000-0000-0000-000000000000"  # the fake's GPU 0
SLOT = Slot("n0", 0, "cuda", 16 * GiB, "127.0.0.1", 1, (), "gpu0@n0", cuda_index=0, host="m1", gpu_uuid=UUID)


@pytest.fixture
def gpu(tmp_path: Path, monkeypatch) -> Path:
    """The fake nvidia-smi on PATH with GPU 0 free; the usage file is returned to be written."""
    used = tmp_path / "used.csv"
    used.write_text("0, 2\n")
    monkeypatch.setenv("PATH", f"{FAKE_GPU_DIR}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_NVIDIA_SMI_USED_FILE", str(used))
    monkeypatch.setattr(rank_module, "FREE_MEMORY", FreeMemoryWaiter(memory_used, wait_s=2.0, poll_s=0.2))
    return used


def script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "train.sh"
    path.write_text(f"#!/bin/sh\ntouch {tmp_path / 'ran'}\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def spec(tmp_path: Path, path: Path) -> RankSpec:
    return RankSpec(job="j", name="e", attempt="att-1", results_root=str(tmp_path / "results"),
                    script_argv=[str(path)], ds_config={}, rank=0, world_size=1, local_rank=0,
                    local_world_size=1, node_rank=0, timeout_s=30.0, metric_file="", cuda_devices=["0"])


def mark(client: redis.Redis) -> dict | None:
    raw = client.get(keys.unhealthy(SLOT.queue))
    return json.loads(raw) if raw else None


def test_others_memory_that_stays_means_no_start(client: redis.Redis, gpu: Path, tmp_path: Path) -> None:
    gpu.write_text("0, 20480\n")
    record = run_rank(spec(tmp_path, script(tmp_path, "exit 0")), SLOT, client)
    assert record["status"] == "gpu_busy" and record["exit"] == "not started"
    assert record["device_foreign_bytes"] == 20 * GiB and record["device_wait_s"] >= 2.0
    assert not (tmp_path / "ran").exists()
    assert mark(client)["used_bytes"] == 20 * GiB and mark(client)["why"] == "before a launch"
    assert client.exists(keys.abort("att-1"))  # the launch's other ranks stop


def test_memory_left_after_the_run_keeps_the_slot_out(client: redis.Redis, gpu: Path, tmp_path: Path) -> None:
    record = run_rank(spec(tmp_path, script(tmp_path, f'echo "0, 8192" >> {gpu}')), SLOT, client)
    assert record["status"] == "ok" and (tmp_path / "ran").exists()
    assert record["device_foreign_bytes"] == 0 and record["device_foreign_after_bytes"] == 8 * GiB
    assert mark(client)["used_bytes"] == 8 * GiB and mark(client)["why"] == "after a run"


def test_memory_torn_down_within_the_wait_is_waited_for_not_marked(client: redis.Redis, gpu: Path,
                                                                   tmp_path: Path) -> None:
    """The script leaves 8 GiB behind that goes 0.3 s after it exited (a context the driver tears
    down slowly): the rank waits for it and the slot stays in tuning."""
    def tear_down() -> None:
        while "8192" not in gpu.read_text():
            time.sleep(0.02)
        time.sleep(0.3)
        with gpu.open("a") as used:
            used.write("0, 0\n")

    driver = threading.Thread(target=tear_down, daemon=True)
    driver.start()
    record = run_rank(spec(tmp_path, script(tmp_path, f'echo "0, 8192" >> {gpu}')), SLOT, client)
    driver.join(timeout=5)
    assert record["status"] == "ok" and "device_foreign_after_bytes" not in record
    assert mark(client) is None


def test_redis_failing_as_the_slot_is_marked_keeps_the_record(client: redis.Redis, gpu: Path, tmp_path: Path,
                                                              monkeypatch) -> None:
    def refused(*args: object) -> None:
        raise redis.ConnectionError("Redis is restarting")

    monkeypatch.setattr(rank_module.RedisSlotStore, "mark_unhealthy", refused)
    record = run_rank(spec(tmp_path, script(tmp_path, f'echo "0, 8192" >> {gpu}')), SLOT, client)
    assert record["status"] == "ok" and record["device_foreign_after_bytes"] == 8 * GiB
