"""What `python -m deploy` does on which host, decided without touching a network or a process.

Why a separate module: choosing the workers of a hostfile selection, building the argv each host
runs, checking the Redis URL and picking the process groups to clean up are decisions that must be
right on a cluster nobody can test on; as pure functions they are unit-tested here, and the fabric
layer (`deploy.fabric_hosts`) only carries their results over SSH.
"""
from __future__ import annotations

import shlex
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scheduler.cluster.jobs import job_id_for
from scheduler.errors import UsageError
from workers.state import keys, redis_url
from workers.process.process_identity import RankProcess
from workers.state.redis_url import REDIS_URL_VARIABLE
from workers.device.slot import parse_queue, slot_queue
from scheduler.embedded.worker_command import control_names, slot_names

LOCAL_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


@dataclass(frozen=True)
class WorkerPlan:
    """One long-running process `deploy up` starts on a host: a slot worker, the control worker or
    Flower. `label` names its pidfile and log on that host; it carries the node name, so hosts that
    share a home directory (NFS) never share a pidfile."""

    host: str
    role: str  #: "slot" | "control" | "flower"
    label: str
    queue: str = ""
    name: str = ""
    device: int | None = None

    @property
    def slot(self) -> str:
        """The queue this slot worker serves once started (`<node>.gpu<i>`); empty for others."""
        return slot_queue(self.host, self.device) if self.role == "slot" and self.device is not None else ""


def plan_workers(hosts: Mapping[str, Sequence[int]], control_host: str | None = None,
                 flower: bool = False) -> list[WorkerPlan]:
    """One slot worker per selected device (`-Q gpu<i> -n gpu<i>@<host>`), in hostfile order; the
    control worker (and Flower next to it) on `control_host` when one is asked for."""
    plans = [WorkerPlan(host, "slot", slot_queue(host, device), *slot_names(device, host), device=device)
             for host, devices in hosts.items() for device in devices]
    if control_host is not None:
        plans.append(WorkerPlan(control_host, "control", f"{control_host}.control",
                                *control_names(control_host)))
        if flower:
            plans.append(WorkerPlan(control_host, "flower", f"{control_host}.flower"))
    elif flower:
        raise UsageError("--flower runs next to the control worker: add --control HOST")
    return plans


def by_host(plans: Iterable[WorkerPlan]) -> dict[str, list[WorkerPlan]]:
    grouped: dict[str, list[WorkerPlan]] = {}
    for plan in plans:
        grouped.setdefault(plan.host, []).append(plan)
    return grouped


def check_redis_url(url: str | None, source: str = REDIS_URL_VARIABLE) -> str:
    """The cluster's Redis URL, or a UsageError naming what is wrong and how to fix it
    (`workers.state.redis_url`'s rules). The policy of a cluster of hosts: no unix socket (it is one
    machine's), no empty password (`redis://:@host`, what an unset `$REDIS_PASSWORD` expands to,
    would connect to a Redis that has no password at all)."""
    try:
        return redis_url.check_redis_url(url, source, allow_unix=False, allow_empty_password=False)
    except redis_url.RedisUrlError as exc:
        raise UsageError(str(exc)) from None


def remote_command(python: str, repo: str, action: str, options: Sequence[str] = ()) -> str:
    """The shell line a host runs for `deploy.remote <action>`: every word quoted, nothing secret
    (the Redis URL travels in a 0600 environment file, never on a command line)."""
    argv = [python, "-m", "deploy.remote", action, *options]
    return f"cd {shlex.quote(repo)} && {shlex.join(argv)}"


def up_request(plans: Sequence[WorkerPlan], env: Mapping[str, str],
               flower_port: int | None = None) -> dict[str, object]:
    """The JSON one host's `deploy.remote up` reads on stdin: secrets and the processes to start."""
    workers = []
    for plan in plans:
        worker: dict[str, object] = {"role": plan.role, "label": plan.label, "node": plan.host}
        if plan.role == "slot":
            worker["device"] = plan.device
        if plan.role == "flower":
            worker["port"] = flower_port
        workers.append(worker)
    return {"env": dict(env), "workers": workers}


@dataclass(frozen=True)
class RecordedGroup:
    """A training process group a rank recorded in Redis: where it runs and what proves it is ours."""

    node: str
    queue: str
    pgid: int
    experiment: str
    started: int | None = None  #: its leader's start time (`workers.process.process_identity`); None: pgid only


def cleanup_scope(target: str, running: Mapping[str, Mapping[str, dict]],
                  job_of_folder: Callable[[str], str] = lambda folder: job_id_for(Path(folder))) -> tuple[str, str | None]:
    """(job id, experiment or None for all of the job's) that a cleanup target names: `JOB` or
    `JOB:EXPERIMENT`, JOB a job id or a tuning job's results folder (its id is made from the folder).
    Never an experiment alone: names like z1_gas1_tmbspg4 repeat across jobs (other users' too),
    so a bare name running in some job is refused with the jobs that run it."""
    job, _, experiment = target.rpartition(":") if ":" in target else (target, "", "")
    if job not in running and job and Path(job).is_dir():
        job = job_of_folder(job)
    if job in running:
        return job, experiment or None
    holders = sorted(name for name, launches in running.items() if target in launches)
    if holders:
        raise UsageError(f"{target} names an experiment, and experiment names repeat across jobs: name its job, "
                         f"python -m deploy cleanup JOB:{target} (it runs in job(s) {', '.join(holders)})")
    return job, experiment or None


def launches_matching(running: Mapping[str, Mapping[str, dict]], target: str) -> list[tuple[str, dict]]:
    """(experiment, launch) pairs of `running` ({job: {experiment: launch}}) that `target` names
    (`cleanup_scope`): one job's running experiments, or one of them; never another job's."""
    job, experiment = cleanup_scope(target, running)
    return [(name, launch) for name, launch in running.get(job, {}).items() if experiment in (None, name)]


def recorded_groups(launches: Iterable[tuple[str, dict]], recorded: Mapping[str, Any]) -> list[RecordedGroup]:
    """The groups of these launches that their slots recorded (`recorded`: key -> value, as the
    slots' store reads them, `workers.state.store.BaseSlotStore.read_rank_groups`): a rank's record
    (`keys.rank_process`: its pgid and start time) where there is one, else its bare pgid
    (`keys.pgid`: an op build before the script started)."""
    groups = []
    for name, launch in launches:
        for queue, task_id in sorted(launch.get("rank_tasks", {}).items()):
            parsed = parse_queue(queue)
            if parsed is None or parsed[0] is None:
                continue
            record = recorded.get(keys.rank_process(queue, task_id))
            process = RankProcess.from_json(record) if record else None
            if process is not None:
                groups.append(RecordedGroup(parsed[0], queue, process.pgid, name, process.started or None))
            elif recorded.get(keys.pgid(queue, task_id)):
                groups.append(RecordedGroup(parsed[0], queue, int(recorded[keys.pgid(queue, task_id)]), name))
    return groups


def kill_options(groups: Sequence[RecordedGroup], grace_s: float) -> list[str]:
    """Options of `deploy.remote kill-groups`: each group as QUEUE=PGID, with @STARTED where its
    leader's start time is recorded, so the host checks the group is still that rank (a reused PID
    is never killed)."""
    return ["--grace", f"{grace_s:g}",
            *[f"{g.queue}={g.pgid}" + (f"@{g.started}" if g.started else "") for g in groups]]


def is_local(host: str, local_names: Iterable[str]) -> bool:
    """Whether `host` is this machine (its processes are handled without SSH)."""
    return host in LOCAL_NAMES or host in set(local_names)


def registration_report(plans: Sequence[WorkerPlan], registered: Iterable[str],
                        host_errors: Mapping[str, str], exits: Mapping[str, str]) -> list[str]:
    """One line per host: all its slots registered, or which did not and why.

    `host_errors`: host -> why nothing could be started there (SSH); `exits`: slot queue -> why its
    worker ended (the last line of its log)."""
    live = set(registered)
    lines = []
    for host, host_plans in by_host(plans).items():
        slots = [p.slot for p in host_plans if p.role == "slot"]
        if host in host_errors:
            lines.append(f"{host}: FAILED: {host_errors[host]}")
            continue
        missing = [s for s in slots if s not in live]
        if not missing:
            extra = [p.role for p in host_plans if p.role != "slot"]
            lines.append(f"{host}: ok: {len(slots)} slot(s) registered ({', '.join(slots) or '-'})"
                         + (f"; {' and '.join(extra)} started" if extra else ""))
        else:
            why = "; ".join(f"{s}: {exits.get(s, 'not registered yet (still starting, or cannot reach Redis)')}"
                            for s in missing)
            lines.append(f"{host}: FAILED: {len(missing)} of {len(slots)} slot(s) not registered: {why}")
    return lines
