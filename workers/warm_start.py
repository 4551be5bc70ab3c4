"""A warm interpreter per slot: ranks forked from a process that has already imported the script's
own top-level imports (and torch, DeepSpeed and torch._dynamo for a script that uses DeepSpeed,
`workers.warm_plan`), instead of a fresh `python` that imports them.

Why: on the 2-core machine `import torch, deepspeed` alone is 3 s of every rank, and most of an
experiment was start-up (issue 33); on a cluster whose Python lives on a shared filesystem the
imports take tens of seconds. Each slot worker keeps one multiprocessing forkserver (the standard
library's: `set_forkserver_preload`, nothing hand-rolled) whose preload is `workers.warm_preload`,
and forks every rank from it. The forked rank is a fresh process for every experiment, so nothing
leaks from one experiment to the next (Ray Tune's `reuse_actors` reuses a process; this does not):
`workers.warm_rank` sets its environment, argv, cwd, sys.path, stdout/stderr, session and CPU
affinity, sets torch's thread count, and runs the script through `workers.entry.run_script` as
`python script.py` would (runpy, `__main__`), then ends as the interpreter would. What a rank
imported itself (torch and DeepSpeed import much lazily inside `deepspeed.initialize`) is learned
and preloaded from then on (`WarmStarts.learn`); the warm process is started again with it between
experiments, keeping the slot's lease meanwhile, when the lesson is worth a start (`RESTART_AT_IMPORTS`).
The warm process freezes what it imported out of the garbage collector's sight before it forks
(`workers.warm_preload`), so a rank's collections do not copy the pages it shares with it, and on
CPU it has already probed which DeepSpeed ops the machine can build and loaded DeepSpeed's
communication op, which each rank otherwise did again in `deepspeed.initialize` (a C compiler run,
two subprocesses).

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
  launch token stops the ones that exec'd (`WarmProcess.leftover_marks`). The memory a forked rank
  shares with the warm process is counted as its own, as a cold rank's would be (`forked_from_warm`).
- Environment read at import time is the rank's: the warm process is started with the slot's OMP/MKL
  threads, DeepSpeed's accelerator and PYTHONUNBUFFERED, and a rank whose values differ gets a warm
  process started with its own (`workers.warm_plan.import_time_env`); torch's thread count is set in
  the rank (`torch.set_num_threads`); CUDA_VISIBLE_DEVICES and TORCH_EXTENSIONS_DIR are read when
  CUDA and an op build start, in the rank. The script's own modules (next to it) are never
  preloaded: they are the user's to edit between jobs, and may read RANK when imported.
- A launch the warm path cannot serve runs cold (`python -m workers.entry`, as before), and the
  record says which path ran (`start_path`, and `cold_because`): not a `.py` script (a wrapper),
  AUTOTUNE_WARM_START=0 (`workers.warm_plan`, which decides what runs cold and what is preloaded), a
  script that imports only the standard library (nothing to preload: such a rank starts in tens of
  milliseconds cold), a preload that fails or hangs, a rank that refused.
- The wait for the warm process is not the experiment's: `workers.launch.run_watched` starts the
  time limit when the rank exists, so a preload slowed by a loaded machine or a shared filesystem
  cannot turn a good config into a timeout (the record's wall still counts it: it is start-up).
- Its costs: the warm process's memory on each slot while the worker lives (not under the slot's
  cap), one start per script and import-time setting (multiprocessing has one forkserver per
  process: jobs with different scripts on one slot take turns restarting it).
- It never outlives its worker: the pool process ends it when it shuts down (`WarmStarts.stop`,
  from `tasks.worker_hooks` on Celery's worker_process_shutdown, warm or cold), and Linux kills it
  when that process dies any other way (`workers.warm_preload.die_with_parent`); `workers.warm_server`
  drives multiprocessing's forkserver. Otherwise it would notice only after billiard's exit pause,
  then spend seconds tearing torch down: `deploy down` and the tests' checks for leftovers found
  it still running after its worker had gone.
"""
from __future__ import annotations

import json
import logging
import multiprocessing.process
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import psutil

from workers import warm_server
from workers.warm_plan import (SWITCH_ENV, beyond_the_standard_library, import_time_env, installed_only,
                               installed_roots, preload_modules, why_cold)
from workers.warm_rank import probe_fork, rank_sys_path, run_forked_rank

log = logging.getLogger(__name__)

PRELOAD_ENV = "AUTOTUNE_WARM_PRELOAD"  #: the modules `workers.warm_preload` imports, comma-separated
REPORT_ENV = "AUTOTUNE_WARM_REPORT"  #: where it writes what it imported, and what failed
#: How long the preload may take (a cold import of torch, DeepSpeed and transformers from a shared
#: filesystem is tens of seconds), and how long a forked rank may take to say it is ready.
PRELOAD_TIMEOUT_S = 600.0
READY_TIMEOUT_S = 60.0
MAX_LEARNED = 300  #: learned preloads kept per script
#: A rank that imported fewer modules than this itself (ZeRO-1's optimizer after ZeRO-0 taught the
#: rest: 3-20 modules) does not start the warm process again: a start costs the slot 4-6 s of a core
#: here (torch's import again), more than those imports cost each rank. They wait in `_deferred` and
#: are preloaded with the next start. The first rank of a DeepSpeed script imports hundreds.
RESTART_AT_IMPORTS = 50
NOTHING_TO_PRELOAD = "nothing to preload: the script imports only the standard library"


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
                PRELOAD_ENV: ",".join([*preload, "workers.warm_rank"]), REPORT_ENV: str(report)})  # the rank's start
    env.setdefault("DS_ACCELERATOR", "cuda" if slot_kind == "cuda" else "cpu")
    return env


@dataclass
class Start:
    """How one launch was started: the record's `start_path` and, when cold, why."""

    path: str = "cold"
    why_cold: str = ""


class WarmProcess:
    """A rank forked by the warm process, as `workers.launch.run_watched` watches a Popen."""

    #: The memory it shares with the warm process counts as its own, as a cold rank would own it
    #: (`workers.tree_memory.inherited`).
    forked_from_warm = True

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

    def leftover_marks(self) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """What the rank forked without exec carries (its /proc environ is the warm process's): the
        warm process's token, to stop after the launch as the launch's own, sparing the warm process."""
        return (self._server_token,), (self._server_pid,)


class WarmStarts:
    """This slot worker's warm process, started on the first launch that can use it, started again
    when a launch needs other preloads or import-time settings, or after it died."""

    def __init__(self, roots: list[Path] | None = None) -> None:
        self._roots = roots if roots is not None else installed_roots()
        self._key: tuple[Any, ...] | None = None
        self._pid = 0
        self._token = ""
        self._dropped: set[str] = set()  #: preloads that initialised CUDA, or learned ones that failed
        self._learned: dict[str, list[str]] = {}  #: per script: what its ranks imported themselves
        self._deferred: dict[str, list[str]] = {}  #: per script: learned, preloaded from the next start on
        self._last: tuple[str, dict[str, str], str, str] | None = None  #: the latest warm launch's script, env, cwd, kind
        self._failed: dict[tuple[Any, ...], str] = {}  #: keys whose preload failed, and how
        self._lock = threading.Lock()

    def spawn_for(self, script_argv: list[str], rank_env: dict[str, str], slot_kind: str,
                  cpus: tuple[int, ...], start: Start, keep_alive: Callable[[], object] = lambda: None):
        """The `spawn` for `workers.launch.run_watched`: a warm rank when it can, else a cold
        `subprocess.Popen` of the same command; `start` says which ran. `keep_alive` is called
        every second while a warm process starts (the slot's lease must not lapse meanwhile: a
        preload from a shared filesystem takes tens of seconds)."""
        reason = why_cold(script_argv, rank_env)

        def spawn(argv: list[str], env: dict[str, str], cwd: str, out: IO[bytes], err: IO[bytes]):
            cold = reason
            if cold is None:
                try:
                    with self._lock:
                        return self._fork(script_argv, env, cwd, out.name, err.name, slot_kind, cpus, start,
                                          keep_alive)
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
              slot_kind: str, cpus: tuple[int, ...], start: Start,
              keep_alive: Callable[[], object] = lambda: None) -> WarmProcess:
        key, preload, learned = self._plan(script_argv[0], env, cwd, slot_kind)
        self._last = (script_argv[0], env, cwd, slot_kind)
        if key in self._failed:
            raise WarmUnavailable(self._failed[key])
        if not beyond_the_standard_library(preload):
            raise WarmUnavailable(NOTHING_TO_PRELOAD)
        if key != self._key or not self._alive():
            if self._adopt_deferred(script_argv[0]):  # a start anyway: with what smaller lessons taught
                key, preload, learned = self._plan(script_argv[0], env, cwd, slot_kind)
            self._start_server(key, preload, env, slot_kind, learned, keep_alive)
        receive, send = warm_server.CONTEXT.Pipe(duplex=False)
        request = {"script_argv": script_argv, "env": env, "cwd": cwd, "stdout": stdout, "stderr": stderr,
                   "cpus": list(cpus)}
        with warm_server.may_have_children():  # the Process takes a copy of this process's config when made
            process = warm_server.CONTEXT.Process(target=run_forked_rank, args=(request, send),
                                                  name="autotune-rank", daemon=True)
            process.start()
        send.close()
        try:
            answer = receive.recv() if _wait(lambda: receive.poll(1.0), READY_TIMEOUT_S, keep_alive) \
                else ("lost", "no answer in time")
        except EOFError:
            answer = ("lost", "it ended before it was ready")
        receive.close()
        if answer[0] != "ok":
            warm_server.stop_child(process)
            self._stop_server()
            raise WarmUnavailable(f"the forked rank did not start ({answer[0]}: {answer[1]})")
        start.path, start.why_cold = "warm", ""
        return WarmProcess(process, self._pid, self._token)

    def _plan(self, script: str, env: dict[str, str], cwd: str, slot_kind: str
              ) -> tuple[tuple[Any, ...], list[str], set[str]]:
        """The warm process this launch needs (its key), what it preloads, and which of those were
        learned from earlier ranks of the script (`learn`)."""
        own = [name for name in preload_modules(Path(script), self._roots, self._search_path(script, env, cwd))
               if name not in self._dropped]
        learned = [name for name in self._learned.get(script, []) if name not in own and name not in self._dropped]
        preload = [*own, *learned]
        return (tuple(preload), import_time_env(env), slot_kind, env.get("AUTOTUNE_SLOT", "")), preload, set(learned)

    @staticmethod
    def _search_path(script: str, env: dict[str, str], cwd: str) -> list[str]:
        """Where the rank looks for modules: its sys.path (`rank_sys_path`)."""
        search = rank_sys_path(script, cwd, ["", *env.get("PYTHONPATH", "").split(os.pathsep), *sys.path[1:]])
        return [entry for entry in search if entry]

    def learn(self, script_argv: list[str], imported: list[str] | None,
              keep_alive: Callable[[], object] = lambda: None, imported_count: int | None = None) -> None:
        """After a rank of the script ended: the installed modules it imported itself
        (`workers.entry.imports_since`; torch and DeepSpeed import much lazily, inside
        `deepspeed.initialize`) are preloaded from now on, and the warm process is started again
        with them at once, between experiments rather than inside the next one's wall, when the
        rank imported `RESTART_AT_IMPORTS` modules or more (`imported_count`, all of them, None:
        unknown); fewer wait for the next start."""
        if not imported or not script_argv:
            return
        with self._lock:
            if self._last is None or self._last[0] != script_argv[0] or why_cold(script_argv, self._last[1]):
                return
            script, env, cwd, slot_kind = self._last
            known = [*self._learned.get(script, []), *self._deferred.get(script, [])]
            fresh = [name for name in imported if name not in known and name not in self._dropped]
            fresh = installed_only(fresh, self._roots, self._search_path(script, env, cwd))[:MAX_LEARNED - len(known)]
            if not fresh:
                return
            self._deferred.setdefault(script, []).extend(fresh)
            if imported_count is not None and imported_count < RESTART_AT_IMPORTS and self._alive():
                return
            self._adopt_deferred(script)
            key, preload, learned = self._plan(script, env, cwd, slot_kind)
            if key in self._failed or key == self._key or not beyond_the_standard_library(preload):
                return
            try:
                self._start_server(key, preload, env, slot_kind, learned, keep_alive)
            except Exception as exc:  # noqa: BLE001 - the next launch tries again, or runs cold
                log.warning("warm start: starting the warm process with the learned preloads failed: %s", exc)

    def _adopt_deferred(self, script: str) -> bool:
        """Move what ranks of `script` taught into its preload; whether there was anything."""
        deferred = self._deferred.pop(script, [])
        self._learned.setdefault(script, []).extend(deferred)
        return bool(deferred)

    def _alive(self) -> bool:
        try:
            return psutil.Process(self._pid).status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    def _start_server(self, key: tuple[Any, ...], preload: list[str], rank_env: dict[str, str],
                      slot_kind: str, learned: set[str] = frozenset(),  # type: ignore[assignment]
                      keep_alive: Callable[[], object] = lambda: None) -> None:
        """Start the warm process for `key`, its preload done and checked: a module that initialised
        CUDA, or a learned one that failed, is dropped (and the process started again without it);
        one of the script's own imports that failed makes the key cold for this worker's life."""
        self._stop_server()
        for _ in range(len(preload) + 1):
            report = Path(tempfile.mkdtemp(prefix="autotune-warm.")) / "preload.json"
            token = uuid.uuid4().hex
            self._pid = warm_server.start(server_env(rank_env, slot_kind, preload, token, report))
            self._token = token
            with warm_server.may_have_children():
                probe = warm_server.CONTEXT.Process(target=probe_fork, name="autotune-warm-probe", daemon=True)
                # start() waits for the preload (the forkserver forks only after it): in a thread,
                # so that the lease is kept meanwhile
                starter = threading.Thread(target=_quietly, args=(probe.start,), daemon=True)
                starter.start()
                started = _wait(lambda: starter.join(1.0) or not starter.is_alive(), PRELOAD_TIMEOUT_S, keep_alive)
            if started and probe.pid is not None:
                _wait(lambda: probe.join(1.0) or probe.exitcode is not None, 60.0, keep_alive)
            outcome = _read_report(report)
            shutil.rmtree(report.parent, ignore_errors=True)
            if not started or probe.pid is None or probe.exitcode is None:
                if probe.pid is not None:
                    warm_server.stop_child(probe)
                self._stop_server()
                self._failed[key] = f"the warm process's preload took over {PRELOAD_TIMEOUT_S:.0f} s"
                raise WarmUnavailable(self._failed[key])
            culprit = outcome.get("cuda_initialised_by")
            failed = outcome.get("failed") or {}
            if culprit or failed and set(failed) <= learned:
                if culprit:
                    log.warning("warm start: preloading %s initialised CUDA in the warm process; dropped from the "
                                "preload (ranks import it themselves)", culprit)
                else:
                    log.warning("warm start: learned preloads failed, dropped: %s", failed)
                self._stop_server()
                dropped = {culprit} if culprit else set(failed)
                self._dropped |= dropped
                preload = [name for name in preload if name not in dropped]
                continue
            if outcome.get("failed") or probe.exitcode != 0:
                self._stop_server()
                failed = outcome.get("failed") or {"?": f"the probe exited {probe.exitcode}"}
                self._failed[key] = "a preload failed in the warm process: " + "; ".join(
                    f"{name}: {error}" for name, error in failed.items())
                log.warning("warm start: %s; this script's ranks run cold", self._failed[key])
                raise WarmUnavailable(self._failed[key])
            self._key = (tuple(preload), *key[1:])  # without what was dropped: what the next launch asks for
            log.info("warm start: warm process %d ready (%s), preloaded %s in %.1f s%s", self._pid, slot_kind,
                     ", ".join(preload), outcome.get("seconds", 0.0),
                     f"; DeepSpeed's ops: {outcome['deepspeed_ops']}" if outcome.get("deepspeed_ops") else "")
            return
        raise WarmUnavailable("every preload initialised CUDA")

    def stop(self) -> None:
        """End the warm process now, reaped, its socket's folder removed: this process is ending
        (Celery's worker_process_shutdown). Safe from a signal handler that interrupted a launch:
        without the launch's lock, the warm process is only killed."""
        if not self._lock.acquire(blocking=False):
            server_pid = warm_server.running_pid()
            if server_pid is not None:
                warm_server.kill(server_pid)
            return
        try:
            warm_server.end_for_exit()
            self._key, self._pid, self._token = None, 0, ""
        finally:
            self._lock.release()

    def _stop_server(self) -> None:
        warm_server.stop()
        self._key, self._pid, self._token = None, 0, ""


class WarmUnavailable(Exception):
    """The warm path cannot serve this launch; the message says why (the record's `cold_because`)."""


def _wait(done: Callable[[], bool], limit_s: float, keep_alive: Callable[[], object]) -> bool:
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


def _read_report(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


WARM = WarmStarts()
