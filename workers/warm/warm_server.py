"""The standard library's forkserver as a slot worker's warm interpreter (`workers.warm.warm_start`):
started with an environment and a parent of its own from a Celery pool process, and stopped.

Why a module of its own: multiprocessing keeps one forkserver per process, in module state it does
not export (`multiprocessing.forkserver._forkserver`), and a billiard pool process is a daemon with
billiard's authentication key, which multiprocessing refuses to start children from. What reaches
into that state is here, in one place, beside the decisions in `workers.warm.warm_start`.

The forkserver never outlives the process that started it: `end_for_exit` stops it when that
process shuts down, and it asks Linux for SIGKILL when that process's starting thread ends
(`workers.warm.warm_preload.die_with_parent`) for every other way that process can end.

A rank it forked is its child, not this process's: how the rank ended comes down the forkserver's
pipe. When the forkserver dies first (killed, out of memory), the pipe ends without a status and
the rank lives on; `WarmProcess` then watches the rank itself, by its pid, and says that how it
ended is unknown rather than reading the closed pipe as an exit status, as multiprocessing does (255).
"""
from __future__ import annotations

import json
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import multiprocessing.process
import multiprocessing.resource_tracker
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil

log = logging.getLogger(__name__)

PRELOAD_ENV = "AUTOTUNE_WARM_PRELOAD"  #: the modules `workers.warm.warm_preload` imports, comma-separated
REPORT_ENV = "AUTOTUNE_WARM_REPORT"  #: where it writes what it imported, and what failed

#: What the warm process forks ranks through: multiprocessing's forkserver start method.
CONTEXT = multiprocessing.get_context("forkserver")


#: What /proc shows for a warm process before it takes its title (`workers.warm.warm_preload.title`), or
#: where setproctitle is not installed: the forkserver's own command line.
FORKSERVER_LINE = "multiprocessing.forkserver import main"


def shows_warm(line: str) -> bool:
    """Whether a command line as `ps` shows it is a warm process's: its title, or the forkserver's line
    (a rank forked from it shows that line too, for the milliseconds before it takes its own title)."""
    from workers.warm.warm_preload import TITLE_WORD

    shown = line.strip()
    return shown == TITLE_WORD or shown.startswith(f"{TITLE_WORD} ") or FORKSERVER_LINE in shown


#: What a rank's exit status reads as when its warm process died before telling it (the pipe's end,
#: as multiprocessing reads it); `WarmProcess.untold` says so, and the launch is recorded lost.
UNTOLD_EXIT = 255
UNTOLD_POLL_S = 0.1  #: how often a rank whose warm process died is looked for by its pid


class WarmProcess:
    """A rank forked by the warm process, as `workers.process.launch.run_watched` watches a Popen: its exit
    status as the warm process tells it, or, when the warm process died while it ran, `untold` set
    (and `on_untold` called once with why), the rank watched by its pid until it ends."""

    #: The memory it shares with the warm process counts as its own, as a cold rank would own it
    #: (`workers.process.tree_memory.inherited`).
    forked_from_warm = True

    def __init__(self, process: multiprocessing.process.BaseProcess, server_pid: int, server_token: str,
                 on_untold: Callable[[str], object] = lambda why: None) -> None:
        multiprocessing.process._children.discard(process)  # type: ignore[attr-defined] - its pipe is read here alone
        self._process, self.pid = process, int(process.pid or 0)
        self._server_pid, self._server_token, self._on_untold = server_pid, server_token, on_untold
        try:  # its start time guards the pid against reuse once nobody reaps it for us
            self._rank: psutil.Process | None = psutil.Process(self.pid)
        except psutil.Error:
            self._rank = None
        self._code: int | None = None
        self.untold = ""

    def poll(self) -> int | None:
        if self._code is not None:
            return self._code
        if not self.untold:
            sentinel = self._process._popen.sentinel  # type: ignore[union-attr]
            if not multiprocessing.connection.wait([sentinel], 0):
                return None
            try:
                self._code = multiprocessing.forkserver.read_signed(sentinel)  # type: ignore[attr-defined]
                return self._code
            except (OSError, EOFError):
                self.untold = (f"its warm process (pid {self._server_pid}) died while it ran: how the rank "
                               "ended is unknown")
                self._on_untold(self.untold)
        if _running(self._rank):
            return None
        self._code = UNTOLD_EXIT
        return self._code

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            left = 1.0 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(f"warm rank {self.pid}", timeout or 0.0)
            if self.untold:
                time.sleep(min(UNTOLD_POLL_S, left))
            else:  # wakes as the warm process writes the status, or dies
                multiprocessing.connection.wait([self._process._popen.sentinel], min(1.0, left))  # type: ignore[union-attr]
        return code

    def leftover_marks(self) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """What the rank forked without exec carries (its /proc environ is the warm process's): the
        warm process's token, to stop after the launch as the launch's own, sparing the warm process."""
        return (self._server_token,), (self._server_pid,)


def _running(process: psutil.Process | None) -> bool:
    try:
        return process is not None and process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def server_env(rank_env: dict[str, str], slot_kind: str, preload: list[str], token: str,
               report: Path) -> dict[str, str]:
    """The warm process's environment: the rank's without what is the rank's alone (its rank, its
    peers, its launch), CUDA's check through NVML, DeepSpeed's accelerator named."""
    from workers.in_rank.device_memory import EXIT_REPORT_ENV
    from workers.process.launch import CONTAINER_ENV

    per_rank = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "GROUP_RANK", "CROSS_RANK",
                "CROSS_SIZE", "MASTER_ADDR", "MASTER_PORT", EXIT_REPORT_ENV, CONTAINER_ENV}
    env = {name: value for name, value in rank_env.items() if name not in per_rank}
    env.update({"PYTORCH_NVML_BASED_CUDA_CHECK": "1", "PYTHONUNBUFFERED": "1", CONTAINER_ENV: token,
                PRELOAD_ENV: ",".join([*preload, "workers.warm.warm_rank"]), REPORT_ENV: str(report)})  # the rank's start
    env.setdefault("DS_ACCELERATOR", "cuda" if slot_kind == "cuda" else "cpu")
    return env


def start(env: dict[str, str]) -> int:
    """Start this process's forkserver with `env` as its environment and `workers.warm.warm_preload` as
    its preload (it dies with this process's current thread, when that is the main one: Linux's
    parent-death signal follows the thread); its pid. Returns before the preload is done."""
    from workers.warm.warm_preload import PARENT_ENV

    CONTEXT.set_forkserver_preload(["workers.warm.warm_preload"])
    multiprocessing.resource_tracker.ensure_running()  # this worker's: not marked as the ranks are
    if threading.current_thread() is threading.main_thread():
        env = {**env, PARENT_ENV: str(os.getpid())}
    with _environment(env):
        multiprocessing.forkserver.ensure_running()
    return multiprocessing.forkserver._forkserver._forkserver_pid or 0  # type: ignore[attr-defined]


def stop() -> None:
    """Kill this process's forkserver (a preload may hang: no polite stop) and reap it."""
    server = multiprocessing.forkserver._forkserver  # type: ignore[attr-defined]
    if server._forkserver_pid is not None:
        kill(server._forkserver_pid)
        try:
            server._stop()
        except ChildProcessError:
            server._forkserver_pid = server._forkserver_address = server._forkserver_alive_fd = None


def end_for_exit() -> None:
    """`stop`, and the folder multiprocessing made for the forkserver's socket removed: this process
    is ending, by `os._exit` (billiard's way), which skips multiprocessing's own clean-up of it."""
    address = multiprocessing.forkserver._forkserver._forkserver_address  # type: ignore[attr-defined]
    stop()
    config = multiprocessing.process.current_process()._config  # type: ignore[attr-defined]
    if isinstance(address, str) and config.get("tempdir") == os.path.dirname(address):
        shutil.rmtree(config.pop("tempdir"), ignore_errors=True)


def running_pid() -> int | None:
    """The pid of this process's forkserver, if it started one."""
    return multiprocessing.forkserver._forkserver._forkserver_pid  # type: ignore[attr-defined]


def kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def probe(target: Callable[[], None], limit_s: float, keep_alive: Callable[[], object]) -> int | None:
    """Fork `target` from this process's forkserver and wait for it: the exit code of this first
    fork, or None when the fork did not happen within `limit_s` (the forkserver forks only after its
    preload). `keep_alive` is called every second meanwhile (the slot's lease)."""
    with may_have_children():  # the Process takes a copy of this process's config when made
        child = CONTEXT.Process(target=target, name="autotune-warm-probe", daemon=True)
        # start() waits for the preload: in a thread, so that the lease is kept meanwhile
        starter = threading.Thread(target=_quietly, args=(child.start,), daemon=True)
        starter.start()
        started = wait_until(lambda: starter.join(1.0) or not starter.is_alive(), limit_s, keep_alive)
    if started and child.pid is not None:
        wait_until(lambda: child.join(1.0) or child.exitcode is not None, 60.0, keep_alive)
    if not started or child.pid is None or child.exitcode is None:
        if child.pid is not None:
            stop_child(child)
        return None
    return child.exitcode


def wait_until(done: Callable[[], bool], limit_s: float, keep_alive: Callable[[], object]) -> bool:
    """Poll `done` (which waits up to a second itself) until it is true or `limit_s` passed,
    calling `keep_alive` between polls; whether it came true."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if done():
            return True
        keep_alive()
    return done()


def _quietly(call: Callable[[], object]) -> None:
    """For a thread: a failure shows as the call's missing effect (the probe has no pid)."""
    try:
        call()
    except Exception:  # noqa: BLE001
        log.debug("warm start: the probe could not be started", exc_info=True)


def pid_alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie does not)."""
    try:
        return pid > 0 and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def stop_child(process: multiprocessing.process.BaseProcess) -> None:
    """Kill a process the forkserver forked (a probe, a rank that did not start) and reap it."""
    if process.exitcode is None:
        process.kill()
    process.join(5)


@contextmanager
def may_have_children() -> Iterator[None]:
    """A Celery pool process is a daemon to multiprocessing, which refuses it children lest they be
    orphaned when it is terminated. Ours are not: each rank is its own process group that the
    launch kills, and the forkserver ends with this process. The flag is lifted for the start. Its
    authentication key is billiard's (Celery's fork of multiprocessing), which refuses to be sent to
    a child that billiard did not start: the same bytes as the standard library's, for the start."""
    config = multiprocessing.process.current_process()._config  # type: ignore[attr-defined]
    daemon, authkey = config.pop("daemon", None), config.get("authkey")
    if authkey is not None:
        config["authkey"] = multiprocessing.process.AuthenticationString(bytes(authkey))
    try:
        yield
    finally:
        if daemon is not None:
            config["daemon"] = daemon
        if authkey is not None:
            config["authkey"] = authkey


@contextmanager
def _environment(env: dict[str, str]) -> Iterator[None]:
    """This process's environment replaced by `env` for the block: the forkserver takes the
    environment of the process that starts it, and it is started from this worker's pool process."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def acquire(lock: threading.Lock, limit_s: float, keep_alive: Callable[[], object]) -> bool:
    """Take `lock` within `limit_s`, calling `keep_alive` every second meanwhile; whether it was taken."""
    return wait_until(lambda: lock.acquire(timeout=1.0), limit_s, keep_alive)


def read_report(path: Path) -> dict[str, Any]:
    """The preload's report (`workers.warm.warm_preload`), {} when it wrote none."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
