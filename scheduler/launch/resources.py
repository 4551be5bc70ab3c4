"""Decide which devices of which hosts an autotuning run may use, the way DeepSpeed users say it.

Why this exists: users already describe a cluster with a hostfile plus `--include/--exclude`
and `--num_nodes/--num_gpus`, and with `CUDA_VISIBLE_DEVICES` on a single machine. This module
turns those into an ordered {host: [device ids]} selection with DeepSpeed's semantics, as pure
logic (the command `python -m scheduler.resources`, scheduler/resources.py, is the only part that
looks at the machine), so the scheduler can be tested without a cluster and a user can check a
selection before anything runs:

    python -m scheduler.resources --hostfile F [--include S | --exclude S] [--num_nodes N] [--num_gpus G]

Semantics kept from DeepSpeed's runner:
- filter grammar `NODE[:ID[,ID...]][@NODE[:ID...]]...`; entries for one host are merged, ids are
  de-duplicated and sorted; `--include` starts from nothing, `--exclude` from everything;
  `--include` and `--exclude` are mutually exclusive; an unknown host or device id is an error;
  hosts left with no devices are dropped; the result follows hostfile order, not filter order.
- `--num_nodes N` keeps the first N hosts, `--num_gpus G` the first G devices of each host, and
  neither may be combined with `--include/--exclude`.
- without a hostfile, a non-empty `CUDA_VISIBLE_DEVICES` becomes `--include <local host>:<ids>`
  unless one of `--include/--exclude/--num_nodes/--num_gpus` is given, in which case it is
  ignored (with a note). `--num_nodes` above 1 needs a hostfile.

Deliberate differences from DeepSpeed, and why:
- real device ids are kept end to end. DeepSpeed's autotuner renumbers slots from 0 and cuts
  every node down to the smallest one (DeepSpeed #4997), so `CUDA_VISIBLE_DEVICES=2,3` or
  `--include a:2,3` ran on devices 0,1.
- included ids are checked against the host's devices: DeepSpeed checks them against
  themselves, so `worker-0:7` on a 4-slot host was accepted and failed later on the worker.
- a bare host merged with slots of the same host means the whole host (`a@a:1` includes or
  excludes all of `a`); DeepSpeed keeps only slot 1, silently shrinking an explicit whole-host
  request.
- `--num_gpus G` takes the host's first G real ids and is an error when a host has fewer than G;
  DeepSpeed writes `range(G)` whatever the host has and drops the ids an include chose (the
  conflict rule makes the latter unreachable here).
- `--num_nodes N` larger than the number of hosts is an error; DeepSpeed silently runs on fewer.
- `--num_nodes`/`--num_gpus` must be at least 1 when given; DeepSpeed ignores 0 and negative
  values (but still counts `0` as "given" for the include/exclude conflict). Not given is None.
- `CUDA_VISIBLE_DEVICES` is ignored whenever any of the four flags is given. DeepSpeed only
  ignores it for `--num_nodes > 1`/`--num_gpus > 0`, so `--num_nodes 1` turned it into an include
  and then failed the conflict check. A value that is not integer ids (UUIDs, MIG names) is a
  clear error instead of an int() traceback. It is never deleted from the environment here.
- hosts without devices (`slots=0`) are dropped even when no filter is given (DeepSpeed keeps
  them then), and they do not count for `--num_nodes`. A selection with no devices at all is an
  error instead of an empty launch.
- blanks around hosts and ids in a filter are ignored; `+1`/`-1` are not device ids.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import NoReturn

from scheduler.errors import ResourceFilterError
from scheduler.launch.hostfile import LOCAL_HOSTNAME

FILTER_GRAMMAR = "expected NODE[:ID[,ID...]][@NODE[:ID...]]..., e.g. worker-0:0,1@worker-1"
_MAX_HOSTS_NAMED = 8


@dataclass(frozen=True)
class HostDevices:
    """The device ids chosen on one host, ascending."""

    host: str
    device_ids: tuple[int, ...]


@dataclass(frozen=True)
class Resources:
    """An ordered host -> device ids selection, plus notes on how it was reached."""

    entries: tuple[HostDevices, ...]
    notes: tuple[str, ...] = ()

    @classmethod
    def from_mapping(cls, hosts: Mapping[str, Iterable[int]], notes: Iterable[str] = ()) -> Resources:
        """Build from {host: ids}, keeping the mapping's order."""
        entries = tuple(HostDevices(host, tuple(ids)) for host, ids in hosts.items())
        return cls(entries=entries, notes=tuple(notes))

    @property
    def hosts(self) -> dict[str, list[int]]:
        """{host: [device ids]} in selection order; JSON-serialisable."""
        return {entry.host: list(entry.device_ids) for entry in self.entries}

    @property
    def num_nodes(self) -> int:
        return len(self.entries)

    @property
    def num_devices(self) -> int:
        return sum(len(entry.device_ids) for entry in self.entries)

    def to_json_dict(self) -> dict[str, object]:
        """The selection with its totals, ready for json.dumps."""
        return {
            "hosts": self.hosts,
            "num_nodes": self.num_nodes,
            "num_devices": self.num_devices,
            "notes": list(self.notes),
        }


@dataclass(frozen=True)
class ResourceRequest:
    """What the user asked for; empty strings and None mean "not given"."""

    include: str = ""
    exclude: str = ""
    num_nodes: int | None = None
    num_gpus: int | None = None
    include_label: str = field(default="--include", compare=False)

    @property
    def uses_filter(self) -> bool:
        return bool(self.include) or bool(self.exclude)

    @property
    def limits_counts(self) -> bool:
        return self.num_nodes is not None or self.num_gpus is not None


def parse_node_specs(spec: str, label: str = "--include") -> dict[str, tuple[int, ...] | None]:
    """Parse `NODE[:ID[,ID...]][@...]` into {host: sorted unique ids, or None for the whole host}."""
    wanted: dict[str, tuple[int, ...] | None] = {}
    for node_spec in spec.split("@"):
        host, ids = _parse_one_node(node_spec, spec, label)
        wanted[host] = _merge_ids(wanted[host], ids) if host in wanted else ids
    return wanted


def filter_devices(
    available: Mapping[str, Sequence[int]],
    include: str = "",
    exclude: str = "",
    *,
    where: str = "the hostfile",
    include_label: str = "--include",
) -> dict[str, list[int]]:
    """Apply --include or --exclude to {host: ids}; hosts left empty are dropped, order kept."""
    if include and exclude:
        raise ResourceFilterError("--include and --exclude cannot be used together; keep only one of them")
    if include:
        chosen = _included(available, include, include_label, where)
    elif exclude:
        chosen = _remaining_after_exclude(available, exclude, where)
    else:
        chosen = {host: list(ids) for host, ids in available.items()}
    return {host: ids for host, ids in chosen.items() if ids}


def apply_visible_devices(
    request: ResourceRequest,
    visible_devices: str | None,
    *,
    hostfile_given: bool,
    local_host: str = LOCAL_HOSTNAME,
) -> tuple[ResourceRequest, tuple[str, ...]]:
    """DeepSpeed's single-node rule: CUDA_VISIBLE_DEVICES becomes an include when nothing else is asked."""
    if not visible_devices:
        return request, ()
    shown = f"CUDA_VISIBLE_DEVICES={visible_devices}"
    if hostfile_given:
        return request, (f"{shown} ignored: a hostfile was given, devices come from it",)
    if request.uses_filter or request.limits_counts:
        return request, (f"{shown} ignored because --include/--exclude/--num_nodes/--num_gpus was given",)
    ids = _visible_device_ids(visible_devices)
    include = f"{local_host}:{','.join(ids)}"
    derived = replace(request, include=include, include_label=f"{shown} (read as --include)")
    return derived, (f"{shown} read as --include {include}",)


def resolve_resources(
    pool: Mapping[str, int],
    request: ResourceRequest = ResourceRequest(),
    *,
    hostfile: str | None = None,
    visible_devices: str | None = None,
) -> Resources:
    """Turn a pool {host: slot count} and a request into the devices to use.

    `hostfile` is the path the pool came from (None: the pool is the local machine, one host);
    `visible_devices` is the caller's CUDA_VISIBLE_DEVICES value, if any.
    """
    request, notes = apply_visible_devices(
        request, visible_devices, hostfile_given=hostfile is not None, local_host=_local_host_of(pool, hostfile)
    )
    _check_counts_are_positive(request)
    _check_counts_without_filter(request)
    where = f"hostfile {hostfile}" if hostfile is not None else "the local machine"
    _check_nodes_need_hostfile(request, hostfile, pool)
    available = {host: list(range(count)) for host, count in pool.items()}
    chosen = filter_devices(
        available, request.include, request.exclude, where=where, include_label=request.include_label
    )
    if request.num_nodes is not None:
        chosen = first_nodes(chosen, request.num_nodes, where=where)
    if request.num_gpus is not None:
        chosen = first_devices_per_host(chosen, request.num_gpus)
    if not chosen:
        raise ResourceFilterError(_nothing_left_message(request, where))
    return Resources.from_mapping(chosen, notes)


def first_nodes(chosen: Mapping[str, Sequence[int]], num_nodes: int, *, where: str = "the hostfile") -> dict[str, list[int]]:
    """Keep the first `num_nodes` hosts; asking for more hosts than there are is an error."""
    if num_nodes > len(chosen):
        raise ResourceFilterError(
            f"--num_nodes {num_nodes} but {where} has only {len(chosen)} hosts with devices; "
            f"lower --num_nodes or add hosts"
        )
    return {host: list(ids) for host, ids in list(chosen.items())[:num_nodes]}


def first_devices_per_host(chosen: Mapping[str, Sequence[int]], num_gpus: int) -> dict[str, list[int]]:
    """Keep the first `num_gpus` device ids of every host; a host with fewer is an error."""
    for host, ids in chosen.items():
        if len(ids) < num_gpus:
            raise ResourceFilterError(
                f"--num_gpus {num_gpus} but host {host!r} has only {len(ids)} devices; "
                f"lower --num_gpus or pick devices per host with --include"
            )
    return {host: list(ids)[:num_gpus] for host, ids in chosen.items()}


def _parse_one_node(node_spec: str, spec: str, label: str) -> tuple[str, tuple[int, ...] | None]:
    text = node_spec.strip()
    if not text:
        _grammar_error(spec, label, "an empty node (check the '@' separators)")
    host, colon, ids_text = text.partition(":")
    host = host.strip()
    if not host:
        _grammar_error(spec, label, f"no host name before ':' in {text!r}")
    if not colon:
        return host, None
    if ":" in ids_text:
        _grammar_error(spec, label, f"more than one ':' in {text!r}")
    ids = {_parse_device_id(token, text, spec, label) for token in ids_text.split(",")}
    return host, tuple(sorted(ids))


def _parse_device_id(token: str, node_text: str, spec: str, label: str) -> int:
    token = token.strip()
    if not token:
        _grammar_error(spec, label, f"an empty device id in {node_text!r}")
    if not (token.isascii() and token.isdigit()):
        _grammar_error(spec, label, f"device id {token!r} in {node_text!r} is not a non-negative integer")
    return int(token)


def _grammar_error(spec: str, label: str, problem: str) -> NoReturn:
    raise ResourceFilterError(f"{label} {spec!r}: {problem}; {FILTER_GRAMMAR}")


def _merge_ids(earlier: tuple[int, ...] | None, later: tuple[int, ...] | None) -> tuple[int, ...] | None:
    if earlier is None or later is None:
        return None
    return tuple(sorted(set(earlier) | set(later)))


def _check_known(
    available: Mapping[str, Sequence[int]],
    wanted: Mapping[str, tuple[int, ...] | None],
    spec: str,
    label: str,
    where: str,
) -> None:
    for host, ids in wanted.items():
        if host not in available:
            raise ResourceFilterError(
                f"{label} {spec!r}: host {host!r} is not in {where} (hosts: {_host_names(available)}); "
                f"use one of those names"
            )
        unknown = [device_id for device_id in ids or () if device_id not in available[host]]
        if unknown:
            raise ResourceFilterError(
                f"{label} {spec!r}: host {host!r} has no device id {_id_list(unknown)} "
                f"(its ids: {_id_list(available[host]) or 'none'}); use ids from that list"
            )


def _included(
    available: Mapping[str, Sequence[int]], spec: str, label: str, where: str
) -> dict[str, list[int]]:
    wanted = parse_node_specs(spec, label)
    _check_known(available, wanted, spec, label, where)
    return {
        host: list(available[host]) if wanted[host] is None else list(wanted[host] or ())
        for host in available
        if host in wanted
    }


def _remaining_after_exclude(
    available: Mapping[str, Sequence[int]], spec: str, where: str
) -> dict[str, list[int]]:
    unwanted = parse_node_specs(spec, "--exclude")
    _check_known(available, unwanted, spec, "--exclude", where)
    remaining: dict[str, list[int]] = {}
    for host, ids in available.items():
        if host not in unwanted:
            remaining[host] = list(ids)
        elif unwanted[host] is not None:
            removed = set(unwanted[host] or ())
            remaining[host] = [device_id for device_id in ids if device_id not in removed]
    return remaining


def _visible_device_ids(visible_devices: str) -> list[str]:
    ids = [token.strip() for token in visible_devices.split(",")]
    for token in ids:
        if not (token.isascii() and token.isdigit()):
            raise ResourceFilterError(
                f"CUDA_VISIBLE_DEVICES={visible_devices!r}: {token!r} is not an integer device id; "
                f"set it to ids such as 0,1 (UUIDs and MIG names are not supported) or unset it"
            )
    return ids


def _local_host_of(pool: Mapping[str, int], hostfile: str | None) -> str:
    if hostfile is not None or len(pool) != 1:
        return LOCAL_HOSTNAME
    return next(iter(pool))


def _check_counts_are_positive(request: ResourceRequest) -> None:
    for flag, value in (("--num_nodes", request.num_nodes), ("--num_gpus", request.num_gpus)):
        if value is not None and value < 1:
            raise ResourceFilterError(f"{flag} must be at least 1, got {value}; leave it out to use all")


def _check_counts_without_filter(request: ResourceRequest) -> None:
    if request.limits_counts and request.uses_filter:
        raise ResourceFilterError(
            "--num_nodes/--num_gpus cannot be combined with --include/--exclude; "
            "name the hosts and device ids in --include instead"
        )


def _check_nodes_need_hostfile(request: ResourceRequest, hostfile: str | None, pool: Mapping[str, int]) -> None:
    if hostfile is None and request.num_nodes is not None and request.num_nodes > 1:
        raise ResourceFilterError(
            f"--num_nodes {request.num_nodes} needs a hostfile: without one only this machine "
            f"({', '.join(pool)}) is used; pass a hostfile or drop --num_nodes"
        )


def _nothing_left_message(request: ResourceRequest, where: str) -> str:
    if request.exclude:
        return f"--exclude {request.exclude!r} leaves no devices on {where}; exclude fewer devices"
    if request.include:
        return f"{request.include_label} {request.include!r} selects no devices on {where}; include a host that has devices"
    return f"{where} offers no devices (every host has slots=0); give at least one host slots=1 or more"


def _host_names(available: Mapping[str, Sequence[int]]) -> str:
    names = list(available)
    shown = ", ".join(names[:_MAX_HOSTS_NAMED])
    return shown + (f", ... ({len(names)} in all)" if len(names) > _MAX_HOSTS_NAMED else "")


def _id_list(ids: Iterable[int]) -> str:
    return ",".join(str(device_id) for device_id in ids)
