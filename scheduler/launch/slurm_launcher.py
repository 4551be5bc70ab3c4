"""Slurm: `srun` places the ranks by count, with the exports in one `--export=` list.

Differences from DeepSpeed's argv (`scheduler.launch.launchers` lists those common to all): the
export values are raw (no shell parses them, so DeepSpeed's added double quotes ended up inside
them); a value containing ',' is an error, since `--export=` is a comma-separated list; a secret
export is named only (`--export=ALL,...,NAME`), its value taken from srun's own environment.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from scheduler.errors import UsageError
from scheduler.launch.backend import ToolBackend, devices_per_host
from scheduler.launch.environment import split_secrets
from scheduler.launch.launch_spec import LaunchSpec
from scheduler.launch.resources import Resources


@dataclass(frozen=True)
class SlurmLauncher(ToolBackend):
    """srun places tasks by count: whole hosts or the first N devices of equal hosts only."""

    name: ClassVar[str] = "slurm"
    tool: ClassVar[str] = "sinfo"

    def command(self, spec: LaunchSpec) -> list[str]:
        self._check_rank_launcher(spec, whole_hostfile=False)
        _check_slurm_selection(spec.resources)
        argv = ["srun", "-n", str(spec.resources.num_devices), *spec.launcher_arg_list()]
        if spec.slurm_comment:
            argv += ["--comment", spec.slurm_comment]
        if spec.request.uses_filter:
            argv += ["--nodelist", ",".join(spec.resources.hosts), "--nodes", str(spec.resources.num_nodes)]
        if spec.request.num_nodes is not None:
            argv += ["--nodes", str(spec.request.num_nodes)]
        if spec.request.num_gpus is not None:
            argv += ["--gpus-per-node", str(spec.request.num_gpus)]
        argv.append(_slurm_export(spec.exports))
        return [*argv, spec.python, "-u", spec.user_script, *spec.user_args]


def _check_slurm_selection(resources: Resources) -> None:
    for entry in resources.entries:
        if entry.device_ids != tuple(range(len(entry.device_ids))):
            raise UsageError(
                f"--launcher slurm cannot pin device ids, got {list(entry.device_ids)} on {entry.host}; "
                f"select whole hosts or the first N devices of every host"
            )
    devices_per_host("slurm", resources)


def _slurm_export(exports: Mapping[str, str]) -> str:
    """`--export=ALL,K=V,...,NAME`: a secret by name only, its value from srun's own environment."""
    plain, secret = split_secrets(exports)
    for key, value in plain.items():
        if "," in value:
            raise UsageError(f"export {key}={value!r} contains ',' which srun's --export list cannot carry; remove it")
    return ",".join(["--export=ALL", *(f"{key}={value}" for key, value in plain.items()), *secret])
