"""`python -m scheduler.run [options] train.py [args...]`: what `deepspeed train.py ...` does, on Celery slots.

Why: after tuning, people launch training as DeepSpeed taught them: a hostfile and --include/--exclude/
--num_nodes/--num_gpus (resolved by `scheduler.launch.resources`, CUDA_VISIBLE_DEVICES rule included), the
script's arguments untouched (argv lists end to end), one rank per selected device.

`--launcher celery` (default) runs ONE Experiment as a fixed job pinned to the selected slots (`scheduler.cluster.jobs`): each selected (host,
device) is the slot queue `<host>.gpu<device>`, so hostfile hostnames must be the workers' node names
(AUTOTUNE_NODE, else the `name@node` of `-n`); `localhost` is this machine. With AUTOTUNE_REDIS_URL the
running workers serve it (no control worker or no slot registered yet: waited for up to
AUTOTUNE_CLUSTER_WAIT_S; a selected slot without a live worker: one `error:` line, exit 2); without
it an embedded cluster runs here and is torn down after. Ranks log to `<log_dir>/run/` (rank 0:
stdout.log/stderr.log, rank N: rankN.stdout.log/rankN.stderr.log; result.json: every rank's record).
Exit 0 when every rank succeeded, else the root-cause rank's exit code (killed by signal N: 128+N).
Ctrl-C/SIGTERM revokes every rank, kills its process group, stops the embedded cluster, exits 130.
`--launcher pdsh|openmpi|mpich|impi|mvapich|slurm` runs DeepSpeed's command (`scheduler.launch.launchers`) in
its own process group, forwards Ctrl-C/SIGTERM to it and returns its exit code; one host runs
DeepSpeed's per-node launcher locally, as DeepSpeed does. `--dry_run` prints the argv as JSON
(secret variables by name only: `scheduler.launch.environment.is_secret`).

Deliberate differences from DeepSpeed's runner, and why:
- the default launcher is celery: no ssh or pdsh needed, ranks run on exactly the selected slots.
- celery ranks get RANK LOCAL_RANK WORLD_SIZE LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT in the
  environment as torchrun sets them, and no `--local_rank=N` argument (the job passes the argv
  unchanged; deepspeed.init_distributed reads the environment). They meet at a free port of rank 0's
  node, so --master_addr/--master_port/--launcher_args are errors; their output goes to files.
- --elastic_training needs --launcher pdsh (torchrun on every host, or locally on one host).
- --timeout (default a week) stops a hung run (other launchers: exit 124); DeepSpeed waits forever.
- the control worker relaunches a run lost with its worker or node (AUTOTUNE_MAX_ATTEMPTS, default 3, as
  torchrun restarts); DeepSpeed never does. A run lost for good exits 1.
- MASTER_ADDR defaults to the first host's name (one host: 127.0.0.1), not its `hostname -I` via ssh.
- a multi-host launch checks ssh in BatchMode on every host (DeepSpeed: the first); an interrupt
  exits 130 (DeepSpeed: 1); a rank killed by signal N exits 128+N (DeepSpeed: 256-N); no remote
  `pkill -f` after pdsh.
- the embedded cluster starts a worker for exactly each selected device id, no
  RAM cap per CPU rank (training, not a probe), AUTOTUNE_VISIBILITY_TIMEOUT = --timeout + 1 h;
  external workers need theirs above the run's length too, or Redis redelivers a rank.
- `kill -USR1 <pid>` prints every thread's Python stack to stderr and the run goes on (Celery's
  workers answer USR1 alike): a run that seems hung can be read without stopping it.
- not offered: --module --no_python --no_local_rank --no_ssh --node_rank --force_multi --save_pid
  --enable_each_rank_log --bind_cores_to_rank --bind_core_list --venv_script --ssh_port --quiet.
"""
from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import psutil
import redis

from scheduler import exits
from scheduler.launch import elastic
from scheduler.launch.environment import check_numeric_variables, check_redis_url, collect_exports, write_private_file
from scheduler.errors import OneLineArgumentParser, UsageError
from scheduler.preflight import wait_for_cluster
from scheduler.cluster.jobs import JobSpec, run_fixed
from scheduler.launch.hostfile import LOCAL_HOSTNAME, SLOT_WORKER_BYTES, local_pool, max_local_slots, read_hostfile
from scheduler.launch.launch_spec import DEFAULT_MASTER_PORT, LaunchSpec, local_command, needs_multinode
from scheduler.launch.launchers import LAUNCHERS, get_launcher, require_backend
from scheduler.launch.mpi_launchers import MvapichLauncher
from scheduler.launch.pdsh_launcher import private_file_exports
from scheduler.launch.resources import ResourceRequest, Resources, resolve_resources
from scheduler.resources import detect_local_devices
from scheduler.search.space import Experiment
from workers.process.launch import kill_group
from scheduler.embedded.local_cluster import LocalCluster, cluster_client
from workers.files.paths import read_json, safe_child
from workers.state.connection import connect
from workers.slot.records import ExperimentRecord
from workers.state.store import RedisSlotStore
from workers.device.slot import slot_queue

RUN_NAME = "run"
DEFAULT_TIMEOUT_S = 7 * 24 * 3600.0
SSH_TIMEOUT_S = 30
STOP_WAIT_S = 20.0
VISIBILITY_MARGIN_S = 3600
MAX_TIMEOUT_S = 365 * 24 * 3600.0  #: --timeout above a year is a typo; inf would overflow the time limits


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(prog="python -m scheduler.run", allow_abbrev=False)
    add = parser.add_argument
    add("-H", "--hostfile", help="'HOSTNAME slots=N' per line (default: this machine only)")
    add("-i", "--include", default="", help="NODE[:ID[,ID...]][@NODE...]: use only these")
    add("-e", "--exclude", default="", help="NODE[:ID[,ID...]][@NODE...]: use all but these")
    add("--num_nodes", type=int, help="use the first N hosts")
    add("--num_gpus", "--num_accelerators", dest="num_gpus", type=int, help="first G devices per host")
    add("--launcher", default="celery", type=str.lower, choices=("celery", *LAUNCHERS))
    add("--launcher_args", default="", help="extra arguments for pdsh/mpirun/srun")
    add("--master_addr", default="", help="non-celery launchers (default: the first host)")
    add("--master_port", type=int, help=f"non-celery launchers (default {DEFAULT_MASTER_PORT})")
    add("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds (default: a week)")
    add("--slots", type=int, help="without --hostfile: devices of this machine (default: GPUs, else cores)")
    add("--log_dir", help="celery: where ranks log (default ./run_logs/<UTC time>-<pid>)")
    add("--no_ssh_check", action="store_true",
        help="non-celery launches across hosts: skip the passwordless ssh check of each host")
    add("--elastic_training", action="store_true", help="torchrun with --min/--max_elastic_nodes")
    add("--min_elastic_nodes", type=int)
    add("--max_elastic_nodes", type=int)
    add("--dry_run", action="store_true", help="print the command as JSON and run nothing")
    add("user_script", help="the training script")
    add("user_args", nargs=argparse.REMAINDER, help="its arguments, passed unchanged")
    return parser


#: How a run ends on a failure (`scheduler.exits`): a Redis failure is most often its URL or password.
ENDINGS = exits.Endings(
    crashed="the control worker failed on this run ({exc})",
    redis_failed="Redis failed ({kind}: {exc}); check that it runs and the password in AUTOTUNE_REDIS_URL, or "
                 "unset it for an embedded cluster",
    redis_code=exits.USAGE,
    interrupted="interrupted: every rank was stopped")


def main(argv: Sequence[str] | None = None) -> int:
    signal.signal(signal.SIGINT, _interrupted)
    signal.signal(signal.SIGTERM, _interrupted)
    return exits.guarded(lambda: run(build_parser().parse_args(sys.argv[1:] if argv is None else list(argv))),
                         ENDINGS)


def run(args: argparse.Namespace) -> int:
    check_numeric_variables(os.environ)
    if not math.isfinite(args.timeout) or not 0 < args.timeout <= MAX_TIMEOUT_S:
        raise UsageError(f"--timeout must be a positive number of seconds up to {MAX_TIMEOUT_S:.0f} "
                         f"(a year), got {args.timeout}")
    url = os.environ.get("AUTOTUNE_REDIS_URL")
    if url:
        check_redis_url(url)
    request = ResourceRequest(include=args.include, exclude=args.exclude,
                              num_nodes=args.num_nodes, num_gpus=args.num_gpus)
    resources = resolve(args, request)
    for note in resources.notes:
        print(f"note: {note}")
    settings = elastic.resolve_elastic(
        elastic_training=args.elastic_training, min_nodes=args.min_elastic_nodes,
        max_nodes=args.max_elastic_nodes, num_hosts=resources.num_nodes, environ=os.environ)
    log_dir = Path(args.log_dir or f"run_logs/{datetime.now(timezone.utc):%Y%m%d-%H%M%S}-{os.getpid()}").resolve()
    if args.launcher == "celery":
        return run_on_slots(args, resources, settings, log_dir)
    return run_backend(args, resources, request, settings)


def resolve(args: argparse.Namespace, request: ResourceRequest) -> Resources:
    """The selected hosts and devices, exactly as `python -m scheduler.resources` resolves them."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if args.hostfile is not None:
        if args.slots is not None:
            raise UsageError("--slots only applies without --hostfile; drop one of them")
        return resolve_resources(read_hostfile(args.hostfile), request, hostfile=args.hostfile,
                                 visible_devices=visible)
    if args.slots is not None and args.slots < 1:
        raise UsageError(f"--slots must be at least 1, got {args.slots}")
    if args.slots is not None and args.launcher == "celery" and args.slots > max_local_slots():
        raise UsageError(f"--slots {args.slots}: this machine can hold at most {max_local_slots()} slot "
                         f"workers ({SLOT_WORKER_BYTES // 2**20} MiB of RAM each); ask for at most {max_local_slots()}")
    count = args.slots if args.slots is not None else detect_local_devices()[0]
    return resolve_resources(local_pool(LOCAL_HOSTNAME, count), request, visible_devices=visible)


def run_on_slots(args: argparse.Namespace, resources: Resources, settings: elastic.ElasticSettings | None,
                 log_dir: Path) -> int:
    """The celery launcher: one Experiment pinned to the selected slots, on running or embedded workers."""
    if settings is not None:
        raise UsageError("--elastic_training needs --launcher pdsh (torchrun on every host, or locally on "
                         "one host); the celery launcher runs a fixed set of ranks")
    for flag in ("--master_addr", "--master_port", "--launcher_args"):
        if getattr(args, flag[2:]):
            raise UsageError(f"{flag} is for the other launchers (celery ranks meet at a free port): drop it")
    if not Path(args.user_script).is_file():
        raise UsageError(f"training script {args.user_script} not found; check the path")
    if not args.user_script.endswith(".py") and not os.access(args.user_script, os.X_OK):
        raise UsageError(f"training script {args.user_script} is not executable (Permission denied); "
                         "chmod +x it, or name a .py file (run through Python)")
    url = os.environ.get("AUTOTUNE_REDIS_URL")
    this_node = (os.environ.get("AUTOTUNE_NODE") if url else None) or socket.gethostname()
    queues = [[slot_queue(this_node if entry.host == LOCAL_HOSTNAME else entry.host, device)
               for device in entry.device_ids] for entry in resources.entries]
    argv = [args.user_script, *args.user_args]
    if args.dry_run:
        print(json.dumps({"slots": queues, "argv": argv}, indent=2))
        return 0
    if not url and resources.num_nodes > 1:
        raise UsageError("a hostfile with several hosts needs running workers: set AUTOTUNE_REDIS_URL "
                         "(see docs/cluster.md) or use --launcher pdsh")

    def embedded() -> LocalCluster:
        os.environ.setdefault("AUTOTUNE_VISIBILITY_TIMEOUT", str(int(args.timeout) + VISIBILITY_MARGIN_S))
        devices = resources.entries[0].device_ids
        return LocalCluster(len(devices), log_dir / "cluster", node=this_node, devices=devices,
                            slot_memory=str(psutil.virtual_memory().total))

    def started(cluster: LocalCluster) -> None:
        print(f"embedded cluster on {cluster.node}: logs in {log_dir / 'cluster'}")

    with cluster_client(connect(url) if url else None, embedded, started) as client:
        return run_experiment(client, argv, queues, args.timeout, log_dir)


def run_experiment(client: redis.Redis, argv: list[str], queues: list[list[str]], timeout_s: float,
                   log_dir: Path) -> int:
    """Run the script once on exactly `queues`, print every rank's outcome, return the exit status."""
    from tasks import app  # imports the Celery app, which reads AUTOTUNE_REDIS_URL
    from tasks.work import CeleryWork

    slots = RedisSlotStore(client)

    def ready() -> str | None:
        if not slots.control_alive():
            return "no control worker is running; start one with `celery -A tasks worker -Q control -n control@%h`"
        return None if slots.live_slots() else "no slot workers are registered in Redis"

    wait_for_cluster(ready)  # a cluster still starting; a started one lacking a selected slot is an error
    live = {slot.queue for slot in slots.live_slots()}
    missing = [queue for node in queues for queue in node if queue not in live]
    if missing:
        raise UsageError(f"no live slot worker for {', '.join(missing)}; start `celery -A tasks worker -Q gpu<i> "
                         "-n gpu<i>@<host>` there, or change the selection")
    experiment = Experiment(name=RUN_NAME, stage=0, micro_batch_size=0, gradient_accumulation_steps=0,
                            ds_config=user_ds_config(argv[1:]), num_nodes=len(queues),
                            num_gpus=len(queues[0]), metric_file="")
    spec = JobSpec(job=uuid.uuid4().hex, results_root=str(log_dir.resolve()), cwd=os.getcwd(),
                   timeout_s=timeout_s, experiments=[{**experiment.to_json(), "argv": list(argv)}],
                   pinned=queues)
    slots = [queue for node in queues for queue in node]
    print(f"running {argv[0]} as {len(slots)} rank(s) on {', '.join(slots)}; "
          f"logs in {safe_child(log_dir, RUN_NAME)}", flush=True)
    [record] = [ExperimentRecord.from_json(result) for result in run_fixed(client, CeleryWork(app), spec)]
    for rank in record.rank_records:
        print(f"rank {rank.rank} on {rank.slot}: {rank.status.value} ({rank.exit}, {rank.wall_s:.1f}s)")
    cause = record.cause or {}
    if cause:
        print(f"run {record.status.value}: root cause rank {cause.get('rank')} ({cause.get('exit')}); its "
              f"stderr ends with:\n{cause.get('stderr_tail', '')}", file=sys.stderr)
    return exit_status(record)


def exit_status(record: ExperimentRecord) -> int:
    """0 when every rank succeeded, else the root-cause rank's exit code (signal N: 128+N; none: 1)."""
    if record.ok:
        return 0
    cause_rank = (record.cause or {}).get("rank")
    codes = [rank.exit_code for rank in record.rank_records if rank.rank == cause_rank]
    return shell_status(codes[0]) if codes and codes[0] else 1


def shell_status(code: int) -> int:
    """A return code as a shell reports it: a death by signal N is 128+N."""
    return 128 - code if code < 0 else code


def user_ds_config(user_args: Sequence[str]) -> dict[str, Any]:
    """The JSON config of `--deepspeed_config X` / `--deepspeed X.json`, for the run's records; else {}."""
    for index, arg in enumerate(user_args):
        following = user_args[index + 1] if index + 1 < len(user_args) else ""
        if arg.startswith(("--deepspeed_config=", "--deepspeed=")):
            config = read_json(Path(arg.split("=", 1)[1]))
        elif arg == "--deepspeed_config" or (arg == "--deepspeed" and following.endswith(".json")):
            config = read_json(Path(following))
        else:
            continue
        return config if isinstance(config, dict) else {}
    return {}


def run_backend(args: argparse.Namespace, resources: Resources, request: ResourceRequest,
                settings: elastic.ElasticSettings | None) -> int:
    """pdsh/MPI/Slurm: DeepSpeed's command in its own process group (DeepSpeed's local launch on one host)."""
    multinode, cwd = needs_multinode(resources), os.getcwd()
    spec = LaunchSpec(
        resources=resources, user_script=args.user_script, user_args=tuple(args.user_args), cwd=cwd,
        master_addr=args.master_addr or (resources.entries[0].host if multinode else "127.0.0.1"),
        master_port=DEFAULT_MASTER_PORT if args.master_port is None else args.master_port,
        launcher_args=args.launcher_args, hostfile=args.hostfile, request=request, elastic=settings,
        exports=collect_exports(os.environ, home_dir=os.path.expanduser("~"), cwd=cwd) if multinode else {},
        secrets_file=os.path.join(cwd, f".autotune_secrets.{uuid.uuid4().hex}"))
    launcher = get_launcher(args.launcher)
    secret = spec.split_exports()[1]  # on no command line: the backend takes them from its environment
    if multinode:
        argv, env = launcher.command(spec), launcher.launch_env(spec, os.environ)
    else:
        argv = local_command(spec)
        env = elastic.node_environment(elastic.shared_device_ids(resources)) if settings else {}
    if args.dry_run:  # the secrets by name, never their values
        print(json.dumps({"argv": argv, "env": env, "secret_variables": list(secret)}, indent=2))
        return 0
    if multinode:
        require_backend(launcher)
        if not args.no_ssh_check:
            check_ssh(list(resources.hosts))
        if isinstance(launcher, MvapichLauncher):
            Path(launcher.hostfile_path).write_text(launcher.hostfile_text(spec))
    private = private_file_exports(launcher, spec) if multinode else {}
    if private:
        write_private_file(spec.secrets_file, private)
    try:
        return run_command(argv, {**os.environ, **secret, **env}, args.timeout)
    finally:
        if private:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(spec.secrets_file)


def check_ssh(hosts: list[str]) -> None:
    """Every host must take passwordless ssh, as the backends need; the first that does not is named."""
    for host in hosts:
        try:
            subprocess.run(["ssh", "-o", "PasswordAuthentication=no", "-o", "BatchMode=yes", host, "hostname"],
                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           timeout=SSH_TIMEOUT_S, check=True)
        except (OSError, subprocess.SubprocessError):
            raise UsageError(f"host {host} is not reachable with passwordless ssh (`ssh {host} hostname` failed); "
                             "set up ssh keys for it, or pass --no_ssh_check") from None


def run_command(argv: list[str], env: dict[str, str], timeout_s: float) -> int:
    """Run `argv` in its own process group; Ctrl-C/SIGTERM and the timeout stop the whole group.
    A signal that comes while Popen is still starting it waits until the group can be stopped:
    raised inside Popen, it left the group running (its children holding the command's output) and
    the command saying every rank was stopped."""
    print(f"launching: {json.dumps(argv)}", flush=True)
    _DEFERRED.update(deferring=True, pending=False)
    try:
        proc = subprocess.Popen(argv, env=env, start_new_session=True)
    except BaseException:
        _DEFERRED["deferring"] = False
        raise
    try:
        _DEFERRED["deferring"] = False
        if _DEFERRED["pending"]:
            raise KeyboardInterrupt
        return shell_status(proc.wait(timeout=timeout_s))
    except subprocess.TimeoutExpired:
        _stop_group(proc)
        print(f"error: the launch ran past --timeout {timeout_s:g}s and was stopped", file=sys.stderr)
        return 124
    except BaseException:
        _stop_group(proc)
        raise


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGINT twice (DeepSpeed's launcher stops its ranks on one, pdsh aborts on a second within 1 s),
    then TERM and, after a grace, KILL to whatever is left of the group."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGINT)
        time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGINT)
    kill_group(proc.pid, grace_s=STOP_WAIT_S)
    proc.wait()


#: While `run_command` starts the backend: a signal is noted (`pending`) rather than raised.
_DEFERRED = {"deferring": False, "pending": False}


def _interrupted(signum: int, frame: object) -> None:
    """Ctrl-C or SIGTERM: stop the run; later signals are ignored so that the cleanup runs to its end."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if _DEFERRED["deferring"]:
        _DEFERRED["pending"] = True
        return
    raise KeyboardInterrupt


if __name__ == "__main__":
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a hung run can be read: module docstring
    sys.exit(main())
