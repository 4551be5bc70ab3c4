"""A warm interpreter per slot: ranks forked from a process that has already imported torch,
DeepSpeed and the script's own top-level imports, instead of a fresh `python` that imports them.

Why: on the 2-core machine `import torch, deepspeed` alone is 3 s of every rank, and most of an
experiment was start-up (issue 33); on a cluster whose Python lives on a shared filesystem the
imports take tens of seconds. Each slot worker keeps one multiprocessing forkserver (the standard
library's: `set_forkserver_preload`, nothing hand-rolled) whose preload is `workers.warm_preload`,
and forks every rank from it. The forked rank is a fresh process for every experiment, so nothing
leaks from one experiment to the next (Ray Tune's `reuse_actors` reuses a process; this does not):
it sets its environment, argv, cwd, sys.path, stdout/stderr, session and CPU affinity, sets torch's
thread count, and runs the script through `workers.entry.run_script` as `python script.py` would
(runpy, `__main__`), then ends as the interpreter would (threads joined, atexit run, exit status).

What stays true, and why:
- CUDA is never initialised in the warm process: it is started with PYTORCH_NVML_BASED_CUDA_CHECK=1
  and DeepSpeed's accelerator named; `workers.warm_preload` checks `torch.cuda.is_initialized()`
  after every preloaded module (one that initialises CUDA is dropped from the preload and the slot's
  log says so) and before every fork; a rank forked from a process with CUDA refuses to run and the
  launch goes cold.
- Finding, limiting and killing a rank: the rank makes its own process group (`setsid`), so group
  kills, the memory cap and Ctrl-C work as for a cold rank. A forked process keeps the warm
  process's original environment in /proc/<pid>/environ, so the warm process carries AUTOTUNE_SLOT
  (`workers.launch.group_runs_slot`) and a token of its own (`server_token`): after a launch every
  process holding it, started since the launch, except the warm process, is stopped too, as the
  launch token stops the ones that exec'd (`WarmProcess.after_kill`). The memory a forked rank
  shares with the warm process is counted as its own, as a cold rank's would be (`inherited_bytes`).
- Environment read at import time is the rank's: the warm process is started with the slot's
  OMP/MKL threads, DeepSpeed's accelerator and PYTHONUNBUFFERED, and a rank whose values differ gets
  a warm process started with its own (`import_time_env`); torch's thread count is set in the rank
  (`torch.set_num_threads`); CUDA_VISIBLE_DEVICES and TORCH_EXTENSIONS_DIR are read when CUDA and an
  op build start, in the rank. The script's own modules (next to it) are never preloaded: they are
  the user's to edit between jobs, and may read RANK when imported.
- A launch the warm path cannot serve runs cold (`python -m workers.entry`, as before), and the
  record says which path ran (`start_path`, and `cold_because`): not a `.py` script (a wrapper),
  AUTOTUNE_WARM_START=0, a preload that fails or hangs, a rank that refused.
"""
from __future__ import annotations

import ast
import atexit
import importlib.machinery
import itertools
import json
import logging
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.process
import multiprocessing.resource_tracker
import os
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import psutil

log = logging.getLogger(__name__)

SWITCH_ENV = "AUTOTUNE_WARM_START"  #: "0" starts every rank cold
PRELOAD_ENV = "AUTOTUNE_WARM_PRELOAD"  #: the modules `workers.warm_preload` imports, comma-separated
REPORT_ENV = "AUTOTUNE_WARM_REPORT"  #: where it writes what it imported, and what failed
#: Read once, when a library is loaded or first asked, so the warm process must already have the rank's.
IMPORT_TIME_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "DS_ACCELERATOR", "PYTHONPATH", "PYTHONHASHSEED")
#: torch._dynamo: every torch optimizer's constructor imports it (`torch._disable_dynamo`), so
#: `deepspeed.initialize` paid 2.5-8 s of imports on the 2-core machine after the script's own.
ALWAYS_PRELOADED = ("torch", "deepspeed", "torch._dynamo")
#: How long the preload may take (a cold import of torch, DeepSpeed and transformers from a shared
#: filesystem is tens of seconds), and how long a forked rank may take to say it is ready.
PRELOAD_TIMEOUT_S = 600.0
READY_TIMEOUT_S = 60.0
REFUSED_EXIT = 86  #: a forked rank that would not run (CUDA initialised in the warm process)
_CONTEXT = multiprocessing.get_context("forkserver")


def switched_off(environ: dict[str, str] | os._Environ[str] = os.environ) -> bool:
    return environ.get(SWITCH_ENV, "1").strip().lower() in ("0", "false", "no", "off")


def why_cold(script_argv: list[str], environ: dict[str, str] | os._Environ[str] = os.environ) -> str | None:
    """Why the warm path cannot run this script (None: it can)."""
    if switched_off(environ):
        return f"switched off ({SWITCH_ENV}={environ.get(SWITCH_ENV)})"
    script = script_argv[0] if script_argv else ""
    if not script.endswith(".py"):
        return f"not a Python script: {script}"
    try:
        ast.parse(Path(script).read_bytes(), filename=script)
    except (OSError, SyntaxError, ValueError) as exc:
        return f"cannot be read as Python ({type(exc).__name__}): the cold run reports it"
    return None


def top_level_imports(source: str) -> list[str]:
    """The absolute modules a script imports at its top level (in order, without duplicates), also
    inside top-level `try`/`if` blocks; `from a.b import c` gives `a.b`. Pure."""
    found: list[str] = []

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif isinstance(node, ast.Try):
                for block in (node.body, *(handler.body for handler in node.handlers), node.orelse, node.finalbody):
                    visit(block)
            elif isinstance(node, ast.If):
                visit(node.body)
                visit(node.orelse)
            for name in names:
                if name != "__future__" and name not in found:
                    found.append(name)

    visit(ast.parse(source).body)
    return found


def installed_roots() -> list[Path]:
    """Where installed packages live: the standard library and site-packages."""
    return [Path(p).resolve() for p in {sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib", "purelib",
                                                                               "platlib")}]


def preload_modules(script: Path, installed: list[Path], search_path: list[str]) -> list[str]:
    """torch, DeepSpeed and the script's top-level imports that are installed packages (found on
    the rank's `search_path` under `installed`), never a module next to the script or one that
    shadows a package there."""
    chosen = []
    for name in [*ALWAYS_PRELOADED, *top_level_imports(script.read_text(errors="replace"))]:
        top = name.partition(".")[0]
        if name in chosen:
            continue
        try:
            spec = importlib.machinery.PathFinder.find_spec(top, search_path)
        except (ImportError, ValueError):
            continue
        places = ([spec.origin] if spec.origin else list(spec.submodule_search_locations or [])) if spec else []
        if places and all(any(Path(place).resolve().is_relative_to(root) for root in installed) for place in places):
            chosen.append(name)
    return chosen


def import_time_env(env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """The rank's values of what libraries read once: a warm process started with others is not its."""
    return tuple((name, env.get(name, "")) for name in IMPORT_TIME_ENV)


def server_env(rank_env: dict[str, str], slot_kind: str, preload: list[str], token: str,
               report: Path) -> dict[str, str]:
    """The warm process's environment: the rank's without what is the rank's alone (its rank, its
    peers, its launch), CUDA's check through NVML, DeepSpeed's accelerator named."""
    from workers.device_memory import EXIT_REPORT_ENV
    from workers.launch import CONTAINER_ENV

    per_rank = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "GROUP_RANK", "CROSS_RANK",
                "CROSS_SIZE", "MASTER_ADDR", "MASTER_PORT", EXIT_REPORT_ENV, CONTAINER_ENV}
    env = {name: value for name, value in rank_env.items() if name not in per_rank}
    env.update({"PYTORCH_NVML_BASED_CUDA_CHECK": "1", "PYTHONUNBUFFERED": "1", CONTAINER_ENV: token,
                PRELOAD_ENV: ",".join([*preload, __name__]), REPORT_ENV: str(report)})  # this module: the rank's start
    env.setdefault("DS_ACCELERATOR", "cuda" if slot_kind == "cuda" else "cpu")
    return env


@dataclass
class Start:
    """How one launch was started: the record's `start_path` and, when cold, why."""

    path: str = "cold"
    why_cold: str = ""


class WarmProcess:
    """A rank forked by the warm process, as `workers.launch.run_watched` watches a Popen."""

    def __init__(self, process: multiprocessing.process.BaseProcess, server_pid: int, server_token: str) -> None:
        self._process, self.pid = process, int(process.pid or 0)
        self._server_pid, self._server_token = server_pid, server_token

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(f"warm rank {self.pid}", timeout or 0.0)
        return self._process.exitcode

    def inherited_bytes(self) -> int:
        """The memory the rank still shares with the warm process: counted half in its PSS, but a
        cold rank would own it (its anonymous memory in full, less its proportional share)."""
        try:
            fields = {}
            for line in Path(f"/proc/{self.pid}/smaps_rollup").read_text().splitlines():
                name, _, value = line.partition(":")
                if name.replace("_", "").isalpha():
                    fields[name] = int(value.split()[0]) * 1024
            anonymous, proportional = fields["Anonymous"], fields["Pss_Anon"]
        except (OSError, KeyError, ValueError, IndexError):
            return 0
        return max(0, anonymous - proportional)

    def after_kill(self, since: float) -> None:
        """Stop what the rank forked without exec (its /proc environ is the warm process's)."""
        from workers.launch import CONTAINER_ENV, kill_marked

        kill_marked(CONTAINER_ENV, self._server_token, since, exclude=(self._server_pid,))


class WarmStarts:
    """This slot worker's warm process, started on the first launch that can use it, started again
    when a launch needs other preloads or import-time settings, or after it died."""

    def __init__(self, roots: list[Path] | None = None) -> None:
        self._roots = roots if roots is not None else installed_roots()
        self._key: tuple[Any, ...] | None = None
        self._pid = 0
        self._token = ""
        self._dropped: set[str] = set()  #: preloads that initialised CUDA
        self._failed: dict[tuple[Any, ...], str] = {}  #: keys whose preload failed, and how
        self._lock = threading.Lock()

    def spawn_for(self, script_argv: list[str], rank_env: dict[str, str], slot_kind: str,
                  cpus: tuple[int, ...], start: Start):
        """The `spawn` for `workers.launch.run_watched`: a warm rank when it can, else a cold
        `subprocess.Popen` of the same command; `start` says which ran."""
        reason = why_cold(script_argv, rank_env)

        def spawn(argv: list[str], env: dict[str, str], cwd: str, out: IO[bytes], err: IO[bytes]):
            cold = reason
            if cold is None:
                try:
                    with self._lock:
                        return self._fork(script_argv, env, cwd, out.name, err.name, slot_kind, cpus, start)
                except WarmUnavailable as exc:
                    cold = str(exc)
                except Exception as exc:  # noqa: BLE001 - a fault of the warm path costs the launch its speed only
                    log.exception("warm start failed; this rank runs cold")
                    cold = f"the warm path failed ({type(exc).__name__}: {exc})"
            start.path, start.why_cold = "cold", cold
            return subprocess.Popen(argv, env=env, cwd=cwd, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                    start_new_session=True)

        return spawn

    def _fork(self, script_argv: list[str], env: dict[str, str], cwd: str, stdout: str, stderr: str,
              slot_kind: str, cpus: tuple[int, ...], start: Start) -> WarmProcess:
        script = script_argv[0]
        search = rank_sys_path(script, cwd, ["", *env.get("PYTHONPATH", "").split(os.pathsep), *sys.path[1:]])
        preload = [name for name in preload_modules(Path(script), self._roots, [p for p in search if p])
                   if name not in self._dropped]
        key = (tuple(preload), import_time_env(env), slot_kind, env.get("AUTOTUNE_SLOT", ""))
        if key in self._failed:
            raise WarmUnavailable(self._failed[key])
        if key != self._key or not self._alive():
            self._start_server(key, preload, env, slot_kind)
        receive, send = _CONTEXT.Pipe(duplex=False)
        request = {"script_argv": script_argv, "env": env, "cwd": cwd, "stdout": stdout, "stderr": stderr,
                   "cpus": list(cpus)}
        with _may_have_children():  # the Process takes a copy of this process's config when made
            process = _CONTEXT.Process(target=run_forked_rank, args=(request, send), name="autotune-rank",
                                       daemon=True)
            process.start()
        send.close()
        try:
            answer = receive.recv() if receive.poll(READY_TIMEOUT_S) else ("lost", "no answer in time")
        except EOFError:
            answer = ("lost", "it ended before it was ready")
        receive.close()
        if answer[0] != "ok":
            _stop(process)
            self._stop_server()
            raise WarmUnavailable(f"the forked rank did not start ({answer[0]}: {answer[1]})")
        start.path, start.why_cold = "warm", ""
        return WarmProcess(process, self._pid, self._token)

    def _alive(self) -> bool:
        try:
            return psutil.Process(self._pid).status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    def _start_server(self, key: tuple[Any, ...], preload: list[str], rank_env: dict[str, str],
                      slot_kind: str) -> None:
        """Start the warm process for `key`, its preload done and checked: a module that initialised
        CUDA is dropped (and the process started again without it); one that failed makes the key
        cold for this worker's life."""
        self._stop_server()
        for _ in range(len(preload) + 1):
            report = Path(tempfile.mkdtemp(prefix="autotune-warm.")) / "preload.json"
            token = uuid.uuid4().hex
            _CONTEXT.set_forkserver_preload(["workers.warm_preload"])
            multiprocessing.resource_tracker.ensure_running()  # this worker's: not marked as the ranks are
            with _environment(server_env(rank_env, slot_kind, preload, token, report)):
                multiprocessing.forkserver.ensure_running()
            self._pid, self._token = multiprocessing.forkserver._forkserver._forkserver_pid or 0, token
            with _may_have_children():
                probe = _CONTEXT.Process(target=probe_fork, name="autotune-warm-probe", daemon=True)
                probe.start()
            probe.join(PRELOAD_TIMEOUT_S)
            outcome = _read_report(report)
            if probe.exitcode is None:
                _stop(probe)
                self._stop_server()
                self._failed[key] = f"the warm process's preload took over {PRELOAD_TIMEOUT_S:.0f} s"
                raise WarmUnavailable(self._failed[key])
            culprit = outcome.get("cuda_initialised_by")
            if culprit:
                log.warning("warm start: preloading %s initialised CUDA in the warm process; dropped from the "
                            "preload (ranks import it themselves)", culprit)
                self._stop_server()
                self._dropped.add(culprit)
                preload = [name for name in preload if name != culprit]
                continue
            if outcome.get("failed") or probe.exitcode != 0:
                self._stop_server()
                failed = outcome.get("failed") or {"?": f"the probe exited {probe.exitcode}"}
                self._failed[key] = "a preload failed in the warm process: " + "; ".join(
                    f"{name}: {error}" for name, error in failed.items())
                log.warning("warm start: %s; this script's ranks run cold", self._failed[key])
                raise WarmUnavailable(self._failed[key])
            self._key = key
            log.info("warm start: warm process %d ready (%s), preloaded %s in %.1f s", self._pid, slot_kind,
                     ", ".join(preload), outcome.get("seconds", 0.0))
            return
        raise WarmUnavailable("every preload initialised CUDA")

    def _stop_server(self) -> None:
        server = multiprocessing.forkserver._forkserver
        if server._forkserver_pid is not None:
            try:
                os.kill(server._forkserver_pid, signal.SIGKILL)  # a preload may hang: no polite stop
            except ProcessLookupError:
                pass
            try:
                server._stop()
            except ChildProcessError:
                server._forkserver_pid = server._forkserver_address = server._forkserver_alive_fd = None
        self._key, self._pid, self._token = None, 0, ""


class WarmUnavailable(Exception):
    """The warm path cannot serve this launch; the message says why (the record's `cold_because`)."""


def _read_report(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _stop(process: multiprocessing.process.BaseProcess) -> None:
    if process.exitcode is None:
        process.kill()
    process.join(5)


@contextmanager
def _may_have_children() -> Iterator[None]:
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


def probe_fork() -> None:
    """The first fork of a new warm process: waits for its preload, exits REFUSED_EXIT with CUDA."""
    from workers import warm_preload

    os._exit(REFUSED_EXIT if warm_preload.cuda_before_fork() else 0)


def rank_sys_path(script: str, cwd: str, inherited: list[str]) -> list[str]:
    """sys.path as `python -m workers.entry script.py` in `cwd` has it: the script's folder, the
    cwd (`-m`), then the warm interpreter's own (its PYTHONPATH, which is the rank's, and the
    installation's), less its first entry (the `-c` it was started with). Pure."""
    first = [os.path.dirname(os.path.abspath(script)), cwd]
    return [*first, *(entry for entry in inherited[1:] if entry not in first)]


def run_forked_rank(request: dict[str, Any], ready: Any) -> None:
    """The rank, in the process the warm process forked: becomes what a cold rank would be, says so
    on `ready`, runs the script and ends as the interpreter would. Never returns."""
    from workers import warm_preload

    refused = warm_preload.cuda_before_fork()
    if refused:
        ready.send(("refused", refused))
        os._exit(REFUSED_EXIT)
    try:
        os.setsid()
        if request["cpus"] and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, request["cpus"])
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
    from workers.entry import run_script
    from workers.step_clock import note

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


WARM = WarmStarts()
