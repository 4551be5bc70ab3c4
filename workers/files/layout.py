"""What this tool writes into a results folder: one list, read by the writers and the overwrite guard.

Why: `"overwrite": true` (`scheduler.inputs.folders`) empties a folder only when every entry in it
is something this tool writes, so that a file of the user's is never deleted. Two lists, the names
the writers use and the guard's own, would drift apart (a finished run's results.csv, timeline.png,
*_best_partial* files or op_prebuild.log/.json missing from the guard's, so overwrite refuses the
very folder a run has just filled). So the names live here only: every writer takes its path from
`result_file`, `experiment_file` or `cluster_file`, which refuse a name the guard would not accept
(a new output cannot be written before it is listed here), and the guard asks `is_result_file`,
`is_experiment_file` and `is_cluster_file`.

The layout (DeepSpeed's, plus ours):

    <results_dir>/.celery-autotune           the marker: this folder was made by this tool
    <results_dir>/<RESULT_FILES>             summary, results.jsonl/.csv, plots, optimal or partial best,
                                             mlflow_run.json (what was logged to MLflow)
    <results_dir>/<experiment>/<file>        per experiment: EXPERIMENT_FILES and the ranks' logs; each
                                             launch's own config, metrics, description, command, logs and
                                             exit reports (LAUNCH_FILES, `rank_log`, `exit_report`)
    <results_dir>/cluster/<name>.log         the embedded cluster's logs, pids.json (CLUSTER_DIR)
    <exps_dir>/<experiment>.json             each experiment's description (DESCRIPTION_KEYS)

plus the temporary files of atomic writes, which an interrupted run may leave behind: `.<name>.<random>`
(`workers.files.paths.write_atomic`), `.tmp-<random>.json` (`workers.in_rank.metrics`, beside the metric file) and
`<exit report>.<pid>.tmp` (`workers.in_rank.device_memory`). What the user's script writes into an experiment
folder (a checkpoint, a file of its own) is not listed: overwrite refuses it, as any file of theirs.
"""
from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from pathlib import Path

MARKER = ".celery-autotune"
SUMMARY = "summary.txt"
RESULTS_JSONL = "results.jsonl"
RESULTS_CSV = "results.csv"
TUNING_PLOT = "tuning.png"
TIMELINE_PLOT = "timeline.png"
MODEL_PLOT = "model_fit.png"
#: What the command logged to MLflow: the parent run a rerun continues (`scheduler.report.mlflow_log`).
MLFLOW_RUN = "mlflow_run.json"
#: The winner of a finished search: its config, its command, its hostfile (more than one node).
OPTIMAL_FILES = ("ds_config_optimal.json", "cmd_optimal.txt", "hostfile_optimal")
#: The best measured config of an interrupted search, never under the "optimal" names.
PARTIAL_FILES = ("ds_config_best_partial.json", "cmd_best_partial.txt", "hostfile_best_partial")
#: Every file this tool writes at the top of a results folder (`scheduler.report.outputs`).
RESULT_FILES = frozenset({MARKER, SUMMARY, RESULTS_JSONL, RESULTS_CSV, TUNING_PLOT, TIMELINE_PLOT, MODEL_PLOT, MLFLOW_RUN,
                          *OPTIMAL_FILES, *PARTIAL_FILES})

EXP_JSON = "exp.json"  #: the experiment as launched (rank 0)
DS_CONFIG = "ds_config.json"  #: the config the script is given (every rank)
CMD = "cmd.txt"  #: the command the ranks run (rank 0)
METRICS = "metrics.json"  #: what rank 0's script writes at autotuning.metric_path
MODEL_INFO = "model_info.json"  #: what the profile run's script writes at autotuning.model_info_path
RESULT = "result.json"  #: the experiment's record (the control worker, `scheduler.cluster.dispatch`)
EXPERIMENT_FILES = frozenset({EXP_JSON, DS_CONFIG, CMD, METRICS, MODEL_INFO, RESULT})
#: A slot writes one of these first: a folder without any is no experiment folder of ours.
EXPERIMENT_CORE = (DS_CONFIG, EXP_JSON, RESULT)
#: Per-rank logs, `<prefix><stream>[.<launch>].log` (rank 0 unprefixed, rank N `rankN.`), and op_prebuild's
#: report beside its log (`.json`). Each launch writes its own (`rank_log` with its launch); the folder
#: shows the counted launch's under the plain names (`workers.process.launch_files`).
RANK_STREAMS = ("stdout", "stderr", "op_prebuild")

CLUSTER_DIR = "cluster"  #: the embedded cluster's folder inside the results folder (`scheduler.embedded.local_cluster`)
PIDS = "pids.json"
#: `<exps_dir>/<name>.json`, DeepSpeed's experiment description: exactly these keys.
DESCRIPTION_KEYS = frozenset({"name", "ds_config", "num_gpus", "num_nodes"})

#: The files each launch of an experiment writes under its own name (`launch_file`), as its ranks'
#: logs (`rank_log`) and exit reports are: two launches of one experiment (a node cut off while its
#: launch runs on, and the relaunch elsewhere) never read or write each other's config, metrics,
#: description (its slots differ), command (its interpreter may), logs or exit reports. The control
#: worker writes the counted launch's metrics to METRICS, its record to RESULT, and shows its
#: description, command and logs under the plain names (`workers.process.launch_files.LaunchFiles.adopt`).
LAUNCH_FILES = (DS_CONFIG, METRICS, MODEL_INFO, EXP_JSON, CMD)
#: A launch's name in its files: the first LAUNCH_ID_CHARS hex digits of its attempt token.
LAUNCH_ID_CHARS = 12
_LAUNCH = rf"[0-9a-f]{{{LAUNCH_ID_CHARS}}}"

_RANK = r"(?:rank\d+\.)?"
_EXPERIMENT = re.compile(
    "|".join(re.escape(name) for name in sorted(EXPERIMENT_FILES))
    + rf"|{_RANK}(?:{'|'.join(RANK_STREAMS)})(?:\.{_LAUNCH})?\.log|{_RANK}op_prebuild(?:\.{_LAUNCH})?\.json"
    + rf"|rank\d+\.(?:{_LAUNCH}\.)?exit\.json"
    + "|" + "|".join(rf"{re.escape(stem)}\.{_LAUNCH}\.{re.escape(suffix)}"
                     for stem, _, suffix in (name.rpartition(".") for name in LAUNCH_FILES)))
_EXPERIMENT_TEMP = re.compile(rf"\.tmp-[^/]*\.json|rank\d+\.(?:{_LAUNCH}\.)?exit\.json\.\d+\.tmp")
_CLUSTER = re.compile(r"[A-Za-z0-9_.@-]+\.log|" + re.escape(PIDS) + r"|dump\.rdb")
_ATOMIC_TEMP = re.compile(r"\.(?P<name>[^/]+)\.[A-Za-z0-9_]+")


def rank_log(rank: int, stream: str, launch: str = "") -> str:
    """`stdout.log` for rank 0, `rank<N>.stdout.log` for the others (DeepSpeed's layout has rank 0's);
    with `launch` (`launch_id`), the name that launch writes: `stdout.<launch>.log`."""
    if stream not in RANK_STREAMS:
        raise ValueError(f"no per-rank log {stream!r} in workers.files.layout: add it to RANK_STREAMS")
    return f"{'' if rank == 0 else f'rank{rank}.'}{stream}{f'.{launch}' if launch else ''}.log"


def exit_report(rank: int, launch: str = "") -> str:
    """What `workers.in_rank.device_memory` writes as the rank's process ends (every rank, rank 0 too);
    `launch` (`launch_id`) names the launch it belongs to."""
    return f"rank{rank}.{launch}.exit.json" if launch else f"rank{rank}.exit.json"


def launch_id(attempt: str) -> str:
    """The name a launch gives its files: its attempt token's first hex digits (dispatch makes a
    fresh hex token per launch), or a digest of a token of another form."""
    found = attempt[:LAUNCH_ID_CHARS]
    if re.fullmatch(_LAUNCH, found):
        return found
    return hashlib.sha256(attempt.encode()).hexdigest()[:LAUNCH_ID_CHARS]


def launch_file(name: str, launch: str) -> str:
    """`name` (one of LAUNCH_FILES) as launch `launch` writes it: metrics.json -> metrics.<launch>.json,
    cmd.txt -> cmd.<launch>.txt."""
    if name not in LAUNCH_FILES:
        raise ValueError(f"{name!r} is not one of workers.files.layout.LAUNCH_FILES")
    stem, _, suffix = name.rpartition(".")
    return f"{stem}.{launch}.{suffix}"


def is_result_file(name: str) -> bool:
    """Whether `name`, at the top of a results folder, is a file this tool writes there."""
    return name in RESULT_FILES or _temp_of(name, lambda inner: inner in RESULT_FILES)


def is_experiment_file(name: str) -> bool:
    """Whether `name`, inside an experiment folder, is a file this tool (or the metric writer) writes."""
    return (_EXPERIMENT.fullmatch(name) is not None or _EXPERIMENT_TEMP.fullmatch(name) is not None
            or _temp_of(name, lambda inner: _EXPERIMENT.fullmatch(inner) is not None))


def is_cluster_file(name: str) -> bool:
    """Whether `name`, inside the embedded cluster's folder, is one of its logs or its pid file."""
    return _CLUSTER.fullmatch(name) is not None or _temp_of(name, lambda inner: inner == PIDS)


def result_file(results_dir: Path, name: str) -> Path:
    """`results_dir/name` for a writer; ValueError for a name the overwrite guard would not know."""
    return _checked(results_dir, name, is_result_file, "RESULT_FILES")


def experiment_file(experiment_dir: Path, name: str) -> Path:
    """`experiment_dir/name` for a writer; ValueError for a name the overwrite guard would not know."""
    return _checked(experiment_dir, name, is_experiment_file, "EXPERIMENT_FILES or RANK_STREAMS")


def cluster_file(cluster_dir: Path, name: str) -> Path:
    """`cluster_dir/name` for the embedded cluster; ValueError for a name the guard would not know."""
    return _checked(cluster_dir, name, is_cluster_file, "the cluster's files")


def _checked(folder: Path, name: str, known: Callable[[str], bool], where: str) -> Path:
    if "/" in name or not known(name):
        raise ValueError(f"{name!r} is not a file workers.files.layout lists ({where}): list it there, or "
                         '"overwrite": true would refuse the folder it is written into')
    return Path(folder) / name


def _temp_of(name: str, known: Callable[[str], bool]) -> bool:
    match = _ATOMIC_TEMP.fullmatch(name)
    return match is not None and bool(known(match["name"]))
