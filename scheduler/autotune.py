"""`python -m scheduler.autotune cfg.json [options] [-- train.py args...]`: tune, report, write the winner.

With AUTOTUNE_REDIS_URL set it uses the slot and control workers already running on that Redis;
otherwise it starts an embedded cluster on this machine (private redis-server, one slot worker per
device, a control worker) and stops it afterwards, also on errors and Ctrl-C.

Finished experiments are kept in the results folder: running the same command again reuses every
experiment whose config is unchanged and re-runs only the rest (`"overwrite": true` starts afresh).
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import redis
from rich.console import Console

from scheduler import status
from scheduler.arguments import check_arg_mappings, parse_arg_mappings, with_config, with_mapped_args
from scheduler.config import TuningConfig, load_config
from scheduler.errors import ClusterError, ConfigError, UsageError
from scheduler.outputs import print_table, write_experiment_descriptions, write_results
from scheduler.ranking import metric_value
from scheduler.fast_search import PROFILE, SearchSettings, fast_search
from scheduler.phases import Phase, drive
from scheduler.space import Experiment, optimal_config
from workers.local_cluster import LocalCluster, LocalClusterError
from workers.paths import read_json, safe_child
from workers.registry import connect, control_alive, live_slots
from workers.slot import parse_size

RUN_TIMEOUT_S = 7 * 24 * 3600.0  #: a real training run: the limit only guards against a hang forever
console = Console(highlight=False, width=None if sys.stdout.isatty() else 130)


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    own, script = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(
        prog="python -m scheduler.autotune",
        description="Find the fastest DeepSpeed configuration for a training script.")
    parser.add_argument("config", nargs="?",
                        help="DeepSpeed config with an \"autotuning\" section (JSON or hjson)")
    parser.add_argument("--status", action="store_true",
                        help="show the cluster at AUTOTUNE_REDIS_URL: slots, who holds them, jobs and "
                        "why their next experiment waits; tunes nothing")
    parser.add_argument("--slots", type=int, default=os.cpu_count() or 1,
                        help="embedded cluster: slot workers to start (default: number of cores)")
    parser.add_argument("--slot-memory", help="embedded cluster on CPU: memory cap per slot, e.g. 3GiB "
                        "(default: total RAM / slots)")
    parser.add_argument("--num_gpus", type=int, help="slots per experiment (default: all slots of a node)")
    parser.add_argument("--num_nodes", type=int, default=1, help="nodes per experiment (default 1)")
    parser.add_argument("--exp-timeout", type=float, default=900.0,
                        help="wall-clock limit of one experiment in seconds (default 900)")
    parser.add_argument("--run", action="store_true",
                        help="after tuning, train with the optimal config on the same kind of slots "
                        "(DeepSpeed's --autotuning run)")
    return parser.parse_args(own), script


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    try:
        return run(*parse_args(sys.argv[1:] if argv is None else argv))
    except (UsageError, LocalClusterError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
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
    cfg = load_config(args.config)
    script, base_args = _script(cfg, script_args)
    mappings = parse_arg_mappings(cfg.ds_config["autotuning"].get("arg_mappings"), str(cfg.path))
    check_arg_mappings(mappings, base_args, str(cfg.path))
    _check_numbers(args)
    if cfg.overwrite:
        shutil.rmtree(cfg.results_dir, ignore_errors=True)
        shutil.rmtree(cfg.exps_dir, ignore_errors=True)
    cfg.results_dir.mkdir(parents=True, exist_ok=True)
    url = os.environ.get("AUTOTUNE_REDIS_URL")
    if url:
        return tune(cfg, args, script, base_args, mappings, _connect(url))
    with LocalCluster(args.slots, cfg.results_dir / "cluster", slot_memory=args.slot_memory) as cluster:
        console.print(f"embedded cluster: redis-server and {args.slots} slot workers + control "
                      f"on {cluster.node} (logs in {cfg.results_dir / 'cluster'})")
        os.environ["AUTOTUNE_REDIS_URL"] = cluster.url
        try:
            return tune(cfg, args, script, base_args, mappings, connect(cluster.url))
        finally:
            os.environ.pop("AUTOTUNE_REDIS_URL", None)


def tune(cfg: TuningConfig, args: argparse.Namespace, script: Path, base_args: tuple[str, ...],
         mappings: dict[str, str], client: redis.Redis) -> int:
    from scheduler.driver import Driver  # imports the Celery app, which reads AUTOTUNE_REDIS_URL
    from tasks import app

    slots = live_slots(client)
    if not slots:
        raise ClusterError("no slot workers are registered in Redis; start one per device with "
                           "`celery -A tasks worker -Q gpu0 -n gpu0@%h`")
    if not control_alive(client):
        raise ClusterError("no control worker is running; start one with "
                           "`celery -A tasks worker -Q control -n control@%h`")
    per_node = max(sum(1 for s in slots if s.node == node) for node in {s.node for s in slots})
    num_gpus = args.num_gpus or per_node
    settings = SearchSettings.from_config(
        cfg, capacity_bytes=min(s.memory_bytes for s in slots), num_nodes=args.num_nodes,
        num_gpus=num_gpus, device_kind="cpu" if all(s.kind == "cpu" for s in slots) else "gpu",
        concurrency=len(slots) // (args.num_nodes * num_gpus))
    console.print(f"tuning {script.name}: stages {list(cfg.stages)}, {args.num_nodes} node(s) x "
                  f"{num_gpus} slot(s) per experiment, metric {cfg.metric}, "
                  f"slot memory {settings.capacity_bytes / 2**30:.1f} GiB")

    experiments: list[Experiment] = []
    records: dict[str, dict[str, Any]] = {}

    def argv_for(exp: Experiment, config_path: Path) -> list[str]:
        return with_config(str(script), with_mapped_args(base_args, mappings, exp.ds_config), config_path)

    def report(record: dict[str, Any]) -> None:
        records[record["name"]] = record
        _check_metric_key(cfg, record)
        value = metric_value(record, cfg.metric)
        shown = f"{cfg.metric}={value:,.2f}" if value is not None else record.get("status")
        console.print(f"  {record['name']:<28} {record.get('status', '?'):<10} {shown}  "
                      f"{record.get('wall_s') or 0:.1f}s on {','.join(record.get('slots') or [])}")

    driver = Driver(client, app, job=uuid.uuid4().hex, results_root=cfg.results_dir,
                    script_argv=argv_for, cwd=os.getcwd(), timeout_s=args.exp_timeout, on_record=report)

    def run_phase(phase: Phase) -> dict[str, dict[str, Any]]:
        experiments.extend(e for e in phase.experiments if e not in experiments)
        reused = {e.name: r for e in phase.experiments if (r := _measured_before(cfg.results_dir, e))}
        records.update(reused)
        todo = [e for e in phase.experiments if e.name not in reused]
        console.print(f"phase {phase.name}: {len(todo)} to run"
                      + (f", {len(reused)} already measured" if reused else ""))
        write_experiment_descriptions(cfg.exps_dir, todo)
        driver.run(todo)
        return {e.name: records[e.name] for e in phase.experiments}

    started = time.time()
    try:
        drive(fast_search(settings), run_phase)
    except BaseException:
        driver.cancel()
        _report(cfg, experiments, records, started, argv_for)
        raise
    winner = _report(cfg, experiments, records, started, argv_for)
    if winner is None:
        return 1
    if args.run:
        return _train_with_optimal(cfg, args, client, app, argv_for,
                                   next(e for e in experiments if e.name == winner["name"]))
    return 0


def _train_with_optimal(cfg: TuningConfig, args: argparse.Namespace, client: redis.Redis, app,
                        argv_for, best: Experiment) -> int:
    """DeepSpeed's `--autotuning run`, but the training really trains: the optimal config has no
    autotuning section, so nothing exits after the profiled steps. Ranks run on the slot workers."""
    from scheduler.driver import Driver

    optimal = replace(best, name="run_optimal", ds_config=optimal_config(best.ds_config),
                      tuning_space="run_optimal", metric_file="")
    console.print(f"training with the optimal config {best.name} on {best.num_nodes} node(s) x "
                  f"{best.num_gpus} slot(s); logs in {cfg.results_dir / optimal.name}")
    outcome: dict[str, Any] = {}
    driver = Driver(client, app, job=uuid.uuid4().hex, results_root=cfg.results_dir,
                    script_argv=argv_for, cwd=os.getcwd(), timeout_s=RUN_TIMEOUT_S,
                    on_record=outcome.update)
    try:
        driver.run([optimal])
    except BaseException:
        driver.cancel()
        raise
    console.print(f"training {outcome.get('status')}: "
                  + ", ".join(f"rank {r.get('rank')} {r.get('exit')}" for r in outcome.get("ranks", [])))
    return 0 if outcome.get("status") == "ok" else 1


def show_status() -> int:
    url = os.environ.get("AUTOTUNE_REDIS_URL")
    if not url:
        raise UsageError("--status needs the cluster's Redis: set AUTOTUNE_REDIS_URL "
                         "(an embedded cluster lives only as long as its autotuner)")
    status.render(console, status.collect(_connect(url)))
    return 0


def _check_metric_key(cfg: TuningConfig, record: dict[str, Any]) -> None:
    """A script that never writes the metric asked for would make every experiment look failed."""
    metrics = record.get("metrics")
    if record.get("status") == "ok" and record["name"] != PROFILE and isinstance(metrics, dict) \
            and cfg.metric not in metrics:
        raise ConfigError(f"{cfg.path}: autotuning.metric is \"{cfg.metric}\" but the script's metrics "
                          f"file has only {sorted(metrics)}; choose one of those or write \"{cfg.metric}\"")


def _report(cfg: TuningConfig, experiments: list[Experiment], records: dict[str, dict[str, Any]],
            started: float, argv_for) -> dict[str, Any] | None:
    winner = write_results(cfg.results_dir, experiments, records, cfg.metric, cfg.maximize,
                           time.time() - started, argv_for)
    print_table(console, experiments, records, cfg.metric, winner)
    console.print((cfg.results_dir / "summary.txt").read_text())
    if winner is None:
        console.print("no experiment succeeded: see the cause in each experiment's result.json")
    else:
        console.print(f"best: {winner['name']} -> {cfg.results_dir / 'ds_config_optimal.json'}\n"
                      f"run it: {(cfg.results_dir / 'cmd_optimal.txt').read_text().strip()}")
    return winner


def _measured_before(results_dir: Path, exp: Experiment) -> dict[str, Any] | None:
    """The record of `exp` if an earlier run measured exactly this config (resume), else None."""
    record = read_json(safe_child(results_dir, exp.name) / "result.json")
    if isinstance(record, dict) and record.get("ds_config") == exp.ds_config \
            and record.get("status") != "lost":
        return record
    return None


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
    return script, args


def _check_numbers(args: argparse.Namespace) -> None:
    for name in ("slots", "num_gpus", "num_nodes"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UsageError(f"--{name.replace('_', '-') if name == 'slots' else name} must be at least 1")
    if args.exp_timeout <= 0:
        raise UsageError("--exp-timeout must be a positive number of seconds")
    if args.slot_memory is not None:
        try:
            parse_size(args.slot_memory)
        except ValueError as exc:
            raise UsageError(f"--slot-memory: {exc}") from None


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
        raise ClusterError(f"cannot reach Redis at {where} (AUTOTUNE_REDIS_URL): {exc}; start "
                           "redis-server there or unset AUTOTUNE_REDIS_URL for an embedded cluster") from None
    return client


def _raise_keyboard_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
