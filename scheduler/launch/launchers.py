"""The multi-node backends by the name `--launcher` takes (pdsh, openmpi, mvapich, slurm, mpich,
impi), and the check that the chosen one is installed.

Why this exists: users pick a multi-node backend with `--launcher` and expect the processes
DeepSpeed starts. Each backend is a small class behind one interface (`scheduler.launch.backend`)
in a module of its family: `pdsh_launcher`, `mpi_launchers`, `slurm_launcher`; what a launch is
and the command one node runs are `launch_spec`. Nothing here starts a process, so every command is
testable as data.

For the two-host fixture (`worker-0`, `worker-1`, four devices each) every argv equals DeepSpeed's
element for element, except for the deliberate differences each backend's module lists, and these:
- Unknown launchers and missing backends are `UsageError`s naming the fix.
- elastic launches run torchrun on each node (see scheduler/launch/elastic.py).
- a secret export (`environment.is_secret`) is never on the command line, where every user of the
  host reads it in /proc/<pid>/cmdline: MPI and Slurm name it and take its value from the launching
  process's environment (the caller puts them there); pdsh forwards no environment, so each node's
  shell reads the secrets from a private file (`pdsh_launcher`).
"""
from __future__ import annotations

import shutil
from collections.abc import Mapping

from scheduler.errors import UsageError
from scheduler.launch.backend import Launcher, ReadOutput, Which
from scheduler.launch.mpi_launchers import ImpiLauncher, MpichLauncher, MvapichLauncher, OpenMpiLauncher
from scheduler.launch.pdsh_launcher import PdshLauncher
from scheduler.launch.slurm_launcher import SlurmLauncher


LAUNCHERS: Mapping[str, type] = {
    launcher.name: launcher
    for launcher in (PdshLauncher, OpenMpiLauncher, MvapichLauncher, SlurmLauncher, MpichLauncher, ImpiLauncher)
}


def get_launcher(name: str) -> Launcher:
    """The backend named by `--launcher` (case-insensitive, as in DeepSpeed)."""
    launcher = LAUNCHERS.get(name.strip().lower())
    if launcher is None:
        raise UsageError(f"unknown --launcher {name!r}; choose one of {', '.join(LAUNCHERS)}")
    return launcher()


def require_backend(launcher: Launcher, which: Which = shutil.which, read_output: ReadOutput | None = None) -> None:
    """Raise a UsageError naming the missing program when the backend is not installed."""
    if not launcher.backend_exists(which, read_output):
        raise UsageError(
            f"launcher {launcher.name!r} is not installed: {launcher.tool!r} was not found or is not the expected "
            f"program; install it on this machine or choose another --launcher ({', '.join(LAUNCHERS)})"
        )
