"""What one rank of one experiment is given: its spec (`RankSpec`, sent as JSON inside the
`run_rank` task message), the argv that runs the user's script, and the environment torchrun or
DeepSpeed's launcher would give it, bound to its slot.

Apart from running the rank (`workers.slot.rank`) because the control path builds these specs
(`scheduler.cluster.dispatch`) and the tests check the argv and environment as data.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import psutil

from workers.files import layout
from workers.slot.build_locks import default_extensions_dir
from workers.in_rank.device_memory import EXIT_REPORT_ENV
from workers.files.paths import safe_child
from workers.state.redis_tls import TLS_ENV
from workers.device.slot import Slot

#: The worker's own secrets and bindings: a training script has no business with the cluster's Redis
#: (its URL with the password, its TLS client certificate and key) or Flower's settings, which an
#: operator sets on the workers (FLOWER_BASIC_AUTH and any other FLOWER_* option: `PRIVATE_PREFIXES`).
PRIVATE_ENV = frozenset({"AUTOTUNE_REDIS_URL", "AUTOTUNE_SLOT_JSON", "AUTOTUNE_EXIT_WITH_PARENT", *TLS_ENV})
PRIVATE_PREFIXES = ("FLOWER_",)


@dataclass(frozen=True)
class RankSpec:
    """Everything a slot needs to run one rank; sent as JSON inside the task message."""

    job: str
    name: str
    attempt: str  #: fresh token per launch: keys rendezvous and abort to this launch only
    results_root: str  #: absolute; the experiment folder is results_root/name
    script_argv: list[str]  #: the user's script and its arguments (config path already set)
    ds_config: dict[str, Any]
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    timeout_s: float
    num_nodes: int = 1  #: nodes the experiment spans (CROSS_SIZE, as DeepSpeed's launcher sets it)
    rendezvous_timeout_s: float = 120.0
    cwd: str = ""
    metric_file: str = layout.METRICS  #: what rank 0's script writes (model_info.json when profiling;
                                       #: "" for a real training run, which writes none)
    exp: dict[str, Any] = field(default_factory=dict)  #: the experiment description for exp.json
    gang_token: str = ""  #: the reservation this launch runs under; a message outliving it is stale
    lease_s: float = 60.0  #: the reservation's lease, which this rank renews for its own slot
    cuda_devices: list[str] = field(default_factory=list)  #: the gang's GPUs on this node (nvidia-smi indices), local-rank order
    local_rank_arg: bool = False  #: pass `--local_rank=N` after the script, as DeepSpeed's launcher does

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RankSpec:
        return cls(**data)

    def to_json(self) -> dict[str, Any]:
        """The fields as a dict, their values the same objects (`asdict` would deep-copy the config)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @property
    def result_dir(self) -> Path:
        return safe_child(self.results_root, self.name)


def script_command(script_argv: list[str], local_rank: int | None = None) -> list[str]:
    """The argv that runs the user's script: Python scripts through `workers.in_rank.entry` (OOM exit code).
    With `local_rank`, `--local_rank=N` follows the script as DeepSpeed's launcher puts it, so tuned
    runs get exactly the arguments the final `deepspeed` command will give."""
    script, *args = script_argv
    if local_rank is not None:
        args = [f"--local_rank={local_rank}", *args]
    if script.endswith(".py"):
        return [sys.executable, "-m", "workers.in_rank.entry", script, *args]
    return [script, *args]


def rank_env(spec: RankSpec, slot: Slot, master: tuple[str, int], exit_report: Path | None = None) -> dict[str, str]:
    """The environment torchrun or DeepSpeed's launcher would give this rank, bound to the slot: on
    CUDA slots it sees its gang's GPUs on this node, so LOCAL_RANK names its own reserved device."""
    env = {name: value for name, value in os.environ.items()
           if name not in PRIVATE_ENV and not name.startswith(PRIVATE_PREFIXES)}
    env.update(slot.child_env(spec.cuda_devices or None))
    env.setdefault("TORCH_EXTENSIONS_DIR", default_extensions_dir())  # this machine's own
    env.update({
        "RANK": str(spec.rank), "LOCAL_RANK": str(spec.local_rank),
        "WORLD_SIZE": str(spec.world_size), "LOCAL_WORLD_SIZE": str(spec.local_world_size),
        "LOCAL_SIZE": str(spec.local_world_size), "GROUP_RANK": str(spec.node_rank),
        "CROSS_RANK": str(spec.node_rank), "CROSS_SIZE": str(spec.num_nodes),  # DeepSpeed's checkpointing reads them
        "MASTER_ADDR": master[0], "MASTER_PORT": str(master[1]),
        "PYTHONUNBUFFERED": "1",
    })
    interface = _interface_holding(slot.address)
    if interface:
        env.setdefault("GLOO_SOCKET_IFNAME", interface)
        if spec.num_nodes > 1:
            # Only across nodes: inside one node NCCL talks over P2P/shared memory and picks its own
            # bootstrap interface, as it will in the final run. NCCL reads a bare name as a prefix
            # (eth1 also matches eth10); '=' asks for exactly this one. cmd_optimal.txt carries it.
            env.setdefault("NCCL_SOCKET_IFNAME", f"={interface}")
    if exit_report is not None:
        env[EXIT_REPORT_ENV] = str(exit_report)
    return env


def _interface_holding(address: str) -> str | None:
    """The local interface that has `address`: gloo's own sockets must use the same one as
    MASTER_ADDR, or a node whose host name does not resolve advertises 127.0.0.1 to its peers."""
    for name, addresses in psutil.net_if_addrs().items():
        if any(entry.address == address for entry in addresses):
            return name
    return None
