"""Which registered slots a tuning job may reserve: DeepSpeed's resource pool, matched to live slots.

Why: DeepSpeed's autotuner runs its experiments on the runner's resource pool, the hostfile narrowed
by `--include`/`--exclude` (research notes deepspeed-autotuning.md, 1.1 and 4.4), so that is how its
users bound a tuning. Here the pool is said the same way and matched against the slots that are
registered: a hostfile host is a worker's node name (`localhost`: this machine's node), its
`slots=N` the devices 0..N-1; without a hostfile the pool is every registered slot (DeepSpeed's
"this machine", which on a deployed cluster is all of its nodes). The grammar, its checks and its
one-line errors are `scheduler.launch.resources`'; `--num_nodes`/`--num_gpus` size each experiment as
in DeepSpeed's autotuner (they do not cut the pool) and, as there, cannot be combined with a filter.

Pure: slots in, the selected slots out. A selection that matches no live slot is one error naming
the hosts and devices that are registered, decided before any folder or process exists
(`scheduler.preflight`).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from scheduler.errors import ClusterError, ResourceFilterError
from scheduler.launch.hostfile import LOCAL_HOSTNAME
from scheduler.launch.resources import filter_devices
from workers.device.slot import Slot, slot_queue


@dataclass(frozen=True)
class PoolRequest:
    """The resource pool as DeepSpeed's runner takes it: a parsed hostfile ({host: slots}, None: no
    hostfile) and its path, and at most one of `--include`/`--exclude`."""

    hostfile: Mapping[str, int] | None = None
    hostfile_path: str | None = None
    include: str = ""
    exclude: str = ""

    @property
    def given(self) -> bool:
        """Whether the pool is bounded at all (else every registered slot may be used)."""
        return self.hostfile is not None or bool(self.include or self.exclude)

    def describe(self) -> str:
        """The flags as the user typed them, for messages."""
        parts = [f"--hostfile {self.hostfile_path}"] if self.hostfile is not None else []
        parts += [f"--{flag} {value}" for flag, value in (("include", self.include), ("exclude", self.exclude))
                  if value]
        return " ".join(parts)


def check_counts(request: PoolRequest, num_nodes: int | None, num_gpus: int | None) -> None:
    """DeepSpeed's rule: experiment sizes (--num_nodes/--num_gpus) and a filter do not mix."""
    if (request.include or request.exclude) and (num_nodes is not None or num_gpus is not None):
        raise ResourceFilterError("--num_nodes/--num_gpus cannot be combined with --include/--exclude "
                                  "(as in DeepSpeed); name the hosts and device ids in --include instead")


def registered(slots: Sequence[Slot]) -> dict[str, list[int]]:
    """{node: sorted device ids} of these slots, nodes in name order."""
    nodes: dict[str, list[int]] = {}
    for slot in sorted(slots, key=lambda s: (s.node, s.device)):
        nodes.setdefault(slot.node, []).append(slot.device)
    return nodes


@dataclass(frozen=True)
class Pool:
    """A bounded pool: the live slots in it now, and the queues of every device it names (a slot of
    the pool that registers later may be used too)."""

    slots: list[Slot]
    queues: list[str]


def select_slots(slots: Sequence[Slot], request: PoolRequest, local_node: str) -> Pool | None:
    """The pool of `request` over these live slots (None: no pool asked, every slot may be used);
    `localhost` in the hostfile or a filter is `local_node`. An unknown host or id in a filter, or
    nothing live in the pool, is one error."""
    if not request.given:
        return None
    live = registered(slots)
    if request.hostfile is None:
        available: dict[str, list[int]] = live
        where = "the registered slots"
    else:
        available = {}
        for host, count in request.hostfile.items():
            available[local_node if host == LOCAL_HOSTNAME else host] = list(range(count))
        where = f"hostfile {request.hostfile_path}"
    chosen = filter_devices(available, _local(request.include, local_node), _local(request.exclude, local_node),
                            where=where)
    wanted = {(host, device) for host, devices in chosen.items() for device in devices}
    selected = [slot for slot in slots if (slot.node, slot.device) in wanted]
    if not selected:
        raise ClusterError(f"{request.describe()} selects {describe_devices(chosen) or 'nothing'}, which "
                           f"matches no live slot; registered: {describe_devices(live) or 'none'}; name "
                           "registered hosts (workers' node names; localhost is this machine) and devices")
    return Pool(selected, [slot_queue(host, device) for host, devices in chosen.items() for device in devices])


def describe_devices(devices: Mapping[str, Sequence[int]]) -> str:
    """`node:0,1 node2:0` (DeepSpeed's include form, blank-separated), for messages."""
    return " ".join(f"{node}:{','.join(map(str, ids))}" for node, ids in devices.items())


def _local(spec: str, local_node: str) -> str:
    """A filter with `localhost` written as this machine's node name."""
    parts = [part.strip() for part in spec.split("@")] if spec else []
    return "@".join(local_node + part[len(LOCAL_HOSTNAME):] if part.split(":")[0].strip() == LOCAL_HOSTNAME
                    else part for part in parts)
