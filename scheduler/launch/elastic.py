"""Map DeepSpeed's elastic-training flags onto torch's own elastic launcher (torchrun).

Why this exists: `deepspeed --elastic_training --min_elastic_nodes A --max_elastic_nodes B` asks for
a job that starts once A nodes have joined, admits up to B, and survives nodes leaving. DeepSpeed
implemented that with a private agent inside its per-node launcher (and newer releases dropped the
flags from the runner altogether). torch ships the same machinery as `torchrun`, so each node here
runs `python -u -m torch.distributed.run` with a c10d rendezvous instead:

    --elastic_training              -> elastic launch on (the flags below are rejected without it)
    --min_elastic_nodes A           -> --nnodes=A:B   (A defaults to 1 when only B is given)
    --max_elastic_nodes B           ->                (B defaults to the number of selected hosts)
    --master_addr H --master_port P -> --rdzv_backend=c10d --rdzv_endpoint=H:P  ([H]:P for IPv6)
    $ELASTIC_RUN_ID or 123456789    -> --rdzv_id=...  (an explicit run id wins over both)
    DeepSpeed's agent settings      -> --max_restarts=100 --monitor_interval=5
    devices of each host            -> --nproc_per_node=<count>, CUDA_VISIBLE_DEVICES=<real ids>
    async NCCL error handling       -> TORCH_NCCL_ASYNC_ERROR_HANDLING=1 on every node

What is supported, exactly:
- launchers: the local (single node) launch and `pdsh`, i.e. the launchers that start one launcher
  process per node. The MPI launchers and Slurm start every rank themselves, so there is no
  per-node agent to make elastic; asking for elastic with them is an error (DeepSpeed ignored it).
- every selected host must offer the same device ids: torchrun takes one `--nproc_per_node` and the
  same command runs on every node.
- `--module` and `--no_python` are passed on to torchrun; `--save_pid`, `--enable_each_rank_log`,
  `--bind_cores_to_rank` and `--bind_core_list` belong to DeepSpeed's own launcher and are errors
  with elastic here instead of being dropped.

Deliberate differences from DeepSpeed, and why:
- a node range is required: `--elastic_training` with neither end given is an error. DeepSpeed
  silently used 1:<hosts>, so a job meant for four nodes could start training on one, with a
  different global batch size.
- min/max given without `--elastic_training`, min above max, either end below 1, and a min larger
  than the number of selected hosts (the rendezvous could never complete) are errors naming the fix.
- torchrun passes the local rank in the LOCAL_RANK environment variable, never as `--local_rank=N`,
  so DeepSpeed's rule that elastic excludes `--no_local_rank` does not apply; scripts read the env
  (as `deepspeed.init_distributed` does).
- DeepSpeed's `timeout=100` rendezvous setting is not mapped: torch's c10d rendezvous does not read a
  key of that name, so it never had an effect.
- the environment variable is torch's current name, TORCH_NCCL_ASYNC_ERROR_HANDLING; DeepSpeed set
  the deprecated NCCL_ASYNC_ERROR_HANDLING, which torch still reads with a warning.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from scheduler.errors import UsageError
from scheduler.launch.resources import Resources

DEFAULT_RUN_ID = "123456789"
"""DeepSpeed's rendezvous id when ELASTIC_RUN_ID is not set."""

RUN_ID_VARIABLE = "ELASTIC_RUN_ID"
DEFAULT_MAX_RESTARTS = 100
DEFAULT_MONITOR_INTERVAL = 5
RENDEZVOUS_BACKEND = "c10d"
TORCHRUN_MODULE = "torch.distributed.run"
ELASTIC_LAUNCHERS = ("local", "pdsh")
LAUNCH_ONLY_FLAGS = ("--save_pid", "--enable_each_rank_log", "--bind_cores_to_rank", "--bind_core_list")


@dataclass(frozen=True)
class ElasticSettings:
    """A validated elastic launch: node range, rendezvous id and agent settings."""

    min_nodes: int
    max_nodes: int
    run_id: str = DEFAULT_RUN_ID
    max_restarts: int = DEFAULT_MAX_RESTARTS
    monitor_interval: int = DEFAULT_MONITOR_INTERVAL

    @property
    def nnodes(self) -> str:
        """torchrun's `MIN:MAX` node range."""
        return f"{self.min_nodes}:{self.max_nodes}"


def resolve_elastic(
    *,
    elastic_training: bool,
    min_nodes: int | None,
    max_nodes: int | None,
    num_hosts: int,
    run_id: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> ElasticSettings | None:
    """Validate the elastic flags against the selected hosts; None when elastic is off.

    `None` means "flag not given". `run_id` wins over `environ[ELASTIC_RUN_ID]`, which wins over
    DeepSpeed's fixed default.
    """
    if not elastic_training:
        _reject_range_without_elastic(min_nodes, max_nodes)
        return None
    if min_nodes is None and max_nodes is None:
        raise UsageError(
            "--elastic_training needs a node range: give --min_elastic_nodes and/or --max_elastic_nodes "
            f"(e.g. --min_elastic_nodes 1 --max_elastic_nodes {max(num_hosts, 1)})"
        )
    low = 1 if min_nodes is None else min_nodes
    high = num_hosts if max_nodes is None else max_nodes
    _check_range(low, high, num_hosts)
    return ElasticSettings(min_nodes=low, max_nodes=high, run_id=_run_id(run_id, environ or {}))


def rendezvous_endpoint(master_addr: str, master_port: int) -> str:
    """`host:port` for the c10d store on the master node; IPv6 addresses are bracketed."""
    host = master_addr.strip()
    if not host:
        raise UsageError("elastic training needs --master_addr: it is the rendezvous endpoint every node joins")
    if not 1 <= master_port <= 65535:
        raise UsageError(f"--master_port {master_port} is not a TCP port; use 1-65535")
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{master_port}"


def rendezvous_args(settings: ElasticSettings, master_addr: str, master_port: int) -> list[str]:
    """torchrun's rendezvous and agent flags for `settings`."""
    return [
        f"--nnodes={settings.nnodes}",
        f"--rdzv_backend={RENDEZVOUS_BACKEND}",
        f"--rdzv_endpoint={rendezvous_endpoint(master_addr, master_port)}",
        f"--rdzv_id={settings.run_id}",
        f"--max_restarts={settings.max_restarts}",
        f"--monitor_interval={settings.monitor_interval}",
    ]


def torchrun_command(
    settings: ElasticSettings,
    *,
    python: str,
    master_addr: str,
    master_port: int,
    nproc_per_node: int,
    user_script: str,
    user_args: Sequence[str] = (),
    module: bool = False,
    no_python: bool = False,
) -> list[str]:
    """The argv each node runs: `python -u -m torch.distributed.run ... script args`."""
    if module and no_python:
        raise UsageError("--module and --no_python cannot be used together; keep one of them")
    argv = [python, "-u", "-m", TORCHRUN_MODULE, *rendezvous_args(settings, master_addr, master_port)]
    argv.append(f"--nproc_per_node={nproc_per_node}")
    if module:
        argv.append("--module")
    if no_python:
        argv.append("--no_python")
    return [*argv, user_script, *user_args]


def shared_device_ids(resources: Resources) -> tuple[int, ...]:
    """The device ids every host offers; elastic needs them identical since one command runs everywhere."""
    distinct = {entry.device_ids for entry in resources.entries}
    if len(distinct) != 1:
        shown = ", ".join(f"{entry.host}:{','.join(map(str, entry.device_ids))}" for entry in resources.entries)
        raise UsageError(
            f"elastic training needs the same device ids on every host, got {shown}; "
            f"select matching devices with --include or --num_gpus"
        )
    return next(iter(distinct))


def node_environment(device_ids: Sequence[int]) -> dict[str, str]:
    """Variables each elastic node sets before torchrun: its devices and torch's NCCL error handling."""
    return {
        "CUDA_VISIBLE_DEVICES": ",".join(str(device_id) for device_id in device_ids),
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    }


def check_elastic_launch(launcher: str, flags_in_use: Iterable[str] = ()) -> None:
    """Reject launchers and DeepSpeed-launcher flags that an elastic launch cannot honour."""
    if launcher not in ELASTIC_LAUNCHERS:
        raise UsageError(
            f"--elastic_training is not supported with --launcher {launcher}: it starts every rank itself, "
            f"so there is no per-node agent; use --launcher pdsh or drop --elastic_training"
        )
    refused = [flag for flag in flags_in_use if flag in LAUNCH_ONLY_FLAGS]
    if refused:
        raise UsageError(
            f"{', '.join(refused)} cannot be combined with --elastic_training (torchrun runs the ranks, "
            f"not DeepSpeed's launcher); drop {'them' if len(refused) > 1 else 'it'}"
        )


def _reject_range_without_elastic(min_nodes: int | None, max_nodes: int | None) -> None:
    given = [
        flag
        for flag, value in (("--min_elastic_nodes", min_nodes), ("--max_elastic_nodes", max_nodes))
        if value is not None
    ]
    if given:
        raise UsageError(f"{' and '.join(given)} only apply with --elastic_training; add it or drop them")


def _check_range(low: int, high: int, num_hosts: int) -> None:
    for flag, value in (("--min_elastic_nodes", low), ("--max_elastic_nodes", high)):
        if value < 1:
            raise UsageError(f"{flag} must be at least 1, got {value}")
    if low > high:
        raise UsageError(
            f"--min_elastic_nodes {low} is larger than --max_elastic_nodes {high}; "
            f"the minimum must not exceed the maximum"
        )
    if low > num_hosts:
        raise UsageError(
            f"--min_elastic_nodes {low} but only {num_hosts} hosts are selected, so the rendezvous "
            f"could never complete; lower --min_elastic_nodes or select more hosts"
        )


def _run_id(explicit: str | None, environ: Mapping[str, str]) -> str:
    chosen = explicit if explicit is not None else environ.get(RUN_ID_VARIABLE, DEFAULT_RUN_ID)
    if not chosen.strip() or any(character.isspace() for character in chosen):
        raise UsageError(f"elastic run id {chosen!r} must be a non-empty word without blanks; set {RUN_ID_VARIABLE}")
    return chosen
