"""The chord callback (`tasks.experiment.finish_experiment`) run in this process against a real
redis-server: the record goes to disk before anything else, field by field as the ranks reported it,
a callback whose ranks were all stale writes nothing, and one whose launch no longer holds its
experiment (a newer launch does, `scheduler.cluster.fencing`) is not counted: its record, marked
stale, goes only into a folder that has none."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis

from scheduler.cluster.launches import FinishSpec, RunningLaunch
from tasks import experiment as experiment_tasks
from workers.state import keys


@pytest.fixture
def callback(client: redis.Redis, work, monkeypatch):
    monkeypatch.setattr(experiment_tasks, "task_client", lambda conf: client)
    monkeypatch.setattr(experiment_tasks, "WORK", work)
    return experiment_tasks.finish_experiment.run


def finish(tmp_path: Path, metric_file: str = "metrics.json") -> dict:
    return FinishSpec(job="j", name="z1_gas1_tmbspg4", exp_id=7, attempt="att-1", slots=["n.gpu0", "n.gpu1"],
                      gang_token="tok", results_root=str(tmp_path), world_size=2,
                      ds_config={"train_micro_batch_size_per_gpu": 4}, timeout_s=60.0,
                      metric_file=metric_file).to_json()


def hold(client: redis.Redis, attempt: str = "att-1") -> None:
    """The job's running launch of the experiment is `attempt` (the launch that holds it now)."""
    launch = RunningLaunch(seq=1, exp={"name": "z1_gas1_tmbspg4"}, argv=[], attempt=attempt,
                           queues=["n.gpu0", "n.gpu1"], token=f"tok-{attempt}", rank_tasks={}, started=0.0,
                           deadline=1e12)
    client.hset(keys.job_running("j"), launch.name, json.dumps(launch.to_json()))


@pytest.fixture
def held(client: redis.Redis) -> None:
    hold(client)


def rank(index: int, status: str = "ok", **fields) -> dict:
    return {"rank": index, "status": status, "slot": f"n.gpu{index}", "started_at": 100.0 + index,
            "ended_at": 110.0 + index, "peak_rss_bytes": (index + 1) * 2**20, **fields}


def test_an_ok_experiment_is_written_as_its_ranks_reported_it(callback, held, tmp_path: Path) -> None:
    returned = callback([rank(1), rank(0, metrics={"throughput": 12.5, "latency": 80.0})], finish(tmp_path))
    folder = tmp_path / "z1_gas1_tmbspg4"
    assert json.loads((folder / "metrics.json").read_text()) == {"throughput": 12.5, "latency": 80.0}
    record = json.loads((folder / "result.json").read_text())
    assert record == returned
    assert (record["name"], record["exp_id"], record["status"]) == ("z1_gas1_tmbspg4", 7, "ok")
    assert record["slots"] == ["n.gpu0", "n.gpu1"] and record["ds_config"] == {"train_micro_batch_size_per_gpu": 4}
    assert (record["started_at"], record["ended_at"], record["wall_s"]) == (100.0, 111.0, 11.0)
    assert record["peak_rss_bytes"] == 2 * 2**20


def test_a_failed_rank_fails_the_experiment_and_leaves_no_metrics_file(callback, held, tmp_path: Path) -> None:
    callback([rank(0, metrics={"throughput": 12.5}), rank(1, "oom", exit=1)], finish(tmp_path))
    folder = tmp_path / "z1_gas1_tmbspg4"
    record = json.loads((folder / "result.json").read_text())
    assert record["status"] == "oom" and record["metrics"] is None and record["cause"]["rank"] == 1
    assert not (folder / "metrics.json").exists()


def test_the_launches_that_ran_beside_it_are_in_the_record(callback, held, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr("scheduler.cluster.co_runners.co_runners_of", lambda client, finish: ["j2/b"])
    returned = callback([rank(0, metrics={"throughput": 12.5}), rank(1)], finish(tmp_path))
    record = json.loads((tmp_path / "z1_gas1_tmbspg4" / "result.json").read_text())
    assert record["co_runners"] == ["j2/b"] and record == returned


def test_the_profile_runs_counted_model_info_goes_under_deepspeeds_name(callback, held, tmp_path: Path) -> None:
    """Each launch's ranks write model_info.<launch>.json (workers.process.launch_files); the callback copies
    the counted launch's to model_info.json, DeepSpeed's name, and writes no metrics.json."""
    callback([rank(0, metrics={"num_params": 10}), rank(1)], finish(tmp_path, metric_file="model_info.json"))
    folder = tmp_path / "z1_gas1_tmbspg4"
    assert json.loads((folder / "result.json").read_text())["status"] == "ok"
    assert not (folder / "metrics.json").exists()
    assert json.loads((folder / "model_info.json").read_text()) == {"num_params": 10}


def test_ranks_that_were_all_stale_write_nothing(callback, client: redis.Redis, tmp_path: Path) -> None:
    returned = callback([rank(0, "lost", stale=True), rank(1, "lost", stale=True)], finish(tmp_path))
    assert returned == {"name": "z1_gas1_tmbspg4", "status": "lost", "stale": True}
    assert list(tmp_path.iterdir()) == [] and client.keys("*") == []


def test_a_rank_that_found_its_gpu_busy_writes_no_record(callback, client: redis.Redis, tmp_path: Path) -> None:
    """A `gpu_busy` rank did not start (workers.state.slot_health): the experiment never ran, so the
    callback writes nothing and frees the launch's slots (finish.requeue_for_busy_gpu queues it
    again; tests/redis/test_dispatch.py)."""
    client.set("autotune:gang:n.gpu0", "tok")
    client.set("autotune:gang:n.gpu1", "tok")
    returned = callback([rank(0, "aborted"), rank(1, "gpu_busy", device_foreign_bytes=20 * 2**30)], finish(tmp_path))
    assert returned == {"name": "z1_gas1_tmbspg4", "status": "gpu_busy", "requeued": False}  # no such job here
    assert list(tmp_path.iterdir()) == [] and not client.keys("autotune:gang:*")


@pytest.mark.parametrize("holder", ["att-2", None])
def test_a_launch_that_no_longer_holds_its_experiment_is_not_counted(callback, client: redis.Redis, tmp_path: Path,
                                                                      holder: str | None) -> None:
    """Its node was cut off longer than its lease: the sweep launched the experiment again (att-2
    runs now), or the relaunch was recorded and its job ended (no job at all). The old launch's
    ranks finished and reported, and its record is neither written nor counted."""
    if holder is not None:
        hold(client, holder)
    before = {key: client.dump(key) for key in client.keys("*")}
    returned = callback([rank(1), rank(0, metrics={"throughput": 99.0})], finish(tmp_path))
    assert returned == {"name": "z1_gas1_tmbspg4", "status": "ok", "stale": True}
    folder = tmp_path / "z1_gas1_tmbspg4"
    assert sorted(path.name for path in folder.iterdir()) == ["result.json"]  # no metrics.json
    written = json.loads((folder / "result.json").read_text())
    assert written["stale"] is True and written["attempt"] == "att-1", "marked: never ranked, never listed"
    assert {key: client.dump(key) for key in client.keys("*")} == before  # not recorded, nothing published


def test_a_launch_not_counted_never_writes_over_the_record_of_the_launch_that_was(callback, client: redis.Redis,
                                                                                  tmp_path: Path) -> None:
    hold(client, "att-2")
    folder = tmp_path / "z1_gas1_tmbspg4"
    folder.mkdir()
    (folder / "result.json").write_text(json.dumps({"name": "z1_gas1_tmbspg4", "status": "ok", "attempt": "att-2"}))
    callback([rank(1), rank(0, metrics={"throughput": 99.0})], finish(tmp_path))
    assert json.loads((folder / "result.json").read_text())["attempt"] == "att-2"
