"""Advancing a job by one step: replay its search from the results folder, queue what the current
phase still lacks, or end the job with its outputs written.

This is what an experiment's chord callback does after recording it (and what the first step after
submission does). The search (`scheduler.search.fast_search`, a generator of phases) answered against the
records on disk: the first phase with an unanswered experiment is the current one. When the last
experiment of a phase is recorded, the search moves past it, so the same step computes the phase's
result and queues the next phase. A process keeps the job's search alive between steps and feeds it
only the new records (`scheduler.search.live_search`); a process without it rebuilds it from the spec and
replays every record on disk (`scheduler.search.phases.replay`), with the same result. Because the tuner
is deterministic given the spec and the records, any control worker can take any step, and a job
survives the death of every process that ever touched it: its state is the folder.

A record on disk answers an experiment when its config is the experiment's config and it is not a
`lost` record still worth retrying (fewer launches than the job's max_attempts in this job), nor an
earlier job's record of an op that could not be built (the job stopped there; resumed, it builds
again). A fixed
job (`python -m scheduler.run`, `--run`) only accepts records made during the job itself.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import redis

from scheduler.inputs.arguments import STRATEGY_KEY, checkpointing_given, with_config, with_mapped_args
from scheduler.inputs.config import TuningConfig, parse_config
from scheduler.errors import ConfigError, UsageError
from scheduler.search.fast_search import SearchSettings, fast_search, search_notes
from scheduler.inputs.batch_keys import cli_batch
from scheduler.cluster.job_store import JobStore, StepReads, reserve_seqs
from scheduler.cluster.jobs import JobSpec, end, publish
from scheduler.cluster.launches import QueuedLaunch
from scheduler.search.live_search import LiveSearches
from scheduler.report.outputs import write_results
from scheduler.report.rows import CancelledRecord
from scheduler.search.phases import Phase, Search, replay
from scheduler.search.space import PROFILE, Experiment
from workers.files.layout import DS_CONFIG, EXP_JSON, RESULT
from workers.files.paths import read_json, safe_child
from workers.in_rank.failure import Status
from workers.slot.records import ExperimentRecord
from workers.state.store import RedisSlotStore

log = logging.getLogger(__name__)

Lookup = Callable[[Experiment], "dict[str, Any] | None"]


def advance(client: redis.Redis, job: str, dispatch: Callable[[], None] | None = None,
            read: StepReads | None = None) -> None:
    """Take the job's next step (module docstring), and dispatch after it (`dispatch`, when given).
    Errors end the job with a `failed` event. `read`: the step's reads, where the caller made them in
    a round trip of its own (`finish.record_and_read`).

    When the step cannot change what a pass would start now, the pass runs before it: the job's
    search is live in this process (no rebuild) and no queued experiment of the job has a record
    (the only ones a step takes off the queue), so the step can only add experiments or end the
    job; it is then followed by a second pass only if it did. A chord callback thus sends the next
    experiment before the search has seen the record (bench/dispatch_overhead.py)."""
    if read is None:
        read = JobStore(client, job).step_reads()  # the spec and what the step needs, in one round trip
    if not read.spec:
        if dispatch is not None:
            dispatch()
        return
    spec = JobSpec.from_json(read.spec)
    first = dispatch is not None and not (read.queued & read.recorded) and LIVE_SEARCHES.holds(_key(spec, read))
    if first:
        dispatch()
    try:
        changed = _step(client, spec, read)
    except UsageError as exc:
        end(client, job, {"kind": "failed", "error": str(exc), "usage": True})
        changed = True
    except Exception as exc:
        log.exception("advancing job %s failed", job)
        end(client, job, {"kind": "failed", "error": f"{type(exc).__name__}: {exc}", "usage": False})
        changed = True
    if dispatch is not None and (changed or not first):
        dispatch()


def _key(spec: JobSpec, read: StepReads) -> tuple:
    """The job's live search's key. The job's place in the active jobs changes when it is submitted
    again (Redis lost it): rebuild then. The spec as stored (`JobSpec.to_json`'s text) stands for itself."""
    return spec.job, read.order, read.spec


#: This process's live searches (`scheduler.search.live_search`): a step feeds the new records to the
#: search the previous step left suspended, instead of replaying every record from disk.
LIVE_SEARCHES = LiveSearches()


def _step(client: redis.Redis, spec: JobSpec, read: StepReads) -> bool:
    """The step; True when it changed the job's queue or ended the job."""
    store = JobStore(client, spec.job)
    recorded_here, queued = read.recorded, set(read.queued)
    lookup = record_lookup(client, spec, recorded_here, read.attempts)

    def new_record(exp: Experiment) -> dict[str, Any] | None:
        """Since a live search's last step, only experiments recorded in this job can have a record:
        every record a job makes is marked recorded in its store (finish or sweep) before its step."""
        return lookup(exp) if exp.name in recorded_here else None

    progress = LIVE_SEARCHES.advance(_key(spec, read), lambda: search_of(spec), lookup, new_record)
    answered, current = progress.answered, progress.current
    if spec.tune is not None:
        _check_metric_key(spec, progress.newly_answered, lookup)
    _announce(client, spec, [(phase, 0, sum(e.name not in recorded_here for e in phase.experiments))
                             for phase in progress.newly_answered])
    if current is None:
        winner = write_outputs(spec, *tuned(answered, lookup)) if spec.tune is not None else None
        end(client, spec.job, {"kind": "done", "winner": winner})
        return True
    # A queued experiment may have been answered meanwhile by an older launch's record (after Redis
    # lost the job): a rebuilt search checks every queued entry, a live one those recorded since.
    # Those of the current phase the search found answered need no second look.
    suspects = queued if progress.rebuilt else queued & recorded_here
    changed = False
    for launch in store.queued(sorted(suspects)):
        if launch.name in progress.found or lookup(Experiment.from_json(launch.exp)) is not None:
            store.unqueue(launch)
            queued.discard(launch.name)
            changed = True
    missing = [e for e in current.experiments if e.name not in progress.found]
    todo = [e for e in missing if e.name not in queued]
    todo = [e for e in todo if e.name not in read.running]
    if todo:  # the gang owners of every live slot: read only when something would be queued
        holding = launches_holding_slots(client, spec.job)
        todo = [e for e in todo if e.name not in holding]
        if todo and store.settling():
            todo = []  # its launches that ran on may not have taken their slots back yet: the sweep steps it again
    _announce(client, spec, [(current, len(missing), len(current.experiments) - len(missing))], current=current)
    if not todo:
        return changed
    first_seq = reserve_seqs(client, len(todo))
    store.queue(QueuedLaunch(first_seq + i, {**exp.to_json(), "min_memory": max(exp.min_memory, spec.min_memory)},
                             argv_of(spec, exp)) for i, exp in enumerate(todo))
    return True


def _announce(client: redis.Redis, spec: JobSpec, phases: list[tuple[Phase, int, int]],
              current: Phase | None = None) -> None:
    """One `phase` event per phase and job, when the job first reaches it: for each (phase, to do,
    reused). `current`: the phase the job is in now, for `--status` (written with the announcements)."""
    if not phases and current is None:
        return
    store = JobStore(client, spec.job)
    first = store.announce_phases([phase.name for phase, _, _ in phases], current.name if current else None)
    for (phase, todo, reused), new in zip(phases, first):
        if new:
            publish(client, spec.job, {"kind": "phase", "name": phase.name, "todo": todo, "reused": reused})


def search_of(spec: JobSpec) -> Search:
    """The job's search, rebuilt from its spec: DeepSpeed's fast/full search, or the fixed list."""
    if spec.tune is None:
        return _fixed(tuple(Experiment.from_json({k: v for k, v in e.items() if k != "argv"})
                            for e in spec.experiments or []))
    return fast_search(settings_of(spec))


def settings_of(spec: JobSpec) -> SearchSettings:
    """The tuning job's search settings, from its config, its slots and the script's flags (the
    global batch a Hugging Face config keeps comes from them: `scheduler.search.global_batch`)."""
    tune = spec.tune
    assert tune is not None, "a fixed job has no search"
    return SearchSettings.from_config(tuning_config(spec), capacity_bytes=tune.capacity_bytes,
                                      num_nodes=tune.num_nodes, num_gpus=tune.num_gpus,
                                      device_kind=tune.device_kind, concurrency=tune.concurrency,
                                      command_line=cli_batch(tune.base_args, tune.mappings),
                                      checkpointing_fixed=checkpointing_given(tune.base_args, tune.mappings))


def tuning_config(spec: JobSpec) -> TuningConfig:
    """The tuning job's config, checked again from the spec (relative dirs against its cwd)."""
    tune = spec.tune
    assert tune is not None, "a fixed job has no tuning config"
    return parse_config(tune.ds_config, Path(tune.config_path), Path(spec.cwd))


def _fixed(experiments: tuple[Experiment, ...]) -> Iterator[Phase]:
    yield Phase("run", experiments)


def launches_holding_slots(client: redis.Redis, job: str) -> set[str]:
    """The job's experiments whose ranks still hold slots (the gang keys' owners, `job/experiment`).
    After Redis lost its data, a running launch's ranks take their leases back (workers.state.gang) while
    the job, submitted again, has no record of the launch: queueing the experiment again would run it
    twice at once. It waits instead; its own record answers it (`scheduler.cluster.fencing` adopts
    it), or, if that never comes, its leases lapse and it is queued then. The resubmitted job queues
    nothing for its first `job_store.RESUME_SETTLE_S`, so the ranks have taken their slots back when
    this is read."""
    slots = RedisSlotStore(client)
    owners = slots.owners([slot.queue for slot in slots.live_slots()])
    return {name for owner in owners.values() for owning_job, _, name in [owner.rpartition("/")] if owning_job == job}


def record_lookup(client: redis.Redis, spec: JobSpec, recorded: set[str] | None = None,
                  attempts: dict[str, int] | None = None) -> Lookup:
    """exp -> the record on disk that answers it, or None (module docstring). Use one per step:
    it remembers what it read. `recorded`, `attempts`: the job's recorded names and attempts, when
    the caller has them."""
    store = JobStore(client, spec.job)
    attempts = store.attempts() if attempts is None else attempts
    recorded = store.recorded() if recorded is None else recorded

    read: dict[str, dict[str, Any] | None] = {}  #: one step reads each folder once (names fix configs)

    def lookup(exp: Experiment) -> dict[str, Any] | None:
        if exp.name not in read:
            read[exp.name] = _answer(exp)
        return read[exp.name]

    def _answer(exp: Experiment) -> dict[str, Any] | None:
        if spec.tune is None and exp.name not in recorded:
            return None
        written = read_json(safe_child(spec.results_root, exp.name) / RESULT)
        record = read_record(written)
        if record is None or record.stale or record.ds_config != exp.ds_config:
            return None
        if record.status is Status.LOST and attempts.get(exp.name, 0) < spec.max_attempts:
            return None
        if record.op_build_failed and exp.name not in recorded:
            return None  # an earlier job's: the node may build the op now (workers.in_rank.op_build)
        return written  # the search reads records as their JSON
    return lookup


def argv_of(spec: JobSpec, exp: Experiment) -> list[str]:
    """The script's argv for one experiment: the base arguments, mapped flags, and its config path."""
    if spec.tune is None:
        return next(e["argv"] for e in spec.experiments or [] if e["name"] == exp.name)
    return optimal_argv(spec)(exp, safe_child(spec.results_root, exp.name) / DS_CONFIG)


def optimal_argv(spec: JobSpec) -> Callable[[Experiment, Path], list[str]]:
    tune = spec.tune
    assert tune is not None
    return lambda exp, config_path: with_config(
        tune.script, with_mapped_args(tuple(tune.base_args), tune.mappings, exp.ds_config), config_path)


def tuned(phases: list[Phase], lookup: Lookup) -> tuple[list[Experiment], dict[str, dict[str, Any]]]:
    """Every experiment of the answered phases (first occurrence) and its record."""
    experiments: dict[str, Experiment] = {}
    for phase in phases:
        for exp in phase.experiments:
            experiments.setdefault(exp.name, exp)
    records = {name: record for name, exp in experiments.items() if (record := lookup(exp)) is not None}
    return list(experiments.values()), records


def outcome(client: redis.Redis, spec: JobSpec) -> tuple[list[Experiment], dict[str, dict[str, Any]]]:
    """A tuning job's experiments so far (the unfinished phase's too) and their records, for the
    submitter's report."""
    lookup = record_lookup(client, spec)
    answered, current = replay(search_of(spec), lookup)
    return tuned(answered + ([current] if current else []), lookup)


def write_outputs(spec: JobSpec, experiments: list[Experiment], records: dict[str, dict[str, Any]],
                  cancelled: Mapping[str, CancelledRecord] | None = None) -> str | None:
    """summary.txt, results.jsonl, ds_config_optimal.json, cmd_optimal.txt, tuning.png; returns the
    winner's name. Elapsed time is counted from the job's submission. `cancelled` (an interrupted
    search) makes them partial (`scheduler.report.outputs`)."""
    cfg = tuning_config(spec)
    off_path = measured_off_path(Path(spec.results_root), {exp.name for exp in experiments})
    winner = write_results(Path(spec.results_root), experiments, records, cfg.metric, cfg.maximize,
                           time.time() - spec.submitted_at, optimal_argv(spec), spec.local_rank_arg,
                           cancelled=cancelled, notes=search_notes(settings_of(spec)),
                           name_hosts=spec.allowed is not None, off_path=off_path)
    return winner.name if winner else None


def measured_off_path(results_root: Path, on_path: set[str]) -> list[tuple[Experiment, dict[str, Any]]]:
    """The experiment folders under `results_root` with a record that this run's search did not
    name: what an earlier run of the job measured on a path a resume no longer takes (it re-ran a
    lost experiment and decided otherwise). Listed with the results so nothing measured is dropped;
    a folder without a record (never finished), with a stale one or a `lost` one (given up: it
    never ran to a result) holds no measurement."""
    found = []
    for exp_file in sorted(results_root.glob(f"*/{EXP_JSON}")):
        name = exp_file.parent.name
        written = read_json(exp_file.parent / RESULT)
        record = read_record(written)
        if name in on_path or name == PROFILE or record is None or record.stale or record.status is Status.LOST:
            continue
        exp = described_experiment(name, read_json(exp_file), record)
        if exp is not None:
            found.append((exp, {**written, "name": name}))
    return found


def read_record(written: Any) -> ExperimentRecord | None:
    """A result.json's record typed; None where the file held none (missing, torn, not a record)."""
    if not isinstance(written, dict):
        return None
    try:
        return ExperimentRecord.from_json(written)
    except (TypeError, ValueError):  # no name, or a status no release wrote
        return None


def described_experiment(name: str, described: Any, record: ExperimentRecord) -> Experiment | None:
    """The experiment a folder holds, from its exp.json (DeepSpeed's description: the shape) and its
    record's config (stage, sizes, strategy); None when they do not describe one."""
    config = record.ds_config
    if not isinstance(described, dict) or not isinstance(config, dict):
        return None
    try:
        return Experiment(name, int((config.get("zero_optimization") or {}).get("stage", 0)),
                          int(config["train_micro_batch_size_per_gpu"]), int(config.get("gradient_accumulation_steps", 1)),
                          config, int(described.get("num_nodes", 1)), int(described.get("num_gpus", 1)),
                          strategy=tuple((config.get("autotuning") or {}).get(STRATEGY_KEY) or ()))
    except (KeyError, TypeError, ValueError):
        return None


def _check_metric_key(spec: JobSpec, phases: list[Phase], lookup: Lookup) -> None:
    """A script that never writes the metric asked for would make every experiment look failed."""
    metric = tuning_config(spec).metric
    for exp in (e for phase in phases for e in phase.experiments if e.name != PROFILE):
        record = read_record(lookup(exp))
        metrics = record.metrics if record is not None else None
        if record is not None and record.ok and isinstance(metrics, dict) and metric not in metrics:
            raise ConfigError(f"{spec.tune.config_path}: autotuning.metric is \"{metric}\" but the script's "
                              f"metrics file has only {sorted(metrics)}; choose one of those (every experiment then runs "
                              f"again) or write \"{metric}\" and start afresh with \"overwrite\": true (known only "
                              "once an experiment ran: its record stays, and a rerun of this config reuses it)")

