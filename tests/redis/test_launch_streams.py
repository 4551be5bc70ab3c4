"""Two launches of one experiment at once (a node cut off from Redis runs its launch on while the
control worker launched it again elsewhere), run in this process against a real redis-server with
real script subprocesses: each launch's ranks write their stdout/stderr under the launch's own name
(`workers.process.launch_files`), so the counted launch's failure class is read from its own stderr, never
from the stale launch's; and the chord callback shows the counted launch's logs, description and
command under DeepSpeed's plain names (stderr.log, exp.json, cmd.txt)."""
from __future__ import annotations

import json
import stat
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from scheduler.cluster.launches import FinishSpec, RunningLaunch
from tasks import experiment as experiment_tasks
from workers.state import keys
from workers.files import layout
from workers.slot.rank import run_rank
from workers.slot.rank_spec import RankSpec
from workers.device.slot import Slot

GiB = 2**30
STALE, COUNTED = "a" * 32, "b" * 32  #: the launches' attempt tokens (dispatch makes hex ones)
NAME = "z1_gas1_tmbspg4"
OOM_TRACE = ("Traceback (most recent call last):\n  File \"train.py\", line 9, in <module>\n"
             "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n")


def _slot(device: int) -> Slot:
    return Slot("n", device, "cpu", 16 * GiB, "127.0.0.1", 1, ())


def _script(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def _spec(tmp_path: Path, attempt: str, script: Path, slot: Slot) -> RankSpec:
    return RankSpec(job="j", name=NAME, attempt=attempt, results_root=str(tmp_path / "results"),
                    script_argv=[str(script)], ds_config={"train_micro_batch_size_per_gpu": 4}, rank=0,
                    world_size=1, local_rank=0, local_world_size=1, node_rank=0, timeout_s=30.0, metric_file="",
                    exp={"name": NAME, "slots": [slot.queue]})


def _wait_for(path: Path, what: str) -> None:
    deadline = time.monotonic() + 20
    while not path.exists():
        assert time.monotonic() < deadline, f"no {what} within 20s"
        time.sleep(0.02)


@pytest.fixture
def callback(client: redis.Redis, work, monkeypatch):
    monkeypatch.setattr(experiment_tasks, "task_client", lambda conf: client)
    monkeypatch.setattr(experiment_tasks, "WORK", work)
    return experiment_tasks.finish_experiment.run


def test_the_counted_launch_reads_its_own_stderr_and_the_folder_shows_its_logs(
        client: redis.Redis, callback, tmp_path: Path) -> None:
    """The stale launch's node was cut off while it built the ops: its script starts after the
    relaunch's (the counted one), and runs out of memory there while the counted one crashes with a
    KeyError. Through one shared stderr.log the stale trace lands in the counted launch's stderr
    (the stale process truncated it), and the counted launch is recorded as an out-of-memory: a
    config judged by a stranger's failure. Before the record, the plain names show the stale launch
    (the latest to start); the record shows the counted one there."""
    flags = tmp_path / "flags"
    flags.mkdir()
    counted = _script(tmp_path, "counted.sh", "echo 'KeyError: boom' >&2\necho counted says hello\n"
                      f"touch {flags}/counted_wrote\n"
                      f"while [ ! -e {flags}/stale_wrote ]; do sleep 0.02; done\nexit 1")
    stale = _script(tmp_path, "stale.sh", f"printf '{OOM_TRACE}' >&2\necho stale says hello\n"
                    f"touch {flags}/stale_wrote\nexit 1")
    records: dict[str, dict[str, Any]] = {}
    runs = [threading.Thread(target=lambda: records.update(counted=run_rank(
        _spec(tmp_path, COUNTED, counted, _slot(1)), _slot(1), client)), daemon=True)]
    runs[0].start()
    _wait_for(flags / "counted_wrote", "the counted launch's error")
    runs.append(threading.Thread(target=lambda: records.update(stale=run_rank(
        _spec(tmp_path, STALE, stale, _slot(0)), _slot(0), client)), daemon=True))
    runs[1].start()
    for run in runs:
        run.join(timeout=60)
    assert records["stale"]["status"] == "oom", records["stale"]  # its own trace, in its own stderr
    assert records["counted"]["status"] == "crashed", records["counted"]
    assert "oom" not in records["counted"] and "KeyError: boom" in records["counted"]["stderr_tail"]

    folder = tmp_path / "results" / NAME
    assert json.loads((folder / layout.EXP_JSON).read_text())["slots"] == ["n.gpu0"]  # the latest to start
    launch = RunningLaunch(seq=1, exp={"name": NAME}, argv=[], attempt=COUNTED, queues=["n.gpu1"],
                           token="tok", rank_tasks={}, started=0.0, deadline=1e12)
    client.hset(keys.job_running("j"), NAME, json.dumps(launch.to_json()))
    finish = FinishSpec(job="j", name=NAME, exp_id=1, attempt=COUNTED, slots=["n.gpu1"], gang_token="tok",
                        results_root=str(tmp_path / "results"), world_size=1,
                        ds_config={"train_micro_batch_size_per_gpu": 4}, timeout_s=30.0, metric_file="")
    record = callback([records["counted"]], finish.to_json())
    assert record["status"] == "crashed" and json.loads((folder / layout.RESULT).read_text()) == record
    # DeepSpeed's names show the counted launch: its stderr, stdout, slots and command
    assert (folder / "stderr.log").read_text() == "KeyError: boom\n"
    assert (folder / "stdout.log").read_text() == "counted says hello\n"
    assert json.loads((folder / layout.EXP_JSON).read_text())["slots"] == ["n.gpu1"]
    assert str(counted) in (folder / layout.CMD).read_text()
    # each launch's own files are kept, and "overwrite": true knows every name in the folder
    assert OOM_TRACE in (folder / layout.rank_log(0, "stderr", layout.launch_id(STALE))).read_text()
    assert all(layout.is_experiment_file(path.name) for path in folder.iterdir()), sorted(folder.iterdir())


def test_a_rank_starting_on_a_slot_ends_an_older_launchs_rank_still_running_there(
        client: redis.Redis, tmp_path: Path) -> None:
    """The older launch lost the slot (its node froze, its pool process died) but its rank runs on;
    the newer launch, which holds the slot now, ends it before its own script starts, so the two
    never share the slot's device (`workers.slot.rank_claim.end_older_launches`)."""
    flags = tmp_path / "flags"
    flags.mkdir()
    older = _script(tmp_path, "older.sh", f"date +%s.%N >> {flags}/older_alive\ntouch {flags}/older_up\n"
                    f"while true; do date +%s.%N >> {flags}/older_alive; sleep 0.02; done")
    newer = _script(tmp_path, "newer.sh", f"date +%s.%N > {flags}/newer_start\nexit 1")
    records: dict[str, dict[str, Any]] = {}
    run = threading.Thread(target=lambda: records.update(older=run_rank(
        _spec(tmp_path, STALE, older, _slot(0)), _slot(0), client)), daemon=True)
    run.start()
    _wait_for(flags / "older_up", "the older launch's script")
    records["newer"] = run_rank(_spec(tmp_path, COUNTED, newer, _slot(0)), _slot(0), client)
    run.join(timeout=30)
    assert not run.is_alive() and records["older"]["status"] != "ok"
    newer_start = float((flags / "newer_start").read_text())
    older_last = max(float(line) for line in (flags / "older_alive").read_text().split())
    assert older_last < newer_start, "the older launch's rank ran beside the newer one"
