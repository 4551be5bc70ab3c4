"""The files one launch of an experiment writes under its own name, and the script's argv that reads them.

Two launches of one experiment can run at once: a node cut off from Redis runs its launch on while
the control worker launches the experiment again elsewhere, both writing into the experiment's
folder. Each launch therefore gives its script its own config (`ds_config.<launch>.json`), whose
metric path is its own file (`metrics.<launch>.json`, or `model_info.<launch>.json` for the
profile run), and its ranks their own exit reports (`rank<N>.<launch>.exit.json`): no launch reads
another's metrics or memory peaks. The experiment's `ds_config.json` (what `cmd_optimal.txt`
names, pointing at `metrics.json`) is the same for every launch; the control worker copies the
counted launch's metrics to `metrics.json`, or `model_info.json` for the profile run
(`tasks.experiment.finish_experiment`). The names are listed in `workers.layout` (LAUNCH_FILES), so
`"overwrite": true` knows them.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workers import layout
from workers.layout import experiment_file
from workers.paths import write_json


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


def with_metric_path(ds_config: dict[str, Any], metric_path: Path, metric_name: str) -> dict[str, Any]:
    """The experiment's config with DeepSpeed's metric file (`metric_name`, model_info.json for the
    profile run) pointed at `metric_path` in its own folder."""
    config = copy.deepcopy(ds_config)
    autotuning = config.get("autotuning")
    if isinstance(autotuning, dict):
        key = "model_info_path" if metric_name == layout.MODEL_INFO else "metric_path"
        autotuning[key] = str(metric_path)
    return config
