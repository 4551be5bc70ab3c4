"""`python -m deploy up|down|status|cleanup|redis-user`: the cluster's workers, started and stopped over SSH.

Why: the README's hand recipe (one `celery ... worker` per GPU on every node) is easy to get wrong
and leaves nothing to stop or clean up with. This starts one slot worker per selected device of a
hostfile (the same hostfile and `--include/--exclude` as `scheduler.run`), the control worker and
Flower where asked, as processes that outlive the SSH session; waits until every slot registered in
Redis and says, one line per host, which did not and why; stops them warm then cold; shows each
slot's state; kills the recorded process groups of a job or experiment on their hosts; and creates
the cluster's least-privilege Redis user on a running Redis (`up` warns when the URL's user could
still reconfigure the server).

    python -m deploy up --hostfile F [--include S|--exclude S] [--control HOST] [--flower [PORT]]
    python -m deploy status|down --hostfile F [...]
    python -m deploy cleanup JOB[:EXPERIMENT]   (JOB: a job id or a tuning job's results folder)
    python -m deploy redis-user       (AUTOTUNE_REDIS_ADMIN_URL set: deploy/redis_user.py)

The Redis URL comes from AUTOTUNE_REDIS_URL (or --redis); it reaches each host on stdin and is kept
there in a 0600 file, never on a command line. SSH user, port and key come from ~/.ssh/config
(or --ssh-config, whose path the started workers get too: the control worker reaches other hosts
under the same names to clean up a lost launch); unknown host keys are refused unless
--accept-new-host-keys.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from deploy.cleanup import DEFAULT_GRACE_S, cleanup, running_launches
from deploy.fabric_hosts import Answer, Hosts
from deploy.plan import by_host, check_redis_url, plan_workers, registration_report, up_request
from deploy.redis_user import ADMIN_ENV, connected, create_cluster_user, may_reconfigure
from scheduler.errors import OneLineArgumentParser, UsageError
from scheduler.launch.hostfile import read_hostfile
from scheduler.launch.resources import ResourceRequest, resolve_resources
from workers.state.redis_tls import TLS_ENV
from workers.state.store import RedisSlotStore
from workers.warm.warm_plan import SWITCH_ENV as WARM_SWITCH_ENV

REPO = str(Path(__file__).resolve().parents[1])
RUN_DIR = "~/.celery-autotune/run"
FLOWER_USER = "autotune"


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(prog="python -m deploy", description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=["up", "down", "status", "cleanup", "redis-user"])
    parser.add_argument("target", nargs="?", help="cleanup: JOB or JOB:EXPERIMENT (JOB: a job id or a tuning job's results folder)")
    parser.add_argument("-H", "--hostfile", help="MPI-style hostfile: 'HOSTNAME slots=N' per line")
    parser.add_argument("-i", "--include", default="", help="NODE[:ID[,ID...]][@NODE...]: only these")
    parser.add_argument("-e", "--exclude", default="", help="NODE[:ID[,ID...]][@NODE...]: all but these")
    parser.add_argument("--redis", help="Redis URL (default: $AUTOTUNE_REDIS_URL; prefer the variable, "
                                        "a command line is visible in ps)")
    parser.add_argument("--control", metavar="HOST", help="up: start the control worker on HOST")
    parser.add_argument("--flower", nargs="?", type=int, const=5555, metavar="PORT",
                        help="up: start Flower next to the control worker, on 127.0.0.1:PORT (5555)")
    parser.add_argument("--ssh-config", help="SSH config to read instead of ~/.ssh/config")
    parser.add_argument("--accept-new-host-keys", action="store_true",
                        help="trust host keys not yet in known_hosts (and add them); default: refuse")
    parser.add_argument("--repo", default=REPO, help="this repository's path on the hosts (default: same)")
    parser.add_argument("--python", default=sys.executable, help="python on the hosts (default: same)")
    parser.add_argument("--run-dir", default=RUN_DIR, help="pidfiles, logs and the 0600 env file on each host")
    parser.add_argument("--timeout", type=float, default=120.0, help="up: seconds to wait for registration")
    parser.add_argument("--deadline", type=float, default=60.0,
                        help="down: seconds of warm shutdown (running experiments finish) before a cold one")
    parser.add_argument("--grace", type=float, default=DEFAULT_GRACE_S,
                        help="cleanup: seconds between SIGTERM and SIGKILL")
    return parser


def selected_hosts(args: argparse.Namespace) -> dict[str, list[int]]:
    if not args.hostfile:
        raise UsageError(f"{args.action} needs --hostfile F ('HOSTNAME slots=N' per line)")
    pool = read_hostfile(args.hostfile)
    request = ResourceRequest(include=args.include, exclude=args.exclude)
    return resolve_resources(pool, request, hostfile=args.hostfile).hosts


def _hosts(args: argparse.Namespace) -> Hosts:
    return Hosts(args.repo, args.python, ssh_config=args.ssh_config,
                 accept_new_host_keys=args.accept_new_host_keys)


def up(args: argparse.Namespace, url: str) -> int:
    hosts_devices = selected_hosts(args)
    if args.control and args.control not in hosts_devices:
        hosts_devices = {**hosts_devices, args.control: []}
    plans = plan_workers(hosts_devices, args.control, flower=args.flower is not None)
    client = connected(url)
    if may_reconfigure(client):
        print("deploy: warning: the user in AUTOTUNE_REDIS_URL may run CONFIG, MODULE and FLUSHALL: one compromised "
              "node could take over the Redis host or wipe every job; create the cluster's own user with "
              "`python -m deploy redis-user` (docs/cluster.md, \"The cluster's Redis\")", file=sys.stderr)
    # TLS: the certificate files' paths (each host has its own copy there), never their contents;
    # the warm-start switch as the deployer has it (AUTOTUNE_WARM_START=0 python -m deploy up: every rank cold)
    env = {"AUTOTUNE_REDIS_URL": url, **_ssh_config_env(args),
           **{name: os.environ[name] for name in (*TLS_ENV, WARM_SWITCH_ENV) if os.environ.get(name)}}
    flower_password = secrets.token_urlsafe(12) if args.flower is not None else ""
    grouped = by_host(plans)
    answers = _hosts(args).run_many({
        host: ("up", ["--run-dir", args.run_dir],
               json.dumps(up_request(host_plans, {**env, **({"FLOWER_BASIC_AUTH": f"{FLOWER_USER}:{flower_password}"}
                                                       if any(p.role == "flower" for p in host_plans) else {})},
                                args.flower)))
        for host, host_plans in grouped.items()})
    host_errors = {host: answer.error for host, answer in answers.items() if not answer.ok}
    expected = {p.slot: p for p in plans if p.role == "slot" and p.host not in host_errors}
    exits: dict[str, str] = {}
    deadline = time.monotonic() + args.timeout
    next_check = time.monotonic() + 2.0
    while True:
        live = {slot.queue for slot in RedisSlotStore(client).live_slots()}
        waiting = [q for q in expected if q not in live and q not in exits]
        if not waiting or time.monotonic() > deadline:
            break
        if time.monotonic() >= next_check:  # a worker that exited will never register: stop waiting
            exits.update(_exited(args, [expected[q] for q in waiting]))
            next_check = time.monotonic() + 2.0
        time.sleep(0.3)
    for line in registration_report(plans, live, host_errors, exits):
        print(line)
    if args.flower is not None and args.control not in host_errors:
        print(f"flower: http://127.0.0.1:{args.flower}/ on {args.control} (bound to 127.0.0.1; from "
              f"elsewhere: ssh -L {args.flower}:127.0.0.1:{args.flower} {args.control}); "
              f"user {FLOWER_USER}, password {flower_password} (shown once)")
    failed = bool(host_errors) or any(q not in live for q in expected)
    return 1 if failed else 0


def _ssh_config_env(args: argparse.Namespace) -> dict[str, str]:
    """The SSH config this deploy used, for the workers it starts: the control worker kills a lost
    launch's process groups on their hosts over SSH (deploy.cleanup), and must reach them under the
    same names. Without it, a hostfile of aliases from --ssh-config resolves nowhere there."""
    path = args.ssh_config or os.environ.get("AUTOTUNE_SSH_CONFIG")
    return {"AUTOTUNE_SSH_CONFIG": str(Path(path).expanduser().resolve())} if path else {}


def _exited(args: argparse.Namespace, waiting: Sequence) -> dict[str, str]:
    """Slot queue -> why its worker ended, for waiting slots whose worker process is gone."""
    found = {}
    hosts = {p.host for p in waiting}
    answers = _hosts(args).run_many({h: ("status", ["--run-dir", args.run_dir, "--node", h], None)
                                     for h in hosts})
    for plan in waiting:
        report = answers[plan.host].data if answers[plan.host].ok else None
        entry = report.get(plan.label) if isinstance(report, dict) else None
        if entry is not None and not entry["running"]:
            found[plan.slot] = f"worker exited: {entry['last_log_line'] or 'no log output'}"
    return found


def status(args: argparse.Namespace, url: str) -> int:
    hosts_devices = selected_hosts(args)
    plans = plan_workers(hosts_devices)
    client = connected(url)
    slots = RedisSlotStore(client)
    live = {slot.queue: slot for slot in slots.live_slots()}
    busy = {queue: name for launches in running_launches(client).values()
            for name, launch in launches.items() for queue in launch.get("queues", [])}
    answers = _hosts(args).run_many({h: ("status", ["--run-dir", args.run_dir, "--node", h], None)
                                     for h in hosts_devices})
    reserved_slots = slots.held([plan.slot for plan in plans if plan.slot in live])
    for plan in plans:
        answer = answers[plan.host]
        proc = answer.data.get(plan.label) if answer.ok and isinstance(answer.data, dict) else None
        if plan.slot in live:
            state = (f"busy: {busy[plan.slot]}" if plan.slot in busy
                     else "reserved" if plan.slot in reserved_slots else "idle")
            pid = proc["pid"] if proc else "?" if answer.ok else f"? ({plan.host} did not answer: {answer.error})"
            print(f"{plan.slot}: {state} (worker {live[plan.slot].worker}, pid {pid})")
        elif not answer.ok:
            print(f"{plan.slot}: unknown: {answer.error}")
        elif proc and proc["running"]:
            print(f"{plan.slot}: starting (pid {proc['pid']}, not registered yet)")
        else:
            why = f": {proc['last_log_line']}" if proc and proc["last_log_line"] else ""
            print(f"{plan.slot}: down{why}")
    return 0 if all(p.slot in live for p in plans) else 1


def _with_control(args: argparse.Namespace, hosts_devices: dict[str, list[int]]) -> list[str]:
    return list(hosts_devices) + ([args.control] if args.control and args.control not in hosts_devices else [])


def down(args: argparse.Namespace) -> int:
    hosts_devices = selected_hosts(args)
    answers = _hosts(args).run_many(
        {h: ("stop", ["--run-dir", args.run_dir, "--node", h, "--deadline", f"{args.deadline:g}"], None)
         for h in _with_control(args, hosts_devices)},
        timeout=args.deadline + 60)
    return _print_per_host(answers)


def _print_per_host(answers: dict[str, Answer]) -> int:
    failed = False
    for host, answer in answers.items():
        if not answer.ok:
            failed = True
            print(f"{host}: FAILED: {answer.error}")
        elif not answer.data:
            print(f"{host}: nothing to do")
        else:
            print(f"{host}: " + "; ".join(f"{label} {what}" for label, what in answer.data.items()))
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        if args.flower is not None and not 1 <= args.flower <= 65535:
            raise UsageError("--flower PORT: a port 1-65535")
        if args.action == "down":
            return down(args)
        url = check_redis_url(args.redis or os.environ.get("AUTOTUNE_REDIS_URL"),
                              "--redis" if args.redis else "AUTOTUNE_REDIS_URL")
        if args.action == "up":
            return up(args, url)
        if args.action == "status":
            return status(args, url)
        if args.action == "redis-user":
            print(create_cluster_user(url, os.environ.get(ADMIN_ENV)))
            return 0
        if not args.target:
            raise UsageError("cleanup needs a job: python -m deploy cleanup JOB[:EXPERIMENT] (a job id or results folder)")
        result = cleanup(connected(url), _hosts(args), args.target, args.grace)
        if not result:
            print(f"{args.target}: no recorded process groups (not running, or already cleaned up)")
            return 0
        return _print_per_host({node: Answer(node, data=r) if isinstance(r, dict) else Answer(node, error=r)
                                for node, r in result.items()})
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
