"""What one launch is (`LaunchSpec`: hosts and devices, script, rendezvous, DeepSpeed launcher
flags, exports) and the command that runs on one node: DeepSpeed's per-node launcher
(`python -u -m deepspeed.launcher.launch`), or torchrun for an elastic launch.

Apart from the multi-node backends (`scheduler.launch.launchers`) because every backend, and a
single-node launch, builds on these; nothing here starts a process, so every command is data.
`encode_world_info` is the host -> device ids map DeepSpeed hands its per-node launcher, real
device ids kept.
"""
from __future__ import annotations

import base64
import json
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from scheduler.launch import elastic
from scheduler.launch.elastic import ElasticSettings
from scheduler.launch.environment import split_secrets
from scheduler.errors import UsageError
from scheduler.launch.resources import ResourceRequest, Resources

DEFAULT_MASTER_PORT = 29500
LAUNCH_MODULE = "deepspeed.launcher.launch"
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
