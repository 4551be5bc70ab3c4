"""The rank's side of a warm start (`workers.warm.warm_start`): what a process forked from the slot's
warm interpreter does to become the rank a cold `python -m workers.in_rank.entry script.py` would be.

It sets its own session (the launch's process group), CPU affinity, environment (the rank's,
exactly), cwd, stdin/stdout/stderr (the launch's files on fds 0-2, where the warm process's
stream objects, and the loggers holding them, already write), argv and sys.path, and undoes
what the fork carried over that a fresh interpreter would not have (multiprocessing's idea of
this process, the forkserver's signal handling, torch's thread count); then says so on the pipe
the launcher waits on, and runs the script through `workers.in_rank.entry.run_script`, ending as the
interpreter would (threads joined, atexit run, the exit status or the signal). It refuses to run,
before touching anything, when CUDA was initialised in the warm process (`workers.warm.warm_preload`).
"""
from __future__ import annotations

import atexit
import itertools
import multiprocessing
import multiprocessing.context
import multiprocessing.process
import os
import signal
import sys
import threading
from typing import Any

REFUSED_EXIT = 86  #: a forked rank that would not run (CUDA initialised in the warm process)


def probe_fork() -> None:
    """The first fork of a new warm process: waits for its preload, exits REFUSED_EXIT with CUDA."""
    from workers.warm import warm_preload

    os._exit(REFUSED_EXIT if warm_preload.cuda_before_fork() else 0)


def rank_sys_path(script: str, cwd: str, inherited: list[str]) -> list[str]:
    """sys.path as `python -m workers.in_rank.entry script.py` in `cwd` has it: the script's folder, the
    cwd (`-m`), then the warm interpreter's own (its PYTHONPATH, which is the rank's, and the
    installation's), less its first entry (the `-c` it was started with). Pure."""
    first = [os.path.dirname(os.path.abspath(script)), cwd]
    return [*first, *(entry for entry in inherited[1:] if entry not in first)]


def run_forked_rank(request: dict[str, Any], ready: Any) -> None:
    """The rank, in the process the warm process forked: becomes what a cold rank would be, says so
    on `ready`, runs the script and ends as the interpreter would. Never returns."""
    from workers.warm import warm_preload

    refused = warm_preload.cuda_before_fork()
    if refused:
        ready.send(("refused", refused))
        os._exit(REFUSED_EXIT)
    try:
        os.setsid()
        if request["cpus"] and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, request["cpus"])
        from workers.in_rank.entry import take_title

        take_title(request["env"])  # before the environment changes: `ps` names the rank (workers.process.process_identity)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        _redirect(0, os.devnull, os.O_RDONLY)
        _redirect(1, request["stdout"], os.O_WRONLY | os.O_APPEND)
        _redirect(2, request["stderr"], os.O_WRONLY | os.O_APPEND)
        script, *args = request["script_argv"]
        sys.argv = [script, *args]
        sys.path[:] = rank_sys_path(script, request["cwd"], sys.path)
        _as_a_fresh_process(request["env"])
    except BaseException as exc:  # noqa: BLE001 - reported to the launcher, which runs the rank cold
        ready.send(("failed", f"{type(exc).__name__}: {exc}"))
        os._exit(REFUSED_EXIT)
    ready.send(("ok", ""))
    ready.close()
    from workers.in_rank.entry import run_script
    from workers.in_rank.step_clock import note

    note("up")
    code = 0
    try:
        run_script(script)
    except SystemExit as exc:
        code = _exit_code(exc)
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())
        code = -signal.SIGINT
    except BaseException:  # noqa: BLE001 - the interpreter's top level: print it, exit 1
        sys.excepthook(*sys.exc_info())
        code = 1
    _leave(code)


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def _leave(code: int) -> None:
    """The interpreter's exit: non-daemon threads joined, atexit handlers run, output flushed."""
    try:
        threading._shutdown()  # type: ignore[attr-defined]
    except BaseException:  # noqa: BLE001
        pass
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    if code < 0:  # killed by a signal, as `python script.py` ends on an uncaught KeyboardInterrupt
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code & 0xFF)


def _redirect(fd: int, path: str, flags: int) -> None:
    opened = os.open(path, flags)
    os.dup2(opened, fd)
    os.close(opened)


def _as_a_fresh_process(env: dict[str, str]) -> None:
    """Undo what the fork carried over that a fresh interpreter would not have: multiprocessing's
    idea of this process (a daemon child of the worker) and its start method, the forkserver's
    signal handling, torch's thread count (read from OMP_NUM_THREADS when a fresh one loads)."""
    me = multiprocessing.process.current_process()  # what _MainProcess() would be (it is not exported)
    me._identity, me._name, me._parent_pid, me._popen = (), "MainProcess", None, None  # type: ignore[attr-defined]
    me._config = {"authkey": multiprocessing.process.AuthenticationString(os.urandom(32)),  # type: ignore[attr-defined]
                  "semprefix": "/mp"}
    multiprocessing.process._parent_process = None  # type: ignore[attr-defined]
    multiprocessing.process._children = set()  # type: ignore[attr-defined]
    multiprocessing.process._process_counter = itertools.count(1)  # type: ignore[attr-defined]
    multiprocessing.context._default_context._actual_context = None  # type: ignore[attr-defined]
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for name in ("SIGTERM", "SIGCHLD", "SIGUSR1", "SIGUSR2", "SIGHUP"):
        signal.signal(getattr(signal, name), signal.SIG_DFL)
    torch = sys.modules.get("torch")
    threads = env.get("OMP_NUM_THREADS", "").strip()
    if torch is not None and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
