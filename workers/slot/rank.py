"""One rank of one experiment on this slot: the body of the `run_rank` task.

It prepares the experiment folder, meets the other ranks (rendezvous), runs the user's script
watched (see `workers.process.launch`), reads the metrics file and returns a JSON record, whose metrics are
the profiled window's mean step time where the script ran under `workers.in_rank.entry` (see
`workers.in_rank.step_clock`; the engine's own file times its last step only). It never raises
for anything the experiment does: a record with a failure class is the answer, so the chord's
callback always runs and one bad experiment never stops the others.

Folder written (shared with DeepSpeed's layout): ds_config.json, and under the launch's own name
(`workers.process.launch_files`: two launches of one experiment can run at once) its config, exp.json and
cmd.txt (rank 0), stdout/stderr logs (rank 0 `stderr.<launch>.log`; other ranks
`rank<N>.stderr.<launch>.log`), op_prebuild's log and report where ops were built, the exit report,
and the metrics file the script itself writes (DeepSpeed's engine does, when `autotuning.enabled`);
the plain names (exp.json, stdout.log, ...) show the counted launch's. Every name comes from
`workers.files.layout`, the list `"overwrite": true` checks a folder against; a name it does not list
fails the rank before it runs.

Here: the task's body, as stages (`_RankStages`). What a rank is given is `workers.slot.rank_spec`, how
it keeps in touch with its peers `workers.slot.rank_peers`, its record `workers.slot.rank_record`.
"""
from __future__ import annotations

import json
import logging
import os
import shlex
import socket
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil
import redis

from workers.state import keys
from workers.files import layout
from workers.slot import rank_claim
from workers.slot.build_locks import clear_stale_locks, rebuild_stale_ops
from workers.device.device_idle import FreeMemoryWaiter, Wait, gpu_wait_s, seconds_setting
from workers.in_rank.device_memory import read_exit_report
from workers.device.gpus import memory_used
from workers.in_rank.failure import Status
from workers.slot.op_prebuild import needed_op_builders, prebuild_ops
from workers.process.launch_files import LaunchFiles
from workers.process.launch import MEASURED_GRACE_ENV, MEASURED_GRACE_S, run_watched
from workers.process.process_identity import RankIdentity, forget_rank, record_rank, write_record
from workers.files.paths import write_atomic, write_json
from workers.slot.rank_peers import Measured, StopCheck, meet_peers, ops_ready_everywhere, signal_abort
from workers.slot.rank_record import RankRun, outcome, rank_record
from workers.slot.records import RankRecord, not_started
from workers.slot.rank_spec import RankSpec, rank_env, script_command
from workers.process.shared_memory import remove_rank_segment
from workers.device.slot import Slot
from workers.state.store import RedisSlotStore
from workers.warm.rank_start import Start
from workers.warm.warm_start import WARM

log = logging.getLogger(__name__)
PGID_TTL_S = 7 * 24 * 3600
#: What an older launch's rank still on the slot gets between SIGTERM and SIGKILL (`rank_claim.end_older_launches`).
OLDER_LAUNCH_GRACE_S = 2.0
#: How long a rank waits for others' memory on its GPU to go (workers.device.device_idle.WAIT_S by default).
GPU_WAIT_ENV = "AUTOTUNE_GPU_WAIT_S"
#: This worker's waits for others' memory on its GPU to go (workers.device.device_idle), one per process.
FREE_MEMORY = FreeMemoryWaiter(memory_used, wait_s=gpu_wait_s(os.environ.get(GPU_WAIT_ENV)))


def run_rank(spec: RankSpec, slot: Slot, client: redis.Redis, task_id: str = "") -> dict[str, Any]:
    """Run one rank and return its record; never raises for anything the experiment does."""
    started = time.time()
    identity = {"name": spec.name, "rank": spec.rank, "slot": slot.queue, "node": slot.node,
                "device": slot.device, "worker": slot.worker or socket.gethostname(), "threads": slot.threads}
    refused = "running"  # until claimed: nothing of ours to release
    try:
        refused = rank_claim.claim(client, slot.queue, task_id) if task_id else None
        if refused is not None:  # a redelivered message (workers.slot.rank_claim): never a second copy
            if refused == "lost":
                signal_abort(client, spec.attempt)  # its peers stop: the launch runs again
            return replace(rank_claim.refused_record(refused), **identity).to_json()
        return replace(_run(spec, slot, client, task_id), **identity).to_json()
    except Exception as exc:  # a bug or fault of ours: still a record, so the chord completes
        signal_abort(client, spec.attempt)
        ended = not_started(Status.CRASHED, f"{type(exc).__name__}: {exc}", started_at=started)
        return replace(ended, **identity).to_json()
    finally:
        if task_id and refused != "running":
            rank_claim.release(client, slot.queue, task_id)


def record_started(client: redis.Redis, task_id: str, identity: RankIdentity, pgid: int,
                   stop_check: StopCheck) -> None:
    """A group the rank started (an op build's or the script's): where the slot's clean-ups
    (`keys.pgid`, and `keys.rank_process` with its leader's start time, which recognises a group
    that carries no rank title, as an op build's does), a later launch on the slot and a redelivery
    of this task (its claim) find it; `stop_check` writes the record again while the group runs."""
    record = record_rank(client, task_id or identity.launch, identity, pgid, PGID_TTL_S)
    stop_check.keep_record(lambda: write_record(client, task_id or identity.launch, record, PGID_TTL_S))
    if task_id:
        rank_claim.note_group(client, identity.slot, task_id, pgid)


def _run(spec: RankSpec, slot: Slot, client: redis.Redis, task_id: str) -> RankRecord:
    """The rank after its claim, stage by stage (`_RankStages`); a stage that stops it returns its record."""
    if spec.gang_token and not RedisSlotStore(client).holds([slot.queue], spec.gang_token):
        # Redelivered long after its launch was given up (a worker died holding the message):
        # running it now would overwrite the folder of a newer launch of the same experiment.
        return not_started(Status.LOST, "the reservation of this launch is gone", stale=True)
    try:
        ended = rank_claim.end_older_launches(client, slot.queue, spec.attempt, OLDER_LAUNCH_GRACE_S)
    except (redis.RedisError, psutil.Error, OSError) as exc:  # best effort: never a reason to fail the rank
        log.warning("%s: could not check %s for an older launch's ranks: %s", spec.name, slot.queue, exc)
        ended = []
    if ended:
        log.warning("%s: ended %d process(es) an older launch left on %s before this rank started: %s",
                    spec.name, len(ended), slot.queue, ended)
    stages = _RankStages(spec, slot, client, task_id)
    stages.set_up()
    for stage in (stages.wait_for_gpu, stages.meet, stages.build_ops):
        stopped = stage()
        if stopped is not None:
            return stopped
    run = stages.run_script()
    ended = outcome(spec, run)
    if ended.status is not Status.OK:
        signal_abort(client, spec.attempt)
    return rank_record(spec, slot, run, ended)


class _RankStages:
    """One rank's stages, in order: `set_up`, `wait_for_gpu`, `meet`, `build_ops`, `run_script`.
    Those that can stop the rank return its `not_started` record (None: go on); what a stage leaves
    for the next is kept here."""

    result_dir: Path
    files: LaunchFiles
    metric_path: Path
    ds_config: dict[str, Any]  #: this launch's own config (its metric file in its own name)
    command: list[str]
    describe: _Description
    stop_check: StopCheck
    on_gpu: bool
    device_wait: Wait | None
    master: tuple[str, int]
    stderr_path: Path
    exit_report: Path
    identity: RankIdentity  #: what `ps` shows and the slot records of this rank (workers.process.process_identity)
    cwd: str
    env: dict[str, str]
    prebuild_failed: str | None

    def __init__(self, spec: RankSpec, slot: Slot, client: redis.Redis, task_id: str) -> None:
        self.spec, self.slot, self.client, self.task_id = spec, slot, client, task_id

    def set_up(self) -> None:
        """The experiment folder, this launch's own config and metric file, the script's argv."""
        spec, slot, client = self.spec, self.slot, self.client
        result_dir = self.result_dir = spec.result_dir
        result_dir.mkdir(parents=True, exist_ok=True)
        # this launch's own config, metric file and exit reports (workers.process.launch_files)
        files = self.files = LaunchFiles.of(result_dir, spec.attempt, spec.metric_file)
        metric_path = self.metric_path = files.metric_path
        shared_config, self.ds_config = files.write_configs(spec.ds_config)
        self.command = script_command(files.argv(spec.script_argv), spec.local_rank if spec.local_rank_arg else None)
        self.describe = _Description(files, spec, shared_config,
                                     script_command(spec.script_argv, spec.local_rank if spec.local_rank_arg else None))
        if spec.rank == 0:
            metric_path.unlink(missing_ok=True)

        self.stop_check = StopCheck(client, keys.abort(spec.attempt), slot.queue, spec.gang_token, spec.lease_s)

    def wait_for_gpu(self) -> RankRecord | None:
        """Wait for others' memory on the slot's GPU to go; a rank is not started beside it."""
        spec, slot, client = self.spec, self.slot, self.client
        self.on_gpu = slot.kind == "cuda" and slot.cuda_index >= 0
        device_wait = self.device_wait = FREE_MEMORY.wait(slot.nvidia_smi_id, self.stop_check) if self.on_gpu else None
        if device_wait is not None and device_wait.busy:  # not started beside others: workers.state.slot_health
            _take_out_of_tuning(client, slot, device_wait.used_bytes or 0, "before a launch")
            signal_abort(client, spec.attempt)
            self.describe()
            held = f"{(device_wait.used_bytes or 0) / 2**30:.1f} GiB of GPU {slot.cuda_index}"
            return not_started(Status.GPU_BUSY, f"other processes held {held} after a {device_wait.waited_s:.0f}s wait",
                               device_foreign_bytes=device_wait.used_bytes, device_wait_s=device_wait.waited_s)
        return None

    def meet(self) -> RankRecord | None:
        """Meet the launch's other ranks (`workers.slot.rank_peers.meet_peers`)."""
        spec = self.spec
        master = meet_peers(spec, self.slot, self.client, self.stop_check)
        if master is None:
            self.describe()
            why = f"no address from rank 0 within {spec.rendezvous_timeout_s:.0f}s"
            return not_started(Status.RENDEZVOUS_FAILED, why)
        self.master = master
        return None

    def build_ops(self) -> RankRecord | None:
        """The rank's environment, and the ops DeepSpeed will need, built on every rank before any
        script starts (`workers.slot.op_prebuild`)."""
        spec, slot, client, task_id = self.spec, self.slot, self.client, self.task_id
        stop_check = self.stop_check
        self.stderr_path = self.files.log(spec.rank, "stderr")  # this launch's own: its failure class is read there
        exit_report = self.exit_report = self.files.exit_report(spec.rank)
        exit_report.unlink(missing_ok=True)
        identity = self.identity = RankIdentity(slot.queue, spec.job, spec.name, spec.rank, spec.world_size,
                                                spec.attempt)
        self.cwd = spec.cwd if spec.cwd and os.path.isdir(spec.cwd) else os.getcwd()
        env = self.env = rank_env(spec, slot, self.master, exit_report)
        clear_stale_locks(env["TORCH_EXTENSIONS_DIR"])  # a build killed with an earlier experiment
        rebuild_stale_ops(env["TORCH_EXTENSIONS_DIR"], env.get("PATH"), stop_check)  # outside the memory cap
        builders = needed_op_builders(self.ds_config)
        prebuild_log = self.files.log(spec.rank, "op_prebuild")
        self.prebuild_failed = prebuild_ops(
            builders, _build_env(env, slot), prebuild_log, stop_check,
            on_start=lambda pgid: record_started(client, task_id, identity, pgid, stop_check))
        self.files.show_while_running(self.files.rank_logs(spec.rank, ("op_prebuild",)))
        if builders and not ops_ready_everywhere(spec, client, stop_check):
            stop_check.keep_record(None)
            forget_rank(client, slot.queue, task_id or spec.attempt)
            self.describe()
            return not_started(Status.ABORTED, "stopped while the ops DeepSpeed needs were built")
        return None

    def run_script(self) -> RankRun:
        """Run the script watched, warm or cold (`workers.warm.warm_start`), then wait for its GPU to be idle."""
        spec, slot, client, task_id = self.spec, self.slot, self.client, self.task_id
        stop_check, command, env, cwd, master = self.stop_check, self.command, self.env, self.cwd, self.master
        describe, metric_path = self.describe, self.metric_path
        start = Start()  # warm or cold, and why (workers.warm.warm_start)
        identity = self.identity
        script_argv = command[3:] if command[1:3] == ["-m", "workers.in_rank.entry"] else command
        # The wait for the warm process (its preload) is taken from the time limit, as a cold rank's imports are.
        warm_wait_s = WARM.prepare(script_argv, env, cwd, slot.kind, spec.timeout_s, start, stop_check.slot_taken)
        stdout_path = self.files.log(spec.rank, "stdout")
        for path in (stdout_path, self.stderr_path):
            path.touch()  # to be shown under the plain names before the script writes to it
        self.files.show_while_running(self.files.rank_logs(spec.rank, ("stdout", "stderr")))
        try:
            launch = run_watched(
                command, env=env, cwd=cwd,
                spawn=WARM.spawn_for(script_argv, env, slot.kind, slot.cpus, start, stop_check.slot_taken),
                stdout_path=stdout_path,
                stderr_path=self.stderr_path,
                timeout_s=spec.timeout_s - warm_wait_s, memory_cap_bytes=slot.host_memory_cap, cpus=slot.cpus,
                should_abort=stop_check,
                on_start=lambda pgid: (record_started(client, task_id, identity, pgid, stop_check), describe()),
                title=identity.title(),  # what `ps` shows the rank as (workers.process.process_identity)
                measured=Measured(client, keys.measured(spec.attempt),
                                  metric_path if spec.rank == 0 and spec.metric_file else None),
                measured_grace_s=seconds_setting(os.environ.get(MEASURED_GRACE_ENV), MEASURED_GRACE_S),
            )
        finally:
            stop_check.keep_record(None)
            forget_rank(client, slot.queue, task_id or spec.attempt)
            remove_rank_segment(master[0], master[1], spec.rank)  # DeepSpeed's CPU all-reduce never does
            describe()  # where the script did not start
        report = read_exit_report(self.exit_report)  # final: the rank's whole group has ended
        # what the next rank's warm process preloads
        WARM.learn(script_argv, report.get("imported"), stop_check.slot_taken, report.get("imported_count"))
        # The slot is freed only with its GPU back to idle: a context torn down slowly is waited for;
        # memory still held after the wait is someone else's, and the slot leaves tuning until it goes.
        device_after = FREE_MEMORY.wait(slot.nvidia_smi_id, stop_check.slot_taken) if self.on_gpu else None
        if device_after is not None and device_after.busy:
            _take_out_of_tuning(client, slot, device_after.used_bytes or 0, "after a run")
        return RankRun(launch, report, start, master, env, self.device_wait, device_after, metric_path,
                       self.stderr_path, self.prebuild_failed)


class _Description:
    """Rank 0 writes its launch's exp.json and cmd.txt (`exp.<launch>.json`: the launch's slots and
    exp_id; `cmd.<launch>.txt`: its node's interpreter) once its script has started (or failed to),
    shown under the plain names while no record is (`workers.process.launch_files`): nothing the script
    reads, so not on the way between one experiment's end and the next's start
    (bench/dispatch_overhead.py); every other rank writes nothing. Called again, it does nothing."""

    def __init__(self, files: LaunchFiles, spec: RankSpec, ds_config: dict[str, Any], command: list[str]) -> None:
        self._files, self._spec, self._ds_config, self._command = files, spec, ds_config, command
        self._done = spec.rank != 0

    def __call__(self) -> None:
        if self._done:
            return
        self._done = True
        write_json(self._files.own(layout.EXP_JSON), {**self._spec.exp, "ds_config": self._ds_config})
        write_atomic(self._files.own(layout.CMD), shlex.join(self._command) + "\n")
        self._files.show_while_running(self._files.descriptions())


def _build_env(env: dict[str, str], slot: Slot) -> dict[str, str]:
    """The rank's environment for building its ops: as many compiler jobs as the slot has cores."""
    return {"MAX_JOBS": str(len(slot.cpus)), **env} if slot.cpus else env


def _take_out_of_tuning(client: redis.Redis, slot: Slot, used_bytes: int, why: str) -> None:
    """Mark the slot (workers.state.slot_health); Redis being away loses the mark, never the record."""
    try:
        RedisSlotStore(client).mark_unhealthy(slot.queue, used_bytes, why)
    except redis.RedisError as exc:
        log.warning("slot %s: could not take it out of tuning (%s): %s", slot.queue, why, exc)


def slot_from_env() -> Slot:
    """The slot this worker serves, as its main process described it before forking the pool."""
    return Slot.from_redis(json.loads(os.environ["AUTOTUNE_SLOT_JSON"]))
