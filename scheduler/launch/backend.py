"""The one interface every multi-node backend implements (`Launcher`: `name`, `tool`,
`backend_exists(which)`, `command(spec)`, `launch_env(spec, environ)`), and the parts most share.

Apart from the backends themselves (`pdsh_launcher`, `mpi_launchers`, `slurm_launcher`) so each
imports only this, and the registry (`launchers`) imports them all.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

from scheduler.launch import elastic
from scheduler.errors import UsageError
from scheduler.launch.launch_spec import LaunchSpec
from scheduler.launch.resources import Resources

Which = Callable[[str], "str | None"]
"""Finds a program on PATH, like shutil.which."""
ReadOutput = Callable[[Sequence[str]], str]
"""Runs a short probe command and returns its stdout."""


class Launcher(Protocol):
    """A multi-node backend: how to tell it is installed and which command it runs."""

    name: ClassVar[str]
    tool: ClassVar[str]

    def backend_exists(self, which: Which, read_output: ReadOutput | None = None) -> bool: ...

    def command(self, spec: LaunchSpec) -> list[str]: ...

    def launch_env(self, spec: LaunchSpec, environ: Mapping[str, str]) -> dict[str, str]: ...


@dataclass(frozen=True)
class ToolBackend:
    """Shared parts: installed when `tool` is on PATH; no extra variables for the launching process."""

    name: ClassVar[str] = ""
    tool: ClassVar[str] = ""

    def backend_exists(self, which: Which, read_output: ReadOutput | None = None) -> bool:
        return which(self.tool) is not None

    def launch_env(self, spec: LaunchSpec, environ: Mapping[str, str]) -> dict[str, str]:
        return {}

    def _check_rank_launcher(self, spec: LaunchSpec, *, whole_hostfile: bool = True) -> None:
        """Backends that start every rank themselves: no elastic; MPI ones also take the whole hostfile."""
        if spec.elastic is not None:
            elastic.check_elastic_launch(self.name)
        if whole_hostfile and spec.request.uses_filter:
            raise UsageError(
                f"--launcher {self.name} does not support --include/--exclude; it uses every host of the hostfile"
            )
        if whole_hostfile and spec.request.limits_counts:
            raise UsageError(
                f"--launcher {self.name} does not support --num_nodes/--num_gpus; edit the hostfile instead"
            )


def devices_per_host(name: str, resources: Resources) -> int:
    """The devices of every host, which MPI and Slurm need equal; a UsageError naming them when not."""
    counts = {entry.host: len(entry.device_ids) for entry in resources.entries}
    if len(set(counts.values())) != 1:
        raise UsageError(f"--launcher {name} needs the same number of devices on every host, got {counts}")
    return next(iter(counts.values()))
