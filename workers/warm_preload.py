"""The warm process's preload (`workers.warm_start`): importing this module is the preload.

The forkserver imports it once, before it forks anything. It imports the modules named in
AUTOTUNE_WARM_PRELOAD one by one and checks after each that CUDA is still not initialised in this
process (a fork after CUDA's initialisation breaks every child's CUDA); the first module that
initialised it ends the preload, and the report (AUTOTUNE_WARM_REPORT, JSON) names it, so the slot
worker starts a warm process again without it and says so in its log. A module that fails to
import is reported too (that script's ranks then run cold). Before every fork, the same check
runs again (`os.register_at_fork`): its answer is inherited by the forked rank, which refuses to
run with CUDA initialised in its parent (`cuda_before_fork`).

It ends with the slot worker's process that started it, at once: first thing, it asks Linux for
SIGKILL when that process's starting thread ends (PR_SET_PDEATHSIG, when AUTOTUNE_WARM_PARENT names
the parent), so neither a worker's warm or cold shutdown nor its death leaves it tearing torch down
for seconds after the worker has gone (multiprocessing's own signal, its "alive" pipe closing,
comes only after billiard's exit pause). The ranks it forks do not inherit that signal (Linux clears
it on fork): a rank's lifetime is its launch's.
"""
from __future__ import annotations

import ctypes
import gc
import importlib
import importlib.util
import json
import os
import signal
import sys
import time

PARENT_ENV = "AUTOTUNE_WARM_PARENT"  #: the pid of the process that started this one, to die with
PR_SET_PDEATHSIG = 1
_state = {"cuda_at_fork": ""}


def cuda_initialised() -> bool:
    """Whether torch has initialised CUDA in this process (False when torch is not imported)."""
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    try:
        return bool(cuda is not None and cuda.is_initialized())
    except Exception:  # noqa: BLE001 - a half-imported torch: not initialised by anyone
        return False


def cuda_before_fork() -> str:
    """In a forked rank: why it must not run ("" when it may): its parent had CUDA initialised."""
    return _state["cuda_at_fork"]


def _check_before_fork() -> None:
    _state["cuda_at_fork"] = "CUDA was initialised in the warm process before the fork" if cuda_initialised() else ""


def preload(names: list[str]) -> dict[str, object]:
    """Import `names` in order; stop at the first that initialised CUDA. The report as a dict."""
    report: dict[str, object] = {"imported": [], "failed": {}, "cuda_initialised_by": None, "seconds": 0.0}
    began = time.monotonic()
    for name in names:
        try:
            importlib.import_module(name)
        except BaseException as exc:  # noqa: BLE001 - any failure, SystemExit included, is reported
            report["failed"][name] = f"{type(exc).__name__}: {exc}"[:500]  # type: ignore[index]
            continue
        if cuda_initialised():
            report["cuda_initialised_by"] = name
            break
        report["imported"].append(name)  # type: ignore[union-attr]
    if "deepspeed" in report["imported"] and not report["cuda_initialised_by"]:  # type: ignore[operator]
        report["deepspeed_ops"] = prepare_deepspeed_ops()
    report["seconds"] = round(time.monotonic() - began, 3)
    # What was imported lives as long as every rank: out of the collector's sight, so a forked rank's
    # collections neither walk it nor write its pages (each write copies a page shared with this
    # process). Measured (bench/README.md, "Start-up"): a warm rank's start 0.51 -> 0.23 s.
    gc.collect()
    gc.freeze()
    return report


def prepare_deepspeed_ops() -> str:
    """Work out once, here, what DeepSpeed works out once per process and every rank asked again in
    `deepspeed.initialize`: which ops this machine can build (`deepspeed.ops.__compatible_ops__`; its
    async-io probe runs the C compiler: 70 ms of every rank on the 2-core machine) and, on CPU, its
    shared-memory communication op, which DeepSpeed keeps per process (`OpBuilder._loaded_ops`) and
    otherwise loads in each rank through torch's JIT path (two subprocesses: ninja's version and
    its up-to-date check). A forked rank finds both done. The op is imported from the library the
    slot worker built (`workers.op_prebuild`) and keeps up to date before every launch
    (`workers.build_locks.rebuild_stale_ops`), never built here, and never while a build holds its
    folder's lock: torch's JIT path waits on that lock, and one left by a killed build held this
    process's start for its whole time limit. On CUDA nothing is done: a probe there may ask the
    driver, and CUDA must stay uninitialised in this process. What happened, for the report."""
    try:
        from deepspeed.accelerator import get_accelerator

        if get_accelerator().device_name() != "cpu":
            return "not on CPU: left to each rank"
        import deepspeed.ops

        compatible = deepspeed.ops.__compatible_ops__
        builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
        if builder is None or not compatible.get(builder.NAME, False):
            return "probed"
        from torch.utils.cpp_extension import get_default_build_root

        folder = os.path.join(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root(), builder.name)
        library = os.path.join(folder, f"{builder.name}.so")
        if not os.path.exists(library) or os.path.exists(os.path.join(folder, "lock")):
            return "probed; the communication op is left to each rank (not built, or its build is running)"
        spec = importlib.util.spec_from_file_location(builder.name, library)
        module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        spec.loader.exec_module(module)  # type: ignore[union-attr]
        from deepspeed.ops.op_builder.builder import OpBuilder

        OpBuilder._loaded_ops[builder.name] = module
        return "probed, communication op loaded"
    except Exception as exc:  # noqa: BLE001 - each rank then does it itself, as a cold one does
        return f"left to each rank ({type(exc).__name__}: {exc})"[:300]


def _without_the_workers_main() -> None:
    """A process this forkserver forks would first take the slot worker's sys.path and import its
    main module (the standard library's `spawn.prepare`, for pickled functions defined there). A
    rank's `__main__` is the user's script and its path the one this process's interpreter built
    from the rank's own PYTHONPATH, as a cold rank's is: both are left as they are here."""
    from multiprocessing import spawn

    prepare = spawn.prepare
    workers_own = ("init_main_from_name", "init_main_from_path", "sys_path")

    def prepare_without_main(data: dict[str, object]) -> None:
        prepare({key: value for key, value in data.items() if key not in workers_own})

    spawn.prepare = prepare_without_main


def die_with_parent(parent: int) -> bool:
    """Have Linux SIGKILL this process when `parent` (the thread of it that started this one) ends;
    whether `parent` is still this process's parent (False: it already ended, and nothing would
    signal). Elsewhere than Linux, nothing is asked and True is returned."""
    if not sys.platform.startswith("linux"):
        return True
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    return os.getppid() == parent


def _main() -> None:
    parent = os.environ.get(PARENT_ENV, "")
    if parent.isdigit() and not die_with_parent(int(parent)):
        os._exit(0)  # started by a process that is already gone: nobody will fork from here
    _without_the_workers_main()
    names = [name for name in os.environ.get("AUTOTUNE_WARM_PRELOAD", "").split(",") if name]
    report = preload(names)
    path = os.environ.get("AUTOTUNE_WARM_REPORT")
    if path:
        with open(path, "w") as handle:
            json.dump(report, handle)
    os.register_at_fork(before=_check_before_fork)
    _check_before_fork()


if os.environ.get("AUTOTUNE_WARM_REPORT") is not None:  # imported as the preload, not by a test
    _main()
