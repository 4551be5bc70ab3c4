"""The autotune command's input check: every refusal the inputs decide, before anything exists.

Why its own module: the promise "bad input is refused before a folder is made or a process is
started" holds only while every such check runs before `folders.prepare` and `LocalCluster`. Checks
that lived after them (an unknown `autotuning.search`, an `mp_size` that does not divide the ranks,
min above max micro-batch, `--min-slot-memory` above every slot, no `redis-server`) exited 2 after
the folders were marked and the embedded cluster had started. Here they are one function, `check`,
which returns everything the command needs next, so a check cannot slip behind the side effects again.

In order: the flags' bounds, the numeric `AUTOTUNE_*` variables and the Redis URL, the config file
(full mode's spaces among it), the training script and `arg_mappings`; then the cluster: a deployed one is
connected to and its live slots read (a control worker must run; one still starting is waited for,
up to AUTOTUNE_CLUSTER_WAIT_S, `wait_for_cluster`); for the embedded one, `redis-server`
must be on PATH and its slots are predicted from the GPUs or `--slots`/`--slot-memory` exactly as its
workers will describe them (`workers.device.slot.cpu_slot_memory`); the resource pool (`--hostfile`,
`--include`, `--exclude`: `scheduler.launch.pool`) must name live slots, and the job keeps to it
(`JobSpec.allowed`); the experiment shape must fit the embedded cluster's pool;
`--min-slot-memory` must leave a slot; last, the job spec is built and the search takes its first step,
which is pure: `autotuning.search`, `tuner_type`, `mp_size`, the micro-batch bounds and, with
`autotuning.model_info`, whether any stage holds the model are decided there.

What only a run can tell is refused later and says so: a model no stage holds once the profile run
measured it, a metric the script never writes, an op that cannot be built. The folders made by then
hold only what was measured, so the next run resumes (or, with `"overwrite": true`, starts afresh).
"""
from __future__ import annotations

import argparse
import math
import os
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil
import redis

from scheduler.cluster.dispatch import refusal
from scheduler.cluster.jobs import JobSpec, TuneSpec, job_id_for
from scheduler.cluster.placement import largest_shape
from scheduler.cluster.progress import search_of
from scheduler.errors import ClusterError, ConfigError, UsageError
from scheduler.inputs.arguments import check_arg_mappings, parse_arg_mappings
from scheduler.inputs.config import TuningConfig, load_config
from scheduler.launch.environment import check_numeric_variables, check_redis_url
from scheduler.launch.hostfile import MAX_SLOTS_PER_HOST, SLOT_WORKER_BYTES, max_local_slots, read_hostfile
from scheduler.launch.pool import PoolRequest, check_counts, select_slots
from workers.device.gpus import GpuListingError, local_gpus, refuse_mig
from scheduler.embedded.local_cluster import redis_server
from workers.state.redis_tls import describe_tls_failure
from workers.state.connection import connect
from workers.state.store import RedisSlotStore
from workers.device.slot import HOST_MEMORY_CAP_ENV, Slot, cpu_slot_memory, parse_size

RUN_TIMEOUT_S = 7 * 24 * 3600.0  #: a real training run: the limit only guards against a hang forever
MAX_EXP_TIMEOUT_S = RUN_TIMEOUT_S  #: --exp-timeout above a week is a typo (and inf hangs the dispatcher)
MAX_NODES = 4096
MIN_SLOT_MEMORY_BYTES = 64 * 2**20  #: less cannot hold a Python interpreter with torch
MAX_MEMORY_BYTES = 2**50
CLUSTER_WAIT_ENV = "AUTOTUNE_CLUSTER_WAIT_S"
#: How long a command waits for a deployed cluster's control worker and slots to register: workers
#: started a moment before the command (`celery ... &` then the command) are still booting.
CLUSTER_WAIT_S = 30.0
CLUSTER_POLL_S = 0.5


@dataclass(frozen=True)
class Checked:
    """What `check` found valid: the config, the script and its arguments, the cluster to use (a
    connected client, or None for an embedded cluster of `len(slots)` workers) and the job it would run."""

    cfg: TuningConfig
    script: Path
    base_args: tuple[str, ...]
    mappings: dict[str, str]
    client: redis.Redis | None
    slots: list[Slot]
    spec: JobSpec
    allowed: list[str] | None = None  #: the resource pool's slot queues (None: every slot)
    workers: int = 0  #: an embedded cluster's slot workers: one per device, the pool restricts their use


def check(args: argparse.Namespace, script_args: list[str]) -> Checked:
    """Every refusal the inputs decide (module docstring), as a UsageError; nothing is created or started."""
    check_numeric_variables(os.environ)
    check_numbers(args)
    url = os.environ.get("AUTOTUNE_REDIS_URL")
    if url:
        check_redis_url(url)
    pool = pool_request(args)
    cfg = load_config(args.config)
    script, base_args = script_of(cfg, script_args)
    mappings = parse_arg_mappings(cfg.ds_config["autotuning"].get("arg_mappings"), str(cfg.path))
    check_arg_mappings(mappings, base_args, str(cfg.path))
    if url:
        client: redis.Redis | None = connect_checked(url)
        slots, allowed = tuning_slots(client, args, pool)
    else:
        client = None
        redis_server()
        workers = embedded_slot_count(args.slots)
        slots, allowed = in_pool(embedded_slots(workers, args.slot_memory), args, pool, socket.gethostname())
    spec = job_spec(cfg, args, script, base_args, mappings, slots, allowed)
    if client is None:
        _check_shape(spec, slots)
    _check_search(spec)
    return Checked(cfg, script, base_args, mappings, client, slots, spec, allowed, 0 if client else workers)


def pool_request(args: argparse.Namespace) -> PoolRequest:
    """--hostfile/--include/--exclude as a resource pool (the hostfile read and checked now)."""
    hostfile = getattr(args, "hostfile", None)
    request = PoolRequest(read_hostfile(hostfile) if hostfile is not None else None, hostfile,
                          getattr(args, "include", "") or "", getattr(args, "exclude", "") or "")
    check_counts(request, args.num_nodes, args.num_gpus)
    return request


def in_pool(slots: list[Slot], args: argparse.Namespace, request: PoolRequest,
            local_node: str) -> tuple[list[Slot], list[str] | None]:
    """The slots of the resource pool with at least --min-slot-memory, and the pool's slot queues
    (None: no pool asked)."""
    pool = select_slots(slots, request, local_node)
    if pool is None:
        return usable_slots(slots, args.min_slot_memory), None
    return usable_slots(pool.slots, args.min_slot_memory), pool.queues


def tuning_slots(client: redis.Redis, args: argparse.Namespace,
                 request: PoolRequest | None = None) -> tuple[list[Slot], list[str] | None]:
    """A deployed (or the started embedded) cluster's slots the job may use, and its pool's queues;
    waits for a cluster still starting: no slot or no control worker registered yet (`wait_for_cluster`).
    `localhost` is AUTOTUNE_NODE, else this host's name, as the workers started here name their node."""
    request = request or pool_request(args)
    local_node = os.environ.get("AUTOTUNE_NODE") or socket.gethostname()
    found: list[tuple[list[Slot], list[str] | None]] = []

    def ready() -> str | None:
        try:
            slots = live_usable_slots(client)
        except ClusterError as exc:  # no slot or no control worker registered yet
            return str(exc)
        found[:] = [in_pool(slots, args, request, local_node)]  # a started cluster: its pool is decided now
        return None

    wait_for_cluster(ready)
    return found[0]


def wait_for_cluster(ready: Callable[[], str | None], wait_s: float | None = None) -> None:
    """Poll `ready` (None: ready, else why not) for up to AUTOTUNE_CLUSTER_WAIT_S seconds (default
    30), saying once what it waits for; then the last reason is the error."""
    limit = float(os.environ.get(CLUSTER_WAIT_ENV) or CLUSTER_WAIT_S) if wait_s is None else wait_s
    deadline = time.monotonic() + limit
    why = ready()
    if why is not None and limit > 0:
        print(f"waiting up to {limit:g}s ({CLUSTER_WAIT_ENV}) for the cluster to start: {why.split(';')[0]}",
              file=sys.stderr, flush=True)
    while why is not None and time.monotonic() < deadline:
        time.sleep(CLUSTER_POLL_S)
        why = ready()
    if why is not None:
        raise ClusterError(why)


def job_spec(cfg: TuningConfig, args: argparse.Namespace, script: Path, base_args: tuple[str, ...],
             mappings: dict[str, str], slots: list[Slot], allowed: list[str] | None = None) -> JobSpec:
    """The tuning job for these slots (within the pool `allowed`): never mixed kinds, sized for the
    smallest slot's memory. Each experiment spans --num_nodes nodes, by default (as in DeepSpeed's
    autotuner) every node of a --hostfile pool, else one."""
    device_kind = "cpu" if all(s.kind == "cpu" for s in slots) else "gpu"
    slots = [s for s in slots if s.kind == ("cpu" if device_kind == "cpu" else "cuda")]
    per_node = max(sum(1 for s in slots if s.node == node) for node in {s.node for s in slots})
    num_gpus = args.num_gpus or per_node
    num_nodes = args.num_nodes or (len({s.node for s in slots}) if getattr(args, "hostfile", None) else 1)
    return JobSpec(
        job=job_id_for(cfg.results_dir), results_root=str(cfg.results_dir.resolve()), cwd=os.getcwd(),
        timeout_s=args.exp_timeout, min_memory=min_memory(args.min_slot_memory), submitted_at=time.time(),
        slot_kind="cpu" if device_kind == "cpu" else "cuda", local_rank_arg=not args.no_local_rank, allowed=allowed,
        tune=TuneSpec(config_path=str(cfg.path), ds_config=cfg.ds_config, exps_dir=str(cfg.exps_dir.resolve()),
                      script=str(script), base_args=list(base_args), mappings=mappings,
                      capacity_bytes=min(s.memory_bytes for s in slots), num_nodes=num_nodes,
                      num_gpus=num_gpus, device_kind=device_kind,
                      concurrency=len(slots) // (num_nodes * num_gpus)))


def _check_search(spec: JobSpec) -> None:
    """Build the job's search and take its first step: pure, and where the search's own settings are
    refused (and, with autotuning.model_info, a model no stage holds)."""
    try:
        next(search_of(spec))
    except StopIteration:
        pass


def _check_shape(spec: JobSpec, slots: list[Slot]) -> None:
    """An embedded cluster is one node of known slots: a shape it cannot hold never could run."""
    assert spec.tune is not None
    nodes, per_node = largest_shape(slots)
    if spec.tune.num_nodes > nodes or spec.tune.num_gpus > per_node:
        shape = {"name": "every experiment", "num_nodes": spec.tune.num_nodes, "num_gpus": spec.tune.num_gpus}
        raise UsageError(f"the embedded cluster has {len(slots)} slot(s) on this machine: "
                         + refusal(shape, slots, spec.slot_kind))


def embedded_slots(count: int, slot_memory: str | None) -> list[Slot]:
    """The slots an embedded cluster of `count` workers will register, as they will describe themselves
    (workers.device.slot.describe_local_slot): the first `count` usable GPUs, else CPU slots of `--slot-memory`
    (or AUTOTUNE_SLOT_MEMORY, which its workers inherit) or RAM / count each."""
    node = socket.gethostname()  # the embedded cluster's node name (scheduler.embedded.local_cluster)
    gpus = local_gpus()
    if gpus is not None:
        return [Slot(node, i, "cuda", gpu.memory_bytes, "127.0.0.1", 1, (), cuda_index=gpu.index)
                for i, gpu in enumerate(gpus[:count])]
    explicit = slot_memory or os.environ.get("AUTOTUNE_SLOT_MEMORY") or None
    try:
        memory = cpu_slot_memory(count, explicit)
    except ValueError as exc:
        raise UsageError(f"AUTOTUNE_SLOT_MEMORY: {exc}") from None
    return [Slot(node, i, "cpu", memory, "127.0.0.1", 1, ()) for i in range(count)]


def live_usable_slots(client: redis.Redis) -> list[Slot]:
    """A deployed cluster's registered slots; it needs a control worker."""
    store = RedisSlotStore(client)
    slots = store.live_slots()
    if not slots:
        raise ClusterError("no slot workers are registered in Redis; start one per device with "
                           "`celery -A tasks worker -Q gpu0 -n gpu0@%h`")
    if not store.control_alive():
        raise ClusterError("no control worker is running; start one with "
                           "`celery -A tasks worker -Q control -n control@%h`")
    return slots


def usable_slots(slots: list[Slot], min_slot_memory: str | None) -> list[Slot]:
    """The slots with at least --min-slot-memory; refused when none has that much."""
    floor = min_memory(min_slot_memory)
    usable = [s for s in slots if s.memory_bytes >= floor]
    if not usable:
        biggest = max(s.memory_bytes for s in slots)
        raise ClusterError(f"--min-slot-memory {min_slot_memory}: no slot has that much; the largest has "
                           f"{biggest / 2**30:.2f} GiB, ask for at most that")
    return usable


def min_memory(min_slot_memory: str | None) -> int:
    """--min-slot-memory in bytes (0: every slot); its bounds were checked by `check_numbers`."""
    return parse_size(min_slot_memory) if min_slot_memory else 0


def script_of(cfg: TuningConfig, script_args: list[str]) -> tuple[Path, tuple[str, ...]]:
    """The training script (after `--`, else autotuning.user_script) and its arguments; it must exist."""
    if script_args:
        script, args = Path(script_args[0]).resolve(), tuple(script_args[1:])
        where = "the command line"
    elif cfg.user_script is not None:
        script, args, where = cfg.user_script, cfg.user_args, f"{cfg.path}: autotuning.user_script"
    else:
        raise ConfigError(f"{cfg.path}: no training script; name it after `--` "
                          "(python -m scheduler.autotune cfg.json -- train.py ...) "
                          "or as autotuning.user_script")
    if not script.is_file():
        raise ConfigError(f"{where}: training script {script} not found; check the path")
    if script.suffix != ".py" and not os.access(script, os.X_OK):
        raise ConfigError(f"{where}: training script {script} is not executable (Permission denied); "
                          "chmod +x it, or name a .py file (run through Python)")
    return script, args


def embedded_slot_count(asked: int | None) -> int:
    """Slot workers of the embedded cluster: one per usable GPU on a GPU machine (more would be CPU
    slots beside GPU ones, or GPUs that do not exist: refused), else `asked` or one per core."""
    try:
        gpus = local_gpus()
    except GpuListingError as exc:
        raise UsageError(str(exc)) from None
    if gpus is None:
        return asked or os.cpu_count() or 1
    if asked is not None and asked > len(gpus):
        raise UsageError(f"--slots {asked}: this machine has {len(gpus)} usable GPU(s) and an embedded cluster "
                         f"gets one slot per GPU; ask for at most {len(gpus)}, or set AUTOTUNE_DEVICE_KIND=cpu "
                         "for CPU slots")
    try:
        refuse_mig(gpus[:asked or len(gpus)])  # the GPUs the embedded cluster's workers will serve
    except GpuListingError as exc:
        raise UsageError(str(exc)) from None
    return asked or len(gpus)


def check_numbers(args: argparse.Namespace) -> None:
    """Every numeric flag within its bounds, each bound stated in the message."""
    most = max_local_slots()
    for flag, value, high, why in (
            ("--slots", args.slots, most, f"this machine can hold at most {most} slot workers "
             f"({SLOT_WORKER_BYTES // 2**20} MiB of RAM each)"),
            ("--num_gpus", args.num_gpus, MAX_SLOTS_PER_HOST, f"a node has at most {MAX_SLOTS_PER_HOST} devices"),
            ("--num_nodes", args.num_nodes, MAX_NODES, f"at most {MAX_NODES} nodes")):
        if value is not None and value < 1:
            raise UsageError(f"{flag} must be at least 1, got {value}")
        if value is not None and value > high:
            raise UsageError(f"{flag} {value}: {why}; ask for at most {high}")
    if getattr(args, "flower", None) is not None and not 1024 <= args.flower <= 65535:
        raise UsageError(f"--flower PORT must be 1024-65535, got {args.flower}")
    if not math.isfinite(args.exp_timeout) or not 0 < args.exp_timeout <= MAX_EXP_TIMEOUT_S:
        raise UsageError(f"--exp-timeout must be a positive number of seconds up to {MAX_EXP_TIMEOUT_S:.0f} "
                         f"(a week), got {args.exp_timeout}")
    total = psutil.virtual_memory().total
    for name, value, low, high in (
            ("--slot-memory", args.slot_memory, MIN_SLOT_MEMORY_BYTES, total),
            ("--host-memory-cap", getattr(args, "host_memory_cap", None), MIN_SLOT_MEMORY_BYTES, MAX_MEMORY_BYTES),
            (HOST_MEMORY_CAP_ENV, os.environ.get(HOST_MEMORY_CAP_ENV) or None, MIN_SLOT_MEMORY_BYTES, MAX_MEMORY_BYTES),
            ("--min-slot-memory", args.min_slot_memory, 1, MAX_MEMORY_BYTES)):
        if value is None:
            continue
        try:
            size = parse_size(value)
        except ValueError as exc:
            raise UsageError(f"{name}: {exc}") from None
        except OverflowError:
            size = high + 1
        if not low <= size <= high:
            raise UsageError(f"{name} {value[:40]}: must be from {low / 2**20:g} MiB to "
                             f"{high / 2**30:.1f} GiB" + (" (this machine's RAM)" if high == total else ""))


def connect_checked(url: str) -> redis.Redis:
    """A client of the cluster's Redis that answered a PING; each way it can refuse is one line."""
    client = connect(url)
    where = f"{client.connection_pool.connection_kwargs.get('host')}:" \
            f"{client.connection_pool.connection_kwargs.get('port')}"
    try:
        client.ping()
    except redis.AuthenticationError:
        raise ClusterError(f"Redis at {where} refused the credentials in AUTOTUNE_REDIS_URL; "
                           "fix the password in the URL") from None
    except redis.ResponseError as exc:
        if "NOAUTH" in str(exc) or "AUTH" in str(exc):
            raise ClusterError(f"Redis at {where} needs a password; put it in AUTOTUNE_REDIS_URL "
                               "as redis://:PASSWORD@host:port/0") from None
        raise ClusterError(f"Redis at {where} answered {exc}") from None
    except redis.RedisError as exc:
        refused = describe_tls_failure(exc)
        if refused:
            raise UsageError(refused) from None
        raise ClusterError(f"cannot reach Redis at {where} (AUTOTUNE_REDIS_URL): {exc}; start "
                           "redis-server there or unset AUTOTUNE_REDIS_URL for an embedded cluster") from None
    return client
