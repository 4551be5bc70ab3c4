"""The checks of bench/chaos.py, pure (no I/O): the fault schedule, which processes of a sample of the
process table are training processes and which rank of which launch each is (`identify`), and the
four counts of its summary line from what the soak read (records on disk, samples, leftovers).

Why apart: the soak's verdict must not hang on its own bookkeeping, and each check must be seen to
fail when its property breaks; tests/unit/test_chaos.py plants records that break each one.
"""
from __future__ import annotations

import math
import random
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum

from workers.process.process_identity import RankIdentity

MIN_GAP_S, MAX_GAP_S = 4.0, 14.0  #: a fault every MIN_GAP_S-MAX_GAP_S seconds
SAMPLE_S = 0.25  #: how often the soak samples the process table
#: A record's final statuses: how an experiment ended. `lost` is final only for a job that gave up;
#: a resume runs it again, so after the soak's resume pass none may be left.
FINAL = frozenset({"ok", "oom", "timeout", "crashed", "no_metrics", "bad_metrics", "rendezvous_failed"})
#: The status the soak gives a result.json marked `stale`: the record of a launch that no longer held
#: its experiment, kept in a folder the job went on without (`tasks.experiment.finish_experiment`).
STALE = "stale"


class Fault(str, Enum):
    """What the bench does to the cluster."""

    KILL_SLOT_WORKER = "kill_slot_worker"  #: SIGKILL a slot worker's main process; restarted later
    KILL_CONTROL = "kill_control"  #: SIGKILL the control worker's main process; restarted later
    KILL_COMMAND = "kill_command"  #: SIGKILL a job's `python -m scheduler.autotune`; run again later
    STOP_WORKER = "stop_worker"  #: SIGSTOP a slot worker and its training processes for FREEZE_S
    KILL_RANK = "kill_rank"  #: SIGKILL one rank's training process
    REDIS_AOF = "redis_restart_aof"  #: SIGKILL redis-server; restarted with its append-only file
    REDIS_WIPED = "redis_restart_wiped"  #: SIGKILL redis-server; restarted with its data gone
    KILL_POOL = "kill_pool"  #: SIGKILL the Celery pool process running a rank task (the OOM killer's way)
    KILL_WARM = "kill_warm"  #: SIGKILL the warm interpreter a running rank was forked from
    BUMP_PACKAGE = "bump_package"  #: move the mtime of an imported distribution's METADATA (an upgrade)


#: How often each fault is drawn, relative to the others.
WEIGHTS = {Fault.KILL_SLOT_WORKER: 3, Fault.KILL_CONTROL: 2, Fault.KILL_COMMAND: 3, Fault.STOP_WORKER: 2,
           Fault.KILL_RANK: 3, Fault.REDIS_AOF: 1, Fault.REDIS_WIPED: 1, Fault.KILL_POOL: 2, Fault.KILL_WARM: 2,
           Fault.BUMP_PACKAGE: 1}
#: Each kind is in a schedule at least this often once the schedule is long enough to hold every kind
#: MIN_EACH times twice over (about 400 s): a rare kind drawn once or never in a 600 s soak would be
#: a kind the soak claims to cover and barely tried.
MIN_EACH = 2


def fault_schedule(seed: int, seconds: float) -> list[tuple[float, Fault]]:
    """(offset in seconds, fault) for a soak of `seconds`, the same for the same seed: faults drawn
    by WEIGHTS, then, for each kind drawn fewer than MIN_EACH times (fewer in a soak too short for
    it), draws of the most drawn kinds turned into it, at places drawn from the seed too."""
    rng = random.Random(seed)
    kinds, weights = list(WEIGHTS), list(WEIGHTS.values())
    schedule, at = [], rng.uniform(MIN_GAP_S, MAX_GAP_S)
    while at < seconds:
        schedule.append((round(at, 2), rng.choices(kinds, weights)[0]))
        at += rng.uniform(MIN_GAP_S, MAX_GAP_S)
    floor = min(MIN_EACH, len(schedule) // (2 * len(kinds)))
    counts = Counter(fault for _, fault in schedule)
    for kind in kinds:
        while counts[kind] < floor:
            most = max(kinds, key=lambda other: (counts[other], -kinds.index(other)))
            index = rng.choice([i for i, (_, fault) in enumerate(schedule) if fault is most])
            schedule[index] = (schedule[index][0], kind)
            counts[most] -= 1
            counts[kind] += 1
    return schedule


# ------------------------------------------------------------------ the checks: pure, no I/O


@dataclass(frozen=True)
class Seen:
    """One training process in one sample of the process table, as its rank's title names it."""

    slot: str  #: the slot its title names
    launch: str  #: its launch (the attempt token's start, in its title)
    experiment: str  #: "<job>/<experiment>": the soak's name of the job its title names, and the experiment
    rank: str  #: its rank


@dataclass(frozen=True)
class ProcessRow:
    """One live process as the sampler read it: what `ps` shows for it, and its process group."""

    pid: int
    pgid: int
    shown: str  #: its command line, or the title that replaced it


def identify(rows: Iterable[ProcessRow], jobs: Mapping[str, str]) -> dict[int, Seen]:
    """pid -> what it is, for the training processes of the soak's jobs (`jobs`: job id -> the name
    the lines give it): each process titled as a rank of one of them (`workers.process.process_identity`: a
    rank forked from the warm process too, whose environment and command line are the warm
    process's), and each untitled process of such a rank's group (an exec'd child), as that rank.
    The warm process itself and the workers carry no rank title: not training processes."""
    rows = list(rows)
    seen: dict[int, Seen] = {}
    leaders: dict[int, Seen] = {}
    for row in rows:
        identity = RankIdentity.from_title(row.shown)
        if identity is None or identity.job not in jobs:
            continue
        seen[row.pid] = Seen(identity.slot, identity.launch, f"{jobs[identity.job]}/{identity.experiment}",
                             str(identity.rank))
        if row.pid == row.pgid or row.pgid not in leaders:
            leaders[row.pgid] = seen[row.pid]
    for row in rows:
        if row.pid not in seen and row.pgid in leaders:
            seen[row.pid] = leaders[row.pgid]
    return seen


@dataclass(frozen=True)
class Sample:
    """The running (not stopped, not zombie) training processes at one moment."""

    at: float
    seen: tuple[Seen, ...]


@dataclass(frozen=True)
class JobRecords:
    """What one job left: its results list, the result.json of each experiment folder, and the
    fault-free run's results list for its config."""

    name: str
    finished: bool  #: its command ended with status 0
    listed: tuple[tuple[str, str], ...]  #: (name, status) per results.jsonl line, in order
    #: every experiment folder -> the status in its result.json (None: none; STALE: a launch not counted)
    on_disk: dict[str, str | None]
    reference: dict[str, str]  #: experiment -> status in the fault-free run of the same config
    #: listed lines marked `off_path`: an earlier run of the job measured them, its resume took another path
    off_path: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Leftovers:
    """What was still there at the end."""

    redis_keys: tuple[str, ...] = ()  #: leases, recorded process groups, active jobs
    training: tuple[str, ...] = ()  #: training processes alive once every job ended ("pid (which rank)")
    processes: tuple[int, ...] = ()  #: processes with the marker alive after teardown (pids)
    shm: tuple[str, ...] = ()  #: /dev/shm segments of recorded rendezvous


@dataclass(frozen=True)
class Verdict:
    lost: int
    duplicated: int
    overlapping_s: float
    leaked: int
    #: one line per finding, to say what each count is made of
    findings: tuple[str, ...] = field(default=())


def fault_made(job: JobRecords) -> bool:
    """Whether a record of the job is a failure its fault-free run does not have (module docstring)."""
    listed = dict(job.listed)
    return any(status not in ("ok", job.reference.get(name)) for name, status in listed.items())


def lost_experiments(jobs: Iterable[JobRecords]) -> list[str]:
    """Experiments a user would miss: unfinished jobs' reference experiments, listed experiments
    without a final record on disk (or with another status than listed), experiment folders the
    job's results do not list (but a `lost` one: given up, it holds no measurement, and a resume
    whose path no longer needs it leaves it; and a STALE one: a launch that no longer held its
    experiment, never counted by design, `scheduler.cluster.fencing`), and the fault-free run's
    experiments a job without fault-made failures lacks."""
    lost = []
    for job in jobs:
        listed = dict(job.listed)
        if not job.finished:
            lost += [f"{job.name}/{name}: job unfinished" for name in job.reference if listed.get(name) not in FINAL]
            continue
        for name, status in listed.items():
            disk = job.on_disk.get(name)
            if status not in FINAL or disk != status:
                lost.append(f"{job.name}/{name}: listed {status}, on disk {disk}")
        lost += [f"{job.name}/{name}: ran (on disk {status}) but the job's results lack it"
                 for name, status in job.on_disk.items() if name not in listed and status not in ("lost", STALE)]
        if not fault_made(job):
            lost += [f"{job.name}/{name}: the fault-free run has it" for name in job.reference if name not in listed]
    return lost


def duplicated_experiments(jobs: Iterable[JobRecords], samples: Iterable[Sample]) -> list[str]:
    """Experiments listed twice by their job, run by two launches at once, or (in a job without
    fault-made failures) run where the fault-free run did not need them (but those listed
    `off_path`: an earlier run of a resumed job measured them on the path it took then)."""
    found = []
    for job in jobs:
        counts = Counter(name for name, _ in job.listed)
        found += [f"{job.name}/{name}: listed {n} times" for name, n in counts.items() if n > 1]
        if job.finished and not fault_made(job):
            found += [f"{job.name}/{name}: the fault-free run has no such experiment"
                      for name in counts if name not in job.reference and name not in job.off_path]
    twice: set[str] = set()
    for sample in samples:
        launches: dict[tuple[str, str], set[str]] = defaultdict(set)
        for seen in sample.seen:
            launches[(seen.experiment, seen.rank)].add(seen.launch)
        twice.update(f"{experiment}: rank {rank} in {len(tokens)} launches at once at {sample.at:.1f}"
                     for (experiment, rank), tokens in launches.items() if len(tokens) > 1)
    unique: dict[str, str] = {}
    for line in sorted(twice):
        unique.setdefault(line.split(":")[0], line)
    return found + list(unique.values())


def overlap_seconds(spans: Iterable[tuple[str, str, float, float]]) -> float:
    """Slot-seconds covered by two or more experiments: spans are (slot, experiment, start, end)."""
    by_slot: dict[str, list[tuple[float, float, str]]] = defaultdict(list)
    for slot, experiment, start, end in spans:
        if end > start:
            by_slot[slot].append((start, end, experiment))
    total = 0.0
    for intervals in by_slot.values():
        events = sorted([(start, 1, exp) for start, _, exp in intervals] + [(end, -1, exp) for _, end, exp in intervals],
                        key=lambda event: (event[0], event[1]))
        active: Counter[str] = Counter()
        last = None
        for at, step, experiment in events:
            if last is not None and len(+active) > 1:
                total += at - last
            active[experiment] += step
            last = at
    return total


def sampled_overlap_seconds(samples: list[Sample]) -> float:
    """Slot-seconds during which one slot ran training processes of two launches, each sample
    counting for the time to the next one (the last for SAMPLE_S)."""
    return sum(seconds for _, seconds in _overlap_spans(samples).values())


def sampled_overlaps(samples: list[Sample]) -> list[str]:
    """One line per slot and set of launches seen on it at once: the experiments, when first seen
    (the first sample's time) and for how long (as `sampled_overlap_seconds` counts it)."""
    return [f"{slot}: {' and '.join(names)} from {first:.1f}s for {seconds:.1f}s"
            for (slot, names), (first, seconds) in _overlap_spans(samples).items()]


def _overlap_spans(samples: list[Sample]) -> dict[tuple[str, tuple[str, ...]], tuple[float, float]]:
    """(slot, its launches' "experiment (launch)") -> (first sample's time, seconds seen together)."""
    spans: dict[tuple[str, tuple[str, ...]], tuple[float, float]] = {}
    for index, sample in enumerate(samples):
        width = samples[index + 1].at - sample.at if index + 1 < len(samples) else SAMPLE_S
        launches: dict[str, dict[str, str]] = defaultdict(dict)
        for seen in sample.seen:
            launches[seen.slot][seen.launch] = seen.experiment
        for slot, tokens in launches.items():
            if len(tokens) > 1:
                key = (slot, tuple(f"{tokens[t]} ({t})" for t in sorted(tokens)))
                first, seconds = spans.get(key, (sample.at, 0.0))
                spans[key] = (first, seconds + width)
    return spans


def leaked(leftovers: Leftovers) -> list[str]:
    """One line per leftover."""
    return ([f"redis key {key}" for key in leftovers.redis_keys]
            + [f"training process {pid} alive after every job ended" for pid in leftovers.training]
            + [f"process {pid} alive after teardown" for pid in leftovers.processes]
            + [f"/dev/shm/{name}" for name in leftovers.shm])


#: Faults that leave a rank's own process alone: its launch is lost and runs again, so a failure in
#: the record of an experiment they struck is a result the faults took, not the experiment's.
SPARE_THE_RANK = frozenset({Fault.KILL_POOL.value, Fault.KILL_WARM.value})


def failed_after_strikes(jobs: Iterable[JobRecords], struck: Mapping[str, Iterable[str]]) -> list[str]:
    """Experiments whose record is a failure the fault-free run does not have (a crash, where a
    lost launch must have run again) after only faults that spare the rank struck them. `struck`:
    "<job>/<experiment>" -> the kinds of the faults aimed at one of its ranks. One struck by
    `kill_rank` too may have crashed for that."""
    found = []
    for job in jobs:
        for name, status in job.listed:
            kinds = set(struck.get(f"{job.name}/{name}", ()))
            spared = bool(kinds) and kinds <= SPARE_THE_RANK
            if spared and status not in ("ok", "lost", job.reference.get(name)):  # `lost`: lost_experiments'
                found.append(f"{job.name}/{name}: recorded {status} after {', '.join(sorted(kinds))} (its launch "
                             "must be lost and run again)")
    return found


def verdict(jobs: list[JobRecords], samples: list[Sample], spans: list[tuple[str, str, float, float]],
            leftovers: Leftovers, struck: Mapping[str, Iterable[str]] | None = None) -> Verdict:
    """The four counts of the summary line, with the findings behind them. A result the faults took
    (`failed_after_strikes`) is lost."""
    lost = lost_experiments(jobs) + failed_after_strikes(jobs, struck or {})
    duplicated, leaks = duplicated_experiments(jobs, samples), leaked(leftovers)
    recorded, sampled = overlap_seconds(spans), sampled_overlap_seconds(samples)
    findings = [f"lost: {line}" for line in lost] + [f"duplicated: {line}" for line in duplicated]
    if recorded or sampled:
        findings.append(f"overlapping: {recorded:.1f} slot-s in the records, {sampled:.1f} in the process table")
        findings += [f"overlapping: {line}" for line in sampled_overlaps(samples)]
    findings += [f"leaked: {line}" for line in leaks]
    return Verdict(len(lost), len(duplicated), max(recorded, sampled), len(leaks), tuple(findings))


def summary_line(faults: int, experiments: int, jobs: int, result: Verdict) -> str:
    """The soak's one line; overlapping slot-seconds rounded up, so that any overlap shows."""
    return (f"chaos: {faults} faults, {experiments} experiments, {jobs} jobs: {result.lost} lost, "
            f"{result.duplicated} duplicated, {math.ceil(result.overlapping_s)} overlapping slot-seconds, "
            f"{result.leaked} leaked")
