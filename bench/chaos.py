"""Chaos soak: tuning jobs on a cluster of their own while faults strike at random.

Why: every fault the project claims to survive is tested once, alone, at a moment the test chose
(tests/integration/test_faults.py, test_leases.py, test_tuning.py). This runs several tuning jobs of
short real experiments on one cluster for S seconds while a schedule drawn from `random.Random(seed)`
kills and freezes its processes at moments nobody chose, then checks, from the records on disk, from
Redis and from samples of the process table (never from its own bookkeeping of what it did):

  lost         every job finished; every experiment its results list is on disk with one final
               status (not `lost`, which a resume re-runs), the one the list gives; every experiment
               folder is in its job's results (but a `lost` one a resume no longer needed: it holds
               no measurement); and a job's results hold every experiment of the
               fault-free run of its config, unless one of its records is a failure the faults made
               (below), which legitimately sends the search another way
  duplicated   no experiment listed twice, none the fault-free run did not need (same proviso; nor
               those listed `off_path`: a resumed job's earlier run measured them on its path), and
               none run by two launches at the same time (the same rank of it alive in two launches
               in one sample of the process table; a rank is what its title names, `identify`)
  overlapping  no slot running two experiments at once: slot-seconds covered by two rank spans of
               one slot in the records, or by training processes of two launches in one sample
  leaked       nothing left: no slot lease or active job in Redis once every job ended (and a lease
               had time to lapse), no recorded process group still running, no training process; no
               process of the cluster after teardown; no shared-memory segment of a recorded
               rendezvous in /dev/shm. (A recorded group that is gone is a stale hint, checked by
               whoever reads it: noted, not counted.)

The checks are pure functions in bench/chaos_checks.py, tested on planted records.

Faults, one every MIN_GAP_S-MAX_GAP_S seconds: kill -9 of a slot worker's main process (restarted
0.5-5 s later, as systemd would), of the control worker, of a job's command (run again: resume);
SIGSTOP of a slot worker and everything under it (its training processes: a frozen node) for a lease
plus 5 s; kill -9 of one rank's training process; redis-server killed and restarted on the same port
with its append-only file (appendfsync always: nothing acknowledged is lost), or with its data gone;
kill -9 of the Celery pool process running a rank (the OOM killer's way: the redelivered task must
kill the orphaned training group and the launch runs again), of the warm interpreter a running rank
was forked from (the rank is a lost launch, run again, never a crashed config), and a package
"upgraded" under the running workers (the mtime of torch's, numpy's or typing_extensions' METADATA
moved: each warm process is replaced before its next rank); bench/chaos_strikes.py says how each
target is found. A fault with nothing to strike when due waits up to TARGET_WAIT_S for a target;
each kind is in a schedule of about 400 s or more at least twice (`fault_schedule`).
Redis is set up as docs/cluster.md's recipe (an admin password on the default user, the cluster
user beside it). After the last fault everything comes back, every job runs to its end, and a job
that gave an experiment up as `lost` is run once more (a resume runs exactly those again).

Why the results can legitimately differ from a fault-free run: a killed rank is a crash to the
search (it cannot tell the bench's kill -9 from a script's), so it launches `<name>_r2`, and a size
that fails twice leaves its stage's probing. So a job whose records hold a failure the fault-free run
of its config does not have is only checked for the rest (every listed experiment recorded once,
finally); every other job must have exactly the fault-free run's names and statuses.

    .venv/bin/python bench/chaos.py [--seconds 120] [--seed 1] [--slots 3]

It prints one line per fault (stderr) and, last, `chaos: F faults, E experiments, J jobs: L lost,
D duplicated, O overlapping slot-seconds, K leaked`; exit status 0 when all four are 0, else 1.
The fault-free reference runs (one job per config, before the faults) and the final drain (at most
DRAIN_S) come on top of S. Everything runs on this machine under one marker in the environment;
every process is stopped by PID or process group.

Not covered: two nodes (network namespaces need root) and multi-node experiments; a network
partition or a slow network (only whole processes die or freeze); a full disk or a lost results
folder (the folder is the durable record; nothing survives losing it); clock jumps; real DeepSpeed
and GPUs (the experiments are tests/integration/scripts/fake_train.py, whose 2-rank runs are a real
torch gloo all-reduce); Flower and `python -m deploy`; faults inside the fault-free reference runs;
a Redis crash that loses only its last writes. A seed fixes the schedule of faults, not which
experiment each one hits (that depends on timing). bench/README.md has a 30-minute run and what it
found.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: the repository's packages (workers, scheduler)
    sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402
import redis  # noqa: E402

from bench.chaos_checks import (SAMPLE_S, STALE, Fault, JobRecords, Leftovers, ProcessRow, Sample, Seen, Verdict,  # noqa: E402
                                fault_made, fault_schedule, identify, summary_line, verdict)
from bench.chaos_strikes import (bump, bump_candidates, read_pools, read_warm, warm_identities,  # noqa: E402
                                 warm_processes)
from scheduler.errors import OneLineArgumentParser, UsageError, one_line  # noqa: E402
from workers.state import keys  # noqa: E402
from scheduler.cluster.jobs import job_id_for  # noqa: E402
from scheduler.report.outputs import OFF_PATH  # noqa: E402
from workers.process.launch import group_alive  # noqa: E402
from scheduler.embedded.local_cluster import CLUSTER_USER, cluster_user_rules, cold_stop, free_tcp_port, redis_config  # noqa: E402
from scheduler.embedded.worker_command import worker_argv  # noqa: E402
from workers.process.process_identity import owns_group, recorded_groups, recorded_ranks  # noqa: E402
from workers.state.registry import control_alive, live_slots  # noqa: E402
from workers.process.shared_memory import SHM_DIR, segment_name  # noqa: E402

FAKE = ROOT / "tests" / "integration" / "scripts" / "fake_train.py"
#: Every process of the cluster inherits it: the cluster's processes are found by it, never by name. Which
#: of them are training processes, and which rank each is, says its title (`identify`), never this.
MARKER_ENV = "AUTOTUNE_CHAOS_MARKER"
LEASE_S = 10.0  #: the jobs' AUTOTUNE_LEASE_S: short, so a frozen worker loses its slot within the soak
EXP_TIMEOUT_S = 60.0  #: each experiment's --exp-timeout
RESTART_DELAY_S = (0.5, 5.0)  #: a killed worker or command comes back after this many seconds
FREEZE_S = LEASE_S + 5.0  #: a frozen worker stays stopped longer than a lease
CONCURRENT_JOBS = 2  #: tuning jobs running at once while faults are injected
#: A fault with nothing to strike when it is due (no warm-forked rank running, Redis down) waits this
#: long for a target, the faults after it too, before another kind with a target is struck instead.
TARGET_WAIT_S = 30.0
DRAIN_S = 300.0  #: after the last fault, how long the jobs get to finish
MAX_SECONDS = 24 * 3600.0


# ------------------------------------------------------------------ the workload


@dataclass(frozen=True)
class JobKind:
    """One tuning config the soak runs, again and again, in fresh folders."""

    name: str
    num_gpus: int
    config: dict[str, Any]


def job_kinds() -> list[JobKind]:
    """Three small configs of 1.5-15 s per experiment: a list of sizes on one rank (the largest runs
    out of the slot's memory: a real `oom`), two ranks (a real gloo all-reduce between two torch
    processes), and fast mode (a profile run, the sampled search, a re-measurement of the leader)
    over a law whose memory grows with the micro-batch, its largest size well inside the cap. The
    15 s ones outlast a slot worker's restart, so a training process its death left behind would
    meet the next experiment on that slot."""
    def config(mbs: Any, stages: Any, args: list[str], **autotuning: Any) -> dict[str, Any]:
        return {"train_micro_batch_size_per_gpu": mbs, "gradient_accumulation_steps": 1,
                "zero_optimization": {"stage": stages},
                "autotuning": {"enabled": True, "metric": "throughput", "user_script": str(FAKE),
                               "user_args": args, **autotuning}}
    info = {"num_params": 1000, "trainable_num_params": 1000, "activation_mem_per_gpu": 2**20}
    sleepy = ",".join(f"{mbs}=slow1.5" for mbs in range(1, 33))
    return [
        JobKind("list", 1, config([1, 2, 3, 4], [0, 1], ["--behaviour", "1=slow2,2=slow15,3=slow3,4=oom"],
                                  model_info=info)),
        JobKind("pair", 2, config([1, 2], [0, 1], ["--behaviour", "1=slow3,2=slow15"], model_info=info)),
        JobKind("law", 1, config(4, [0, 1], ["--law", "--behaviour", sleepy], max_train_micro_batch_size_per_gpu=32)),
    ]


# ------------------------------------------------------------------ the cluster and the jobs


class Cluster:
    """A redis-server with an append-only file, restartable on its port, and workers started by
    hand, each in its own session, each killed, frozen or restarted by PID."""

    def __init__(self, work: Path, slots: int, marker: str) -> None:
        self.work, self.marker = work, marker
        self.queues = [f"gpu{i}" for i in range(slots)] + ["control"]
        self.port, self.password, self.admin_password = free_tcp_port(), secrets.token_hex(16), secrets.token_hex(16)
        self.url = f"redis://{CLUSTER_USER}:{self.password}@127.0.0.1:{self.port}/0"
        self.redis_dir = work / "redis"
        self.redis_dir.mkdir(parents=True)
        self.redis: subprocess.Popen | None = None
        self.workers: dict[str, subprocess.Popen] = {}
        self.frozen: dict[str, list[int]] = {}
        self.client = redis.Redis.from_url(self.url, socket_timeout=5, socket_connect_timeout=2)

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("AUTOTUNE_")}
        return {**env, "AUTOTUNE_REDIS_URL": self.url, MARKER_ENV: self.marker, "SPT_NOENV": "1",
                "PYTHONUNBUFFERED": "1"}

    def start_redis(self, wipe: bool = False) -> None:
        if wipe:
            for entry in self.redis_dir.iterdir():
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        # docs/cluster.md's recipe for a cluster's Redis (an admin password on the default user, the
        # cluster user beside it), with the append-only file on. Not the embedded cluster's
        # `user default off`: Redis up to 7.2 replays an AOF as the default user and re-checks its
        # ACL at each EXEC, so with that user off every MULTI/EXEC of the file is dropped at load
        # (redis/redis#14541, fixed by #14545): half of each job's state would come back.
        config = redis_config([("port", str(self.port)), ("bind", "127.0.0.1"), ("save", ""),
                               ("appendonly", "yes"), ("appendfsync", "always"),
                               ("requirepass", self.admin_password),
                               ("user", cluster_user_rules(CLUSTER_USER, self.password))])
        with open(self.work / "redis.log", "ab") as log:
            self.redis = subprocess.Popen(["redis-server", "-"], stdin=subprocess.PIPE, stdout=log,
                                          stderr=subprocess.STDOUT, cwd=self.redis_dir, env=self.env(),
                                          start_new_session=True)
        self.redis.stdin.write(config)
        self.redis.stdin.close()
        wait_until(lambda: self.client.ping(), 30, "redis-server")

    def kill_redis(self) -> None:
        kill_session(self.redis)

    def redis_up(self) -> bool:
        return self.redis is not None and self.redis.poll() is None

    def start_worker(self, queue: str) -> None:
        env = {**self.env(), "AUTOTUNE_NODE": "chaos", "AUTOTUNE_SLOT_MEMORY": "1GiB",
               "AUTOTUNE_SLOTS_PER_NODE": str(len(self.queues) - 1)}
        with open(self.work / f"{queue}.log", "ab") as log:
            self.workers[queue] = subprocess.Popen(
                worker_argv(queue, f"{queue}@chaos", 2 if queue == "control" else 1),
                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def alive(self, queue: str) -> bool:
        proc = self.workers.get(queue)
        return proc is not None and proc.poll() is None

    def ready(self) -> bool:
        return len(live_slots(self.client)) == len(self.queues) - 1 and control_alive(self.client)

    def freeze(self, queue: str) -> int:
        """SIGSTOP the worker and every process under it (a frozen node); returns how many."""
        try:
            root = psutil.Process(self.workers[queue].pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return 0
        for proc in procs:
            try:
                proc.suspend()
            except psutil.Error:
                pass
        self.frozen[queue] = [proc.pid for proc in procs]
        return len(procs)

    def thaw(self, queue: str) -> None:
        for pid in self.frozen.pop(queue, []):
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass

    def stop(self) -> None:
        """Cold shutdown of every worker (SIGQUIT: running training groups are killed), then
        SIGKILL of what is left of their sessions, then Redis."""
        for queue in list(self.frozen):
            self.thaw(queue)
        cold_stop(list(self.workers.values()), grace_s=20)
        kill_session(self.redis, signal.SIGTERM)


def kill_session(proc: subprocess.Popen | None, sig: int = signal.SIGKILL) -> None:
    """Signal the session `proc` leads (it was started with start_new_session) and reap it."""
    if proc is None:
        return
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def wait_until(condition: Callable[[], object], timeout: float, what: str) -> None:
    """Poll `condition` until it is true (a Redis or OS error counts as not yet); else RuntimeError."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if condition():
                return
        except (redis.RedisError, OSError):
            pass
        time.sleep(0.2)
    raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}")


@dataclass
class Job:
    """One tuning job: a folder with its config, and its command while one runs."""

    name: str
    kind: JobKind
    folder: Path
    proc: subprocess.Popen | None = None
    rerun_at: float | None = None
    finished: bool = False
    exits: list[int] = field(default_factory=list)

    @property
    def results(self) -> Path:
        return self.folder / "autotuning_results"

    def launch(self, cluster: Cluster) -> None:
        env = {**cluster.env(), "AUTOTUNE_LEASE_S": str(LEASE_S), "AUTOTUNE_LOST_GRACE_S": "5"}
        with open(self.folder / "command.log", "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "scheduler.autotune", "cfg.json", "--num_gpus", str(self.kind.num_gpus),
                 "--exp-timeout", str(EXP_TIMEOUT_S)], cwd=self.folder, env=env, stdout=log,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        self.rerun_at = None

    def poll(self, now: float, rng: random.Random) -> None:
        """Note how the command ended; a failed or killed one runs again after a delay (resume)."""
        if self.proc is None or self.proc.poll() is None:
            return
        self.exits.append(self.proc.returncode)
        self.proc = None
        if self.exits[-1] == 0:
            self.finished = True
        else:
            self.rerun_at = now + rng.uniform(*RESTART_DELAY_S)


def new_job(work: Path, name: str, kind: JobKind) -> Job:
    """A job of `kind` in a fresh folder <work>/jobs/<name> holding its cfg.json."""
    folder = work / "jobs" / name
    folder.mkdir(parents=True)
    (folder / "cfg.json").write_text(json.dumps(kind.config))
    return Job(name, kind, folder)


# ------------------------------------------------------------------ watching: the process table


class Sampler(threading.Thread):
    """Samples the running training processes of the soak's jobs every SAMPLE_S (`identify`)."""

    def __init__(self, jobs: dict[str, str]) -> None:
        super().__init__(daemon=True, name="process sampler")
        self.jobs, self.samples, self.latest = jobs, [], {}
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.wait(SAMPLE_S):
            found = training_processes(self.jobs)
            self.samples.append(Sample(time.time(), tuple(found.values())))
            self.latest = {pid: item for pid, item in found.items() if pid in self.leaders(found)}

    @staticmethod
    def leaders(found: dict[int, Seen]) -> set[int]:
        """The ranks themselves (each leads its own group), not what they started."""
        leaders = set()
        for pid in found:
            try:
                if os.getpgid(pid) == pid:
                    leaders.add(pid)
            except ProcessLookupError:
                continue
        return leaders

    def stop(self) -> None:
        self._halt.set()
        self.join()


def training_processes(jobs: dict[str, str]) -> dict[int, Seen]:
    """pid -> rank, of the running (not stopped, not zombie) training processes of `jobs` (job id ->
    name): one pass over the process table, each process read by its title and group (`identify`)."""
    rows = []
    for proc in psutil.process_iter(["status", "cmdline"]):
        try:
            if proc.info["status"] in (psutil.STATUS_STOPPED, psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
                continue
            rows.append(ProcessRow(proc.pid, os.getpgid(proc.pid), " ".join(proc.info["cmdline"] or [])))
        except (ProcessLookupError, psutil.Error):
            continue
    return identify(rows, dict(jobs))


def marked(marker: str) -> list[int]:
    """Live processes of the cluster: those carrying the marker (each inherits it from the cluster's
    environment; a forked rank shows the warm process's, which has it too)."""
    found = []
    for proc in psutil.process_iter(["status"]):
        try:
            env = proc.environ()
        except psutil.Error:
            continue
        if env.get(MARKER_ENV) == marker and proc.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(proc.pid)
    return found


# ------------------------------------------------------------------ the soak


class Soak:
    """The cluster, the jobs, the fault schedule and what they left."""

    def __init__(self, work: Path, seconds: float, seed: int, slots: int) -> None:
        self.work, self.seconds, self.seed = work, seconds, seed
        self.marker = secrets.token_hex(8)
        self.cluster = Cluster(work, slots, self.marker)
        self.job_ids: dict[str, str] = {}  #: job id (a rank's title names it) -> the job's name here
        self.sampler = Sampler(self.job_ids)
        self.rng = random.Random(f"chaos targets {seed}")  #: targets and delays, from the seed too
        self.kinds = job_kinds()
        self.jobs: list[Job] = []
        self.references: dict[str, dict[str, str]] = {}
        self.records: list[JobRecords] = []
        self.notes: list[str] = []
        self.injected: Counter[str] = Counter()
        self.pending: list[tuple[float, str, str]] = []  #: (when, what, which): worker and Redis restarts, thaws
        self.bumped_warm: dict[int, int] = {}  #: warm processes running at a bump: pid -> start time
        self.struck: dict[str, set[str]] = {}  #: "<job>/<experiment>" -> kinds of the faults aimed at its ranks
        self.started = 0.0

    def log(self, text: str) -> None:
        print(f"{time.monotonic() - self.started:7.1f}s {text}", file=sys.stderr, flush=True)

    def run(self) -> Verdict:
        self.started = time.monotonic()
        shm_before = set(os.listdir(SHM_DIR)) if SHM_DIR.is_dir() else set()
        self.cluster.start_redis()
        for queue in self.cluster.queues:
            self.cluster.start_worker(queue)
        wait_until(self.cluster.ready, 120, "the slot workers and the control worker")
        self.sampler.start()
        self.references = self.run_references()
        self.log("fault-free references: " + ", ".join(f"{k} {len(v)} experiments" for k, v in self.references.items()))
        self.soak()
        self.drain()
        self.resume_lost()
        if self.bumped_warm:
            kept = set(warm_identities(self.bumped_warm).items()) & set(self.bumped_warm.items())
            self.notes.append(f"note: of {len(self.bumped_warm)} warm process(es) running at a bump_package, "
                              f"{len(self.bumped_warm) - len(kept)} gone by the end (replaced, or killed by a fault), "
                              f"{len(kept)} still ran")
        redis_left, training_left = self.leftovers_in_redis(), self.training_left()
        jobs, spans, shm = self.collect()
        self.records = jobs
        self.sampler.stop()
        self.cluster.stop()
        after = self.after_teardown()
        shm_left = tuple(sorted(name for name in shm if name not in shm_before and (SHM_DIR / name).exists()))
        return verdict(jobs, self.sampler.samples, spans, Leftovers(redis_left, training_left, after, shm_left),
                       self.struck)

    def run_references(self) -> dict[str, dict[str, str]]:
        """One fault-free job per config, all at once: each config's experiments and statuses."""
        jobs = [self.new_job(f"reference-{kind.name}", kind) for kind in self.kinds]
        for job in jobs:
            job.launch(self.cluster)
        for job in jobs:
            if job.proc.wait(timeout=DRAIN_S) != 0:
                raise RuntimeError(f"the fault-free run of {job.kind.name} failed; see {job.folder / 'command.log'}")
        return {job.kind.name: dict(listed_statuses(job.results)) for job in jobs}

    def new_job(self, name: str, kind: JobKind) -> Job:
        """A fresh job, its id known to the sampler before its command starts."""
        job = new_job(self.work, name, kind)
        self.job_ids[job_id_for(job.results)] = job.name
        return job

    def soak(self) -> None:
        schedule = fault_schedule(self.seed, self.seconds)
        soak_start = time.monotonic()
        while time.monotonic() - soak_start < self.seconds:
            now = time.monotonic()
            self.tend(now, starting=True)
            while schedule and now - soak_start >= schedule[0][0]:
                due, fault = schedule[0]
                if not self.inject(fault, now, waited=now - soak_start - due):
                    break  # it waits for a target, and the faults after it wait for it
                schedule.pop(0)
            time.sleep(0.2)

    def tend(self, now: float, starting: bool) -> None:
        """Restarts, thaws and re-runs that are due; jobs that ended; new jobs while soaking."""
        for item in [p for p in self.pending if p[0] <= now]:
            self.pending.remove(item)
            _, what, which = item
            if what == "thaw":
                self.cluster.thaw(which)
            elif what == "worker" and not self.cluster.alive(which):
                self.cluster.start_worker(which)
            elif what == "redis" and not self.cluster.redis_up():
                self.cluster.start_redis(wipe=which == "wiped")
        for job in self.jobs:
            job.poll(now, self.rng)
            if job.rerun_at is not None and job.rerun_at <= now and self.cluster.redis_up():
                job.launch(self.cluster)
        active = [job for job in self.jobs if not job.finished]
        if starting and len(active) < CONCURRENT_JOBS:
            kind = self.kinds[len(self.jobs) % len(self.kinds)]
            job = self.new_job(f"{len(self.jobs):03d}-{kind.name}", kind)
            self.jobs.append(job)
            job.launch(self.cluster)

    def inject(self, fault: Fault, now: float, waited: float = TARGET_WAIT_S) -> bool:
        """Strike `fault` (another kind when it has had nothing to strike for TARGET_WAIT_S); False
        while it waits for a target."""
        targets = self.targets()
        if not targets.get(fault):
            if waited < TARGET_WAIT_S:
                return False
            choices = [kind for kind in Fault if targets.get(kind)]
            if not choices:
                self.log(f"fault {fault.value}: nothing to strike, skipped")
                return True
            fault = self.rng.choice(choices)
        target = self.rng.choice(targets[fault])
        self.injected[fault.value] += 1
        delay = self.rng.uniform(*RESTART_DELAY_S)
        if fault in (Fault.KILL_SLOT_WORKER, Fault.KILL_CONTROL):
            os.kill(self.cluster.workers[target].pid, signal.SIGKILL)  # the main process: no clean-up at all
            self.pending.append((now + delay, "worker", target))
            detail = f"{target} (pid {self.cluster.workers[target].pid}), restarted in {delay:.1f}s"
        elif fault is Fault.KILL_COMMAND:
            job = next(job for job in self.jobs if job.name == target)
            os.kill(job.proc.pid, signal.SIGKILL)
            detail = f"job {target} (pid {job.proc.pid})"
        elif fault is Fault.STOP_WORKER:
            count = self.cluster.freeze(target)
            self.pending.append((now + FREEZE_S, "thaw", target))
            detail = f"{target} and {max(count - 1, 0)} process(es) under it for {FREEZE_S:.0f}s"
        elif fault is Fault.KILL_RANK:
            pid, seen = target
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            detail = f"rank {seen.rank} of {seen.experiment} on {seen.slot} (pid {pid})"
            self.struck.setdefault(seen.experiment, set()).add(fault.value)
        elif fault in (Fault.KILL_POOL, Fault.KILL_WARM, Fault.BUMP_PACKAGE):
            detail = self.strike_near_rank(fault, target)
        else:
            self.cluster.kill_redis()
            wiped = fault is Fault.REDIS_WIPED
            self.pending.append((now + delay, "redis", "wiped" if wiped else "aof"))
            detail = f"back in {delay:.1f}s " + ("with its data gone" if wiped else "from its append-only file")
        self.log(f"fault {sum(self.injected.values())}: {fault.value} {detail}")
        return True

    def strike_near_rank(self, fault: Fault, target: Any) -> str:
        """Strike a pool process or a warm process (a `Struck`), or bump a distribution (a `Bump`);
        what was struck, for the fault's line."""
        if fault is Fault.BUMP_PACKAGE:
            bump(target)
            warm = warm_processes(proc.pid for proc in self.cluster.workers.values() if proc.poll() is None)
            self.bumped_warm.update(warm_identities(warm))
            return (f"{target.name} {target.version}: METADATA's mtime moved ({target.metadata}); warm "
                    f"process(es) {', '.join(map(str, warm))} running, each replaced before its next rank")
        try:
            os.kill(target.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        what = "pool process" if fault is Fault.KILL_POOL else "warm process"
        seen = target.seen
        self.struck.setdefault(seen.experiment, set()).add(fault.value)
        return (f"{what} {target.pid} ({' '.join(target.shown.split())[:60]}) running rank {seen.rank} of {seen.experiment} on "
                f"{seen.slot} (pid {target.rank_pid})")

    def targets(self) -> dict[Fault, list[Any]]:
        slots = [q for q in self.cluster.queues if q != "control" and self.cluster.alive(q)]
        return {
            Fault.KILL_SLOT_WORKER: slots,
            Fault.KILL_CONTROL: ["control"] if self.cluster.alive("control") else [],
            Fault.KILL_COMMAND: [job.name for job in self.jobs if job.proc is not None and job.proc.poll() is None],
            Fault.STOP_WORKER: [q for q in slots if q not in self.cluster.frozen],
            Fault.KILL_RANK: sorted(self.sampler.latest.items()),
            Fault.REDIS_AOF: ["redis"] if self.cluster.redis_up() else [],
            Fault.REDIS_WIPED: ["redis"] if self.cluster.redis_up() else [],
            **self.targets_near_ranks(),
        }

    def targets_near_ranks(self) -> dict[Fault, list[Any]]:
        """The pool processes and warm processes of the running ranks; the distributions to bump
        while a warm process of the soak runs (one that imported them: they preload torch)."""
        live = dict(self.sampler.latest)
        try:
            pools = read_pools(self.cluster.client, live) if self.cluster.redis_up() else []
        except redis.RedisError:
            pools = []
        running = [proc.pid for proc in self.cluster.workers.values() if proc.poll() is None]
        return {Fault.KILL_POOL: pools, Fault.KILL_WARM: read_warm(live),
                Fault.BUMP_PACKAGE: list(bump_candidates()) if warm_processes(running) else []}

    def drain(self) -> None:
        """No more faults: everything comes back at once, and every job runs to its end."""
        self.pending = [(0.0, what, which) for _, what, which in self.pending]
        for job in self.jobs:
            if job.rerun_at is not None:
                job.rerun_at = 0.0
        deadline = time.monotonic() + DRAIN_S
        while time.monotonic() < deadline and not all(job.finished for job in self.jobs):
            self.tend(time.monotonic(), starting=False)
            for queue in self.cluster.queues:
                if not self.cluster.alive(queue):
                    self.cluster.start_worker(queue)
            time.sleep(0.2)
        self.log(f"drained: {sum(job.finished for job in self.jobs)} of {len(self.jobs)} jobs finished")

    def resume_lost(self) -> None:
        """A job that gave an experiment up as `lost` is resumable: its command, run again, runs it."""
        for job in self.jobs:
            if job.finished and any(status == "lost" for _, status in listed_statuses(job.results)):
                self.log(f"resuming {job.name}: it recorded an experiment lost")
                job.finished = False
                job.launch(self.cluster)
                try:
                    job.finished = job.proc.wait(timeout=DRAIN_S) == 0
                except subprocess.TimeoutExpired:
                    kill_session(job.proc)
                job.proc = None

    def leftovers_in_redis(self) -> tuple[str, ...]:
        """Leases and active jobs still in Redis once a lease has had time to lapse (it outlives a
        dead holder by one lease at most), and recorded process groups that still run. A recorded
        group that is gone is only a stale hint (whoever reads one checks the group first): noted."""
        client = self.cluster.client
        found: tuple[str, ...] = ()
        deadline = time.monotonic() + LEASE_S + 5
        while time.monotonic() < deadline:
            found = tuple(sorted(key.decode() for pattern in (keys.gang("*"), keys.job_spec("*"), keys.job_queue("*"))
                                 for key in client.scan_iter(match=pattern)))
            found += tuple(f"{key.decode()} {sorted(f.decode() for f in client.hkeys(key))}"
                           for key in client.scan_iter(match=keys.job_running("*")))
            found += tuple(f"{keys.JOBS} {job.decode()}" for job in client.zrange(keys.JOBS, 0, -1))
            if not found:
                break
            time.sleep(0.5)
        recorded = recorded_ranks(client)
        for record in recorded:  # a rank's record: its group is that rank while its leader started then
            where = f"{keys.rank_process(record.identity.slot, '*')} {record.identity.title()}"
            if owns_group(record.pgid, record.identity.slot, record.started or None):
                found += (f"{where} (group {record.pgid} alive)",)
            else:
                self.notes.append(f"note: {where} names process group {record.pgid}, gone (a stale record)")
        for key, pgid in recorded_groups(client).items():  # an op build's group has no rank record
            if pgid and pgid not in {record.pgid for record in recorded} and group_alive(pgid):
                found += (f"{key} (group {pgid} alive)",)
        return found

    def training_left(self) -> tuple[str, ...]:
        """The training processes of the soak's jobs still running once every job ended, each named
        as its title names it."""
        deadline = time.monotonic() + 10
        while (left := training_processes(self.job_ids)) and time.monotonic() < deadline:
            time.sleep(0.5)
        return tuple(f"{pid} (rank {seen.rank} of {seen.experiment} on {seen.slot}, launch {seen.launch})"
                     for pid, seen in sorted(left.items()))

    def after_teardown(self) -> tuple[int, ...]:
        """Processes of the cluster still alive after it was stopped; they are killed here."""
        deadline = time.monotonic() + 10
        while (left := marked(self.marker)) and time.monotonic() < deadline:
            time.sleep(0.5)
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return tuple(left)

    def collect(self) -> tuple[list[JobRecords], list[tuple[str, str, float, float]], set[str]]:
        """Each soak job's records on disk, every rank span of them, and the rendezvous segments."""
        records, spans, shm = [], [], set()
        for job in self.jobs:
            listed = listed_statuses(job.results)
            folders = {path.parent.name for pattern in ("*/exp.json", "*/result.json") for path in job.results.glob(pattern)}
            on_disk = {}
            for name in sorted(folders | {name for name, _ in listed}):
                record = read_record(job.results / name / "result.json")
                on_disk[name] = (STALE if record.get("stale") else record.get("status")) if record else None
                for rank in (record or {}).get("ranks") or []:
                    if rank.get("slot") and rank.get("started_at") and rank.get("ended_at"):
                        spans.append((rank["slot"], f"{job.name}/{name}", rank["started_at"], rank["ended_at"]))
                    host, _, port = str(rank.get("master") or "").rpartition(":")
                    if host and port.isdigit():
                        shm.add(segment_name(host, int(port), int(rank.get("rank", 0))))
            records.append(JobRecords(job.name, job.finished, tuple(listed), on_disk, self.references[job.kind.name],
                                      off_path_names(job.results)))
        return records, spans, shm

    def report(self) -> list[str]:
        """What the soak did, for the lines above the summary."""
        samples = self.sampler.samples
        launches = {seen.launch for sample in samples for seen in sample.seen}
        compared = [job for job in self.records if not fault_made(job)]
        exits = Counter(code for job in self.jobs for code in job.exits)
        return [
            "faults by kind: " + ", ".join(f"{kind} {n}" for kind, n in sorted(self.injected.items())),
            f"jobs: {sum(job.finished for job in self.jobs)} of {len(self.jobs)} finished; {len(compared)} with "
            f"exactly the fault-free run's experiments and statuses, {len(self.records) - len(compared)} took "
            "another path after a failure the faults made",
            "command exit statuses: " + ", ".join(f"{code} x{n}" for code, n in sorted(exits.items())),
            f"process table: {len(samples)} samples, {len(launches)} rank launches seen",
            *self.notes,
        ]

    def teardown(self) -> None:
        """Whatever happened: every command, worker and Redis of ours stopped, by PID."""
        for job in self.jobs:
            kill_session(job.proc)
        self.cluster.stop()
        for pid in marked(self.marker):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def listed_statuses(results: Path) -> list[tuple[str, str]]:
    """(name, status) of each line of a job's results.jsonl ([] when there is none)."""
    try:
        lines = (results / "results.jsonl").read_text().splitlines()
    except OSError:
        return []
    return [(entry.get("name"), entry.get("status")) for entry in map(json.loads, lines) if entry]


def off_path_names(results: Path) -> frozenset[str]:
    """The results.jsonl lines an earlier run of the job measured off its resume's path (`off_path`)."""
    try:
        lines = (results / "results.jsonl").read_text().splitlines()
    except OSError:
        return frozenset()
    return frozenset(entry.get("name") for entry in map(json.loads, lines) if entry and entry.get(OFF_PATH))


def read_record(path: Path) -> dict[str, Any] | None:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The flags, checked: a bad one is a UsageError (one `error:` line, exit status 2)."""
    parser = OneLineArgumentParser(prog="bench/chaos.py", description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=120.0, help="how long faults are injected (default 120)")
    parser.add_argument("--seed", type=int, default=1, help="seeds the fault schedule and its targets (default 1)")
    parser.add_argument("--slots", type=int, default=3, help="slot workers (default 3; the two-rank jobs need 2)")
    args = parser.parse_args(argv)
    if not (math.isfinite(args.seconds) and 0 < args.seconds <= MAX_SECONDS):
        raise UsageError(f"--seconds must be above 0 and at most {MAX_SECONDS:.0f} (a day), got {args.seconds:g}")
    if not 2 <= args.slots <= 16:
        raise UsageError(f"--slots must be 2-16 (the two-rank jobs need two slots), got {args.slots}")
    if shutil.which("redis-server") is None:
        raise UsageError("redis-server not found on PATH; install it (apt-get install -y redis-server)")
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
    except UsageError as exc:
        print(f"error: {one_line(str(exc))}", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="chaos-"))
    soak = Soak(work, args.seconds, args.seed, args.slots)
    began = time.monotonic()
    # SIGTERM (`timeout`, a CI limit) ends the soak through its teardown, not around it: the cluster,
    # its commands and their ranks are stopped by PID, as after a normal end.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        result = soak.run()
    except RuntimeError as exc:  # the cluster or a fault-free reference run did not come up
        print(f"error: {one_line(str(exc))}; logs in {work}", file=sys.stderr)
        return 1
    finally:
        soak.teardown()
    for line in [*result.findings, *soak.report(), f"wall {time.monotonic() - began:.0f}s; folders in {work}"]:
        print(line, file=sys.stderr)
    experiments = sum(len(listed_statuses(job.results)) for job in soak.jobs)
    print(summary_line(sum(soak.injected.values()), experiments, len(soak.jobs), result), flush=True)
    clean = not (result.lost or result.duplicated or result.overlapping_s or result.leaked)
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
