"""The commands DeepSpeed's runner would start for a launch, built as argv lists.

Why this exists: users pick a multi-node backend with `--launcher` (pdsh, openmpi, mvapich, slurm,
mpich, impi) and expect the processes DeepSpeed starts. Each backend is a small class behind one
interface (`name`, `tool`, `backend_exists(which)`, `command(spec)`, `launch_env(spec, environ)`);
nothing here starts a process, so every command is testable as data. `encode_world_info` is the
host -> device ids map DeepSpeed hands its per-node launcher, real device ids kept.

For the two-host fixture (`worker-0`, `worker-1`, four devices each) every argv equals DeepSpeed's
element for element, except for these deliberate differences:
- pdsh: the remote shell parses the command, so each word of it (user arguments, paths, export
  values) is `shlex.quote`d exactly once. DeepSpeed only wrapped arguments containing a space in
  double quotes, so `$`, backticks, `;` and `\\` acted remotely and quotes without a space broke.
  The exports word has no trailing blank and is left out when there is nothing to export. pdsh
  substitutes `%n` in the command text, so a literal `%n` in a user argument is rewritten (as in
  DeepSpeed; quoting cannot protect it).
- pdsh: `--bind_cores_to_rank`/`--bind_core_list` reach the per-node launcher (DeepSpeed drops them
  for pdsh only); `--ssh_port` is appended to PDSH_SSH_ARGS_APPEND after one blank instead of a run
  of indentation blanks; no `pkill -f` kill command is built (it matches substrings on every host;
  stopping a launch is the caller's job, by process group).
- MPI and Slurm flags carry raw export values (`-x K=a b`): no shell parses them, so DeepSpeed's
  added double quotes ended up inside the values.
- mpich: the helper always runs as `python -u -m deepspeed.launcher.launcher_helper`, which applies
  `--module`/`--no_python` itself. DeepSpeed put the helper's file path after `-m` under `--module`
  (python cannot import a path) and executed the .py file directly under `--no_python`.
- mvapich: the host list path is a constructor argument (default DeepSpeed's fixed
  /tmp/deepspeed_mvapich_hostfile, which concurrent launches overwrite); `hostfile_text()` returns
  the text for the caller to write.
- slurm: an export value containing ',' is an error, since `--export=` is a comma-separated list.
- impi: `--bind_cores_to_rank` is an error instead of numactl ranges computed here.
- MPI backends count only hosts with devices, so a `slots=0` host no longer fails the equal
  devices-per-host check. Unknown launchers and missing backends are `UsageError`s naming the fix.
- elastic launches run torchrun on each node (see scheduler/launch/elastic.py).
- a secret export (`environment.is_secret`) is never on the command line, where every user of the
  host reads it in /proc/<pid>/cmdline: MPI and Slurm name it and take its value from the launching
  process's environment (the caller puts them there): Open MPI `-x NAME`, Hydra (MPICH,
  Intel MPI, MVAPICH2) `-genvlist A,B`, srun `--export=ALL,...,NAME`. pdsh forwards no environment:
  each node's shell reads the secrets from `spec.secrets_file`, which the caller writes (only the
  user can read it; `private_file_exports`) in the working directory every node already shares, and
  removes when the launch ends; a node that cannot read it stops with a line saying so.
"""
from __future__ import annotations

import base64
import json
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

from scheduler.launch import elastic
from scheduler.launch.elastic import ElasticSettings
from scheduler.launch.environment import render_exports, source_private_file, split_secrets
from scheduler.errors import UsageError
from scheduler.launch.resources import ResourceRequest, Resources

Which = Callable[[str], "str | None"]
"""Finds a program on PATH, like shutil.which."""
ReadOutput = Callable[[Sequence[str]], str]
"""Runs a short probe command and returns its stdout."""

DEFAULT_MASTER_PORT = 29500
PDSH_MAX_FAN_OUT = 1024
MVAPICH_HOSTFILE = "/tmp/deepspeed_mvapich_hostfile"
LAUNCH_MODULE = "deepspeed.launcher.launch"
HELPER_MODULE = "deepspeed.launcher.launcher_helper"
UNSET_RANK_LOG = "None"
"""What DeepSpeed's per-node launcher reads as "no per-rank log directory"."""


def encode_world_info(hosts: Resources | Mapping[str, Sequence[int]]) -> str:
    """DeepSpeed's `--world_info`: urlsafe base64 of the JSON {host: [device ids]}, in host order."""
    mapping = hosts.hosts if isinstance(hosts, Resources) else {host: list(ids) for host, ids in hosts.items()}
    return base64.urlsafe_b64encode(json.dumps(mapping).encode("utf-8")).decode("utf-8")


def decode_world_info(encoded: str) -> dict[str, list[int]]:
    """The inverse of `encode_world_info`."""
    return json.loads(base64.urlsafe_b64decode(encoded.encode("utf-8")))


@dataclass(frozen=True)
class LaunchSpec:
    """Everything a backend needs to build its command; `resources` is the resolved selection."""

    resources: Resources
    user_script: str
    master_addr: str
    cwd: str
    user_args: tuple[str, ...] = ()
    exports: Mapping[str, str] = field(default_factory=dict, hash=False)
    master_port: int = DEFAULT_MASTER_PORT
    launcher_args: str = ""
    python: str = sys.executable
    hostfile: str | None = None
    request: ResourceRequest = ResourceRequest()
    module: bool = False
    no_python: bool = False
    no_local_rank: bool = False
    save_pid: int | None = None
    each_rank_log: str | None = None
    bind_cores_to_rank: bool = False
    bind_core_list: str | None = None
    venv_script: str | None = None
    ssh_port: int | None = None
    slurm_comment: str = ""
    log_level: str = "info"
    quiet: bool = False
    elastic: ElasticSettings | None = None
    #: pdsh: the file each node reads the secret exports from (absolute, in the shared working directory)
    secrets_file: str | None = None

    def __post_init__(self) -> None:
        if self.module and self.no_python:
            raise UsageError("--module and --no_python cannot be used together; keep one of them")
        if not 1 <= self.master_port <= 65535:
            raise UsageError(f"--master_port {self.master_port} is not a TCP port; use 1-65535")
        if not self.cwd.startswith("/"):
            raise UsageError(f"working directory {self.cwd!r} must be an absolute path")
        if not self.resources.entries:
            raise UsageError("no hosts selected; nothing to launch")

    @property
    def world_info(self) -> str:
        return encode_world_info(self.resources)

    def launcher_arg_list(self) -> list[str]:
        """`--launcher_args` split the way a shell would."""
        try:
            return shlex.split(self.launcher_args)
        except ValueError as error:
            raise UsageError(f"--launcher_args {self.launcher_args!r}: {error}; balance the quotes") from None

    def python_prefix(self) -> list[str]:
        """`python -u [-m]` before the user script, or nothing with --no_python."""
        if self.no_python:
            return []
        return [self.python, "-u", *(["-m"] if self.module else [])]

    def split_exports(self) -> tuple[dict[str, str], dict[str, str]]:
        """(the exports a command line may carry, the secret ones)."""
        return split_secrets(self.exports)

    def launch_only_flags(self) -> list[str]:
        """The DeepSpeed-launcher flags in use, which an elastic launch cannot honour."""
        used = (self.save_pid is not None, self.each_rank_log is not None, self.bind_cores_to_rank,
                self.bind_core_list is not None)
        return [flag for flag, on in zip(elastic.LAUNCH_ONLY_FLAGS, used) if on]


def launch_module_args(spec: LaunchSpec, node_rank: str | None, *, rank_first: bool = True) -> list[str]:
    """`python -u -m deepspeed.launcher.launch` and its flags, up to (not including) the user script.

    DeepSpeed puts `--node_rank` before the master address for pdsh and after the port locally.
    """
    rank = [] if node_rank is None else [f"--node_rank={node_rank}"]
    argv = [spec.python, "-u", "-m", LAUNCH_MODULE, f"--world_info={spec.world_info}", *(rank if rank_first else [])]
    argv += [f"--master_addr={spec.master_addr}", f"--master_port={spec.master_port}", *([] if rank_first else rank)]
    argv += [flag for flag, on in (("--no_python", spec.no_python), ("--module", spec.module),
                                   ("--no_local_rank", spec.no_local_rank)) if on]
    if spec.save_pid is not None:
        argv += ["--save_pid", str(spec.save_pid)]
    argv.append(f"--enable_each_rank_log={spec.each_rank_log or UNSET_RANK_LOG}")
    if spec.bind_cores_to_rank:
        argv.append("--bind_cores_to_rank")
    if spec.bind_core_list is not None:
        argv.append(f"--bind_core_list={spec.bind_core_list}")
    return argv


def per_node_command(spec: LaunchSpec, node_rank: str | None, launcher: str) -> list[str]:
    """What runs on one node: DeepSpeed's launcher, or torchrun for an elastic launch."""
    if spec.elastic is None:
        return [*launch_module_args(spec, node_rank), spec.user_script, *spec.user_args]
    elastic.check_elastic_launch(launcher, spec.launch_only_flags())
    return elastic.torchrun_command(
        spec.elastic, python=spec.python, master_addr=spec.master_addr, master_port=spec.master_port,
        nproc_per_node=len(elastic.shared_device_ids(spec.resources)), user_script=spec.user_script,
        user_args=spec.user_args, module=spec.module, no_python=spec.no_python,
    )


def needs_multinode(resources: Resources, *, force_multi: bool = False, no_ssh: bool = False) -> bool:
    """DeepSpeed's choice: a multi-node backend for several hosts (or --force_multi), unless --no_ssh."""
    return (force_multi or resources.num_nodes > 1) and not no_ssh


def local_command(spec: LaunchSpec, node_rank: int | None = None) -> list[str]:
    """The single-node launch; `node_rank` is --node_rank under --no_ssh. Inherits the environment.

    An elastic launch runs torchrun, which does not set devices: add `elastic.node_environment(...)`.
    """
    if spec.elastic is not None:
        return per_node_command(spec, None, "local")
    argv = launch_module_args(spec, None if node_rank is None else str(node_rank), rank_first=False)
    if spec.quiet:
        argv.append("--quiet")
    argv.append(f"--log_level={spec.log_level}")
    return [*argv, spec.user_script, *spec.user_args]


class Launcher(Protocol):
    """A multi-node backend: how to tell it is installed and which command it runs."""

    name: ClassVar[str]
    tool: ClassVar[str]

    def backend_exists(self, which: Which, read_output: ReadOutput | None = None) -> bool: ...

    def command(self, spec: LaunchSpec) -> list[str]: ...

    def launch_env(self, spec: LaunchSpec, environ: Mapping[str, str]) -> dict[str, str]: ...


@dataclass(frozen=True)
class _ToolBackend:
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


@dataclass(frozen=True)
class PdshLauncher(_ToolBackend):
    """pdsh runs one DeepSpeed launcher per host over ssh; `%n` becomes each host's index."""

    name: ClassVar[str] = "pdsh"
    tool: ClassVar[str] = "pdsh"

    def command(self, spec: LaunchSpec) -> list[str]:
        head = ["pdsh", "-S", "-f", str(PDSH_MAX_FAN_OUT), "-w", ",".join(spec.resources.hosts)]
        return [*head, *spec.launcher_arg_list(), *self.remote_words(spec)]

    def remote_words(self, spec: LaunchSpec) -> list[str]:
        """The remote command as shell words; pdsh joins them with blanks for the remote shell."""
        words = [f"source {shlex.quote(spec.venv_script)};"] if spec.venv_script is not None else []
        exports, secret = spec.split_exports()
        if spec.elastic is not None:
            exports.update(elastic.node_environment(elastic.shared_device_ids(spec.resources)))
        if exports:
            words.append(render_exports(exports))
        if secret:
            words.append(source_private_file(spec.secrets_file, list(secret)))
        words.append(f"cd {shlex.quote(spec.cwd)};")
        return words + [shlex.quote(word) for word in per_node_command(spec, "%n", self.name)]

    def remote_command(self, spec: LaunchSpec) -> str:
        """The text each host's shell parses (before pdsh replaces `%n`)."""
        return " ".join(self.remote_words(spec))

    def launch_env(self, spec: LaunchSpec, environ: Mapping[str, str]) -> dict[str, str]:
        env = {"PDSH_RCMD_TYPE": "ssh"}
        if spec.ssh_port is not None:
            existing = environ.get("PDSH_SSH_ARGS_APPEND", "")
            env["PDSH_SSH_ARGS_APPEND"] = f"{existing} -p {spec.ssh_port}".lstrip()
        return env


def private_file_exports(launcher: Launcher, spec: LaunchSpec) -> dict[str, str]:
    """What the caller writes to `spec.secrets_file` (`environment.write_private_file`) before
    running `launcher.command(spec)`: the secret exports for pdsh, nothing for the others (they take
    the secrets from the launching process's environment, which must hold `spec.split_exports()[1]`)."""
    return spec.split_exports()[1] if launcher.name == PdshLauncher.name else {}


def _devices_per_host(name: str, resources: Resources) -> int:
    counts = {entry.host: len(entry.device_ids) for entry in resources.entries}
    if len(set(counts.values())) != 1:
        raise UsageError(f"--launcher {name} needs the same number of devices on every host, got {counts}")
    return next(iter(counts.values()))


@dataclass(frozen=True)
class OpenMpiLauncher(_ToolBackend):
    """Open MPI's mpirun starts every rank from the hostfile; exports go in `-x K=V`."""

    name: ClassVar[str] = "openmpi"
    tool: ClassVar[str] = "ompi_info"

    def command(self, spec: LaunchSpec) -> list[str]:
        self._check_rank_launcher(spec)
        if spec.hostfile is None:
            raise UsageError("--launcher openmpi needs a hostfile: mpirun reads the hosts from it")
        extra = spec.launcher_arg_list()
        argv = ["mpirun", "-n", str(spec.resources.num_devices), "-hostfile", spec.hostfile, "--mca", "btl", "^openib"]
        if not _sets_tcp_interface(extra):
            argv += ["--mca", "btl_tcp_if_include", "eth0"]
        argv += extra
        exports, secret = spec.split_exports()
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
class MpichLauncher(_ToolBackend):
    """MPICH's mpirun; DeepSpeed's helper turns PMI ranks into RANK/LOCAL_RANK on each process."""

    name: ClassVar[str] = "mpich"
    tool: ClassVar[str] = "mpirun"

    def command(self, spec: LaunchSpec) -> list[str]:
        self._check_rank_launcher(spec)
        per_host = _devices_per_host(self.name, spec.resources)
        total = spec.resources.num_devices
        argv = ["mpirun", "-n", str(total), "-ppn", str(per_host), *spec.launcher_arg_list()]
        exports, secret = spec.split_exports()
        argv += _export_flags("-genv", exports) + _hydra_secret_flags(secret)
        argv += [*_rendezvous_genv(spec, total, per_host), "-hosts", ",".join(spec.resources.hosts)]
        helper = [spec.python, "-u", "-m", HELPER_MODULE, "--launcher", self.name]
        helper += ["--module"] if spec.module else ["--no_python"] if spec.no_python else []
        return [*argv, *helper, spec.user_script, *spec.user_args]


@dataclass(frozen=True)
class ImpiLauncher(_ToolBackend):
    """Intel MPI: one MPMD block per global rank, each with its RANK and LOCAL_RANK."""

    name: ClassVar[str] = "impi"
    tool: ClassVar[str] = "mpirun"

    def command(self, spec: LaunchSpec) -> list[str]:
        self._check_rank_launcher(spec)
        if spec.bind_cores_to_rank:
            raise UsageError("--bind_cores_to_rank is not supported with --launcher impi here; drop it")
        per_host = _devices_per_host(self.name, spec.resources)
        total = spec.resources.num_devices
        argv = ["mpirun", "-ppn", str(per_host), *spec.launcher_arg_list()]
        exports, secret = spec.split_exports()
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
class MvapichLauncher(_ToolBackend):
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

    def command(self, spec: LaunchSpec) -> list[str]:
        self._check_rank_launcher(spec)
        per_host = _devices_per_host(self.name, spec.resources)
        argv = ["mpirun", "-np", str(spec.resources.num_devices), "-ppn", str(per_host)]
        argv += ["--hostfile", self.hostfile_path, *spec.launcher_arg_list()]
        defaults = {key: value for key, value in MVAPICH_DEFAULT_EXPORTS.items() if self.cuda or key != "MV2_USE_CUDA"}
        exports, secret = spec.split_exports()
        argv += _export_flags("-env", {**defaults, **exports}) + _hydra_secret_flags(secret)
        return [*argv, *spec.python_prefix(), spec.user_script, *spec.user_args]


@dataclass(frozen=True)
class SlurmLauncher(_ToolBackend):
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
    _devices_per_host("slurm", resources)


def _slurm_export(exports: Mapping[str, str]) -> str:
    """`--export=ALL,K=V,...,NAME`: a secret by name only, its value from srun's own environment."""
    plain, secret = split_secrets(exports)
    for key, value in plain.items():
        if "," in value:
            raise UsageError(f"export {key}={value!r} contains ',' which srun's --export list cannot carry; remove it")
    return ",".join(["--export=ALL", *(f"{key}={value}" for key, value in plain.items()), *secret])


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


def _command_output(argv: Sequence[str]) -> str:
    try:
        return subprocess.run(list(argv), capture_output=True, text=True, timeout=30, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""
