"""Results where users already look: a tuning job in MLflow, end to end.

A real `mlflow server` on a free loopback port (SQLite store, proxied artifacts), started here and
stopped by its process group; real tuning jobs on the hand-started cluster with MLFLOW_TRACKING_URI
set; everything read back through MLflow's own client: one parent run per job, one child per
experiment with its params, metrics and tags, the winner tagged, the outputs as the parent's
artifacts, and a resumed job (after Ctrl-C) continuing the same parent. A server that is down is one
warning line, the tuning goes on, and the next run logs every record: nothing is lost.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from integration_helpers import run_autotune, stop_group, wait_for, write_config
from workers.state import keys
from scheduler.embedded.local_cluster import free_tcp_port

pytestmark = pytest.mark.integration

try:
    from mlflow.tracking import MlflowClient
except ImportError:  # the dev extra installs it: a missing client is a broken setup, not a skip
    MlflowClient = None

ARTIFACTS = {"summary.txt", "ds_config_optimal.json", "cmd_optimal.txt", "tuning.png", "timeline.png"}


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as answer:
            return answer.status == 200
    except OSError:
        return False


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    if MlflowClient is None:
        pytest.fail("mlflow is required for this test: pip install -e '.[dev]' (bash deploy/setup_tests.sh does)")
    work = tmp_path_factory.mktemp("mlflow")
    port = free_tcp_port()
    url = f"http://127.0.0.1:{port}"
    with open(work / "server.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
             "--backend-store-uri", f"sqlite:///{work / 'mlflow.db'}", "--artifacts-destination", str(work / "artifacts")],
            cwd=work, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})  # no huey job consumers: unused here
    try:
        wait_for(lambda: proc.poll() is not None or _healthy(url), 180, "mlflow server's /health")
        assert proc.poll() is None, (work / "server.log").read_text()[-3000:]
        yield url
    finally:
        stop_group(proc)  # the server, its uvicorn worker and its job consumers: one process group
        try:  # the job consumers may outlive the server by seconds
            wait_for(lambda: not _group_alive(proc.pid), 30, "the mlflow server's processes to exit")
        except AssertionError:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            wait_for(lambda: not _group_alive(proc.pid), 10, "the mlflow server's processes to be killed")


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True


def _env(hand_cluster, tracking_uri: str, experiment: str) -> dict[str, str]:
    return {"AUTOTUNE_REDIS_URL": hand_cluster["url"], "AUTOTUNE_LEASE_S": "15",
            "MLFLOW_TRACKING_URI": tracking_uri, "MLFLOW_EXPERIMENT_NAME": experiment}


def _records(results: Path) -> dict[str, dict]:
    lines = (results / "results.jsonl").read_text().splitlines()
    return {record["name"]: record for line in lines if (record := json.loads(line))["status"] != "cancelled"}


def _runs(url: str, experiment: str) -> tuple[list, list]:
    """(parent runs, child runs) of the experiment, every run read back from the server."""
    client = MlflowClient(tracking_uri=url)
    found = client.get_experiment_by_name(experiment)
    assert found is not None, f"no MLflow experiment {experiment!r}"
    runs = client.search_runs([found.experiment_id], max_results=1000)
    parents = [run for run in runs if "mlflow.parentRunId" not in run.data.tags]
    return parents, [run for run in runs if "mlflow.parentRunId" in run.data.tags]


def _config(tmp_path: Path, *user_args: str) -> Path:
    cfg = write_config(tmp_path / "cfg.json", train_micro_batch_size_per_gpu=[1, 2, 3],
                       zero_optimization={"stage": [0, 1]})
    data = json.loads(cfg.read_text())
    data["autotuning"]["user_args"] = ["--behaviour", "3=oom", *user_args]
    cfg.write_text(json.dumps(data))
    return cfg


def _check_children(children: list, records: dict[str, dict], parent_id: str) -> None:
    """One child per record, each showing its record: the config's knobs, the metrics, how it ended."""
    by_name = {run.info.run_name: run for run in children}
    assert sorted(run.info.run_name for run in children) == sorted(records), "one child run per experiment"
    for name, record in records.items():
        run, config = by_name[name], record["ds_config"]
        assert run.data.tags["mlflow.parentRunId"] == parent_id
        assert run.data.params["zero_stage"] == str(config["zero_optimization"]["stage"])
        assert run.data.params["micro_batch_size"] == str(config["train_micro_batch_size_per_gpu"])
        assert run.data.params["gradient_accumulation_steps"] == str(config["gradient_accumulation_steps"])
        assert run.data.tags["autotune.status"] == record["status"]
        assert run.data.tags["autotune.slots"] == ",".join(record["slots"])
        assert run.data.metrics["wall_s"] == pytest.approx(record["wall_s"])
        assert run.data.metrics["peak_rss_bytes"] == record["peak_rss_bytes"]
        if record["status"] == "ok":  # the profile run reports the model, not a throughput
            assert run.data.metrics.get("throughput") == pytest.approx(record["metrics"].get("throughput"))
            assert run.info.status == "FINISHED"
        else:
            assert "throughput" not in run.data.metrics and run.info.status == "FAILED"


def test_a_job_is_one_parent_run_with_a_child_per_experiment_and_its_resume_continues_it(
        hand_cluster, mlflow_server, tmp_path):
    hold = tmp_path / "hold"  # every experiment after the 2nd to start waits for hold/release
    cfg, results = _config(tmp_path, "--hold", str(hold), "--hold-after", "2"), tmp_path / "autotuning_results"
    env = {key: value for key, value in os.environ.items() if key != "AUTOTUNE_REDIS_URL"}
    env.update(_env(hand_cluster, mlflow_server, tmp_path.name))
    proc = subprocess.Popen([sys.executable, "-m", "scheduler.autotune", str(cfg), "--num_gpus", "1"], cwd=tmp_path,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:  # Ctrl-C while an experiment runs and more are to come
        wait_for(lambda: list(hold.glob("holding.*")), 120, "an experiment after the 2nd to start")
    finally:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, out + err
    wait_for(lambda: not list(hand_cluster["client"].scan_iter(match=keys.gang("*"))), 30,
             "the cancelled job's slots to be released")
    measured = _records(results)
    assert measured, out + err
    [parent], children = _runs(mlflow_server, tmp_path.name)
    assert parent.info.status == "KILLED" and parent.data.tags["autotune.status"] == "interrupted"
    _check_children(children, measured, parent.info.run_id)

    (hold / "release").touch()
    again = run_autotune([str(cfg), "--num_gpus", "1"], tmp_path, _env(hand_cluster, mlflow_server, tmp_path.name))
    assert again.returncode == 0, again.stdout + again.stderr
    assert "MLflow" not in again.stderr, again.stderr
    records = _records(results)
    assert set(measured) < set(records) and any(r["status"] == "oom" for r in records.values())
    [resumed], children = _runs(mlflow_server, tmp_path.name)
    assert resumed.info.run_id == parent.info.run_id, "the resumed job continues its parent run"
    assert resumed.info.status == "FINISHED"
    _check_children(children, records, parent.info.run_id)  # the reused records were not logged twice
    winner = next(line.split()[1] for line in again.stdout.splitlines() if line.startswith("best: "))
    assert [run.info.run_name for run in children if run.data.tags.get("autotune.winner") == "true"] == [winner]
    assert resumed.data.tags["autotune.winner"] == winner
    assert resumed.data.params["metric"] == "throughput" and resumed.data.params["zero_stages"] == "[0, 1]"
    assert resumed.data.metrics["best_throughput"] == pytest.approx(
        sum(r["metrics"]["throughput"] for r in records.values()
            if r["status"] == "ok" and r["ds_config"] == records[winner]["ds_config"])
        / sum(r["status"] == "ok" and r["ds_config"] == records[winner]["ds_config"] for r in records.values()))

    client = MlflowClient(tracking_uri=mlflow_server)
    assert ARTIFACTS <= {artifact.path for artifact in client.list_artifacts(parent.info.run_id)}
    downloaded = Path(client.download_artifacts(parent.info.run_id, "ds_config_optimal.json", str(tmp_path)))
    assert json.loads(downloaded.read_text()) == json.loads((results / "ds_config_optimal.json").read_text())


def test_a_server_that_is_down_is_one_warning_and_the_next_run_logs_every_record(
        hand_cluster, mlflow_server, tmp_path):
    cfg, results = _config(tmp_path), tmp_path / "autotuning_results"
    closed = f"http://127.0.0.1:{free_tcp_port()}"  # nothing listens there: connection refused
    down = run_autotune([str(cfg), "--num_gpus", "1"], tmp_path, _env(hand_cluster, closed, tmp_path.name))
    assert down.returncode == 0, down.stdout + down.stderr
    warnings = [line for line in down.stderr.splitlines() if "MLflow" in line]
    assert len(warnings) == 1 and warnings[0].startswith(f"warning: MLflow at {closed} failed ("), down.stderr
    assert "tuning goes on" in warnings[0] and (results / "ds_config_optimal.json").is_file()
    records = _records(results)

    up = run_autotune([str(cfg), "--num_gpus", "1"], tmp_path, _env(hand_cluster, mlflow_server, tmp_path.name))
    assert up.returncode == 0 and "MLflow" not in up.stderr, up.stdout + up.stderr
    assert _records(results) == records  # nothing ran again: every experiment was reused
    [parent], children = _runs(mlflow_server, tmp_path.name)
    assert parent.info.status == "FINISHED"
    _check_children(children, records, parent.info.run_id)  # nothing measured while it was down is lost
    assert sum(run.data.tags.get("autotune.winner") == "true" for run in children) == 1



def test_a_child_cut_off_while_it_was_logged_is_neither_lost_nor_logged_twice(mlflow_server, tmp_path):
    """Ctrl-C lands while a record's child run is being sent: the run may exist on the server, ended or
    not, before the results folder's state names it. Finishing the job keeps one child per record."""
    from scheduler.report.mlflow_log import PARENT_TAG, JobRun, MlflowLog

    def record(name: str, ended_at: float) -> dict:
        return {"name": name, "status": "ok", "slots": ["n.gpu0"], "wall_s": 5.0, "peak_rss_bytes": 2**20,
                "started_at": ended_at - 5, "ended_at": ended_at, "metrics": {"throughput": 10.0},
                "ds_config": {"zero_optimization": {"stage": 0}, "train_micro_batch_size_per_gpu": 1,
                              "gradient_accumulation_steps": 1}}

    records = {name: record(name, 1_800_000_000.0 + i) for i, name in enumerate(("kept", "ended", "running"))}
    log = MlflowLog.start(None, tmp_path, JobRun(name="cut off", config_key="k", params={}), pytest.fail,
                          environ={"MLFLOW_TRACKING_URI": mlflow_server, "MLFLOW_EXPERIMENT_NAME": tmp_path.name})
    log.record(records["kept"])
    log.record(records["ended"])
    del log.state["children"]["ended"]  # ended on the server, cut off before the state kept it
    parent = log.parent_run_id
    log.client.create_run(log.state["experiment_id"], run_name="running",  # cut off before it was ended
                          tags={PARENT_TAG: parent})
    log.finish(records, "kept", "throughput", True, 10.0, interrupted=True)
    assert not log.off
    [_], children = _runs(mlflow_server, tmp_path.name)
    _check_children(children, records, parent)
