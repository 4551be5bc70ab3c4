"""The MPI backends: Open MPI, MPICH, Intel MPI and MVAPICH2-GDR, each an `mpirun` that starts
every rank itself from the hosts of the hostfile.

Differences from DeepSpeed's argv (`scheduler.launch.launchers` lists those common to all):
- the flags carry raw export values (`-x K=a b`): no shell parses them, so DeepSpeed's added double
  quotes ended up inside the values. A secret export is named only, its value taken from mpirun's
  own environment: Open MPI `-x NAME`, Hydra (MPICH, Intel MPI, MVAPICH2) `-genvlist A,B`.
- mpich: the helper always runs as `python -u -m deepspeed.launcher.launcher_helper`, which applies
  `--module`/`--no_python` itself. DeepSpeed put the helper's file path after `-m` under `--module`
  (python cannot import a path) and executed the .py file directly under `--no_python`.
- mvapich: the host list path is a constructor argument (default DeepSpeed's fixed
  /tmp/deepspeed_mvapich_hostfile, which concurrent launches overwrite); `hostfile_text()` returns
  the text for the caller to write.
- impi: `--bind_cores_to_rank` is an error instead of numactl ranges computed here.
- only hosts with devices count, so a `slots=0` host no longer fails the equal devices-per-host
  check.
"""
from __future__ import annotations

import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

from scheduler.errors import UsageError
from scheduler.launch.backend import ReadOutput, ToolBackend, Which, devices_per_host
from scheduler.launch.launch_spec import LaunchSpec

MVAPICH_HOSTFILE = "/tmp/deepspeed_mvapich_hostfile"
HELPER_MODULE = "deepspeed.launcher.launcher_helper"


@dataclass(frozen=True)
class _Mpirun(ToolBackend):
    """What every MPI backend's command shares: the checks of a rank launcher (the whole hostfile, no
    elastic training) and the exports split into those passed by value and the secret ones."""

    def command(self, spec: LaunchSpec) -> list[str]:
        self._check_rank_launcher(spec)
        exports, secret = spec.split_exports()
        return self.mpirun(spec, exports, secret)

    def mpirun(self, spec: LaunchSpec, exports: Mapping[str, str], secret: Mapping[str, str]) -> list[str]:
        """The backend's argv: `exports` go with their values, `secret` by name only."""
        raise NotImplementedError


@dataclass(frozen=True)
class OpenMpiLauncher(_Mpirun):
    """Open MPI's mpirun starts every rank from the hostfile; exports go in `-x K=V`."""

    name: ClassVar[str] = "openmpi"
    tool: ClassVar[str] = "ompi_info"

    def mpirun(self, spec: LaunchSpec, exports: Mapping[str, str], secret: Mapping[str, str]) -> list[str]:
        if spec.hostfile is None:
            raise UsageError("--launcher openmpi needs a hostfile: mpirun reads the hosts from it")
        extra = spec.launcher_arg_list()
        argv = ["mpirun", "-n", str(spec.resources.num_devices), "-hostfile", spec.hostfile, "--mca", "btl", "^openib"]
        if not _sets_tcp_interface(extra):
            argv += ["--mca", "btl_tcp_if_include", "eth0"]
        argv += extra
        argv += _export_flags("-x", {"UCX_TLS": "tcp", **exports})
        argv += [word for name in secret for word in ("-x", name)]  # `-x NAME`: the value of mpirun's own
        return [*argv, *spec.python_prefix(), spec.user_script, *spec.user_args]


def _sets_tcp_interface(launcher_args: Sequence[str]) -> bool:
    pairs = zip(launcher_args, launcher_args[1:])
    return any(flag in ("-mca", "--mca") and key == "btl_tcp_if_include" for flag, key in pairs)


def _rendezvous_genv(spec: LaunchSpec, total: int, per_host: int) -> list[str]:
    pairs = (("MASTER_ADDR", spec.master_addr), ("MASTER_PORT", spec.master_port), ("WORLD_SIZE", total),
             ("LOCAL_SIZE", per_host))
    return [word for key, value in pairs for word in ("-genv", key, str(value))]


def _export_flags(flag: str, exports: Mapping[str, str]) -> list[str]:
    """`flag K=V` for every export, values raw: mpirun receives them without a shell."""
    return [word for key, value in exports.items() for word in (flag, f"{key}={value}")]


def _hydra_secret_flags(secret: Mapping[str, str]) -> list[str]:
    """Hydra's `-genvlist A,B`: these variables with the values of mpirun's own environment."""
    return ["-genvlist", ",".join(secret)] if secret else []


@dataclass(frozen=True)
class MpichLauncher(_Mpirun):
    """MPICH's mpirun; DeepSpeed's helper turns PMI ranks into RANK/LOCAL_RANK on each process."""

    name: ClassVar[str] = "mpich"
    tool: ClassVar[str] = "mpirun"

    def mpirun(self, spec: LaunchSpec, exports: Mapping[str, str], secret: Mapping[str, str]) -> list[str]:
        per_host = devices_per_host(self.name, spec.resources)
        total = spec.resources.num_devices
        argv = ["mpirun", "-n", str(total), "-ppn", str(per_host), *spec.launcher_arg_list()]
        argv += _export_flags("-genv", exports) + _hydra_secret_flags(secret)
        argv += [*_rendezvous_genv(spec, total, per_host), "-hosts", ",".join(spec.resources.hosts)]
        helper = [spec.python, "-u", "-m", HELPER_MODULE, "--launcher", self.name]
        helper += ["--module"] if spec.module else ["--no_python"] if spec.no_python else []
        return [*argv, *helper, spec.user_script, *spec.user_args]


@dataclass(frozen=True)
class ImpiLauncher(_Mpirun):
    """Intel MPI: one MPMD block per global rank, each with its RANK and LOCAL_RANK."""

    name: ClassVar[str] = "impi"
    tool: ClassVar[str] = "mpirun"

    def mpirun(self, spec: LaunchSpec, exports: Mapping[str, str], secret: Mapping[str, str]) -> list[str]:
        if spec.bind_cores_to_rank:
            raise UsageError("--bind_cores_to_rank is not supported with --launcher impi here; drop it")
        per_host = devices_per_host(self.name, spec.resources)
        total = spec.resources.num_devices
        argv = ["mpirun", "-ppn", str(per_host), *spec.launcher_arg_list()]
        for key, value in exports.items():
            argv += ["-genv", key, value]
        argv += _hydra_secret_flags(secret)
        argv += [*_rendezvous_genv(spec, total, per_host), "-genv", "I_MPI_PIN", "0"]
        argv += ["-hosts", ",".join(spec.resources.hosts)]
        for rank in range(total):
            block = ["-n", "1", "-env", "RANK", str(rank), "-env", "LOCAL_RANK", str(rank % per_host)]
            argv += ([":"] if rank else []) + block + spec.python_prefix() + [spec.user_script, *spec.user_args]
        return argv


MVAPICH_DEFAULT_EXPORTS: Mapping[str, str] = {
    "MV2_SMP_USE_CMA": "0", "MV2_DEBUG_SHOW_BACKTRACE": "1", "MV2_USE_CUDA": "1", "MV2_SUPPORT_DL": "1",
    "MV2_ENABLE_AFFINITY": "0", "MV2_INTER_ALLGATHER_TUNING": "5", "MV2_CUDA_USE_NAIVE": "0",
}
"""DeepSpeed's MVAPICH settings; MV2_USE_CUDA only on CUDA machines."""


@dataclass(frozen=True)
class MvapichLauncher(_Mpirun):
    """MVAPICH2-GDR's mpirun with a one-host-per-line host list file."""

    name: ClassVar[str] = "mvapich"
    tool: ClassVar[str] = "mpiname"
    hostfile_path: str = MVAPICH_HOSTFILE
    cuda: bool = True

    def backend_exists(self, which: Which, read_output: ReadOutput | None = None) -> bool:
        if which(self.tool) is None:
            return False
        return "MVAPICH2-GDR" in (read_output or _command_output)([self.tool])

    def hostfile_text(self, spec: LaunchSpec) -> str:
        """The host list mpirun reads from `hostfile_path`; the caller writes it before launching."""
        return "".join(f"{host}\n" for host in spec.resources.hosts)

    def mpirun(self, spec: LaunchSpec, exports: Mapping[str, str], secret: Mapping[str, str]) -> list[str]:
        per_host = devices_per_host(self.name, spec.resources)
        argv = ["mpirun", "-np", str(spec.resources.num_devices), "-ppn", str(per_host)]
        argv += ["--hostfile", self.hostfile_path, *spec.launcher_arg_list()]
        defaults = {key: value for key, value in MVAPICH_DEFAULT_EXPORTS.items() if self.cuda or key != "MV2_USE_CUDA"}
        argv += _export_flags("-env", {**defaults, **exports}) + _hydra_secret_flags(secret)
        return [*argv, *spec.python_prefix(), spec.user_script, *spec.user_args]


def _command_output(argv: Sequence[str]) -> str:
    try:
        return subprocess.run(list(argv), capture_output=True, text=True, timeout=30, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""
