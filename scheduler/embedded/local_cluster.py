"""An embedded cluster on this machine: a private redis-server, one slot worker per local device,
and a control worker, all torn down afterwards.

Used when no AUTOTUNE_REDIS_URL is configured, so a laptop or a single GPU box needs nothing
running beforehand. Every process starts in its own session (Ctrl-C in the terminal reaches only
the autotuner, which then stops them in order) and is stopped by PID: workers get a cold shutdown
(SIGQUIT: the running experiment's process group is killed, no waiting for it to finish), then
SIGKILL after a grace; training groups recorded in Redis are killed; Redis goes last.
If the autotuner itself is killed with SIGKILL, the kernel tells its children (Linux parent-death
signal): workers get SIGQUIT and Redis SIGTERM; and each worker notices its parent is gone
(AUTOTUNE_EXIT_WITH_PARENT) and kills its training groups and itself, since a cold shutdown can
hang on the Redis that just died. So even then nothing is left running. Their PIDs
are also in <log_dir>/pids.json. The last sweep of a stop finds training processes by the slots'
records of their ranks and by the title each rank carries (`workers.process.process_identity`), never by
an environment variable: a rank forked from a warm process shows that process's environment.
The Redis password is random and passed on stdin, so it never appears in a process list. No path
reaches redis-server's configuration: it runs in the log folder (its working directory, where it
would put a dump), and every value it is given is quoted by `redis_config`, so a results folder with
spaces, quotes, newlines or non-ASCII letters can neither break its start nor inject a setting.
"""
from __future__ import annotations

import ctypes
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import redis

from workers.process.launch import kill_groups
from workers.files.layout import PIDS, cluster_file
from workers.files.paths import write_json
from workers.process.process_identity import RankProcess, kill_titled, recorded_groups, recorded_ranks
from workers.state.redis_url import REDIS_URL_VARIABLE
from workers.state.connection import connect
from workers.state.store import RedisSlotStore
from workers.device.slot import HOST_MEMORY_CAP_ENV
from scheduler.embedded.worker_command import CONTROL_QUEUE, control_worker_argv, flower_argv, slot_names, slot_worker_argv

START_TIMEOUT_S = 120.0
PR_SET_PDEATHSIG = 1
STOP_GRACE_S = 15.0
#: How long an embedded cluster's stop gives each step (workers to exit cold, training groups and
#: redis-server to end on SIGTERM) before it kills: a user's Ctrl-C ends the command within seconds
#: on a busy machine too. The records are written before the stop; what a step cuts short is killed.
LOCAL_STOP_GRACE_S = 2.0


def cold_stop(workers: Sequence[subprocess.Popen], grace_s: float = STOP_GRACE_S) -> None:
    """Cold shutdown of Celery workers each started as the leader of its own session: SIGQUIT to
    each (a slot worker's running rank kills its training group on the way out), up to `grace_s` in
    all for them to exit, then a kill of whatever is left of each group, reaped. One way for the
    embedded cluster, the fault tests and bench/chaos.py, so all three stop workers alike."""
    for worker in workers:
        if worker.poll() is None:
            worker.send_signal(signal.SIGQUIT)
    deadline = time.monotonic() + grace_s
    for worker in workers:
        try:
            worker.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    kill_groups([worker.pid for worker in workers], grace_s=0.0)
    for worker in workers:
        worker.wait()


class LocalClusterError(RuntimeError):
    """The embedded cluster could not start; the message says what to install or check."""


def redis_server() -> str:
    """The redis-server binary on PATH; LocalClusterError saying how to install it when there is none
    (the autotuner asks before it makes a folder, the cluster again when it starts)."""
    server = shutil.which("redis-server")
    if server is None:
        raise LocalClusterError("redis-server not found on PATH; install it (Debian/Ubuntu: "
                                "apt-get install -y redis-server, macOS: brew install redis) "
                                "or set AUTOTUNE_REDIS_URL to use a running cluster")
    return server


def free_tcp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LocalCluster:
    """Context manager: `with LocalCluster(2, log_dir) as cluster: cluster.url ...`."""

    def __init__(self, slots: int, log_dir: Path, slot_memory: str | None = None,
                 node: str | None = None, devices: Sequence[int] | None = None,
                 flower_port: int | None = None, host_memory_cap: str | None = None) -> None:
        self.devices = list(devices) if devices is not None else list(range(slots))
        #: Flower on 127.0.0.1:flower_port with generated basic auth (`flower_auth`, user:password).
        self.flower_port = flower_port
        self.flower_auth = f"autotune:{secrets.token_urlsafe(12)}" if flower_port is not None else ""
        self.slots = len(self.devices)
        self.log_dir = Path(log_dir)
        self.slot_memory = slot_memory  #: CPU slots' memory (AUTOTUNE_SLOT_MEMORY); GPU slots ignore it
        self.host_memory_cap = host_memory_cap  #: GPU ranks' PSS cap (AUTOTUNE_HOST_MEMORY_CAP), when asked
        self.node = node or socket.gethostname()
        self.url = ""
        self._redis: subprocess.Popen | None = None
        self._workers: list[subprocess.Popen] = []
        self._logs: dict[int, tuple[Path, int]] = {}  #: a worker's pid -> its log, and where its lines start

    def __enter__(self) -> LocalCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc_info: object) -> None:
        self.stop(settled=exc_type is None)

    @property
    def pids(self) -> list[int]:
        procs = ([self._redis] if self._redis else []) + self._workers
        return [p.pid for p in procs]

    def start(self) -> None:
        server = redis_server()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        port, password = free_tcp_port(), secrets.token_hex(16)
        self._redis = _spawn([server, "-"], cluster_file(self.log_dir, "redis.log"), os.environ.copy(),
                             stdin=True, death_signal=signal.SIGTERM, cwd=self.log_dir)
        config = redis_config([("port", str(port)), ("bind", "127.0.0.1"), ("save", ""), ("appendonly", "no"),
                               ("user", ["default", "off"]), ("user", cluster_user_rules(CLUSTER_USER, password))])
        self._redis.stdin.write(config)
        self._redis.stdin.close()
        self.url = f"redis://{CLUSTER_USER}:{password}@127.0.0.1:{port}/0"
        client = connect(self.url)
        slots = RedisSlotStore(client)
        self._wait(lambda: _pings(client), "redis-server", cluster_file(self.log_dir, "redis.log"))

        # SPT_NOENV: where setproctitle is installed, Celery retitles its processes; without this it
        # overwrites /proc/<pid>/environ, and the markers we find our processes by would vanish.
        env = {**os.environ, "SPT_NOENV": "1", REDIS_URL_VARIABLE: self.url, "AUTOTUNE_NODE": self.node,
               "AUTOTUNE_EXIT_WITH_PARENT": str(os.getpid()),
               "AUTOTUNE_SLOTS_PER_NODE": str(self.slots), "PYTHONUNBUFFERED": "1"}
        if self.slot_memory:
            env["AUTOTUNE_SLOT_MEMORY"] = self.slot_memory
        if self.host_memory_cap:
            env[HOST_MEMORY_CAP_ENV] = self.host_memory_cap
        for queue, argv in self.worker_commands():
            self._start_worker(queue, argv, env)
        if self.flower_port is not None:  # options from the environment: no secret in `ps`
            self._workers.append(_spawn(flower_argv(self.flower_port), cluster_file(self.log_dir, "flower.log"),
                                        {**env, "FLOWER_BASIC_AUTH": self.flower_auth}, death_signal=signal.SIGTERM))
        write_json(cluster_file(self.log_dir, PIDS), {"redis-server": self._redis.pid,
                                                    "workers": [w.pid for w in self._workers]})
        self._wait(lambda: len(slots.live_slots()) >= self.slots and slots.control_alive(),
                   f"{self.slots} slot workers and a control worker",
                   cluster_file(self.log_dir, f"{CONTROL_QUEUE}.log"))

    def worker_commands(self) -> list[tuple[str, list[str]]]:
        """(queue, argv) of each worker this cluster starts: one slot worker per device, then the control
        worker, each as `scheduler.embedded.worker_command` builds it."""
        slots = [(slot_names(device, self.node)[0], slot_worker_argv(device, self.node)) for device in self.devices]
        return [*slots, (CONTROL_QUEUE, control_worker_argv(self.node))]

    def _start_worker(self, queue: str, argv: list[str], env: dict[str, str]) -> None:
        log = cluster_file(self.log_dir, f"{queue}.log")
        written = log.stat().st_size if log.exists() else 0  # an earlier run's lines stay behind
        self._workers.append(_spawn(argv, log, env, death_signal=signal.SIGQUIT))
        self._logs[self._workers[-1].pid] = (log, written)

    def _wait(self, ready: Callable[[], bool], what: str, log: Path) -> None:
        if not ready_within(ready, START_TIMEOUT_S, self._none_exited):
            raise LocalClusterError(f"{what} did not come up within {START_TIMEOUT_S:.0f}s; see {log}")

    def _none_exited(self) -> None:
        dead = [p for p in ([self._redis] + self._workers) if p is not None and p.poll() is not None]
        if dead:
            said = refusal_in(*self._logs.get(dead[0].pid, (None, 0)))
            raise LocalClusterError(said or f"a process of the embedded cluster exited during start-up "
                                    f"({' '.join(map(str, dead[0].args[:6]))}); see {self.log_dir}")

    def stop(self, settled: bool = False) -> None:
        """Stop everything this cluster started, by PID; safe to call twice. Each step waits at most
        LOCAL_STOP_GRACE_S before it kills, so the whole stop takes seconds whatever the load.

        `settled`: the command using the cluster ended without an exception. If no rank is recorded
        as running either, the workers are killed at once: this Redis is ours and goes next, so a
        cold shutdown's bookkeeping would be read by no one, and it costs over a second a worker
        (billiard's pool process sleeps 1 s on its way out). Otherwise (Ctrl-C, an error, a rank
        still running) each worker's cold shutdown kills its running rank's group first."""
        client = redis.Redis.from_url(self.url, socket_timeout=2) if self.url else None
        recorded = _recorded_groups(client) if client is not None else None
        ranks = _recorded_ranks(client) if client is not None else []
        if settled and recorded == []:
            kill_groups([worker.pid for worker in self._workers], grace_s=0.0, wait_s=LOCAL_STOP_GRACE_S)
            for worker in self._workers:
                worker.wait()
        else:
            cold_stop(self._workers, grace_s=LOCAL_STOP_GRACE_S)
            if client is not None:  # read again: a worker that died before cleaning up left its group
                recorded = _recorded_groups(client)
                ranks = [*ranks, *_recorded_ranks(client)]
        if recorded:  # all at once: one grace for every group, not one each
            kill_groups(recorded, grace_s=2.0, wait_s=LOCAL_STOP_GRACE_S)
        if ranks:  # what a recorded rank forked that left its group (setsid) still carries its title
            kill_titled(ranks, grace_s=2.0)
        if self._redis is not None and self._redis.poll() is None:
            self._redis.terminate()
            try:
                self._redis.wait(timeout=LOCAL_STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self._redis.kill()
                self._redis.wait()
        self._workers.clear()


def ready_within(ready: Callable[[], bool], timeout_s: float, check: Callable[[], None] = lambda: None) -> bool:
    """Whether `ready()` comes true within `timeout_s`, asked every 0.2 s. A Redis error counts as not
    yet (a server still starting refuses connections); `check` runs before each ask and raises to stop."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        check()
        try:
            if ready():
                return True
        except redis.RedisError:
            pass
        time.sleep(0.2)
    return False


@contextmanager
def cluster_client(client: redis.Redis | None, embedded: Callable[[], LocalCluster],
                   started: Callable[[LocalCluster], None] = lambda cluster: None) -> Iterator[redis.Redis]:
    """The client a command runs on: `client`, a running cluster's (AUTOTUNE_REDIS_URL), when there is
    one; else an embedded cluster's. That one is `embedded()`, started, shown to the user by
    `started(cluster)`, and stopped when the block ends (an exception in it makes the stop a cold
    one); while it runs its URL is AUTOTUNE_REDIS_URL, which the Celery app reads when the command
    imports it. The one set-up of `python -m scheduler.autotune` and `python -m scheduler.run`."""
    if client is not None:
        yield client
        return
    with embedded() as cluster:
        started(cluster)
        before = os.environ.get(REDIS_URL_VARIABLE)
        os.environ[REDIS_URL_VARIABLE] = cluster.url
        try:
            yield connect(cluster.url)
        finally:
            if before is None:
                os.environ.pop(REDIS_URL_VARIABLE, None)
            else:
                os.environ[REDIS_URL_VARIABLE] = before


def redis_config(settings: list[tuple[str, str | list[str]]]) -> bytes:
    """redis.conf text with every value double-quoted and escaped as redis-server's parser
    (sdssplitargs) reads it: no value can end its line or add a directive. A list is a directive
    of several arguments (`user NAME RULE...`), each quoted alike."""
    lines = []
    for name, value in settings:
        if not name.isalnum() and not name.replace("-", "").isalnum():
            raise ValueError(f"not a redis-server setting name: {name!r}")
        values = value if isinstance(value, list) else [value]
        lines.append(" ".join([name, *(f'"{_quoted(v)}"' for v in values)]))
    return ("\n".join(lines) + "\n").encode("ascii")


def _quoted(value: str) -> str:
    return "".join(ch if ch.isascii() and ch.isprintable() and ch not in '"\\' else
                   "".join(f"\\x{byte:02x}" for byte in ch.encode()) for ch in value)


#: The Redis user the cluster's workers and commands connect as (docs/cluster.md, "The cluster's Redis").
CLUSTER_USER = "autotune"
#: What that user may do: every key and channel, every command but Redis's @dangerous category
#: (CONFIG, MODULE, DEBUG, FLUSHALL/FLUSHDB, SHUTDOWN, KEYS, MONITOR, ACL, REPLICAOF, ...): a
#: compromised node can disturb jobs but cannot take over the Redis host (CONFIG SET dir/dbfilename,
#: MODULE LOAD) or wipe every job at once. Celery, kombu, Flower and this project use none of them.
CLUSTER_USER_RULES = ("on", "~*", "&*", "+@all", "-@dangerous")


def cluster_user_rules(user: str, password: str) -> list[str]:
    """The arguments of redis.conf's `user` directive (or ACL SETUSER) for the cluster's user."""
    return [user, *CLUSTER_USER_RULES[:1], f">{password}", *CLUSTER_USER_RULES[1:]]


def refusal_in(log: Path | None, start: int = 0) -> str | None:
    """The one-line refusal (`error: ...`) a worker that ended at start-up left in its log after byte
    `start` (where its own lines begin: the log is appended to across runs), without its prefix:
    the reason the user must read (a GPU that CUDA numbers differently, one already served),
    instead of "see the logs". None when it left none."""
    try:
        with open(log, "rb") as text:
            text.seek(start)
            lines = text.read().decode(errors="replace").splitlines()
    except (OSError, TypeError):
        return None
    said = [line[len("error: "):].strip() for line in lines if line.startswith("error: ")]
    return said[-1] if said else None


def _spawn(argv: list[str], log: Path, env: dict[str, str], death_signal: int,
           stdin: bool = False, cwd: Path | None = None) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                                start_new_session=True, preexec_fn=die_with_parent(death_signal))


def die_with_parent(sig: int) -> Callable[[], None] | None:
    """A preexec hook asking Linux to send `sig` to the child when this process dies (no-op elsewhere)."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)

    def set_death_signal() -> None:
        libc.prctl(PR_SET_PDEATHSIG, sig)
    return set_death_signal


def _pings(client: redis.Redis) -> bool:
    return bool(client.ping())


def _recorded_ranks(client: redis.Redis) -> list[RankProcess]:
    """The ranks the slots recorded as running (`workers.process.process_identity`); none when Redis cannot say."""
    try:
        return recorded_ranks(client)
    except redis.RedisError:
        return []


def _recorded_groups(client: redis.Redis) -> list[int] | None:
    """Training groups recorded as running (run_rank records its group while it runs, and a worker
    that died before cleaning up leaves the record); this Redis is ours. None when Redis cannot say,
    so the caller takes the careful way."""
    try:
        return [pgid for pgid in recorded_groups(client).values() if pgid]
    except redis.RedisError:
        return None
