"""One rank of one experiment on this slot: the body of the `run_rank` task.

It prepares the experiment folder, meets the other ranks (rendezvous), runs the user's script
watched (see `workers.launch`), reads the metrics file and returns a JSON record, whose metrics are
the profiled window's mean step time where the script ran under `workers.entry` (see
`workers.step_clock`; the engine's own file times its last step only). It never raises
for anything the experiment does: a record with a failure class is the answer, so the chord's
callback always runs and one bad experiment never stops the others.

Folder written (shared with DeepSpeed's layout): exp.json, ds_config.json, cmd.txt,
stdout.log/stderr.log (rank 0; other ranks rank<N>.stdout.log/.stderr.log), op_prebuild.log/.json
where ops were built, rank<N>.exit.json, and the metrics file the script itself writes (DeepSpeed's
engine does, when `autotuning.enabled`). Every name comes from `workers.layout`, the list
`"overwrite": true` checks a folder against; a name it does not list fails the rank before it runs.
"""
from __future__ import annotations

import json
import logging
import os
import shlex
import socket
import sys
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import psutil
import redis

from workers import keys, layout, rank_claim, rendezvous
from workers.build_locks import clear_stale_locks, default_extensions_dir, rebuild_stale_ops
from workers.device_idle import FreeMemoryWaiter, gpu_wait_s, seconds_setting
from workers.device_memory import EXIT_REPORT_ENV, read_exit_report
from workers.gang import SlotLease
from workers.gpus import memory_used
from workers.failure import KillReason, Status, classify, describe_exit
from workers.metric_check import asked_metric, metrics_problem
from workers.metrics import AutotuningSettings
from workers.oom import aborted_out_of_memory, stderr_out_of_memory
from workers.op_prebuild import PREBUILD_TIMEOUT_S, needed_op_builders, prebuild_ops
from workers.launch_files import LaunchFiles
from workers.launch import MEASURED_GRACE_ENV, MEASURED_GRACE_S, run_watched, tail
from workers.layout import experiment_file, rank_log
from workers.process_identity import RankIdentity, forget_rank, record_rank
from workers.paths import read_json, safe_child, write_atomic, write_json
from workers.redis_tls import TLS_ENV
from workers.shared_memory import remove_rank_segment
from workers.slot import Slot
from workers.slot_health import mark_unhealthy
from workers.step_clock import wall_clock_metrics, window_seconds
from workers.timeline import launch_timeline
from workers.warm_start import WARM, Start

log = logging.getLogger(__name__)
ABORT_TTL_S = 3600
PGID_TTL_S = 7 * 24 * 3600
#: How much of a crashed rank's stderr is read for an out-of-memory traceback: a deep model's
#: traceback through DeepSpeed's hooks runs to a few kB, the allocator's message to 600 bytes.
STDERR_OOM_BYTES = 32_000
#: The worker's own secrets and bindings: a training script has no business with the cluster's Redis
#: (its URL with the password, its TLS client certificate and key) or Flower's settings, which an
#: operator sets on the workers (FLOWER_BASIC_AUTH and any other FLOWER_* option: `PRIVATE_PREFIXES`).
PRIVATE_ENV = frozenset({"AUTOTUNE_REDIS_URL", "AUTOTUNE_SLOT_JSON", "AUTOTUNE_EXIT_WITH_PARENT", *TLS_ENV})
PRIVATE_PREFIXES = ("FLOWER_",)
#: How long a rank waits for others' memory on its GPU to go (workers.device_idle.WAIT_S by default).
GPU_WAIT_ENV = "AUTOTUNE_GPU_WAIT_S"
#: This worker's waits for others' memory on its GPU to go (workers.device_idle), one per process.
FREE_MEMORY = FreeMemoryWaiter(memory_used, wait_s=gpu_wait_s(os.environ.get(GPU_WAIT_ENV)))


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
    """The argv that runs the user's script: Python scripts through `workers.entry` (OOM exit code).
    With `local_rank`, `--local_rank=N` follows the script as DeepSpeed's launcher puts it, so tuned
    runs get exactly the arguments the final `deepspeed` command will give."""
    script, *args = script_argv
    if local_rank is not None:
        args = [f"--local_rank={local_rank}", *args]
    if script.endswith(".py"):
        return [sys.executable, "-m", "workers.entry", script, *args]
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


def run_rank(spec: RankSpec, slot: Slot, client: redis.Redis, task_id: str = "") -> dict[str, Any]:
    """Run one rank and return its record; never raises for anything the experiment does."""
    started = time.time()
    base = {"name": spec.name, "rank": spec.rank, "slot": slot.queue, "node": slot.node,
            "device": slot.device, "worker": slot.worker or socket.gethostname(), "threads": slot.threads}
    refused = "running"  # until claimed: nothing of ours to release
    try:
        refused = rank_claim.claim(client, slot.queue, task_id) if task_id else None
        if refused is not None:  # a redelivered message (workers.rank_claim): never a second copy
            if refused == "lost":
                _signal_abort(client, spec.attempt)  # its peers stop: the launch runs again
            return {**base, **rank_claim.refused_record(refused)}
        return {**base, **_run(spec, slot, client, task_id)}
    except Exception as exc:  # a bug or fault of ours: still a record, so the chord completes
        _signal_abort(client, spec.attempt)
        return {**base, "status": Status.CRASHED.value, "exit": "not started",
                "error": f"{type(exc).__name__}: {exc}", "started_at": started,
                "ended_at": time.time(), "wall_s": time.time() - started, "peak_rss_bytes": 0}
    finally:
        if task_id and refused != "running":
            rank_claim.release(client, slot.queue, task_id)


def _record_group(client: redis.Redis, pgid_key: str, queue: str, task_id: str, pgid: int) -> None:
    """Where the slot's clean-ups (`keys.pgid`) and a redelivery of this task (its claim) find the group."""
    client.set(pgid_key, pgid, ex=PGID_TTL_S)
    if task_id:
        rank_claim.note_group(client, queue, task_id, pgid)


def _run(spec: RankSpec, slot: Slot, client: redis.Redis, task_id: str) -> dict[str, Any]:
    if spec.gang_token and client.get(keys.gang(slot.queue)) != spec.gang_token.encode():
        # Redelivered long after its launch was given up (a worker died holding the message):
        # running it now would overwrite the folder of a newer launch of the same experiment.
        now = time.time()
        return {"status": Status.LOST.value, "stale": True, "exit": "not started",
                "error": "the reservation of this launch is gone", "started_at": now,
                "ended_at": now, "wall_s": 0.0, "peak_rss_bytes": 0}
    result_dir = spec.result_dir
    result_dir.mkdir(parents=True, exist_ok=True)
    files = LaunchFiles.of(result_dir, spec.attempt, spec.metric_file)  # this launch's own (workers.launch_files)
    metric_path = files.metric_path
    shared_config, ds_config = files.write_configs(spec.ds_config)
    command = script_command(files.argv(spec.script_argv), spec.local_rank if spec.local_rank_arg else None)
    describe = _Description(result_dir, spec, shared_config,
                            script_command(spec.script_argv, spec.local_rank if spec.local_rank_arg else None))
    if spec.rank == 0:
        metric_path.unlink(missing_ok=True)

    stop_check = _StopCheck(client, keys.abort(spec.attempt), slot.queue, spec.gang_token, spec.lease_s)
    on_gpu = slot.kind == "cuda" and slot.cuda_index >= 0
    device_wait = FREE_MEMORY.wait(slot.nvidia_smi_id, stop_check) if on_gpu else None
    if device_wait is not None and device_wait.busy:  # not started beside others: workers.slot_health
        _take_out_of_tuning(client, slot, device_wait.used_bytes or 0, "before a launch")
        _signal_abort(client, spec.attempt)
        describe()
        now = time.time()
        return {"status": Status.GPU_BUSY.value, "exit": "not started", "started_at": now, "ended_at": now,
                "wall_s": 0.0, "peak_rss_bytes": 0, "device_foreign_bytes": device_wait.used_bytes,
                "device_wait_s": device_wait.waited_s,
                "error": f"other processes held {(device_wait.used_bytes or 0) / 2**30:.1f} GiB of GPU "
                         f"{slot.cuda_index} after a {device_wait.waited_s:.0f}s wait"}
    master = _meet(spec, slot, client, stop_check)
    if master is None:
        describe()
        now = time.time()
        return {"status": Status.RENDEZVOUS_FAILED.value, "exit": "not started",
                "error": f"no address from rank 0 within {spec.rendezvous_timeout_s:.0f}s",
                "started_at": now, "ended_at": now, "wall_s": 0.0, "peak_rss_bytes": 0}

    stderr_path = experiment_file(result_dir, rank_log(spec.rank, "stderr"))
    exit_report = files.exit_report(spec.rank)
    exit_report.unlink(missing_ok=True)
    pgid_key = keys.pgid(slot.queue, task_id or spec.attempt)
    cwd = spec.cwd if spec.cwd and os.path.isdir(spec.cwd) else os.getcwd()
    env = rank_env(spec, slot, master, exit_report)
    clear_stale_locks(env["TORCH_EXTENSIONS_DIR"])  # a build killed with an earlier experiment
    rebuild_stale_ops(env["TORCH_EXTENSIONS_DIR"], env.get("PATH"), stop_check)  # outside the memory cap
    builders = needed_op_builders(ds_config)
    prebuild_log = experiment_file(result_dir, rank_log(spec.rank, "op_prebuild"))
    prebuild_failed = prebuild_ops(builders, _build_env(env, slot), prebuild_log,
                                   stop_check, on_start=lambda pgid: _record_group(client, pgid_key, slot.queue, task_id, pgid))
    if builders and not _ops_ready_everywhere(spec, client, stop_check):
        client.delete(pgid_key)
        describe()
        now = time.time()
        return {"status": Status.ABORTED.value, "exit": "not started", "started_at": now, "ended_at": now,
                "wall_s": 0.0, "peak_rss_bytes": 0, "error": "stopped while the ops DeepSpeed needs were built"}
    start = Start()  # warm or cold, and why (workers.warm_start)
    identity = RankIdentity(slot.queue, spec.job, spec.name, spec.rank, spec.world_size, spec.attempt)
    script_argv = command[3:] if command[1:3] == ["-m", "workers.entry"] else command
    # The wait for the warm process (its preload) is taken from the time limit, as a cold rank's imports are.
    warm_wait_s = WARM.prepare(script_argv, env, cwd, slot.kind, spec.timeout_s, start, stop_check.slot_taken)
    try:
        launch = run_watched(
            command, env=env, cwd=cwd, spawn=WARM.spawn_for(script_argv, env, slot.kind, slot.cpus, start, stop_check.slot_taken),
            stdout_path=experiment_file(result_dir, rank_log(spec.rank, "stdout")), stderr_path=stderr_path,
            timeout_s=spec.timeout_s - warm_wait_s, memory_cap_bytes=slot.host_memory_cap, cpus=slot.cpus,
            should_abort=stop_check,
            on_start=lambda pgid: (_record_group(client, pgid_key, slot.queue, task_id, pgid),
                                   record_rank(client, task_id or spec.attempt, identity, pgid, PGID_TTL_S), describe()),
            title=identity.title(),  # what `ps` shows the rank as (workers.process_identity)
            measured=_Measured(client, keys.measured(spec.attempt),
                               metric_path if spec.rank == 0 and spec.metric_file else None),
            measured_grace_s=seconds_setting(os.environ.get(MEASURED_GRACE_ENV), MEASURED_GRACE_S),
        )
    finally:
        forget_rank(client, slot.queue, task_id or spec.attempt)
        remove_rank_segment(master[0], master[1], spec.rank)  # DeepSpeed's CPU all-reduce never does
        describe()  # where the script did not start
    report = read_exit_report(exit_report)  # final: the rank's whole group has ended
    WARM.learn(script_argv, report.get("imported"), stop_check.slot_taken, report.get("imported_count"))  # the next rank's
    # The slot is freed only with its GPU back to idle: a context torn down slowly is waited for;
    # memory still held after the wait is someone else's, and the slot leaves tuning until it goes.
    device_after = FREE_MEMORY.wait(slot.nvidia_smi_id, stop_check.slot_taken) if on_gpu else None
    if device_after is not None and device_after.busy:
        _take_out_of_tuning(client, slot, device_after.used_bytes or 0, "after a run")

    expects_metrics = spec.rank == 0 and bool(spec.metric_file)
    metrics = read_json(metric_path) if expects_metrics else None
    has_metrics = isinstance(metrics, dict)
    # A warm rank whose warm process died under it ended unseen: the launch is lost, not the config's.
    status = Status.LOST if start.lost else classify(launch.exit_code, launch.killed_for, expects_metrics, has_metrics)
    oom_in_stderr = stderr_out_of_memory(tail(stderr_path, STDERR_OOM_BYTES)) if status is Status.CRASHED else None
    oom_in_counts, probable_oom = aborted_out_of_memory(launch.exit_code, report) \
        if status is Status.CRASHED and not oom_in_stderr else (None, None)
    if oom_in_stderr or oom_in_counts:  # a wrapper's script, or an abort: no exception reached us (workers.oom)
        status = Status.OOM
    problem = metrics_problem(metrics, spec.metric_file, asked_metric(spec.ds_config)) if has_metrics else None
    if status is Status.OK and problem:
        status = Status.BAD_METRICS
    if status is not Status.OK:
        _signal_abort(client, spec.attempt)
    record = {
        "status": status.value, "exit": describe_exit(launch.exit_code),
        "exit_code": launch.exit_code, "started_at": launch.started_at,
        "ended_at": launch.ended_at, "wall_s": round(launch.wall_s, 3),
        "peak_rss_bytes": launch.peak_rss_bytes,
        "memory_cap_bytes": slot.host_memory_cap,
        "master": f"{master[0]}:{master[1]}", "start_path": start.path,
        **({"cold_because": start.why_cold} if start.why_cold else {}),
        **report,
    }
    step_ends = record.pop("step_ends", None)
    record.pop("imported", None)  # the warm process's business (workers.warm_start), not the record's
    record.pop("imported_count", None)
    record["timeline"] = launch_timeline(launch.started_at, launch.ended_at, record.pop("moments", None), step_ends,
                                         spec.ds_config)
    if slot.kind == "cuda":
        record["cuda_index"] = slot.cuda_index
        if env.get("NCCL_SOCKET_IFNAME"):
            record["nccl_socket_ifname"] = env["NCCL_SOCKET_IFNAME"]  # cmd_optimal.txt sets it alike
    if device_wait is not None and device_wait.foreign_bytes is not None:
        record.update(device_foreign_bytes=device_wait.foreign_bytes, device_wait_s=device_wait.waited_s)
    if device_after is not None and device_after.busy:  # may have been there during the run too
        record["device_foreign_after_bytes"] = device_after.used_bytes
    if problem:
        record["error"] = problem
    elif status is Status.NO_METRICS:
        record["error"] = f"exited 0 without writing its metrics file {metric_path}"
    elif has_metrics:
        record.update(timed_metrics(metrics, step_ends, spec.ds_config))
        record["metrics_at"] = metric_path.stat().st_mtime  # a later failure did not spoil them
    if launch.start_error:
        record["error"] = launch.start_error
    if prebuild_failed:  # advisory: the script may not need the op (workers.op_prebuild)
        record["op_prebuild_failed"] = prebuild_failed
    if launch.killed_for is KillReason.MEASURED:  # hung at exit: stopped, its measurement kept
        record["stopped_after_measuring"] = True
    if oom_in_stderr:
        record["oom"] = oom_in_stderr[:500]
        record["oom_from"] = "stderr"
    elif oom_in_counts:
        record.update(oom=oom_in_counts, oom_from="allocator counts")
    elif probable_oom:
        record["probable_oom"] = probable_oom
    if status is not Status.OK:
        record["stderr_tail"] = tail(stderr_path, 2000)
    return record


def timed_metrics(metrics: dict[str, Any], step_ends: list[list[float]] | None,
                  ds_config: dict[str, Any]) -> dict[str, Any]:
    """The record's metric fields. Where the rank noted when its optimizer steps ended, the metrics
    are the profiled window's mean step time (`workers.step_clock`: the engine's own file times the
    last step only), with the engine's figures and the window's step times kept beside them."""
    settings = AutotuningSettings.from_ds_config(ds_config)
    durations = window_seconds(step_ends or [], settings.start_profile_step, settings.end_profile_step)
    if not durations:
        return {"metrics": metrics}
    return {"metrics": wall_clock_metrics(metrics, durations), "engine_metrics": metrics,
            "step_seconds": [round(duration, 4) for duration in durations]}


class _Description:
    """Rank 0 writes the experiment's exp.json and cmd.txt once its script has started (or failed to):
    nothing the script reads, so not on the way between one experiment's end and the next's start
    (bench/dispatch_overhead.py); every other rank writes nothing. Called again, it does nothing."""

    def __init__(self, result_dir: Path, spec: RankSpec, ds_config: dict[str, Any], command: list[str]) -> None:
        self._result_dir, self._spec, self._ds_config, self._command = result_dir, spec, ds_config, command
        self._done = spec.rank != 0

    def __call__(self) -> None:
        if self._done:
            return
        self._done = True
        write_json(experiment_file(self._result_dir, layout.EXP_JSON), {**self._spec.exp, "ds_config": self._ds_config})
        write_atomic(experiment_file(self._result_dir, layout.CMD), shlex.join(self._command) + "\n")


class _Measured:
    """Polled while the script runs: whether this launch has its measurement, after which a rank
    still running is hung at exit (`workers.launch.MEASURED_GRACE_S`). Rank 0 looks for its metrics
    file (removed before the script started, so one there is this launch's) and tells the other ranks
    through Redis; they read that flag. A Redis outage only delays the news."""

    def __init__(self, client: redis.Redis, key: str, metric_path: Path | None) -> None:
        self._client, self._key, self._metric_path = client, key, metric_path
        self._seen = self._told = False

    def __call__(self) -> bool:
        try:
            if self._metric_path is None:
                self._seen = self._seen or bool(self._client.exists(self._key))
            else:
                self._seen = self._seen or self._metric_path.exists()
                if self._seen and not self._told:
                    self._client.set(self._key, 1, ex=ABORT_TTL_S)
                    self._told = True
        except redis.RedisError:
            pass
        return self._seen


class _StopCheck:
    """Polled while the script runs: stop when a peer rank failed, and keep this slot's lease alive.

    Renewal happens here, in the rank, rather than in a scheduler process: the lease then lapses
    exactly when the rank's worker or node is gone, which is what frees the slot and tells the
    control worker's sweep that the experiment was lost. A Redis outage is not a reason to stop.
    """

    def __init__(self, client: redis.Redis, abort_key: str, queue: str, token: str, lease_s: float) -> None:
        self._client, self._abort_key = client, abort_key
        self._lease = SlotLease(client, queue, token, lease_s) if token else None

    def __call__(self) -> bool:
        try:
            return self.slot_taken() or bool(self._client.exists(self._abort_key))
        except redis.RedisError:
            return False

    def slot_taken(self) -> bool:
        """Renew the lease when due; True when another launch owns the slot now (this one was given
        up). The check for after the run, when a failed peer no longer matters."""
        try:
            return self._lease is not None and self._lease.renew()
        except redis.RedisError:  # tried again at a later poll (workers.gang.SlotLease)
            return False


def _meet(spec: RankSpec, slot: Slot, client: redis.Redis, stop_check: _StopCheck) -> tuple[str, int] | None:
    if spec.world_size == 1:
        return slot.address, rendezvous.free_port(slot.address)
    if spec.rank == 0:
        port = rendezvous.free_port(slot.address)
        rendezvous.publish(client, spec.attempt, slot.address, port, spec.world_size - 1)
        return slot.address, port
    return rendezvous.wait(client, spec.attempt, spec.rendezvous_timeout_s, keep_alive=stop_check,
                           every_s=max(1.0, spec.lease_s / 3))


def _build_env(env: dict[str, str], slot: Slot) -> dict[str, str]:
    """The rank's environment for building its ops: as many compiler jobs as the slot has cores."""
    return {"MAX_JOBS": str(len(slot.cpus)), **env} if slot.cpus else env


def _ops_ready_everywhere(spec: RankSpec, client: redis.Redis, stop_check: _StopCheck) -> bool:
    """After this rank's ops are built: wait until every rank's are, so the scripts start together
    and no rank's time limit runs while a peer node compiles. False when the launch was stopped or
    a peer never got there."""
    if spec.world_size == 1:
        return not stop_check()
    return rendezvous.all_arrived(client, f"{spec.attempt}:ops", spec.world_size, PREBUILD_TIMEOUT_S + 60,
                                  keep_alive=stop_check)


def _take_out_of_tuning(client: redis.Redis, slot: Slot, used_bytes: int, why: str) -> None:
    """Mark the slot (workers.slot_health); Redis being away loses the mark, never the record."""
    try:
        mark_unhealthy(client, slot.queue, used_bytes, why)
    except redis.RedisError as exc:
        log.warning("slot %s: could not take it out of tuning (%s): %s", slot.queue, why, exc)


def _signal_abort(client: redis.Redis, attempt: str) -> None:
    try:
        client.set(keys.abort(attempt), "1", ex=ABORT_TTL_S)
    except redis.RedisError:
        pass


def slot_from_env() -> Slot:
    """The slot this worker serves, as its main process described it before forking the pool."""
    return Slot.from_redis(json.loads(os.environ["AUTOTUNE_SLOT_JSON"]))
