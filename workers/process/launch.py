"""Run one command in its own process group, watched: memory cap, wall-clock limit, peer abort.

The training script may fork (DataLoader workers, compilers, launchers), so everything is done to
the process group: the cap counts the whole tree's PSS, and every kill is a group kill, TERM then
KILL. The group is also killed after a normal exit, so stragglers never outlive an experiment.
Any BaseException while waiting (billiard's SystemExit on SIGTERM, a revoke, a time limit) kills the
group before it propagates: a worker that stops never leaves a training process behind.

A process that leaves the group (`setsid`, a double fork) escapes a group kill, so every launch also
puts a token in its environment (CONTAINER_ENV) and, after the group, every live process still
carrying that token is stopped too. A process that clears its environment escapes this; a cgroup
per experiment would not, but needs a delegated cgroup tree that slot workers rarely have.

The process is a `subprocess.Popen` unless the caller passes `spawn` (`workers.warm.warm_start` forks
ranks from a warm interpreter): anything with `pid`, `poll()` and `wait(timeout)`, and optionally
`forked_from_warm` (true: the memory it shares with the process it was forked from counts as its
own, `workers.process.tree_memory.inherited`) and `leftover_marks()` (more tokens whose processes to stop
after the group, and pids to spare: one pass over the process table for all). A launch given a
`title` hands it to the rank (`workers.in_rank.entry.TITLE_ENV`), and a process still carrying that title
after the group, wherever it went, is stopped too: a process forked without exec shows the title
but not the launch's environment (`workers.process.process_identity`). The time limit starts
when `spawn` returns: the wait for a warm process (its preload, tens of seconds on a loaded machine
or a shared filesystem) is start-up, in the wall, but not the experiment's to spend.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import psutil

from workers.in_rank.failure import KillReason
from workers.process.process_identity import TITLE_ENV, owns_group, terminate_then_kill
from workers.process.tree_memory import TreeMemory

log = logging.getLogger(__name__)

POLL_S = 0.1  #: how often the tree's memory is checked against a memory cap (a CPU slot's): `TreeMemory`
#: Without a cap (a GPU slot: its device memory is the allocator's business) the tree's memory is
#: only recorded, once a second.
UNCAPPED_POLL_S = 1.0
ABORT_CHECK_S = 0.5  #: how often the peer-abort flag (a Redis GET) is checked, at most
KILL_GRACE_S = 3.0
#: How long a killed group may take to be gone. A SIGKILLed process frees its memory (a GPU context
#: of tens of GB takes seconds) before it is gone; the slot is not handed on before that, or the
#: next experiment on it meets a GPU still full and reads a false out-of-memory.
KILL_WAIT_S = 30.0
CONTAINER_ENV = "AUTOTUNE_CONTAINER"  #: per-launch token inherited by every descendant
#: How much of a launch's title a process must show to be taken for the launch's: up to the launch token.
TITLE_MIN = len("autotune rank 0/1 slot=n.gpu0 launch=0123456789ab")
#: How long a rank may still run once its experiment has measured (rank 0's metrics written) before it
#: is taken as hung in its teardown and stopped, its measurement kept: after DeepSpeed's profiling
#: exit() the interpreter's teardown aborts live NCCL communicators, which can hang (pytorch#117291,
#: NVIDIA/nccl#1013). `workers.in_rank.entry` leaves without a teardown; a script started through a wrapper
#: (a shell script, its own launcher) cannot, and would otherwise run into the time limit, its
#: measurement thrown away as a `timeout`. A normal teardown takes seconds.
MEASURED_GRACE_S = 30.0
MEASURED_GRACE_ENV = "AUTOTUNE_MEASURED_GRACE_S"


@dataclass(frozen=True)
class LaunchResult:
    """How a watched process group ended."""

    exit_code: int | None  #: negative: killed by that signal; None: could not be started
    killed_for: KillReason | None
    peak_rss_bytes: int
    started_at: float
    ended_at: float
    start_error: str = ""

    @property
    def wall_s(self) -> float:
        return self.ended_at - self.started_at


def group_alive(pgid: int) -> bool:
    """True while a non-zombie process of the group exists (kill -0 succeeds on zombies)."""
    return bool(_alive_groups({pgid}))


def _alive_groups(pgids: set[int]) -> set[int]:
    """Those of `pgids` with a non-zombie process: one pass over the process table for all of them."""
    alive = set()
    for proc in psutil.process_iter(["status"]):
        try:
            pgid = os.getpgid(proc.pid)
            if pgid in pgids and proc.info["status"] != psutil.STATUS_ZOMBIE:
                alive.add(pgid)
        except (ProcessLookupError, psutil.Error):
            continue
    return alive


def kill_group(pgid: int, grace_s: float = KILL_GRACE_S) -> bool:
    """SIGTERM the group, give it `grace_s` to exit, then SIGKILL what is left and wait up to
    KILL_WAIT_S until it is gone. False when a process of it outlived that (stuck in the kernel)."""
    return not kill_groups([pgid], grace_s).stuck


@dataclass(frozen=True)
class GroupsKilled:
    """What `kill_groups` did to each group it was given (a group already gone is in none)."""

    terminated: frozenset[int]  #: ended within the grace after SIGTERM
    killed: frozenset[int]  #: still there after the grace: sent SIGKILL
    stuck: frozenset[int]  #: of those, still alive `wait_s` after SIGKILL (stuck in the kernel)


def kill_groups(pgids: Iterable[int], grace_s: float = KILL_GRACE_S, wait_s: float = KILL_WAIT_S) -> GroupsKilled:
    """`kill_group` for several groups at once, so stopping N of them takes one grace, not N: SIGTERM
    each, `grace_s` for all to exit, SIGKILL what is left, up to `wait_s` until gone. The one way
    groups are killed: by a slot, the embedded cluster and `deploy.remote kill-groups` on a host."""
    signalled = set()
    for pgid in set(pgids):
        try:
            os.killpg(pgid, signal.SIGTERM)
            signalled.add(pgid)
        except ProcessLookupError:
            pass
    left = _still_alive(signalled, grace_s)
    for pgid in list(left):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            left.discard(pgid)
    killed = set(left)
    left = _still_alive(left, wait_s)
    for pgid in left:
        log.warning("process group %d is still alive %.0f s after SIGKILL", pgid, wait_s)
    return GroupsKilled(frozenset(signalled - killed), frozenset(killed), frozenset(left))


def _still_alive(pgids: set[int], within_s: float) -> set[int]:
    deadline = time.monotonic() + within_s
    while pgids:
        pgids = _alive_groups(pgids)
        if not pgids or time.monotonic() >= deadline:
            return pgids
        time.sleep(0.05)
    return pgids


def marked_processes(variable: str, token: str | Collection[str], since: float = 0.0,
                     exclude: Collection[int] = (), title: str = "") -> list[psutil.Process]:
    """Live processes started at or after `since` whose environment has `variable`=`token` (or one
    of the tokens given), or whose command line as `ps` shows it is `title`."""
    tokens = {token} if isinstance(token, str) else set(token)
    found = []
    # Only the start time of every process (/proc/<pid>/stat): the status and the environment are
    # read for those started since, a few at most. Reading the status of all (a second file each)
    # tripled the cost of the scan a slot makes after every rank (2.0 -> 0.66 ms of CPU, 80 processes).
    for proc in psutil.process_iter(["create_time"]):
        try:
            if proc.pid == os.getpid() or proc.pid in exclude or proc.info["create_time"] < since - 1.0:
                continue
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            if proc.environ().get(variable) in tokens or (title and _titled(proc, title)):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def _titled(proc: psutil.Process, title: str) -> bool:
    """Whether `proc` shows `title` in `ps`, or the start of it (a title is cut to the command line it replaces)."""
    shown = " ".join(proc.cmdline()).strip()
    return shown == title or (len(shown) >= TITLE_MIN and title.startswith(shown))


def kill_marked(variable: str, token: str | Collection[str], since: float = 0.0, grace_s: float = KILL_GRACE_S,
                exclude: Collection[int] = (), title: str = "") -> None:
    """SIGTERM every process `marked_processes` finds, then SIGKILL what is left after `grace_s`."""
    terminate_then_kill(marked_processes(variable, token, since, exclude, title), grace_s)


def group_runs_slot(pgid: int, queue: str, started: int | None = None) -> bool:
    """Whether group `pgid` is still a rank of slot `queue` (guards against PID reuse): its leader
    started at `started` (the slot's record), or a process of it carries a rank title of `queue`
    (`workers.process.process_identity.owns_group`). Never by the environment, which a forked rank shows
    as the warm process's."""
    return owns_group(pgid, queue, started)


def run_watched(
    argv: list[str],
    *,
    env: dict[str, str],
    cwd: str,
    stdout_path: Path,
    stderr_path: Path,
    timeout_s: float,
    memory_cap_bytes: int | None,
    cpus: tuple[int, ...] = (),
    should_abort: Callable[[], bool] = lambda: False,
    on_start: Callable[[int], None] = lambda pgid: None,
    measured: Callable[[], bool] = lambda: False,
    measured_grace_s: float = MEASURED_GRACE_S,
    spawn: Callable[[list[str], dict[str, str], str, IO[bytes], IO[bytes]], Any] | None = None,
    title: str = "",
) -> LaunchResult:
    """Run `argv` (never a shell string) to completion or until a limit; see the module docstring.
    `measured` says whether the experiment has its measurement (polled with `should_abort`): from then
    on the group gets `measured_grace_s`, or until the deadline if sooner, then is stopped as
    `KillReason.MEASURED`, not as a timeout."""
    started = time.time()
    token = uuid.uuid4().hex
    env = {**env, CONTAINER_ENV: token, **({TITLE_ENV: title} if title else {})}
    with open(stdout_path, "wb") as out, open(stderr_path, "wb") as err:
        try:
            proc = spawn(argv, env, cwd, out, err) if spawn is not None else subprocess.Popen(
                argv, env=env, cwd=cwd, stdout=out, stderr=err, stdin=subprocess.DEVNULL, start_new_session=True)
        except OSError as exc:
            return LaunchResult(None, None, 0, started, time.time(), start_error=str(exc))
    running_since = time.time()  # the time limit is the process's: a `spawn` waiting for a warm process is not
    if cpus:
        try:
            os.sched_setaffinity(proc.pid, cpus)
        except OSError:
            pass
    on_start(proc.pid)
    try:
        killed_for, peak = _watch(proc, running_since + timeout_s, memory_cap_bytes, should_abort, measured,
                                  measured_grace_s)
    except BaseException:
        kill_group(proc.pid)
        proc.wait()
        _kill_leftovers(proc, token, started, title)
        raise
    kill_group(proc.pid)
    exit_code = proc.wait()
    _kill_leftovers(proc, token, started, title)
    return LaunchResult(exit_code, killed_for, peak, started, time.time())


def _kill_leftovers(proc: Any, token: str, started: float, title: str = "") -> None:
    leftover_marks = getattr(proc, "leftover_marks", None)
    tokens, spare = leftover_marks() if leftover_marks is not None else ((), ())
    kill_marked(CONTAINER_ENV, {token, *tokens}, started, exclude=spare, title=title)


def _watch(
    proc: Any,
    deadline: float,
    memory_cap_bytes: int | None,
    should_abort: Callable[[], bool],
    measured: Callable[[], bool] = lambda: False,
    measured_grace_s: float = MEASURED_GRACE_S,
) -> tuple[KillReason | None, int]:
    try:
        memory = TreeMemory(psutil.Process(proc.pid), bool(getattr(proc, "forked_from_warm", False)))
    except psutil.NoSuchProcess:  # ended already: a rank forked from a warm process is reaped by it, not us
        proc.wait()
        return None, 0
    peak = 0
    interval = POLL_S if memory_cap_bytes is not None else UNCAPPED_POLL_S
    next_abort_check = 0.0
    measured_at: float | None = None
    while proc.poll() is None:
        peak = max(peak, memory.read(memory_cap_bytes))
        reason = None
        now = time.time()
        checks_due = now >= next_abort_check or now > deadline
        if checks_due:
            next_abort_check = now + ABORT_CHECK_S
            if measured_at is None and measured():
                measured_at = now
        if memory_cap_bytes is not None and peak > memory_cap_bytes:
            reason = KillReason.MEMORY
        elif measured_at is not None and (now > deadline or now - measured_at >= measured_grace_s):
            reason = KillReason.MEASURED
        elif now > deadline:
            reason = KillReason.TIMEOUT
        elif checks_due and should_abort():
            reason = KillReason.PEER_FAILED
        if reason is not None:
            kill_group(proc.pid)
            proc.wait()
            return reason, peak
        wake = deadline if measured_at is None else min(deadline, measured_at + measured_grace_s)
        try:
            proc.wait(timeout=min(interval, max(0.01, wake - now)))
        except subprocess.TimeoutExpired:
            pass
    return None, peak


def tail(path: Path, limit: int = 4000) -> str:
    """The last `limit` bytes of a log file, decoded leniently ('' if missing)."""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - limit))
            return handle.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
