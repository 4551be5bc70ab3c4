"""The standard library's forkserver as a slot worker's warm interpreter (`workers.warm_start`):
started with an environment and a parent of its own from a Celery pool process, and stopped.

Why a module of its own: multiprocessing keeps one forkserver per process, in module state it does
not export (`multiprocessing.forkserver._forkserver`), and a billiard pool process is a daemon with
billiard's authentication key, which multiprocessing refuses to start children from. What reaches
into that state is here, in one place, beside the decisions in `workers.warm_start`.

The forkserver never outlives the process that started it: `end_for_exit` stops it when that
process shuts down, and it asks Linux for SIGKILL when that process's starting thread ends
(`workers.warm_preload.die_with_parent`) for every other way that process can end.
"""
from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import multiprocessing.process
import multiprocessing.resource_tracker
import os
import shutil
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

#: What the warm process forks ranks through: multiprocessing's forkserver start method.
CONTEXT = multiprocessing.get_context("forkserver")


def start(env: dict[str, str]) -> int:
    """Start this process's forkserver with `env` as its environment and `workers.warm_preload` as
    its preload (it dies with this process's current thread, when that is the main one: Linux's
    parent-death signal follows the thread); its pid. Returns before the preload is done."""
    from workers.warm_preload import PARENT_ENV

    CONTEXT.set_forkserver_preload(["workers.warm_preload"])
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
