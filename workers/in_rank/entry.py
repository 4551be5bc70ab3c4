"""`python -m workers.in_rank.entry script.py args...`: run a Python training script as `python script.py` would,
but turn an out-of-memory into a distinct exit status and leave an exit report behind.

A CUDA OOM (or a host MemoryError) is an OOM, not a crash, and the search treats it as an upper
bound on the micro-batch size. Recognising it here, in the same process, from the exception objects
(`workers.in_rank.oom`: every form, through the cause/context chain) is exact; searching stderr for the text
would not be. When the script exits non-zero without an OOM exception in sight, the CUDA allocator's
own OOM count still tells (a library that swallowed the exception and exited).

The exit report (`workers.in_rank.device_memory`; written every few seconds while the script runs, for a
process that aborts) carries the peak device memory, whether the script
left through DeepSpeed's profiling exit, which op could not be built when a JIT build of DeepSpeed's
ops killed it (`workers.in_rank.op_build`), and when each optimizer step ended
(`workers.in_rank.step_clock`: the metric is the mean step time of the window, not the engine's last step).
After a profiling exit or an OOM the rank leaves at once, without the interpreter's teardown
(`_leave_now`): tearing down live NCCL communicators can hang, on CPU it sometimes aborts, and the
measurement is already complete. A rank that still aborts after writing a report that says it got
that far is excused (`workers.slot.records`).
"""
from __future__ import annotations

import os
import runpy
import sys
import traceback
from collections.abc import Mapping

from workers.in_rank.device_memory import InterimReports, measured_peaks, write_exit_report
from workers.in_rank.failure import OOM_EXIT_CODE
from workers.in_rank.oom import out_of_memory_cause
from workers.in_rank.op_build import op_build_failure
from workers.in_rank.step_clock import install_deepspeed_hook, moments, note, step_ends

#: Where DeepSpeed's engine calls exit() after the profiled steps (`_autotuning_exit`) or after
#: writing the model info of a profile run (`forward`).
_PROFILING_EXITS = {("deepspeed/runtime/engine.py", "_autotuning_exit"), ("deepspeed/runtime/engine.py", "forward")}


#: The same exit for a plain-torch script that measures itself with `workers.in_rank.metrics`.
_METRICS_EXIT = ("workers/in_rank/metrics.py", "end_micro_step")
#: The title the rank takes (`ps`, `top`), set by its slot (`workers.process.process_identity`): what it is,
#: readable without its environment, which a rank forked from the warm process shows as that process's.
TITLE_ENV = "AUTOTUNE_PROCESS_TITLE"


def is_profiling_exit(exc: BaseException | None) -> bool:
    """A clean SystemExit whose innermost DeepSpeed frame is one of the engine's profiling exits, or
    raised by `workers.in_rank.metrics` after writing the metrics (DeepSpeed's exit for a plain-torch script,
    whose process groups are just as alive)."""
    if not isinstance(exc, SystemExit) or exit_status(exc) != 0:
        return False
    trace = traceback.extract_tb(exc.__traceback__)
    if trace and trace[-1].filename.replace(os.sep, "/").endswith(_METRICS_EXIT[0]) \
            and trace[-1].name == _METRICS_EXIT[1]:
        return True
    frames = [frame for frame in trace if "deepspeed" in frame.filename.replace(os.sep, "/")]
    if not frames:
        return False
    innermost = frames[-1]
    return any(innermost.filename.replace(os.sep, "/").endswith(path) and innermost.name == name
               for path, name in _PROFILING_EXITS)


def exit_status(exc: BaseException | None) -> int:
    """The process status the exception would end with (0 for none or a clean SystemExit)."""
    if exc is None:
        return 0
    if isinstance(exc, SystemExit):
        code = exc.code
        if code is None:
            return 0
        return code if isinstance(code, int) else 1
    return 1


def main() -> None:
    note("up")
    if len(sys.argv) < 2:
        sys.exit("usage: python -m workers.in_rank.entry script.py [args...]")
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    run_script(script)


def run_script(script: str) -> None:
    """Run `script` as `__main__` (sys.argv and sys.path already set), then report how it ended and
    leave or re-raise as `main` describes; `workers.warm.warm_start` calls it in a forked rank."""
    take_title()
    pid = os.getpid()
    error: BaseException | None = None
    loaded = set(sys.modules)
    install_deepspeed_hook()
    interim = InterimReports()  # what an abort, which writes no report, leaves behind
    interim.start()
    try:
        runpy.run_path(script, run_name="__main__")
    except BaseException as exc:
        error = exc
    if os.getpid() != pid:  # a forked child returning through our frame: not the rank's ending
        if error is not None:
            raise error
        return
    interim.stop()
    peaks = measured_peaks()
    oom = None
    if exit_status(error) != 0:
        cause = out_of_memory_cause(error)
        if cause is not None:
            oom = f"{type(cause).__name__}: {cause}"
        elif peaks.get("device_ooms"):
            oom = f"the CUDA allocator counted {peaks['device_ooms']} out-of-memory error(s)"
    op_build = op_build_failure(error) if exit_status(error) != 0 and oom is None else None
    ends = step_ends()
    write_exit_report({**peaks, "profiling_exit": is_profiling_exit(error), **({"oom": oom} if oom else {}),
                       **({"op_build_failed": op_build} if op_build else {}), **({"step_ends": ends} if ends else {}),
                       "moments": moments(), "imported": imports_since(loaded),
                       "imported_count": sum(1 for name in list(sys.modules) if name not in loaded)})
    if op_build is not None:
        print(f"workers.in_rank.entry: an op could not be built or loaded: {op_build}", file=sys.stderr)
    if oom is not None:
        print(f"workers.in_rank.entry: out of memory: {oom}"[:2000], file=sys.stderr)
        _leave_now(OOM_EXIT_CODE)
    if is_profiling_exit(error):
        _leave_now(0)
    if error is not None:
        raise error


def take_title(env: Mapping[str, str] | None = None) -> None:
    """Take the title the slot gave this rank (TITLE_ENV in `env`, this process's environment by
    default), through the setproctitle library; a process this one forks keeps it. A forked rank
    takes it before it replaces its environment (`workers.warm.warm_rank`): setproctitle finds the
    memory it writes through the environment the process started with. Before `run_script` notes
    what is loaded: not the script's import."""
    title = (os.environ if env is None else env).get(TITLE_ENV)
    if not title:
        return
    try:
        import setproctitle
    except ImportError:  # a dependency; without it the rank runs untitled
        return
    setproctitle.setproctitle(title)


def imports_since(loaded: set[str], limit: int = 300) -> list[str]:
    """The modules this run imported that were not loaded before it (the outermost of each:
    `torch._dynamo`, not its submodules), for the slot's warm interpreter to import before the next
    rank (`workers.warm.warm_start.WarmStarts.learn`, which keeps the installed ones only): torch and
    DeepSpeed import much lazily, inside `deepspeed.initialize`."""
    new = {name for name in list(sys.modules) if name not in loaded}
    found = []
    for name in sorted(new):
        parts = name.split(".")
        if not any(".".join(parts[:depth]) in new for depth in range(1, len(parts))):  # no new package above it
            found.append(name)
    return found[:limit]


def _leave_now(code: int) -> None:
    """End the process with `code` without the interpreter's teardown. After DeepSpeed's profiling
    exit the measurement is complete (rank 0 wrote the metrics, the exit report is written), but the
    NCCL process groups are still alive: tearing them down at exit aborts communicators, which can
    hang (pytorch#117291, NVIDIA/nccl#1013) until the experiment's time limit turns a measured config
    into a `timeout`; on CPU the same teardown sometimes aborts (SIGABRT). After an OOM the state
    is no better. Nothing the experiment needs is left to the teardown: output is flushed here."""
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
