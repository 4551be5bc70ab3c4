"""`python -m scheduler.autotune cfg.json [options] [-- train.py args...]`: tune, report, write the winner.

With AUTOTUNE_REDIS_URL set it uses the slot and control workers already running on that Redis;
otherwise it starts an embedded cluster on this machine (private redis-server, one slot worker per
device, a control worker) and stops it afterwards, also on errors and Ctrl-C. Every refusal the inputs
decide comes first (`scheduler.preflight`), before a folder is made or a process started.

This command only submits the job (`scheduler.cluster.jobs`) and watches its events: the control worker
advances it phase by phase, dispatches its experiments and writes its outputs, so on a running
cluster the job finishes even if this command dies; running the same command again while the job is
active watches it again. Finished experiments are kept in the results folder: running the same
command after the job ended reuses every experiment whose config is unchanged and re-runs only the
rest (`"overwrite": true` starts afresh). Ctrl-C cancels the job.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

import redis
from rich.console import Console

from scheduler import exits, preflight, status
from scheduler.inputs import folders
from scheduler.inputs.config import TuningConfig
from scheduler.errors import OneLineArgumentParser, UsageError
from scheduler.cluster.job_store import JobStore
from scheduler.cluster.jobs import JobSpec, cancel, run_fixed, submit, watch
from scheduler.live_view import LiveView
from scheduler.report import mlflow_fields
from scheduler.report.mlflow_log import JobRun, MlflowLog
from scheduler.report.outputs import cancelled_record, print_table
from scheduler.cluster.progress import optimal_argv, outcome, settings_of, write_outputs
from scheduler.cluster.work import Work
from scheduler.search.fast_search import search_notes
from scheduler.search.ranking import best, status_word
from scheduler.search.space import PROFILE, Experiment, optimal_config
from workers.files.layout import CLUSTER_DIR, DS_CONFIG, OPTIMAL_FILES, PARTIAL_FILES, SUMMARY
from scheduler.embedded.local_cluster import LocalCluster, cluster_client
from workers.files.paths import read_json, safe_child
from workers.in_rank.failure import Status
from workers.slot.records import ExperimentRecord

console = Console(highlight=False, width=None if sys.stdout.isatty() else 130)


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    own, script = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = OneLineArgumentParser(
        prog="python -m scheduler.autotune",
        description="Find the fastest DeepSpeed configuration for a training script.")
    parser.add_argument("config", nargs="?",
                        help="DeepSpeed config with an \"autotuning\" section (JSON or hjson)")
    add_tuning_options(parser)
    return parser.parse_args(own), script


def add_tuning_options(parser: argparse.ArgumentParser) -> None:
    """The options `python -m scheduler.autotune` and `celery-autotune --autotuning` share."""
    parser.add_argument("--status", action="store_true",
                        help="show the cluster at AUTOTUNE_REDIS_URL: slots, who holds them, jobs and "
                        "why their next experiment waits; tunes nothing")
    parser.add_argument("--slots", type=int,
                        help="embedded cluster: slot workers to start (default: one per GPU, on a machine "
                        "without GPUs one per core)")
    parser.add_argument("--slot-memory", help="embedded cluster on CPU: memory cap per slot, e.g. 3GiB "
                        "(default: total RAM / slots); GPU slots hold their GPU's memory and ignore it")
    parser.add_argument("--host-memory-cap", help="embedded cluster on GPUs: cap each rank's host memory "
                        "(its process tree's PSS) at this, e.g. 64GiB (default: no cap; CPU slots are "
                        "capped by --slot-memory)")
    parser.add_argument("-H", "--hostfile", help="resource pool: 'NODE slots=N' per line, NODE a worker's node "
                        "name (localhost: this machine); experiments use only these slots (default: all)")
    parser.add_argument("-i", "--include", default="", help="resource pool: NODE[:ID[,ID...]][@NODE...], only these")
    parser.add_argument("-e", "--exclude", default="", help="resource pool: NODE[:ID[,ID...]][@NODE...], all but these")
    parser.add_argument("--num_gpus", "--num_accelerators", dest="num_gpus", type=int,
                        help="slots per experiment (default: all slots of a node)")
    parser.add_argument("--num_nodes", type=int,
                        help="nodes per experiment (default: every node of the --hostfile, else 1)")
    parser.add_argument("--exp-timeout", type=float, default=900.0,
                        help="wall-clock limit of one experiment in seconds (default 900)")
    parser.add_argument("--min-slot-memory", help="run experiments only on slots with at least this much "
                        "memory, e.g. 40GiB (heterogeneous clusters; default: every slot)")
    parser.add_argument("--no_local_rank", action="store_true",
                        help="do not pass --local_rank=N to the script (DeepSpeed's launcher flag): the tuned "
                        "runs and cmd_optimal.txt then both give the local rank only as LOCAL_RANK")
    parser.add_argument("--flower", nargs="?", type=int, const=5555, metavar="PORT",
                        help="embedded cluster: also start Flower (monitoring) on 127.0.0.1:PORT (default "
                        "5555) with a generated user and password, printed once")
    parser.add_argument("--run", action="store_true",
                        help="after tuning, train with the optimal config on the same kind of slots "
                        "(DeepSpeed's --autotuning run)")


def main(argv: list[str] | None = None) -> int:
    return guarded(lambda: run(*parse_args(sys.argv[1:] if argv is None else argv)))


#: How a tuning ends on a failure (`scheduler.exits`): what was measured is kept for the next run.
ENDINGS = exits.Endings(
    crashed="the control worker failed on this job ({exc}); finished experiments are kept: run the same "
            "command again to resume",
    redis_failed="Redis failed during the run ({kind}: {exc}); finished experiments are kept: run the same "
                 "command again to resume",
    redis_code=exits.FAILED,
    interrupted="interrupted: finished experiments are kept; run the same command to resume")


def guarded(command: Callable[[], int]) -> int:
    """Run the command with its error endings: one `error:` line and 2 for bad input, 130 on Ctrl-C
    (also `celery-autotune --autotuning`'s, scheduler/cli.py)."""
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    return exits.guarded(command, ENDINGS)


def run(args: argparse.Namespace, script_args: list[str]) -> int:
    if args.status:
        return show_status()
    if args.config is None:
        raise UsageError("give the config to tune: python -m scheduler.autotune cfg.json (or --status)")
    # Every refusal the inputs decide comes before anything is created, started or deleted.
    checked = preflight.check(args, script_args)
    cfg = checked.cfg
    folders.prepare([("results_dir", cfg.results_dir), ("exps_dir", cfg.exps_dir)], cfg.path, cfg.overwrite)

    def embedded() -> LocalCluster:
        return LocalCluster(checked.workers, cfg.results_dir / CLUSTER_DIR, slot_memory=args.slot_memory,
                            flower_port=args.flower, host_memory_cap=args.host_memory_cap)

    def started(cluster: LocalCluster) -> None:
        console.print(f"embedded cluster: redis-server and {checked.workers} slot workers + control "
                      f"on {cluster.node} (logs in {cfg.results_dir / CLUSTER_DIR})")
        if args.flower is not None:
            user, password = cluster.flower_auth.split(":", 1)
            console.print(f"flower: http://127.0.0.1:{args.flower}/ user {user} password {password}",
                          highlight=False)

    with cluster_client(checked.client, embedded, started) as client:
        return tune(checked, args, client)


def tune(checked: preflight.Checked, args: argparse.Namespace, client: redis.Redis) -> int:
    from tasks import app  # imports the Celery app, which reads AUTOTUNE_REDIS_URL
    from tasks.work import CeleryWork

    work = CeleryWork(app)
    cfg, script = checked.cfg, checked.script
    slots, allowed = preflight.tuning_slots(client, args)  # the embedded cluster's, now registered
    spec = preflight.job_spec(cfg, args, script, checked.base_args, checked.mappings, slots, allowed)
    assert spec.tune is not None  # a tuning job
    console.print(f"tuning {script.name}: stages {list(cfg.stages)}, {spec.tune.num_nodes} node(s) x "
                  f"{spec.tune.num_gpus} slot(s) per experiment, metric {cfg.metric}, "
                  f"slot memory {spec.tune.capacity_bytes / 2**30:.1f} GiB")
    for note in search_notes(settings_of(spec)):  # the global batch kept or not, how the winner is named
        console.print(note, highlight=False, soft_wrap=True)
    if args.slot_memory and spec.slot_kind == "cuda":
        console.print(f"note: --slot-memory {args.slot_memory} sizes CPU slots only: these GPU slots hold their "
                      "GPU's memory, and their ranks' host memory is capped only by --host-memory-cap")
    if args.host_memory_cap and spec.slot_kind == "cpu":
        console.print(f"note: --host-memory-cap {args.host_memory_cap} caps ranks on GPU slots only: these CPU "
                      "slots are capped by their slot memory (--slot-memory)")
    tracking = start_mlflow(cfg, spec)  # before the job exists: a Ctrl-C meanwhile leaves nothing running
    if submit(client, work, spec):
        console.print("the job for this results folder was still running on the cluster: watching it")

    view = LiveView(console, client, spec.job, cfg.metric, cfg.maximize, total_slots=len(slots),
                    concurrency=spec.tune.concurrency, started=spec.submitted_at)

    def on_event(event: dict[str, Any]) -> None:
        view(event)
        if tracking is not None and event.get("kind") == "record":
            tracking.record(event["record"])

    try:
        with view:
            done = watch(client, work, spec, on_event)
    except KeyboardInterrupt:
        running = {name: launch.to_json()  # read before cancel forgets them
                   for name, launch in JobStore(client, spec.job).running().items()}
        cancel(client, work, spec.job)
        _, measured = _report(cfg, spec, client, interrupted=running)
        if tracking is not None:
            tracking.finish(measured, None, cfg.metric, cfg.maximize, time.time() - spec.submitted_at, interrupted=True)
        raise
    winner, records = _report(cfg, spec, client)
    if tracking is not None:
        tracking.finish(records, winner.name if winner else None, cfg.metric, cfg.maximize,
                        time.time() - spec.submitted_at)
    if winner is None:
        return 2 if never_reported(typed(records.values())) else 1
    if args.run:
        experiments, _ = outcome(client, spec)
        return _train_with_optimal(cfg, args, client, work, spec,
                                   next(e for e in experiments if e.name == done["winner"]))
    return 0


def start_mlflow(cfg: TuningConfig, spec: JobSpec) -> MlflowLog | None:
    """The job's parent run in MLflow when MLFLOW_TRACKING_URI or autotuning.mlflow asks for one
    (`scheduler.report.mlflow_log`); None when off, or after its one warning line."""
    tune = spec.tune
    assert tune is not None
    script = Path(tune.script).name
    job = JobRun(name=f"{script} {cfg.path.name}", config_key=mlflow_fields.config_key(cfg.ds_config),
                 params=mlflow_fields.job_params(cfg.ds_config, cfg.metric, script, tune.num_nodes, tune.num_gpus),
                 tags={"autotune.config": str(cfg.path.resolve()), "autotune.job": spec.job},
                 started_at=spec.submitted_at)
    tracking = MlflowLog.start((cfg.ds_config.get("autotuning") or {}).get("mlflow"), cfg.results_dir, job,
                               warn=lambda line: print(f"warning: {line}", file=sys.stderr, flush=True))
    if tracking is not None:
        console.print(f"mlflow: run {tracking.parent_run_id} at {mlflow_fields.shown_uri(tracking.uri)}",
                      soft_wrap=True, markup=False)
    return tracking


def _train_with_optimal(cfg: TuningConfig, args: argparse.Namespace, client: redis.Redis, work: Work,
                        tuned_spec: JobSpec, best: Experiment) -> int:
    """DeepSpeed's `--autotuning run`, but the training really trains: the optimal config has no
    autotuning section, so nothing exits after the profiled steps. Ranks run on the slot workers."""
    optimal = replace(best, name="run_optimal", ds_config=optimal_config(best.ds_config),
                      tuning_space="run_optimal", metric_file="", min_memory=tuned_spec.min_memory)
    # the argv from the tuned experiment's config: it says which mapped flags (checkpointing's) it ran with
    argv = optimal_argv(tuned_spec)(best, safe_child(cfg.results_dir, optimal.name) / DS_CONFIG)
    spec = JobSpec(job=uuid.uuid4().hex, results_root=tuned_spec.results_root, cwd=os.getcwd(),
                   timeout_s=preflight.RUN_TIMEOUT_S, experiments=[{**optimal.to_json(), "argv": argv}],
                   min_memory=tuned_spec.min_memory, slot_kind=tuned_spec.slot_kind,
                   local_rank_arg=tuned_spec.local_rank_arg, allowed=tuned_spec.allowed)
    console.print(f"training with the optimal config {best.name} on {best.num_nodes} node(s) x "
                  f"{best.num_gpus} slot(s); logs in {cfg.results_dir / optimal.name}")
    [trained] = typed(run_fixed(client, work, spec))
    console.print(f"training {status_word(trained)}: "
                  + ", ".join(f"rank {r.rank} {r.exit}" for r in trained.rank_records))
    return 0 if trained.ok else 1


def show_status() -> int:
    url = os.environ.get("AUTOTUNE_REDIS_URL")
    if not url:
        raise UsageError("--status needs the cluster's Redis: set AUTOTUNE_REDIS_URL "
                         "(an embedded cluster lives only as long as its autotuner)")
    status.render(console, status.collect(preflight.connect_checked(url)))
    return 0


def _report(cfg: TuningConfig, spec: JobSpec, client: redis.Redis,
            interrupted: dict[str, dict[str, Any]] | None = None,
            ) -> tuple[ExperimentRecord | None, dict[str, dict[str, Any]]]:
    """Print the results table and summary; returns the winner (None: none) and the records read (their
    JSON, as MLflow's log takes them).
    The control worker wrote the outputs of a finished job; an interrupted one (`interrupted`: its
    launches that were running, by name) gets partial outputs written here from what was measured,
    every other experiment of it `cancelled`."""
    experiments, records = outcome(client, spec)
    if interrupted is not None:
        return _report_interrupted(cfg, spec, experiments, records, interrupted), records
    summary = cfg.results_dir / SUMMARY
    optimal = read_json(cfg.results_dir / OPTIMAL_FILES[0])
    rows = dict(zip(records, typed(records.values())))
    winner = best(list(rows.values()), cfg.metric, cfg.maximize) if optimal is not None else None
    print_table(console, experiments, rows, cfg.metric, winner)
    if summary.exists():
        console.print(summary.read_text(), markup=False, soft_wrap=True)
    if winner is None:
        failed = list(rows.values())
        print("error: no experiment succeeded; one example per failure class (all in each experiment's "
              "result.json):", file=sys.stderr)
        for line in failure_examples(failed):
            print(f"  {line}", file=sys.stderr)
        if never_reported(failed):
            print(f"  the script ran but never reported {cfg.metric!r} usably: with autotuning.enabled "
                  "DeepSpeed's engine writes autotuning.metric_path; a script without DeepSpeed writes it "
                  "with workers/in_rank/metrics.py (docs/config.md, \"How the script reports\"); known only once it "
                  "ran: its records stay and a rerun would reuse them, so after fixing the script start "
                  "afresh with \"overwrite\": true", file=sys.stderr)
    else:
        console.print(f"best: {winner.name} -> {cfg.results_dir / OPTIMAL_FILES[0]}", soft_wrap=True)
        # a command meant to be pasted is never wrapped, whatever the terminal's (or log's) width
        console.print(f"run it: {(cfg.results_dir / OPTIMAL_FILES[1]).read_text().strip()}",
                      soft_wrap=True, markup=False)
    return winner, records


def _report_interrupted(cfg: TuningConfig, spec: JobSpec, experiments: list[Experiment],
                        records: dict[str, dict[str, Any]], running: dict[str, dict[str, Any]],
                        ) -> ExperimentRecord | None:
    """An interrupted search: say so, list what was measured and what was cut off, and name the best
    measured config as partial (never as the optimum)."""
    now = time.time()
    cancelled = {e.name: cancelled_record(e, running.get(e.name), now) for e in experiments if e.name not in records}
    write_outputs(spec, experiments, records, cancelled)
    rows = dict(zip(records, typed(records.values())))
    winner = best(list(rows.values()), cfg.metric, cfg.maximize)
    print_table(console, experiments, {**rows, **cancelled}, cfg.metric, winner)
    summary = cfg.results_dir / SUMMARY
    if summary.exists():
        console.print(summary.read_text(), markup=False, soft_wrap=True)
    measured = [e.name for e in experiments if e.name in records and e.name != PROFILE]  # as summary.txt counts
    console.print(f"interrupted: measured {len(measured)} experiment(s)"
                  + (f" ({', '.join(measured)})" if measured else "")
                  + f"; cancelled {len(cancelled)} that were running or queued"
                  + (f" ({', '.join(cancelled)})" if cancelled else ""), soft_wrap=True, markup=False)
    if winner is not None:
        console.print(f"best so far (partial search, not an optimum): {winner.name} -> "
                      f"{cfg.results_dir / PARTIAL_FILES[0]}; its command: {cfg.results_dir / PARTIAL_FILES[1]}",
                      soft_wrap=True, markup=False)
    return winner


#: Failures of the script's reporting, not of the config: every experiment ending so is bad input.
UNREPORTED = frozenset({Status.NO_METRICS, Status.BAD_METRICS})


def typed(records: Iterable[dict[str, Any]]) -> list[ExperimentRecord]:
    """The records' JSON (result.json's, as the control worker wrote them) typed once, so the report
    reads their fields by name."""
    return [ExperimentRecord.from_json(record) for record in records]


def never_reported(records: list[ExperimentRecord]) -> bool:
    """Whether the experiments all ran and none reported a usable metric (`UNREPORTED`): the script
    does not report what the config asks for, which is the user's input to fix (exit 2), whereas
    configs that all ran out of memory or crashed are a finished tuning run without a winner (exit 1)."""
    failed = [record for record in records if not record.ok]  # the profile run's is ok
    return bool(failed) and all(record.status in UNREPORTED for record in failed)


def failure_examples(records: list[ExperimentRecord]) -> list[str]:
    """One line per failure class: how many, and one experiment's cause (exit status, the error, the
    last line of its stderr), so a run where nothing succeeded says why without opening a file. A
    record `ok` with nothing after its metrics (the profile run) failed in nothing: it is not listed."""
    by_class: dict[str, list[ExperimentRecord]] = {}
    for record in records:
        if status_word(record) == "ok" and not (record.cause or record.exit_after_metrics):
            continue
        by_class.setdefault(status_word(record), []).append(record)
    lines = []
    for outcome_class, members in by_class.items():
        example = members[0]
        cause = example.cause or example.exit_after_metrics or {}
        last_err = next((line.strip() for line in reversed(str(cause.get("stderr_tail") or "").splitlines())
                         if line.strip()), "")
        parts = [str(cause.get("exit") or ""), str(cause.get("error") or ""), last_err]
        why = "; ".join(part for part in parts if part) or "no cause recorded"
        if len(why) > 300:
            why = why[:300] + "..."
        lines.append(f"{outcome_class} ({len(members)}): e.g. {example.name}: {why}")
    return lines


def _raise_keyboard_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
