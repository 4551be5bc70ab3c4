"""The host side of `python -m deploy`: run on each host over SSH (or directly on the local one).

Why a module and not shell snippets: starting a worker that outlives the SSH session, stopping it
warm then cold, and killing a recorded process group only if it still runs our slot are small
programs; written once in Python they behave the same on every host, take their arguments as an
argv (nothing to quote wrongly) and answer in one JSON line that the deployer parses.

Every process it starts gets its own session (no SIGHUP when SSH disconnects), its log and a
pidfile (pid + start time, so a reused PID is never signalled) in the run folder. Secrets arrive
on stdin (`up`) and are kept in a 0600 JSON file there; they never appear on a command line.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from celeryconfig import worker_soft_shutdown_timeout
from workers.process.launch import KILL_GRACE_S, group_runs_slot, kill_groups as kill_groups_of
from workers.state.redis_tls import TLS_ENV
from scheduler.embedded.worker_command import control_worker_argv, flower_argv, slot_worker_argv

ENV_FILE = "env.json"
#: After SIGQUIT a slot worker gives its running experiment Celery's soft shutdown, then cancels it:
#: the rank kills its training group (TERM, KILL_GRACE_S, KILL) and the message is restored. A
#: SIGKILL before that leaves the training group running (it has a session of its own), so the
#: wait covers both, plus room for a loaded machine.
COLD_GRACE_S = worker_soft_shutdown_timeout + KILL_GRACE_S + 15.0
#: How long `kill-groups` waits for a group to go after SIGKILL before it reports it still alive.
KILL_WAIT_S = 10.0
ALLOWED_ENV = frozenset({"AUTOTUNE_REDIS_URL", "FLOWER_BASIC_AUTH", "AUTOTUNE_SLOT_MEMORY",
                         "AUTOTUNE_DEVICE_KIND", "AUTOTUNE_ADDRESS", "AUTOTUNE_SSH_CONFIG", "AUTOTUNE_WARM_START",
                         *TLS_ENV})


def _say(payload: object) -> None:
    print(json.dumps(payload), flush=True)


def _run_dir(path: str) -> Path:
    run_dir = Path(path).expanduser()
    run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(run_dir, 0o700)
    return run_dir


def write_env(run_dir: Path, payload: dict[str, str]) -> None:
    """Store the secrets a host's workers need, readable by this user only."""
    unknown = set(payload) - ALLOWED_ENV
    if unknown:
        raise SystemExit(f"error: unexpected environment names {sorted(unknown)}")
    target = run_dir / ENV_FILE
    temp = run_dir / f".{ENV_FILE}.{os.getpid()}"
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump(payload, out)
    os.replace(temp, target)


def _pidfile(run_dir: Path, label: str) -> Path:
    return run_dir / f"{label}.pid"


def _alive(run_dir: Path, label: str) -> psutil.Process | None:
    """The process a pidfile names, if it still runs and is the one we started (same start time)."""
    try:
        record = json.loads(_pidfile(run_dir, label).read_text())
        proc = psutil.Process(int(record["pid"]))
        if abs(proc.create_time() - float(record["started"])) > 1.0 or proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return proc
    except (OSError, ValueError, KeyError, psutil.Error):
        return None


def _last_line(log: Path) -> str:
    try:
        with open(log, "rb") as handle:
            handle.seek(max(0, log.stat().st_size - 4096))
            lines = [line.strip() for line in handle.read().decode(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    errors = [line for line in lines if line.startswith("error:")]
    return (errors or lines or [""])[-1][:300]


def up(run_dir: Path, request: dict) -> dict[str, object]:
    """Store the secrets (`env`), then start every process of `workers` not already running."""
    write_env(run_dir, request.get("env", {}))
    return {worker["label"]: start(run_dir, worker) for worker in request.get("workers", [])}


def start(run_dir: Path, worker: dict) -> dict[str, object]:
    """Start one slot worker, control worker or Flower in its own session, logging to its file."""
    label = worker["label"]
    existing = _alive(run_dir, label)
    if existing is not None:
        return {"pid": existing.pid, "started": False, "note": "already running"}
    secrets = json.loads((run_dir / ENV_FILE).read_text())
    # SPT_NOENV: setproctitle (when installed, Celery uses it) must not overwrite /proc/<pid>/environ.
    env = {**os.environ, **secrets, "PYTHONUNBUFFERED": "1", "AUTOTUNE_NODE": worker["node"], "SPT_NOENV": "1"}
    argv = (flower_argv(int(worker["port"])) if worker["role"] == "flower" else
            control_worker_argv(worker["node"]) if worker["role"] == "control" else
            slot_worker_argv(int(worker["device"]), worker["node"]))
    log = run_dir / f"{label}.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True)
    started = psutil.Process(proc.pid).create_time()
    _pidfile(run_dir, label).write_text(json.dumps({"pid": proc.pid, "started": started,
                                                    "role": worker["role"]}))
    return {"pid": proc.pid, "started": True, "log": str(log)}


def _pidfiles(run_dir: Path, node: str) -> list[Path]:
    """The pidfiles of `node`'s processes (labels are `<node>.<what>`; a shared home holds several)."""
    return sorted(p for p in run_dir.glob("*.pid") if p.stem.rsplit(".", 1)[0] == node)


def status(args: argparse.Namespace) -> dict[str, object]:
    run_dir = _run_dir(args.run_dir)
    report = {}
    for pidfile in _pidfiles(run_dir, args.node):
        label = pidfile.stem
        proc = _alive(run_dir, label)
        report[label] = {"running": proc is not None, "pid": proc.pid if proc else None,
                         "last_log_line": _last_line(run_dir / f"{label}.log")}
    return report


def _wait_gone(procs: list[psutil.Process], deadline: float) -> list[psutil.Process]:
    _, alive = psutil.wait_procs(procs, timeout=max(0.0, deadline - time.monotonic()))
    return alive


def stop(args: argparse.Namespace) -> dict[str, object]:
    """Warm shutdown (SIGTERM: running experiments finish) until the deadline, then cold (SIGQUIT:
    the running experiment's group is killed, its message requeued), then SIGKILL."""
    run_dir = _run_dir(args.run_dir)
    procs = {}
    report: dict[str, object] = {}
    for pidfile in _pidfiles(run_dir, args.node):
        proc = _alive(run_dir, pidfile.stem)
        if proc is None:
            report[pidfile.stem] = "not running"
            pidfile.unlink(missing_ok=True)
        else:
            procs[pidfile.stem] = proc
    for proc in procs.values():
        proc.send_signal(signal.SIGTERM)
    alive = _wait_gone(list(procs.values()), time.monotonic() + args.deadline)
    for proc in alive:
        proc.send_signal(signal.SIGQUIT)
    still = _wait_gone(alive, time.monotonic() + COLD_GRACE_S)
    for proc in still:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _wait_gone(still, time.monotonic() + 5.0)
    for label, proc in procs.items():
        report[label] = ("killed" if proc in still else "cold shutdown" if proc in alive else "warm shutdown")
        _pidfile(run_dir, label).unlink(missing_ok=True)
    return report


def kill_groups(args: argparse.Namespace) -> dict[str, object]:
    """TERM each recorded group still running its slot, give it `grace` seconds, then KILL
    (`workers.process.launch.kill_groups`). Each item is QUEUE=PGID[@STARTED]: with the leader's recorded
    start time, the group is that rank only if its leader started then; without, only if a process
    of it carries a rank title of QUEUE (`workers.process.process_identity.owns_group`)."""
    targets: dict[str, int] = {}
    for item in args.groups:
        queue, _, group = item.rpartition("=")
        pgid_text, _, started_text = group.partition("@")
        if group_runs_slot(int(pgid_text), queue, int(started_text) if started_text else None):
            targets[item] = int(pgid_text)
    done = kill_groups_of(targets.values(), grace_s=args.grace, wait_s=KILL_WAIT_S)
    report: dict[str, object] = {}
    for item in args.groups:
        pgid = targets.get(item)
        report[item] = (f"still alive {KILL_WAIT_S:g}s after SIGKILL" if pgid in done.stuck else
                        f"killed with SIGKILL after {args.grace:g}s (ignored SIGTERM)" if pgid in done.killed else
                        "terminated by SIGTERM" if pgid in done.terminated else
                        "gone (no process of this group runs that slot)")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy.remote")
    sub = parser.add_subparsers(dest="action", required=True)
    begin = sub.add_parser("up", help="stdin: {\"env\": {...}, \"workers\": [...]} (JSON)")
    begin.add_argument("--run-dir", required=True)
    state = sub.add_parser("status")
    state.add_argument("--run-dir", required=True)
    state.add_argument("--node", required=True)
    end = sub.add_parser("stop")
    end.add_argument("--run-dir", required=True)
    end.add_argument("--node", required=True)
    end.add_argument("--deadline", type=float, default=60.0)
    kill = sub.add_parser("kill-groups")
    kill.add_argument("--grace", type=float, default=5.0)
    kill.add_argument("groups", nargs="*")
    args = parser.parse_args(argv)
    if args.action == "up":
        _say(up(_run_dir(args.run_dir), json.loads(sys.stdin.read())))
    else:
        _say({"status": status, "stop": stop, "kill-groups": kill_groups}[args.action](args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
