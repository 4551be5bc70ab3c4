"""What a tuning job shows in MLflow (`scheduler.report.mlflow_fields`), and the switch that turns it
on (`scheduler.report.mlflow_log.MlflowLog.start`), without a server: the integration test
(tests/integration/test_mlflow.py) sends the same through a real `mlflow server`."""
from __future__ import annotations

import base64
import sys
from pathlib import Path
from typing import Any

import pytest

from scheduler.report import mlflow_fields as fields
from scheduler.report.mlflow_log import HTTP_DEFAULTS, INSTALL_HINT, JobRun, MlflowLog
from workers.slot.records import ExperimentRecord

CONFIG = {
    "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "train_batch_size": 16,
    "zero_optimization": {"stage": 2, "overlap_comm": True, "reduce_bucket_size": 5e8,
                          "offload_optimizer": {"device": "cpu", "pin_memory": False}},
    "autotuning": {"enabled": True, "start_profile_step": 3, "end_profile_step": 5},
}


def record(name: str = "z2_gas2_tmbspg4", status: str = "ok", **extra: Any) -> dict[str, Any]:
    """A record as its JSON (what the job's events and result.json carry)."""
    base = {"name": name, "status": status, "ds_config": CONFIG, "slots": ["n1.gpu0", "n1.gpu1"],
            "started_at": 100.0, "ended_at": 112.5, "wall_s": 12.5, "peak_rss_bytes": 2**30,
            "peak_device_bytes": 3 * 2**30, "device_total_bytes": 80 * 2**30, "ranks": [{"rank": 0}, {"rank": 1}],
            "metrics": {"throughput": 250.0, "latency": 0.032, "FLOPS_per_gpu": 1.5e12} if status == "ok" else None}
    return {**base, **extra}


def typed(name: str = "z2_gas2_tmbspg4", status: str = "ok", **extra: Any) -> ExperimentRecord:
    """`record` as the child run's fields read it: parsed once where the event or the file arrives."""
    return ExperimentRecord.from_json(record(name, status, **extra))


@pytest.mark.parametrize(("setting", "environ", "expected"), [
    (None, {}, None),
    (None, {"MLFLOW_TRACKING_URI": "http://mlflow:5000"}, "http://mlflow:5000"),
    (None, {"MLFLOW_TRACKING_URI": ""}, None),
    ("http://other:5000", {"MLFLOW_TRACKING_URI": "http://mlflow:5000"}, "http://other:5000"),
    (False, {"MLFLOW_TRACKING_URI": "http://mlflow:5000"}, None),
], ids=["off", "environment", "empty-environment", "config-wins", "config-false-wins"])
def test_the_switch_is_the_config_then_mlflows_own_variable(setting: Any, environ: dict, expected: str | None) -> None:
    assert fields.tracking_uri(setting, environ) == expected


def test_the_experiment_is_mlflows_variable_else_ours() -> None:
    assert fields.experiment_name({}) == "celery-autotune"
    assert fields.experiment_name({"MLFLOW_EXPERIMENT_NAME": "gpt"}) == "gpt"


@pytest.mark.parametrize(("uri", "shown"), [
    ("http://mlflow:5000", "http://mlflow:5000"),
    ("https://user:secret@mlflow.example.com/path", "https://mlflow.example.com/path"),
    ("https://token@mlflow.example.com:8443", "https://mlflow.example.com:8443"),
    ("databricks", "databricks"),
    ("sqlite:////tmp/mlflow.db", "sqlite:////tmp/mlflow.db"),
])
def test_a_uri_is_shown_without_its_credentials(uri: str, shown: str) -> None:
    assert fields.shown_uri(uri) == shown


def test_a_failure_is_its_operating_system_error_or_its_message_cut_to_one_line() -> None:
    refused = RuntimeError("API request to http://127.0.0.1:1/api/2.0/mlflow/experiments/get-by-name failed with "
                           "exception HTTPConnectionPool(host='127.0.0.1', port=1): Max retries exceeded (Caused by "
                           "NewConnectionError('<urllib3.connection.HTTPConnection object>: Failed to establish a "
                           "new connection: [Errno 111] Connection refused'))")
    assert fields.failure_text(refused) == "RuntimeError: [Errno 111] Connection refused"
    long = fields.failure_text(ValueError("403 Forbidden\n" + "x" * 1000))
    assert long.startswith("ValueError: 403 Forbidden x") and len(long) == 300 and "\n" not in long


@pytest.mark.parametrize("message", [
    # a read timeout and a TLS failure: MLflow quotes the whole URL it requested, then urllib3's error
    "API request to https://alice:pw%40Q9zr@mlflow.example:8443/api/2.0/mlflow/runs/create failed with exception "
    "HTTPSConnectionPool(host='mlflow.example', port=8443): Read timed out. (read timeout=10)",
    "API request to https://alice:pw%40Q9zr@mlflow.example:8443/api/2.0/mlflow/runs/create failed with exception "
    "HTTPSConnectionPool(host='mlflow.example', port=8443): Max retries exceeded (Caused by SSLError("
    "SSLCertVerificationError(1, '[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed')))",
    # the decoded password, the token and the basic-auth header quoted as such
    "401 for alice:pw@Q9zr, Authorization: Basic YWxpY2U6cHdAUTl6cg==, Bearer tok-7f3e9a1c",
])
def test_no_failure_message_shows_a_credential(message: str) -> None:
    uri = "https://alice:pw%40Q9zr@mlflow.example:8443"
    secrets = fields.credentials(uri, {"MLFLOW_TRACKING_TOKEN": "tok-7f3e9a1c"})
    text = fields.failure_text(RuntimeError(message), secrets=secrets)
    assert not any(secret in text for secret in ("pw%40Q9zr", "pw@Q9zr", "tok-7f3e9a1c", "YWxpY2U6cHdAUTl6cg")), text
    assert text.startswith("RuntimeError: ") and "***" in text
    if "timed out" in message:  # what went wrong still shows
        assert "https://***@mlflow.example:8443/api/2.0/mlflow/runs/create" in text and "Read timed out" in text


def test_mlflows_password_variable_is_masked_with_its_user() -> None:
    environ = {"MLFLOW_TRACKING_USERNAME": "bob", "MLFLOW_TRACKING_PASSWORD": "hunter22"}
    secrets = fields.credentials("http://mlflow:5000", environ)
    assert "hunter22" in secrets and base64.b64encode(b"bob:hunter22").decode() in secrets
    assert fields.masked("password hunter22 rejected", secrets) == "password *** rejected"


def test_the_config_key_ignores_where_it_logs_and_nothing_else() -> None:
    key = fields.config_key(CONFIG)
    assert fields.config_key({**CONFIG, "autotuning": {**CONFIG["autotuning"], "mlflow": "http://x"}}) == key
    assert fields.config_key({**CONFIG, "train_micro_batch_size_per_gpu": 8}) != key
    assert fields.config_key({**CONFIG, "autotuning": {**CONFIG["autotuning"], "fast": False}}) != key


def test_params_are_the_knobs_the_experiment_measured() -> None:
    assert fields.experiment_params(typed()) == {
        "zero_stage": "2", "micro_batch_size": "4", "gradient_accumulation_steps": "2", "train_batch_size": "16",
        "world_size": "2", "zero.overlap_comm": "true", "zero.reduce_bucket_size": "500000000.0",
        "zero.offload_optimizer.device": "cpu", "zero.offload_optimizer.pin_memory": "false",
    }
    long = fields.experiment_params(typed(ds_config={"zero_optimization": {"stage": 0, "x": "y" * 900}}))
    assert len(long["zero.x"]) == fields.MAX_VALUE_CHARS and long["zero.x"].endswith("...")


def test_metrics_are_the_scripts_and_what_the_experiment_cost() -> None:
    assert fields.experiment_metrics(typed()) == {
        "throughput": 250.0, "latency": 0.032, "FLOPS_per_gpu": 1.5e12, "wall_s": 12.5,
        "peak_rss_bytes": float(2**30), "peak_device_bytes": float(3 * 2**30), "device_total_bytes": float(80 * 2**30),
    }
    # a failure has no metrics of the script's, only its cost; nothing that is no finite number is logged
    assert fields.experiment_metrics(typed(status="oom")) == {
        "wall_s": 12.5, "peak_rss_bytes": float(2**30), "peak_device_bytes": float(3 * 2**30),
        "device_total_bytes": float(80 * 2**30)}
    odd = typed(metrics={"throughput": float("nan"), "latency": True, "master": "h:1", "rank": 0}, wall_s=None)
    assert set(fields.experiment_metrics(odd)) == {"rank", "peak_rss_bytes", "peak_device_bytes", "device_total_bytes"}


def test_a_lost_launchs_record_logs_no_cost_it_never_measured() -> None:
    """The sweep's record of a launch given up holds no times and no costs: none is logged as a zero."""
    lost = ExperimentRecord.from_json({"name": "z1", "status": "lost", "metrics": None, "ds_config": CONFIG,
                                       "slots": ["n1.gpu0"], "cause": {"error": "its worker is gone"}})
    assert fields.experiment_metrics(lost) == {}
    assert fields.experiment_tags(lost)["autotune.status"] == "lost" and fields.run_status(lost) == "FAILED"


def test_tags_say_how_it_ended_where_it_ran_and_what_it_repeats() -> None:
    assert fields.experiment_tags(typed()) == {
        "autotune.experiment": "z2_gas2_tmbspg4", "autotune.status": "ok", "autotune.slots": "n1.gpu0,n1.gpu1"}
    failed = typed(name="z2_gas2_tmbspg4_r2", status="crashed",
                    cause={"exit": "exit 3", "error": None, "stderr_tail": "Traceback\nRuntimeError: boom\n\n"})
    assert fields.experiment_tags(failed) == {
        "autotune.experiment": "z2_gas2_tmbspg4_r2", "autotune.status": "crashed",
        "autotune.slots": "n1.gpu0,n1.gpu1", "autotune.repeat_of": "z2_gas2_tmbspg4",
        "autotune.cause": "exit 3; RuntimeError: boom"}
    assert len(fields.experiment_tags(typed(status="oom", cause={"error": "e" * 999}))["autotune.cause"]) == 250
    assert fields.run_status(typed()) == "FINISHED" and fields.run_status(typed(status="oom")) == "FAILED"


def test_the_parent_shows_the_job_and_the_winners_mean() -> None:
    params = fields.job_params({**CONFIG, "train_micro_batch_size_per_gpu": [2, 4], "zero_optimization": {"stage": "all"}},
                               "latency", "train.py", 1, 8)
    assert params == {"metric": "latency", "script": "train.py", "num_nodes": "1", "num_gpus": "8",
                      "zero_stages": "all", "micro_batch_sizes": "[2, 4]", "gradient_accumulation_steps": "2",
                      "fast": "true", "search": "sampled"}
    other = {**CONFIG, "train_micro_batch_size_per_gpu": 8}
    records = {"a": record("a", metrics={"throughput": 100.0}), "a_r2": record("a_r2", metrics={"throughput": 120.0}),
               "b": record("b", ds_config=other, metrics={"throughput": 105.0}), "c": record("c", status="oom"),
               "d": record("d", status="cancelled")}
    assert fields.job_metrics(records, "throughput", True, 61.25) == {
        "experiments": 4.0, "failed_experiments": 1.0, "tuning_s": 61.25, "best_throughput": 110.0,
        "best_readings": 2.0}
    assert "best_throughput" not in fields.job_metrics({"c": record("c", status="oom")}, "throughput", True, 1.0)


JOB = JobRun(name="train.py cfg.json", config_key="k", params={})


def test_off_imports_nothing_and_says_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mlflow", None)  # an import would raise
    warned: list[str] = []
    assert MlflowLog.start(None, tmp_path, JOB, warned.append, environ={}) is None
    assert MlflowLog.start(False, tmp_path, JOB, warned.append, environ={"MLFLOW_TRACKING_URI": "http://x"}) is None
    assert warned == [] and list(tmp_path.iterdir()) == []


def test_on_without_the_client_is_one_warning_naming_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("mlflow", "mlflow.tracking"):
        monkeypatch.setitem(sys.modules, name, None)  # as if `pip install '.[mlflow]'` was never run
    for name in HTTP_DEFAULTS:  # start sets them in this process: restored after the test
        monkeypatch.delenv(name, raising=False)
    warned: list[str] = []
    environ = {"MLFLOW_TRACKING_URI": "https://user:secret@mlflow.example.com"}
    assert MlflowLog.start(None, tmp_path, JOB, warned.append, environ=environ) is None
    assert len(warned) == 1 and INSTALL_HINT in warned[0] and "tuning goes on" in warned[0]
    assert "secret" not in warned[0] and "https://mlflow.example.com" in warned[0]
    assert list(tmp_path.iterdir()) == []


def test_a_uri_mlflow_cannot_use_is_one_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.chdir(tmp_path.parent)  # MLflow's default store (./mlflow.db) must not land in the checkout
    previous = mlflow.get_tracking_uri()
    for name in HTTP_DEFAULTS:
        monkeypatch.delenv(name, raising=False)
    warned: list[str] = []
    try:
        assert MlflowLog.start("nosuchscheme://host", tmp_path, JOB, warned.append, environ={}) is None
    finally:
        mlflow.set_tracking_uri(previous)  # start sets this process's URI (2.x uploads read it)
    assert len(warned) == 1 and warned[0].startswith("MLflow at nosuchscheme://host failed (")
    assert list(tmp_path.iterdir()) == []


def test_a_failing_server_is_one_warning_without_its_credentials(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """MLflow's errors quote the URL with its user info, and may quote the token: the warning shows neither."""
    mlflow = pytest.importorskip("mlflow")
    import mlflow.tracking

    uri, token = "https://alice:pw%40Q9zr@mlflow.example:8443", "tok-7f3e9a1c"

    class TimedOut:
        def __init__(self, tracking_uri: str) -> None:
            self.uri = tracking_uri

        def get_experiment_by_name(self, name: str) -> None:
            raise RuntimeError(f"API request to {self.uri}/api/2.0/mlflow/experiments/get-by-name failed with "
                               f"exception Read timed out (headers: Bearer {token})")

    monkeypatch.setattr(mlflow.tracking, "MlflowClient", TimedOut)
    previous = mlflow.get_tracking_uri()
    warned: list[str] = []
    try:
        assert MlflowLog.start(uri, tmp_path, JOB, warned.append, environ={"MLFLOW_TRACKING_TOKEN": token}) is None
    finally:
        mlflow.set_tracking_uri(previous)
    assert len(warned) == 1 and "Read timed out" in warned[0], warned
    assert "pw%40Q9zr" not in warned[0] and "alice" not in warned[0] and token not in warned[0], warned[0]
