"""A tuning job's results in MLflow, where many users already look: one parent run per job, one
child run per experiment, the winner tagged, the outputs as the parent's artifacts.

Why in the command that watches the job, and optional: MLflow is a convenience beside the results
folder, never a reason to stop tuning, and the `mlflow` client is an extra (`pip install
'.[mlflow]'`) imported only when logging is on: MLFLOW_TRACKING_URI set (MLflow's own switch) or
`autotuning.mlflow` a tracking URI (`false`: never). The command hands this module each record as
its event arrives (`record`); at the end (`finish`) it logs every record of the job it has not
logged yet (measured while no command watched, reused from an earlier run, missed while the server
was down), tags the winner, and uploads summary.txt, ds_config_optimal.json, cmd_optimal.txt and
the plots to the parent run.

What was logged is kept in the results folder (`workers.files.layout.MLFLOW_RUN`: the server, the parent
run, each experiment's child run and the record it logged), so running the same command again (a
resumed job) continues the same parent run and logs only what it lacks. Another config in the same
folder is another job with a parent of its own; `"overwrite": true` empties the folder, and so
starts a new parent too.

Any failure (mlflow not installed, the server down or refusing) is one warning line, and logging
stops for this run: the tuning goes on, every record stays in the folder, and the next run of the
same command logs what is missing. What to send is decided in `scheduler.report.mlflow_fields`.
"""
from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scheduler.report import mlflow_fields as fields
from workers.files.layout import MLFLOW_RUN, OPTIMAL_FILES, RESULTS_CSV, SUMMARY, TIMELINE_PLOT, TUNING_PLOT, result_file
from workers.files.paths import read_json, write_json
from workers.slot.records import ExperimentRecord

#: The parent run's artifacts, those of them that exist when the job ends.
ARTIFACTS = (SUMMARY, *OPTIMAL_FILES, TUNING_PLOT, TIMELINE_PLOT, RESULTS_CSV)
#: MLflow's HTTP client retries a failed request 7 times with exponential backoff (minutes) and waits
#: 120 s for an answer: a server down would stall the command that long. Ours, unless the user set them.
HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                 "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
                 # MLflow prints two "View run" lines each time a run ends: one per experiment
                 "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true"}
INSTALL_HINT = "pip install '.[mlflow]'"
PARENT_TAG = "mlflow.parentRunId"  #: MLflow's own: the UI nests a child under its parent


@dataclass(frozen=True)
class JobRun:
    """The parent run's identity and what it shows: the tuning job as the command knows it."""

    name: str  #: the run's name in MLflow's UI
    config_key: str  #: `mlflow_fields.config_key` of the tuning config: another one is another job
    params: dict[str, str]
    tags: dict[str, str] = field(default_factory=dict)
    started_at: float = 0.0


def _ms(seconds: Any) -> int | None:
    return int(float(seconds) * 1000) if isinstance(seconds, (int, float)) and seconds > 0 else None


class MlflowLog:
    """One tuning job's runs in MLflow: `start` it, hand it each `record`, `finish` it."""

    def __init__(self, client: Any, uri: str, results_dir: Path, warn: Callable[[str], None],
                 secrets: tuple[str, ...] = ()) -> None:
        self.client: Any = client
        self.off = False  #: a failure switched logging off for this run
        self.uri = uri
        self.secrets = secrets  #: masked in every warning (`mlflow_fields.credentials`)
        self.results_dir = results_dir
        self.warn = warn
        self.state: dict[str, Any] = {}

    @classmethod
    def start(cls, setting: Any, results_dir: Path, job: JobRun, warn: Callable[[str], None],
              environ: Mapping[str, str] | None = None) -> MlflowLog | None:
        """The job's parent run, new or continued; None when logging is off or failed (said in one
        `warn` line). `setting`: autotuning.mlflow from the config (None when not given)."""
        environ = os.environ if environ is None else environ
        uri = fields.tracking_uri(setting, environ)
        if uri is None:
            return None
        for name, value in HTTP_DEFAULTS.items():  # MLflow's client reads them from this process's environment
            os.environ.setdefault(name, value)
        try:
            import mlflow
            from mlflow.tracking import MlflowClient
        except ImportError:
            warn(f"MLflow logging is on ({fields.shown_uri(uri)}) but the mlflow client is not installed: "
                 f"{INSTALL_HINT}; tuning goes on without it")
            return None
        # urllib3 says each retry on stderr; the one line that matters is ours
        logging.getLogger("urllib3.connectionpool").setLevel(logging.ERROR)
        log = cls(None, uri, results_dir, warn, fields.credentials(uri, {**os.environ, **environ}))

        def connect() -> None:
            # MLflow's artifact upload through a server (mlflow-artifacts:/) reads the process's tracking
            # URI (2.x does), not the client's: both name the same server
            mlflow.set_tracking_uri(uri)
            log.client = MlflowClient(tracking_uri=uri)  # a URI MLflow cannot use fails here
            log._open_parent(job, fields.experiment_name(environ))

        log._guarded(connect)
        return None if log.off else log

    @property
    def parent_run_id(self) -> str | None:
        return self.state.get("parent_run_id")

    def record(self, record: Mapping[str, Any]) -> None:
        """An experiment's record, as its event arrives: its child run, unless it has one already."""
        self._guarded(lambda: self._log_child(ExperimentRecord.from_json(dict(record))))

    def finish(self, records: Mapping[str, Mapping[str, Any]], winner: str | None, metric: str,
               maximize: bool, elapsed_s: float, interrupted: bool = False) -> None:
        """The job ended (`interrupted`: Ctrl-C): log the records not logged yet, tag the winner, upload
        the outputs, and end the parent run FINISHED (a winner), FAILED (none) or KILLED."""
        self._guarded(self._finish, records, winner, metric, maximize, elapsed_s, interrupted)

    def _guarded(self, step: Callable[..., None], *args: Any) -> None:
        if self.off:
            return
        try:
            step(*args)
        except Exception as exc:  # the server, the network, the client: never a reason to stop tuning
            self.off = True
            self.warn(f"MLflow at {fields.shown_uri(self.uri)} failed ({fields.failure_text(exc, secrets=self.secrets)}); tuning goes "
                      f"on without it: every record stays in {self.results_dir}, and the same command run again "
                      "logs what is missing")

    def _save(self) -> None:
        write_json(result_file(self.results_dir, MLFLOW_RUN), self.state)

    def _open_parent(self, job: JobRun, experiment: str) -> None:
        client, shown = self.client, fields.shown_uri(self.uri)
        state = read_json(result_file(self.results_dir, MLFLOW_RUN))
        if (isinstance(state, dict) and state.get("tracking_uri") == shown
                and state.get("config_key") == job.config_key and isinstance(state.get("parent_run_id"), str)):
            try:
                run = client.get_run(state["parent_run_id"])
            except Exception:  # noqa: BLE001 - deleted from the server: a new parent below
                run = None
            if run is not None and run.info.lifecycle_stage == "active":
                client.update_run(state["parent_run_id"], status="RUNNING")
                self.state = state
                return
        found = client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found is not None else client.create_experiment(experiment)
        tags = {"mlflow.source.name": job.params.get("script", ""), "mlflow.source.type": "LOCAL",
                "autotune.results_dir": str(self.results_dir.resolve()), "autotune.host": socket.gethostname(),
                **job.tags}
        run = client.create_run(experiment_id, start_time=_ms(job.started_at), tags=tags, run_name=job.name)
        self._send(run.info.run_id, params=job.params)
        self.state = {"tracking_uri": shown, "config_key": job.config_key, "experiment_id": experiment_id,
                      "parent_run_id": run.info.run_id, "children": {}, "winner": None}
        self._save()

    def _send(self, run_id: str, params: Mapping[str, str] | None = None,
              metrics: Mapping[str, float] | None = None, at: float | None = None) -> None:
        from mlflow.entities import Metric, Param

        stamp = _ms(at) or int(time.time() * 1000)
        self.client.log_batch(run_id, metrics=[Metric(key, value, stamp, 0) for key, value in (metrics or {}).items()],
                              params=[Param(key, value) for key, value in (params or {}).items()])

    def _log_child(self, record: ExperimentRecord) -> None:
        name = record.name
        children: dict[str, Any] = self.state["children"]
        logged = children.get(name)
        if logged is not None and logged.get("ended_at") == record.ended_at:
            return
        client = self.client
        if logged is not None:  # measured again (a lost launch relaunched): the new reading is the record
            client.set_tag(logged["run_id"], fields.SUPERSEDED, "true")
            if self.state.get("winner") == name:
                client.delete_tag(logged["run_id"], fields.WINNER)
                self.state["winner"] = None
        tags = {PARENT_TAG: self.state["parent_run_id"], **fields.experiment_tags(record)}
        run = client.create_run(self.state["experiment_id"], start_time=_ms(record.started_at),
                                tags=tags, run_name=name)
        self._send(run.info.run_id, params=fields.experiment_params(record),
                   metrics=fields.experiment_metrics(record), at=record.ended_at)
        client.set_terminated(run.info.run_id, status=fields.run_status(record), end_time=_ms(record.ended_at))
        children[name] = {"run_id": run.info.run_id, "ended_at": record.ended_at}
        self._save()

    def _settle_cut_off(self, child: Any, records: Mapping[str, ExperimentRecord]) -> None:
        """A child whose logging was cut off (Ctrl-C, a killed command) before the state kept it:
        still RUNNING, it goes (its record is logged again); already ended, it is the record's run
        and is kept as logged, not logged twice. Every child this module ended is in the state."""
        info, name = child.info, child.info.run_name
        if info.status == "RUNNING":
            self.client.delete_run(info.run_id)
            return
        record, logged = records.get(name), self.state["children"].get(name)
        if record is None or info.end_time != _ms(record.ended_at) or fields.SUPERSEDED in child.data.tags:
            return
        if logged is not None and (logged["run_id"] == info.run_id or logged.get("ended_at") == record.ended_at):
            return
        if logged is not None:  # the cut-off run was a newer reading than the one kept
            self.client.set_tag(logged["run_id"], fields.SUPERSEDED, "true")
            if self.state.get("winner") == name:
                self.client.delete_tag(logged["run_id"], fields.WINNER)
                self.state["winner"] = None
        self.state["children"][name] = {"run_id": info.run_id, "ended_at": record.ended_at}
        self._save()

    def _finish(self, records: Mapping[str, Mapping[str, Any]], winner: str | None, metric: str, maximize: bool,
                elapsed_s: float, interrupted: bool) -> None:
        client, parent = self.client, self.state["parent_run_id"]
        typed = {name: ExperimentRecord.from_json(dict(record)) for name, record in records.items()}
        for child in client.search_runs([self.state["experiment_id"]], max_results=1000,
                                        filter_string=f"tags.`{PARENT_TAG}` = '{parent}'"):
            self._settle_cut_off(child, typed)
        for record in typed.values():
            self._log_child(record)
        children = self.state["children"]
        previous = self.state.get("winner")
        if previous and previous != winner and previous in children:
            client.delete_tag(children[previous]["run_id"], fields.WINNER)
        if winner is not None and winner in children:
            client.set_tag(children[winner]["run_id"], fields.WINNER, "true")
        self.state["winner"] = winner
        self._save()
        client.set_tag(parent, fields.WINNER, winner or "")
        client.set_tag(parent, fields.STATUS, "interrupted" if interrupted else "finished" if winner else "no_winner")
        self._send(parent, metrics=fields.job_metrics(records, metric, maximize, elapsed_s))
        # ended before the uploads: a server that stores no artifacts must not leave the run RUNNING
        client.set_terminated(parent, status="KILLED" if interrupted else "FINISHED" if winner else "FAILED")
        for name in ARTIFACTS:
            path = result_file(self.results_dir, name)
            if path.is_file():
                client.log_artifact(parent, str(path))
