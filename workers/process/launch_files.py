"""The files one launch of an experiment writes under its own name, and the script's argv that reads them.

Two launches of one experiment can run at once: a node cut off from Redis runs its launch on while
the control worker launches the experiment again elsewhere, both writing into the experiment's
folder. Each launch therefore gives its script its own config (`ds_config.<launch>.json`), whose
metric path is its own file (`metrics.<launch>.json`, or `model_info.<launch>.json` for the
profile run), its ranks their own exit reports (`rank<N>.<launch>.exit.json`) and logs
(`stderr.<launch>.log`, `rank<N>.stdout.<launch>.log`, `op_prebuild.<launch>.log/.json`), and its
rank 0 its own description and command (`exp.<launch>.json`: its slots; `cmd.<launch>.txt`: its
node's interpreter): no launch reads another's metrics, memory peaks or stderr (a rank's failure
class is read from its own stderr: an out-of-memory trace or an NCCL abort, `workers.slot.rank_record`),
and none truncates another's log.

The experiment's `ds_config.json` (what `cmd_optimal.txt` names, pointing at `metrics.json`) is
the same for every launch. DeepSpeed's plain names show one launch: the control worker writes the
counted launch's metrics to `metrics.json` (`model_info.json` for the profile run) and shows its
description, command and logs under `exp.json`, `cmd.txt`, `stdout.log`... (`LaunchFiles.adopt`,
from `tasks.experiment.finish_experiment`, before the record). While no record is written, each
launch shows its own there as it starts (`show_while_running`: the latest launch to start), so the
folder of a running experiment reads as DeepSpeed's does. A plain name is a hard link to the
launch's file, put in place by a rename (a copy where the filesystem refuses links): a launch
that runs on never writes into the file the plain name shows. The names are listed in
`workers.files.layout` (LAUNCH_FILES, RANK_STREAMS), so `"overwrite": true` knows them.
"""
from __future__ import annotations

import copy
import logging
import os
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workers.files import layout
from workers.files.layout import experiment_file
from workers.files.paths import read_json, write_json

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LaunchFiles:
    """Where one launch (`launch`, `layout.launch_id` of its attempt) writes in its experiment folder."""

    result_dir: Path
    launch: str
    metric_name: str  #: the metric file the experiment asks for: metrics.json, or model_info.json

    @classmethod
    def of(cls, result_dir: Path, attempt: str, metric_file: str) -> LaunchFiles:
        return cls(result_dir, layout.launch_id(attempt), metric_file or layout.METRICS)

    @property
    def metric_path(self) -> Path:
        """What this launch's script writes its metrics to."""
        return experiment_file(self.result_dir, layout.launch_file(self.metric_name, self.launch))

    @property
    def config_path(self) -> Path:
        """The config this launch's script is given."""
        return experiment_file(self.result_dir, layout.launch_file(layout.DS_CONFIG, self.launch))

    def exit_report(self, rank: int) -> Path:
        return experiment_file(self.result_dir, layout.exit_report(rank, self.launch))

    def log(self, rank: int, stream: str) -> Path:
        """Rank `rank`'s log `stream` (one of layout.RANK_STREAMS) as this launch writes it."""
        return experiment_file(self.result_dir, layout.rank_log(rank, stream, self.launch))

    def own(self, name: str) -> Path:
        """`name` (EXP_JSON or CMD: what rank 0 writes) as this launch writes it."""
        return experiment_file(self.result_dir, layout.launch_file(name, self.launch))

    def descriptions(self) -> list[tuple[Path, Path]]:
        """This launch's description and command (rank 0's), each with the plain name that shows it."""
        return [(self.own(name), experiment_file(self.result_dir, name)) for name in (layout.EXP_JSON, layout.CMD)]

    def rank_logs(self, rank: int, streams: tuple[str, ...] = layout.RANK_STREAMS) -> list[tuple[Path, Path]]:
        """Rank `rank`'s logs `streams` in this launch (and op_prebuild's report beside its log), each
        with its plain name."""
        pairs = []
        for stream in streams:
            log, plain = self.log(rank, stream), experiment_file(self.result_dir, layout.rank_log(rank, stream))
            pairs.append((log, plain))
            if stream == "op_prebuild":
                pairs.append((experiment_file(self.result_dir, log.with_suffix(".json").name),
                              experiment_file(self.result_dir, plain.with_suffix(".json").name)))
        return pairs

    def shown(self, world_size: int) -> list[tuple[Path, Path]]:
        """Each file of this launch the folder shows under DeepSpeed's plain name, with that name."""
        return [*self.descriptions(), *(pair for rank in range(world_size) for pair in self.rank_logs(rank))]

    def adopt(self, world_size: int) -> None:
        """Show this launch's files under the plain names: the control worker, for the counted launch.
        A plain log this launch did not write (an earlier launch built the ops, this one found them) is
        removed, so the folder never shows two launches; a description or command it did not write
        (its rank 0 never got that far) is left: the experiment's, from an earlier launch. A file that
        cannot be shown is logged and left: the record is what counts."""
        for own, plain in self.shown(world_size):
            try:
                if own.exists():
                    show(own, plain, or_copy=True)
                elif plain.name not in (layout.EXP_JSON, layout.CMD):
                    plain.unlink(missing_ok=True)
            except OSError as exc:
                log.warning("%s: could not show %s as %s: %s", self.result_dir.name, own.name, plain.name, exc)

    def show_while_running(self, pairs: list[tuple[Path, Path]]) -> None:
        """A rank shows its launch's `pairs` (own file, plain name) as it starts, where no launch's
        record is written yet (after that, the plain names are the counted launch's: `adopt`). A
        `stale` record (a fenced launch's, left where nothing was counted yet) does not stop it: the
        launch that holds the experiment now is the one the folder should show. By hard link only: a
        copy of a log being written would stop at the copy's moment."""
        if counted_record_written(self.result_dir):
            return
        for own, plain in pairs:
            if own.exists():
                try:
                    show(own, plain, or_copy=own.suffix != ".log")
                except OSError:
                    continue  # shown at the end, if this launch is counted

    def write_configs(self, ds_config: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """Write the experiment's shared config and this launch's own; returns (shared, own)."""
        shared = with_metric_path(ds_config, experiment_file(self.result_dir, self.metric_name), self.metric_name)
        write_json(experiment_file(self.result_dir, layout.DS_CONFIG), shared)  # the same for every launch
        own = with_metric_path(ds_config, self.metric_path, self.metric_name)
        write_json(self.config_path, own)
        return shared, own

    def argv(self, script_argv: list[str]) -> list[str]:
        """The script's argv with the experiment's config path (`--deepspeed_config X`, or an `=`
        form) swapped for this launch's own copy."""
        shared = str(self.result_dir / layout.DS_CONFIG)
        swapped = []
        for arg in script_argv:
            head, sep, tail = arg.rpartition("=")
            if arg == shared:
                arg = str(self.config_path)
            elif sep and head.startswith("--") and tail == shared:
                arg = f"{head}={self.config_path}"
            swapped.append(arg)
        return swapped


def counted_record_written(result_dir: Path) -> bool:
    """Whether the experiment's folder holds a counted record: a result.json not marked `stale`
    (an unreadable one counts, so nothing is shown over a record being written)."""
    result = experiment_file(result_dir, layout.RESULT)
    if not result.exists():
        return False
    record = read_json(result)
    return not (isinstance(record, dict) and record.get("stale") is True)


def show(own: Path, plain: Path, *, or_copy: bool) -> None:
    """Make `plain` show `own`: a hard link, or with `or_copy` a copy where the filesystem refuses one,
    put in place by a rename (its temporary name: an atomic write's, which `workers.files.layout` knows)."""
    temporary = plain.with_name(f".{plain.name}.{secrets.token_hex(4)}")
    try:
        try:
            os.link(own, temporary)
        except OSError:
            if not or_copy:
                raise
            shutil.copyfile(own, temporary)
        os.replace(temporary, plain)
    finally:
        temporary.unlink(missing_ok=True)


def with_metric_path(ds_config: dict[str, Any], metric_path: Path, metric_name: str) -> dict[str, Any]:
    """The experiment's config with DeepSpeed's metric file (`metric_name`, model_info.json for the
    profile run) pointed at `metric_path` in its own folder."""
    config = copy.deepcopy(ds_config)
    autotuning = config.get("autotuning")
    if isinstance(autotuning, dict):
        key = "model_info_path" if metric_name == layout.MODEL_INFO else "metric_path"
        autotuning[key] = str(metric_path)
    return config
