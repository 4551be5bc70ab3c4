"""A warm interpreter per slot: ranks forked from a process that has already imported the script's
own top-level imports (and torch, DeepSpeed and torch._dynamo for a script that uses DeepSpeed,
`workers.warm.warm_plan`), instead of a fresh `python` that imports them.

Why: on the 2-core machine `import torch, deepspeed` alone is 3 s of every rank, and most of an
experiment was start-up; on a cluster whose Python lives on a shared filesystem the imports take
tens of seconds. Each slot worker keeps one multiprocessing forkserver (`workers.warm.warm_server`, the
standard library's, nothing hand-rolled) whose preload is `workers.warm.warm_preload`, and forks every
rank from it. The forked rank is a fresh process for every experiment, so nothing leaks from one
experiment to the next: `workers.warm.warm_rank` makes it what a cold `python script.py` rank would be.
What a rank imported itself (torch and DeepSpeed import much lazily inside `deepspeed.initialize`)
is learned and preloaded from then on (`WarmStarts.learn`), the warm process started again with it
between experiments when the lesson is worth a start (`RESTART_AT_IMPORTS`).

What stays true, and why:
- CUDA is never initialised in the warm process: it is started with PYTORCH_NVML_BASED_CUDA_CHECK=1
  and DeepSpeed's accelerator named; `workers.warm.warm_preload` checks after every preloaded module and
  before every fork, by torch's flag and by the driver's state in /proc (another library, pycuda or
  CuPy, may initialise it); a module that initialised it is dropped from the preload and the slot's
  log says so; a rank forked from a process with CUDA refuses to run and the launch goes cold.
- It runs the code a fresh interpreter would: it is started again when the launch needs other
  preloads or import-time settings (`workers.warm.warm_plan.import_time_env`: what libraries read once),
  and when the code it imported changed on disk (`workers.warm.warm_plan.code_changed`: a distribution
  upgraded or reinstalled under the running worker, a file of the user's own package edited).
  The script's own modules (next to it) are never preloaded.
- Finding, limiting and killing a rank: the rank makes its own process group (`setsid`), so group
  kills and the memory cap work as for a cold rank; it carries the warm process's token in its
  /proc environ, by which its leftovers are stopped (`WarmProcess.leftover_marks`), and the memory
  it shares with the warm process counts as its own (`forked_from_warm`). What it is (slot, job,
  experiment, rank) is read from its title and its slot's record, never from that environ
  (`workers.process.process_identity`).
- A rank's end is told by the warm process, its parent; if the warm process dies while the rank
  runs, the rank is watched by its pid to its end and the launch is recorded lost (its exit status
  is unknown), not as the config's crash (`workers.warm.warm_server.WarmProcess`,
  `workers.warm.rank_start.Start.lost`).
- The preload never outlasts the launch's deadline: a launch waits for its warm process in
  `prepare`, before its time limit starts, and that wait is taken from the limit, as a cold rank's
  imports are in its own; a start after a rank (`learn`) is not waited for in that rank's task.
- A launch the warm path cannot serve runs cold (`python -m workers.in_rank.entry`) and the record says why
  (`start_path`, `cold_because`): not a `.py` script, AUTOTUNE_WARM_START=0, a script of the
  standard library alone, a preload that fails or is not done in time, a rank that refused.
- Its costs: the warm process's memory on each slot while the worker lives (not under the slot's
  cap), one start per script and import-time setting (multiprocessing has one forkserver per
  process: jobs with different scripts on one slot take turns restarting it).
- It never outlives its worker: the pool process ends it when it shuts down (`WarmStarts.stop`,
  from `tasks.worker_hooks`), and Linux kills it when that process dies any other way
  (`workers.warm.warm_preload.die_with_parent`).
"""
from __future__ import annotations

import logging
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

from workers.warm import warm_server
from workers.warm.rank_start import Start, WarmUnavailable, recorded_lost
from workers.warm.warm_plan import (SWITCH_ENV, beyond_the_standard_library, code_changed, import_time_env,  # noqa: F401
                               installed_only, installed_roots, preload_modules, why_cold)
from workers.warm.warm_rank import REFUSED_EXIT, probe_fork, rank_sys_path, run_forked_rank
from workers.warm.warm_server import PRELOAD_ENV, REPORT_ENV, WarmProcess, server_env, wait_until as _wait  # noqa: F401

log = logging.getLogger(__name__)

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


@dataclass(frozen=True)
class _Pending:
    """A warm process started, its preload unchecked (`WarmStarts.learn`, or not done in a launch's limit)."""

    key: tuple[Any, ...]
    preload: list[str]
    learned: set[str]
    report: Path
    since: float  #: time.monotonic() when it was started


class WarmStarts:
    """This slot worker's warm process, started on the first launch that can use it, started again
    when a launch needs other preloads or import-time settings, when the code it imported changed on
    disk (`workers.warm.warm_plan.code_changed`), or after it died."""

    def __init__(self, roots: list[Path] | None = None) -> None:
        self._roots = roots if roots is not None else installed_roots()
        self._key: tuple[Any, ...] | None = None
        self._pid = 0
        self._token = ""
        self._code: dict[str, Any] | None = None  #: what the running warm process's code is made of
        self._pending: _Pending | None = None
        self._dropped: set[str] = set()  #: preloads that initialised CUDA, or learned ones that failed
        self._learned: dict[str, list[str]] = {}  #: per script: what its ranks imported themselves
        self._deferred: dict[str, list[str]] = {}  #: per script: learned, preloaded from the next start on
        self._last: tuple[str, dict[str, str], str, str] | None = None  #: the latest warm launch's script, env, cwd, kind
        self._failed: dict[tuple[Any, ...], str] = {}  #: keys whose preload failed, and how
        self._closing = False
        self._lock = threading.Lock()

    def prepare(self, script_argv: list[str], env: dict[str, str], cwd: str, slot_kind: str, limit_s: float,
                start: Start, keep_alive: Callable[[], object] = lambda: None) -> float:
        """Before the launch's time limit starts: the warm process its rank forks from made ready
        (started, or its start between launches finished) within `limit_s`; the seconds that took,
        which the caller takes from the rank's time limit, as a cold rank's imports are in its own.
        So a preload, however slow, never makes a rank's task outlast the deadline the control
        worker gives the launch. A launch it cannot serve is marked cold in `start` (`spawn_for`
        then starts it cold at once). `keep_alive` is called every second meanwhile (the lease)."""
        began = time.monotonic()
        if why_cold(script_argv, env) is not None:
            return 0.0
        try:
            if not warm_server.acquire(self._lock, limit_s, keep_alive):
                start.why_cold = f"the warm process was still starting after {limit_s:.0f} s"
                return time.monotonic() - began
            try:
                self._ready(script_argv[0], env, cwd, slot_kind, keep_alive, limit_s - (time.monotonic() - began))
            finally:
                self._lock.release()
        except WarmUnavailable as exc:
            start.why_cold = str(exc)
        except Exception as exc:  # noqa: BLE001 - a fault of the warm path costs the launch its speed only
            log.exception("warm start failed; this rank runs cold")
            start.why_cold = f"the warm path failed ({type(exc).__name__}: {exc})"
        return time.monotonic() - began

    def spawn_for(self, script_argv: list[str], rank_env: dict[str, str], slot_kind: str,
                  cpus: tuple[int, ...], start: Start, keep_alive: Callable[[], object] = lambda: None):
        """The `spawn` for `workers.process.launch.run_watched`: a warm rank when it can, else a cold
        `subprocess.Popen` of the same command; `start` says which ran. Without `prepare` first, a
        warm process is started here, outside the time limit; `keep_alive` is called every second
        meanwhile (the slot's lease must not lapse)."""
        reason = why_cold(script_argv, rank_env) or start.why_cold or None

        def spawn(argv: list[str], env: dict[str, str], cwd: str, out: IO[bytes], err: IO[bytes]):
            cold = reason
            if cold is None:
                try:
                    with self._lock:
                        self._ready(script_argv[0], env, cwd, slot_kind, keep_alive)
                        return self._fork(script_argv, env, cwd, out.name, err.name, cpus, start, keep_alive)
                except WarmUnavailable as exc:
                    cold = str(exc)
                except Exception as exc:  # noqa: BLE001 - a fault of the warm path costs the launch its speed only
                    log.exception("warm start failed; this rank runs cold")
                    cold = f"the warm path failed ({type(exc).__name__}: {exc})"
            start.path, start.why_cold = "cold", cold
            return subprocess.Popen(argv, env=env, cwd=cwd, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                    start_new_session=True)

        return spawn

    def _ready(self, script: str, env: dict[str, str], cwd: str, slot_kind: str,
               keep_alive: Callable[[], object], limit_s: float = PRELOAD_TIMEOUT_S) -> None:
        """The warm process for this launch running, its preload done and checked (the lock held)."""
        key, preload, learned = self._plan(script, env, cwd, slot_kind)
        self._last = (script, env, cwd, slot_kind)
        if key in self._failed:
            raise WarmUnavailable(self._failed[key])
        if not beyond_the_standard_library(preload):
            raise WarmUnavailable(NOTHING_TO_PRELOAD)
        deadline = time.monotonic() + min(limit_s, PRELOAD_TIMEOUT_S)
        if self._serves(key, deadline, keep_alive):
            return
        self._adopt_deferred(script)  # a start anyway: with what smaller lessons taught
        key, preload, learned = self._plan(script, env, cwd, slot_kind)  # less what a check dropped
        self._start_server(key, preload, env, slot_kind, learned, keep_alive, deadline)

    def _serves(self, key: tuple[Any, ...], deadline: float, keep_alive: Callable[[], object]) -> bool:
        """Whether the warm process is this launch's: started for `key` (its preload done, or done
        and checked by `deadline`), alive, and the code it imported unchanged on disk."""
        pending = self._pending
        if pending is not None and pending.key == key and self._alive():
            self._pending = None
            if self._settle(pending, deadline, keep_alive) is not None:
                return False
        if key != self._key or not self._alive():
            return False
        changed = code_changed(self._code)
        if changed:
            log.warning("warm start: %s since the warm process imported it; starting it again", changed)
        return not changed

    def _fork(self, script_argv: list[str], env: dict[str, str], cwd: str, stdout: str, stderr: str,
              cpus: tuple[int, ...], start: Start, keep_alive: Callable[[], object]) -> WarmProcess:
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
        return WarmProcess(process, self._pid, self._token, lambda why: recorded_lost(start, why, stderr))

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
        return [entry for entry in rank_sys_path(script, cwd, ["", *env.get("PYTHONPATH", "").split(os.pathsep), *sys.path[1:]]) if entry]

    def learn(self, script_argv: list[str], imported: list[str] | None,
              keep_alive: Callable[[], object] = lambda: None, imported_count: int | None = None) -> None:
        """After a rank of the script ended: the installed modules it imported itself
        (`workers.in_rank.entry.imports_since`; torch and DeepSpeed import much lazily, inside
        `deepspeed.initialize`) are preloaded from now on, and the warm process is started again
        with them at once, when the rank imported `RESTART_AT_IMPORTS` modules or more
        (`imported_count`, all of them, None: unknown); fewer wait for the next start. Nothing here
        waits for its preload (`keep_alive` is not called): it runs between experiments, not in
        this rank's task, and the next launch's `prepare` waits for it inside its time limit."""
        if not imported or not script_argv:
            return
        with self._lock:
            try:
                self._relearn(script_argv[0], script_argv, imported, imported_count)
            except Exception as exc:  # noqa: BLE001 - the next launch tries again, or runs cold
                log.warning("warm start: starting the warm process with the learned preloads failed: %s", exc)

    def _relearn(self, script: str, script_argv: list[str], imported: list[str],
                 imported_count: int | None) -> None:
        """Note what a rank taught; the warm process started again with it when due, not waited for."""
        if self._last is None or self._last[0] != script or why_cold(script_argv, self._last[1]):
            return
        _, env, cwd, slot_kind = self._last
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
        if key not in self._failed and key != self._key and beyond_the_standard_library(preload):
            self._pending = self._launch(key, preload, learned, env, slot_kind)  # checked by the next launch

    def _adopt_deferred(self, script: str) -> bool:
        """Move what ranks of `script` taught into its preload; whether there was anything."""
        deferred = self._deferred.pop(script, [])
        self._learned.setdefault(script, []).extend(deferred)
        return bool(deferred)

    def _alive(self) -> bool:
        return warm_server.pid_alive(self._pid)

    def _launch(self, key: tuple[Any, ...], preload: list[str], learned: set[str], rank_env: dict[str, str],
                slot_kind: str) -> _Pending:
        """Start a warm process with `preload` (from this thread: its parent-death signal follows the
        thread that started it). Returns before the preload is done."""
        self._stop_server()
        if self._closing:
            raise WarmUnavailable("the worker is stopping")
        report = Path(tempfile.mkdtemp(prefix="autotune-warm.")) / "preload.json"
        token = uuid.uuid4().hex
        self._pid = warm_server.start(server_env(rank_env, slot_kind, preload, token, report))
        self._token = token
        return _Pending(key, preload, learned, report, time.monotonic())

    def _start_server(self, key: tuple[Any, ...], preload: list[str], rank_env: dict[str, str],
                      slot_kind: str, learned: set[str], keep_alive: Callable[[], object], deadline: float) -> None:
        """Start the warm process for `key` and wait, up to `deadline`, for its preload, checked
        (`_settle`): a module that initialised CUDA, or a learned one that failed, is dropped and
        the process started again without it."""
        for _ in range(len(preload) + 1):
            dropped = self._settle(self._launch(key, preload, learned, rank_env, slot_kind), deadline, keep_alive)
            if dropped is None:
                return
            preload = [name for name in preload if name not in dropped]
        raise WarmUnavailable("every preload initialised CUDA")

    def _settle(self, pending: _Pending, deadline: float, keep_alive: Callable[[], object]) -> set[str] | None:
        """Wait until `deadline` for the started warm process's preload (its first fork goes through
        only after it), then judge its report: None when it serves its key; the preloads to drop (one
        that initialised CUDA, learned ones that failed) when it must start again without them. One of
        the script's own imports that failed, or a preload over PRELOAD_TIMEOUT_S, makes the key cold
        for this worker; one still running at `deadline` is left to finish for the next launch."""
        key, preload, learned, report = pending.key, pending.preload, pending.learned, pending.report
        began = time.monotonic()
        exit_code = warm_server.probe(probe_fork, deadline - began, keep_alive)
        outcome = warm_server.read_report(report)
        if exit_code is None:
            if self._alive() and time.monotonic() - pending.since < PRELOAD_TIMEOUT_S:
                self._pending = pending  # still importing: checked again by the next launch (`_serves`)
                raise WarmUnavailable(f"the warm process's preload was not done in {time.monotonic() - began:.0f} s")
            shutil.rmtree(report.parent, ignore_errors=True)
            self._stop_server()
            self._failed[key] = f"the warm process's preload did not finish within {PRELOAD_TIMEOUT_S:.0f} s"
            raise WarmUnavailable(self._failed[key])
        shutil.rmtree(report.parent, ignore_errors=True)
        culprit = outcome.get("cuda_initialised_by")
        failed = outcome.get("failed") or {}
        if culprit or failed and set(failed) <= learned:
            if culprit:
                log.warning("warm start: preloading %s initialised CUDA in the warm process (seen: %s); dropped "
                            "from the preload (ranks import it themselves)", culprit,
                            outcome.get("cuda_evidence") or "no evidence recorded")
            else:
                log.warning("warm start: learned preloads failed, dropped: %s", failed)
            self._stop_server()
            dropped = {culprit} if culprit else set(failed)
            self._dropped |= dropped
            return dropped
        if failed or exit_code != 0:
            self._stop_server()
            failed = failed or {"?": "CUDA was initialised in the warm process after its preload" if exit_code == REFUSED_EXIT
                                else f"the probe exited {exit_code}"}
            self._failed[key] = "a preload failed in the warm process: " + "; ".join(
                f"{name}: {error}" for name, error in failed.items())
            log.warning("warm start: %s; this script's ranks run cold", self._failed[key])
            raise WarmUnavailable(self._failed[key])
        self._key = (tuple(preload), *key[1:])  # without what was dropped: what the next launch asks for
        self._code = outcome.get("code")
        log.info("warm start: warm process %d ready (%s), preloaded %s in %.1f s%s", self._pid, key[2],
                 ", ".join(preload), outcome.get("seconds", 0.0),
                 f"; DeepSpeed's ops: {outcome['deepspeed_ops']}" if outcome.get("deepspeed_ops") else "")
        return None

    def stop(self) -> None:
        """End the warm process now, reaped, its socket's folder removed: this process is ending
        (Celery's worker_process_shutdown). Safe from a signal handler that interrupted a launch, or
        while a start's preload is awaited: without the lock, the warm process is only killed."""
        self._closing = True
        if not self._lock.acquire(blocking=False):
            server_pid = warm_server.running_pid()
            if server_pid is not None:
                warm_server.kill(server_pid)
            return
        try:
            warm_server.end_for_exit()
            self._key, self._pid, self._token, self._pending = None, 0, "", None
        finally:
            self._lock.release()

    def _stop_server(self) -> None:
        warm_server.stop()
        if self._pending is not None:
            shutil.rmtree(self._pending.report.parent, ignore_errors=True)
        self._key, self._pid, self._token, self._code, self._pending = None, 0, "", None, None


WARM = WarmStarts()
