"""`python -m scheduler.autotune cfg.json [options] [-- train.py args...]`: tune, report, write the winner.

With AUTOTUNE_REDIS_URL set it uses the slot and control workers already running on that Redis;
otherwise it starts an embedded cluster on this machine (private redis-server, one slot worker per
device, a control worker) and stops it afterwards, also on errors and Ctrl-C.

This command only submits the job (`scheduler.cluster.jobs`) and watches its events: the control worker
advances it phase by phase, dispatches its experiments and writes its outputs, so on a running
cluster the job finishes even if this command dies; running the same command again while the job is
active watches it again. Finished experiments are kept in the results folder: running the same
command after the job ended reuses every experiment whose config is unchanged and re-runs only the
rest (`"overwrite": true` starts afresh). Ctrl-C cancels the job.
"""
from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil
import redis
from rich.console import Console

from scheduler import status
from scheduler.inputs.arguments import check_arg_mappings, parse_arg_mappings
from scheduler.inputs import folders
from scheduler.inputs.config import TuningConfig, load_config
from scheduler.launch.environment import check_numeric_variables, check_redis_url
from scheduler.errors import ClusterError, ConfigError, OneLineArgumentParser, UsageError, one_line
from scheduler.search.fast_search import search_notes
from scheduler.search.full_space import check_full_mode
from workers.redis_tls import describe_tls_failure
from scheduler.launch.hostfile import MAX_SLOTS_PER_HOST, SLOT_WORKER_BYTES, max_local_slots
from scheduler.cluster.job_store import JobStore
from scheduler.cluster.jobs import JobCrashed, JobSpec, TuneSpec, cancel, job_id_for, run_fixed, submit, watch
from scheduler.live_view import LiveView
from scheduler.report.outputs import PARTIAL_FILES, cancelled_record, print_table
from scheduler.cluster.progress import optimal_argv, outcome, settings_of, write_outputs
from scheduler.cluster.work import Work
from scheduler.search.ranking import best
from scheduler.search.space import PROFILE, Experiment, optimal_config
from workers.gpus import GpuListingError, local_gpus, refuse_mig
from workers.local_cluster import LocalCluster, LocalClusterError
from workers.paths import read_json, safe_child
from workers.registry import connect, control_alive, live_slots
from workers.slot import Slot, parse_size

RUN_TIMEOUT_S = 7 * 24 * 3600.0  #: a real training run: the limit only guards against a hang forever
MAX_EXP_TIMEOUT_S = RUN_TIMEOUT_S  #: --exp-timeout above a week is a typo (and inf hangs the dispatcher)
MAX_NODES = 4096
MIN_SLOT_MEMORY_BYTES = 64 * 2**20  #: less cannot hold a Python interpreter with torch
MAX_MEMORY_BYTES = 2**50
console = Console(highlight=False, width=None if sys.stdout.isatty() else 130)


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    own, script = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = OneLineArgumentParser(
        prog="python -m scheduler.autotune",
        description="Find the fastest DeepSpeed configuration for a training script.")
    parser.add_argument("config", nargs="?",
                        help="DeepSpeed config with an \"autotuning\" section (JSON or hjson)")
    parser.add_argument("--status", action="store_true",
                        help="show the cluster at AUTOTUNE_REDIS_URL: slots, who holds them, jobs and "
                        "why their next experiment waits; tunes nothing")
    parser.add_argument("--slots", type=int,
                        help="embedded cluster: slot workers to start (default: one per GPU, on a machine "
                        "without GPUs one per core)")
    parser.add_argument("--slot-memory", help="embedded cluster on CPU: memory cap per slot, e.g. 3GiB "
                        "(default: total RAM / slots)")
    parser.add_argument("--num_gpus", type=int, help="slots per experiment (default: all slots of a node)")
    parser.add_argument("--num_nodes", type=int, default=1, help="nodes per experiment (default 1)")
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
    return parser.parse_args(own), script


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    try:
        return run(*parse_args(sys.argv[1:] if argv is None else argv))
    except (UsageError, LocalClusterError) as exc:
        print(f"error: {one_line(str(exc))}", file=sys.stderr)
        return 2
    except JobCrashed as exc:
        print(f"error: the control worker failed on this job ({exc}); finished experiments are kept: "
              "run the same command again to resume", file=sys.stderr)
        return 1
    except redis.RedisError as exc:
        print(f"error: Redis failed during the run ({type(exc).__name__}: {exc}); finished "
              "experiments are kept: run the same command again to resume", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: finished experiments are kept; run the same command to resume",
              file=sys.stderr)
        return 130


def run(args: argparse.Namespace, script_args: list[str]) -> int:
    if args.status:
        return show_status()
    if args.config is None:
        raise UsageError("give the config to tune: python -m scheduler.autotune cfg.json (or --status)")
    # Everything the user gave is checked before anything is created, started or deleted.
    check_numeric_variables(os.environ)
    _check_numbers(args)
    url = os.environ.get("AUTOTUNE_REDIS_URL")
    if url:
        check_redis_url(url)
    cfg = load_config(args.config)
    check_full_mode(cfg)
    script, base_args = _script(cfg, script_args)
    mappings = parse_arg_mappings(cfg.ds_config["autotuning"].get("arg_mappings"), str(cfg.path))
    check_arg_mappings(mappings, base_args, str(cfg.path))
    client = _connect(url) if url else None
    slots = embedded_slot_count(args.slots) if client is None else 0
    folders.prepare([("results_dir", cfg.results_dir), ("exps_dir", cfg.exps_dir)], cfg.path, cfg.overwrite)
    if client is not None:
        return tune(cfg, args, script, base_args, mappings, client)
    with LocalCluster(slots, cfg.results_dir / "cluster", slot_memory=args.slot_memory,
                      flower_port=args.flower) as cluster:
        console.print(f"embedded cluster: redis-server and {slots} slot workers + control "
                      f"on {cluster.node} (logs in {cfg.results_dir / 'cluster'})")
        if args.flower is not None:
            user, password = cluster.flower_auth.split(":", 1)
            console.print(f"flower: http://127.0.0.1:{args.flower}/ user {user} password {password}",
                          highlight=False)
        os.environ["AUTOTUNE_REDIS_URL"] = cluster.url
        try:
            return tune(cfg, args, script, base_args, mappings, connect(cluster.url))
        finally:
            os.environ.pop("AUTOTUNE_REDIS_URL", None)


def tune(cfg: TuningConfig, args: argparse.Namespace, script: Path, base_args: tuple[str, ...],
         mappings: dict[str, str], client: redis.Redis) -> int:
    from tasks import app  # imports the Celery app, which reads AUTOTUNE_REDIS_URL
    from tasks.work import CeleryWork

    work = CeleryWork(app)

    slots = _usable_slots(client, args.min_slot_memory)
    device_kind = "cpu" if all(s.kind == "cpu" for s in slots) else "gpu"
    slots = [s for s in slots if s.kind == ("cpu" if device_kind == "cpu" else "cuda")]  # never mixed
    per_node = max(sum(1 for s in slots if s.node == node) for node in {s.node for s in slots})
    num_gpus = args.num_gpus or per_node
    spec = JobSpec(
        job=job_id_for(cfg.results_dir), results_root=str(cfg.results_dir.resolve()), cwd=os.getcwd(),
        timeout_s=args.exp_timeout, min_memory=_min_memory(args.min_slot_memory), submitted_at=time.time(),
        slot_kind="cpu" if device_kind == "cpu" else "cuda", local_rank_arg=not args.no_local_rank,
        tune=TuneSpec(config_path=str(cfg.path), ds_config=cfg.ds_config, exps_dir=str(cfg.exps_dir.resolve()),
                      script=str(script), base_args=list(base_args), mappings=mappings,
                      capacity_bytes=min(s.memory_bytes for s in slots), num_nodes=args.num_nodes,
                      num_gpus=num_gpus, device_kind=device_kind,
                      concurrency=len(slots) // (args.num_nodes * num_gpus)))
    notes = search_notes(settings_of(spec))  # a config the search refuses: reported before anything is submitted
    console.print(f"tuning {script.name}: stages {list(cfg.stages)}, {args.num_nodes} node(s) x "
                  f"{num_gpus} slot(s) per experiment, metric {cfg.metric}, "
                  f"slot memory {spec.tune.capacity_bytes / 2**30:.1f} GiB")
    for note in notes:
        console.print(note, highlight=False, soft_wrap=True)
    if submit(client, work, spec):
        console.print("the job for this results folder was still running on the cluster: watching it")

    view = LiveView(console, client, spec.job, cfg.metric, cfg.maximize, total_slots=len(slots),
                    concurrency=spec.tune.concurrency, started=spec.submitted_at)
    try:
        with view:
            done = watch(client, work, spec, view)
    except KeyboardInterrupt:
        running = {name: launch.to_json()  # read before cancel forgets them
                   for name, launch in JobStore(client, spec.job).running().items()}
        cancel(client, work, spec.job)
        _report(cfg, spec, client, interrupted=running)
        raise
    winner, records = _report(cfg, spec, client)
    if winner is None:
        return 2 if never_reported(list(records.values())) else 1
    if args.run:
        experiments, _ = outcome(client, spec)
        return _train_with_optimal(cfg, args, client, work, spec,
                                   next(e for e in experiments if e.name == done["winner"]))
    return 0


def _usable_slots(client: redis.Redis, min_slot_memory: str | None) -> list[Slot]:
    slots = live_slots(client)
    if not slots:
        raise ClusterError("no slot workers are registered in Redis; start one per device with "
                           "`celery -A tasks worker -Q gpu0 -n gpu0@%h`")
    if not control_alive(client):
        raise ClusterError("no control worker is running; start one with "
                           "`celery -A tasks worker -Q control -n control@%h`")
    floor = _min_memory(min_slot_memory)
    usable = [s for s in slots if s.memory_bytes >= floor]
    if not usable:
        biggest = max(s.memory_bytes for s in slots)
        raise ClusterError(f"--min-slot-memory {min_slot_memory}: no slot has that much; the largest has "
                           f"{biggest / 2**30:.2f} GiB, ask for at most that")
    return usable


def _min_memory(min_slot_memory: str | None) -> int:
    return parse_size(min_slot_memory) if min_slot_memory else 0


def _train_with_optimal(cfg: TuningConfig, args: argparse.Namespace, client: redis.Redis, work: Work,
                        tuned_spec: JobSpec, best: Experiment) -> int:
    """DeepSpeed's `--autotuning run`, but the training really trains: the optimal config has no
    autotuning section, so nothing exits after the profiled steps. Ranks run on the slot workers."""
    optimal = replace(best, name="run_optimal", ds_config=optimal_config(best.ds_config),
                      tuning_space="run_optimal", metric_file="", min_memory=tuned_spec.min_memory)
    argv = optimal_argv(tuned_spec)(optimal, safe_child(cfg.results_dir, optimal.name) / "ds_config.json")
    spec = JobSpec(job=uuid.uuid4().hex, results_root=tuned_spec.results_root, cwd=os.getcwd(),
                   timeout_s=RUN_TIMEOUT_S, experiments=[{**optimal.to_json(), "argv": argv}],
                   min_memory=tuned_spec.min_memory, slot_kind=tuned_spec.slot_kind,
                   local_rank_arg=tuned_spec.local_rank_arg)
    console.print(f"training with the optimal config {best.name} on {best.num_nodes} node(s) x "
                  f"{best.num_gpus} slot(s); logs in {cfg.results_dir / optimal.name}")
    [outcome_record] = run_fixed(client, work, spec)
    console.print(f"training {outcome_record.get('status')}: "
                  + ", ".join(f"rank {r.get('rank')} {r.get('exit')}" for r in outcome_record.get("ranks", [])))
    return 0 if outcome_record.get("status") == "ok" else 1


def show_status() -> int:
    url = os.environ.get("AUTOTUNE_REDIS_URL")
    if not url:
        raise UsageError("--status needs the cluster's Redis: set AUTOTUNE_REDIS_URL "
                         "(an embedded cluster lives only as long as its autotuner)")
    status.render(console, status.collect(_connect(url)))
    return 0


def _report(cfg: TuningConfig, spec: JobSpec, client: redis.Redis,
            interrupted: dict[str, dict[str, Any]] | None = None,
            ) -> tuple[dict[str, Any] | None, dict[str, dict[str, Any]]]:
    """Print the results table and summary; returns the winner (None: none) and the records read.
    The control worker wrote the outputs of a finished job; an interrupted one (`interrupted`: its
    launches that were running, by name) gets partial outputs written here from what was measured,
    every other experiment of it `cancelled`."""
    experiments, records = outcome(client, spec)
    if interrupted is not None:
        return _report_interrupted(cfg, spec, experiments, records, interrupted), records
    summary = cfg.results_dir / "summary.txt"
    optimal = read_json(cfg.results_dir / "ds_config_optimal.json")
    winner = best(list(records.values()), cfg.metric, cfg.maximize) if optimal is not None else None
    print_table(console, experiments, records, cfg.metric, winner)
    if summary.exists():
        console.print(summary.read_text(), markup=False, soft_wrap=True)
    if winner is None:
        failed = list(records.values())
        print("error: no experiment succeeded; one example per failure class (all in each experiment's "
              "result.json):", file=sys.stderr)
        for line in failure_examples(failed):
            print(f"  {line}", file=sys.stderr)
        if never_reported(failed):
            print(f"  the script ran but never reported {cfg.metric!r} usably: with autotuning.enabled "
                  "DeepSpeed's engine writes autotuning.metric_path; a script without DeepSpeed writes it "
                  "with workers/metrics.py (README, \"The config\")", file=sys.stderr)
    else:
        console.print(f"best: {winner['name']} -> {cfg.results_dir / 'ds_config_optimal.json'}", soft_wrap=True)
        # a command meant to be pasted is never wrapped, whatever the terminal's (or log's) width
        console.print(f"run it: {(cfg.results_dir / 'cmd_optimal.txt').read_text().strip()}",
                      soft_wrap=True, markup=False)
    return winner, records


def _report_interrupted(cfg: TuningConfig, spec: JobSpec, experiments: list[Experiment],
                        records: dict[str, dict[str, Any]], running: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """An interrupted search: say so, list what was measured and what was cut off, and name the best
    measured config as partial (never as the optimum)."""
    now = time.time()
    cancelled = {e.name: cancelled_record(e, running.get(e.name), now) for e in experiments if e.name not in records}
    write_outputs(spec, experiments, records, cancelled)
    winner = best(list(records.values()), cfg.metric, cfg.maximize)
    print_table(console, experiments, {**records, **cancelled}, cfg.metric, winner)
    summary = cfg.results_dir / "summary.txt"
    if summary.exists():
        console.print(summary.read_text(), markup=False, soft_wrap=True)
    measured = [e.name for e in experiments if e.name in records and e.name != PROFILE]  # as summary.txt counts
    console.print(f"interrupted: measured {len(measured)} experiment(s)"
                  + (f" ({', '.join(measured)})" if measured else "")
                  + f"; cancelled {len(cancelled)} that were running or queued"
                  + (f" ({', '.join(cancelled)})" if cancelled else ""), soft_wrap=True, markup=False)
    if winner is not None:
        console.print(f"best so far (partial search, not an optimum): {winner['name']} -> "
                      f"{cfg.results_dir / PARTIAL_FILES[0]}; its command: {cfg.results_dir / PARTIAL_FILES[1]}",
                      soft_wrap=True, markup=False)
    return winner


#: Failures of the script's reporting, not of the config: every experiment ending so is bad input.
UNREPORTED = frozenset({"no_metrics", "bad_metrics"})


def never_reported(records: list[dict[str, Any]]) -> bool:
    """Whether the experiments all ran and none reported a usable metric (`UNREPORTED`): the script
    does not report what the config asks for, which is the user's input to fix (exit 2), whereas
    configs that all ran out of memory or crashed are a finished tuning run without a winner (exit 1)."""
    failed = [record for record in records if record.get("status") != "ok"]  # the profile run's is ok
    return bool(failed) and all(record.get("status") in UNREPORTED for record in failed)


def failure_examples(records: list[dict[str, Any]]) -> list[str]:
    """One line per failure class: how many, and one experiment's cause (exit status, the error, the
    last line of its stderr), so a run where nothing succeeded says why without opening a file."""
    by_class: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        by_class.setdefault(str(record.get("status", "lost")), []).append(record)
    lines = []
    for outcome_class, members in by_class.items():
        example = members[0]
        cause = example.get("cause") or example.get("exit_after_metrics") or {}
        last_err = next((line.strip() for line in reversed(str(cause.get("stderr_tail") or "").splitlines())
                         if line.strip()), "")
        parts = [str(cause.get("exit") or ""), str(cause.get("error") or ""), last_err]
        why = "; ".join(part for part in parts if part) or "no cause recorded"
        if len(why) > 300:
            why = why[:300] + "..."
        lines.append(f"{outcome_class} ({len(members)}): e.g. {example.get('name')}: {why}")
    return lines


def _script(cfg: TuningConfig, script_args: list[str]) -> tuple[Path, tuple[str, ...]]:
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


def _check_numbers(args: argparse.Namespace) -> None:
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
    for flag, low, high in (("slot_memory", MIN_SLOT_MEMORY_BYTES, total),
                            ("min_slot_memory", 1, MAX_MEMORY_BYTES)):
        value = getattr(args, flag)
        if value is None:
            continue
        try:
            size = parse_size(value)
        except ValueError as exc:
            raise UsageError(f"--{flag.replace('_', '-')}: {exc}") from None
        except OverflowError:
            size = high + 1
        if not low <= size <= high:
            raise UsageError(f"--{flag.replace('_', '-')} {value}: must be from {low / 2**20:g} MiB to "
                             f"{high / 2**30:.1f} GiB" + (" (this machine's RAM)" if flag == "slot_memory" else ""))


def _connect(url: str) -> redis.Redis:
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


def _raise_keyboard_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
