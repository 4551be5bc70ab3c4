"""What MLflow shows of a tuning job: each experiment's record as a child run's params, metrics and
tags, and the job as the parent run's.

Why a module of its own: the mapping is the part worth testing, and it needs no server and no
`mlflow` import; `scheduler.report.mlflow_log` only sends what these functions return. Every key
our runs carry that is not a param or a metric starts with `autotune.`, so a user's MLflow search
(`tags.autotune.winner = 'true'`) finds them and nothing else.
"""
from __future__ import annotations

import base64
import hashlib
import json
import math
import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

from scheduler.report.rows import row_of
from scheduler.search.ranking import pooled_best
from scheduler.search.repeats import REPEAT_NAME
from workers.slot.records import ExperimentRecord

TRACKING_URI_ENV = "MLFLOW_TRACKING_URI"  #: MLflow's own switch: set, the command logs there
EXPERIMENT_ENV = "MLFLOW_EXPERIMENT_NAME"  #: MLflow's own: the experiment our runs go into
DEFAULT_EXPERIMENT = "celery-autotune"
#: The record's figures logged as metrics beside the script's own (throughput, latency, FLOPS_per_gpu):
#: what the experiment cost and the peaks its busiest rank reached (`workers.slot.records.aggregate`);
#: each names a field of `ExperimentRecord`, None where the record lacks it (then not logged).
RECORD_METRICS = ("wall_s", "peak_rss_bytes", "peak_device_bytes", "peak_device_allocated_bytes",
                  "device_total_bytes", "device_alloc_retries")
MAX_VALUE_CHARS = 500  #: MLflow 2.10's limit for a param value (later versions allow more)
MAX_CAUSE_CHARS = 250
OS_ERROR = re.compile(r"\[Errno -?\d+\] [^'\"()\]\[]+")
#: `scheme://user:password@` anywhere in a message: the client's errors quote the URL they requested
#: (`API request to https://user:pass@host/api/... failed`), credentials and all.
URL_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^/@\s'\"<>]+@")
#: MLflow's own variables that hold a credential: their values never reach a message.
SECRET_ENV = ("MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")
MIN_SECRET_CHARS = 4  #: shorter values are masked only where they sit in a URL's user info
MASK = "***"

STATUS, SLOTS, WINNER, EXPERIMENT, REPEAT_OF, CAUSE = (
    "autotune.status", "autotune.slots", "autotune.winner", "autotune.experiment", "autotune.repeat_of",
    "autotune.cause")
SUPERSEDED = "autotune.superseded"  #: on a child whose experiment was measured again later (a relaunch)


def tracking_uri(setting: Any, environ: Mapping[str, str]) -> str | None:
    """Where the command logs: `autotuning.mlflow` when it is a URI, nowhere when it is false,
    else MLFLOW_TRACKING_URI when set (MLflow's own switch), else nowhere."""
    if setting is False:
        return None
    if isinstance(setting, str) and setting:
        return setting
    return environ.get(TRACKING_URI_ENV) or None


def experiment_name(environ: Mapping[str, str]) -> str:
    return environ.get(EXPERIMENT_ENV) or DEFAULT_EXPERIMENT


def shown_uri(uri: str) -> str:
    """The URI without the user and password a `https://user:pass@host` URI may carry, for messages."""
    parts = urlsplit(uri)
    if parts.password is None and parts.username is None:
        return uri
    host = parts.hostname or ""
    return urlunsplit(parts._replace(netloc=host + (f":{parts.port}" if parts.port else "")))


def credentials(uri: str, environ: Mapping[str, str]) -> tuple[str, ...]:
    """What a message about this server may quote that is a secret: the URI's password (as written
    and decoded), MLflow's password and token variables, and the basic-auth header made of them."""
    parts = urlsplit(uri)
    user, password = unquote(parts.username or ""), parts.password
    found = [password, unquote(password)] if password else []
    found += [value for name in SECRET_ENV if (value := environ.get(name))]
    pairs = [(user, unquote(password))] if password else []
    if environ.get("MLFLOW_TRACKING_PASSWORD"):
        pairs.append((environ.get("MLFLOW_TRACKING_USERNAME", ""), environ["MLFLOW_TRACKING_PASSWORD"]))
    found += [base64.b64encode(f"{name}:{secret}".encode()).decode() for name, secret in pairs]
    return tuple(sorted({value for value in found if len(value) >= MIN_SECRET_CHARS}, key=len, reverse=True))


def masked(text: str, secrets: tuple[str, ...] = ()) -> str:
    """`text` with every URL's user info and each of `secrets` replaced by ***."""
    text = URL_USERINFO.sub(rf"\g<scheme>{MASK}@", text)
    for secret in secrets:
        text = text.replace(secret, MASK)
    return text


def failure_text(exc: BaseException, limit: int = 300, secrets: tuple[str, ...] = ()) -> str:
    """What went wrong, short enough for one warning line: the operating system's error when there is
    one (`[Errno 111] Connection refused`, buried at the end of MLflow's message), else the message;
    credentials masked (`masked`) wherever the message quotes them."""
    text = masked(" ".join(masked(f"{type(exc).__name__}: {exc}", secrets).split()), secrets)
    errno = OS_ERROR.search(text)
    if errno is not None:
        return f"{type(exc).__name__}: {errno.group(0).strip()}"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def config_key(ds_config: Mapping[str, Any]) -> str:
    """The identity of a tuning config: a job run again with the same one continues its parent run;
    another config in the same results folder is another job, another parent. `autotuning.mlflow`
    (where to log) does not count."""
    config = {**ds_config, "autotuning": {k: v for k, v in (ds_config.get("autotuning") or {}).items() if k != "mlflow"}}
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _text(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= MAX_VALUE_CHARS else text[:MAX_VALUE_CHARS - 3] + "..."


def _flat(prefix: str, value: Any) -> dict[str, Any]:
    if isinstance(value, Mapping):
        return {key: item for name, inner in value.items() for key, item in _flat(f"{prefix}.{name}", inner).items()}
    return {prefix: value}


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def experiment_params(record: ExperimentRecord) -> dict[str, str]:
    """The config the experiment measured: ZeRO stage, micro-batch, gas, the global batch, its ranks,
    and every ZeRO knob it set (`zero.<knob>`, nested ones dotted: `zero.offload_optimizer.device`)."""
    ds_config = record.ds_config or {}
    zero = ds_config.get("zero_optimization") or {}
    params: dict[str, Any] = {
        "zero_stage": zero.get("stage"),
        "micro_batch_size": ds_config.get("train_micro_batch_size_per_gpu"),
        "gradient_accumulation_steps": ds_config.get("gradient_accumulation_steps"),
        "train_batch_size": ds_config.get("train_batch_size"),
        "world_size": len(record.ranks) or None,
    }
    params.update({key: value for key, value in _flat("zero", zero).items() if key != "zero.stage"})
    return {key: _text(value) for key, value in params.items() if value is not None}


def experiment_metrics(record: ExperimentRecord) -> dict[str, float]:
    """The script's metrics (a measured experiment's: throughput, latency, FLOPS_per_gpu, ...) and what
    the experiment cost (`RECORD_METRICS`); a failed one has no metrics of the script's."""
    metrics = {key: number for key, value in (record.metrics or {}).items()
               if record.ok and (number := _number(value)) is not None}
    metrics.update({key: number for key in RECORD_METRICS if (number := _number(getattr(record, key))) is not None})
    return metrics


def experiment_tags(record: ExperimentRecord) -> dict[str, str]:
    """How it ended and where it ran; a failure's cause in one line; a re-measurement's original."""
    tags = {EXPERIMENT: record.name, STATUS: record.status.value,
            SLOTS: ",".join(str(slot) for slot in record.slots or [])}
    match = REPEAT_NAME.match(record.name)
    if match:
        tags[REPEAT_OF] = match["original"]
    cause = record.cause
    if isinstance(cause, Mapping):
        words = [str(cause[key]) for key in ("exit", "error") if cause.get(key)]
        tail = next((line.strip() for line in reversed(str(cause.get("stderr_tail") or "").splitlines())
                     if line.strip()), "")
        text = "; ".join([*words, tail] if tail else words)
        if text:
            tags[CAUSE] = text if len(text) <= MAX_CAUSE_CHARS else text[:MAX_CAUSE_CHARS - 3] + "..."
    return tags


def run_status(record: ExperimentRecord) -> str:
    """MLflow's status of the child run: FINISHED for a measured experiment, FAILED for any failure
    (the class itself is the `autotune.status` tag)."""
    return "FINISHED" if record.ok else "FAILED"


def job_params(ds_config: Mapping[str, Any], metric: str, script: str, num_nodes: int, num_gpus: int) -> dict[str, str]:
    """The parent run's params: what was tuned, on what, by which metric (the config as written)."""
    autotuning = ds_config.get("autotuning") or {}
    params = {
        "metric": metric, "script": script, "num_nodes": num_nodes, "num_gpus": num_gpus,
        "zero_stages": (ds_config.get("zero_optimization") or {}).get("stage", 0),
        "micro_batch_sizes": ds_config.get("train_micro_batch_size_per_gpu", 1),
        "gradient_accumulation_steps": ds_config.get("gradient_accumulation_steps", 1),
        "fast": autotuning.get("fast", True),
        "search": autotuning.get("search", "sampled"),
    }
    return {key: _text(value) for key, value in params.items()}


def job_metrics(records: Mapping[str, Mapping[str, Any]], metric: str, maximize: bool,
                elapsed_s: float) -> dict[str, float]:
    """The parent run's figures: the winner's metric as it was picked (the mean of its readings, as
    summary.txt shows it), how many experiments ran and failed, and the tuning's wall time. An experiment
    an interrupt cut off (`scheduler.report.rows.CancelledRecord`) did not run."""
    measured = [row for row in map(row_of, records.values()) if isinstance(row, ExperimentRecord)]
    figures = {"experiments": float(len(measured)),
               "failed_experiments": float(sum(not row.ok for row in measured)),
               "tuning_s": round(elapsed_s, 3)}
    _, mean, readings = pooled_best(measured, metric, maximize)
    if mean is not None:
        figures[f"best_{metric}"] = mean
        figures["best_readings"] = float(readings)
    return figures
