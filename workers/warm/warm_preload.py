"""The warm process's preload (`workers.warm.warm_start`): importing this module is the preload.

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

It names itself in `ps` before the preload, as a rank does (`workers.process.process_identity`), through the
setproctitle library: `autotune warm slot=node2.gpu0` (`title`). Its /proc environ is kept
(SPT_NOENV): a forked rank's leftovers are found by the token in it (`workers.warm.warm_server`).
"""
from __future__ import annotations

import ctypes
import gc
import importlib
import importlib.util
import json
import os
import re
import signal
import sys
import time

PARENT_ENV = "AUTOTUNE_WARM_PARENT"  #: the pid of the process that started this one, to die with
TITLE_WORD = "autotune warm"  #: how its title begins (`title`); a rank's begins "autotune rank"
PR_SET_PDEATHSIG = 1
UVM_DEVICE = "/dev/nvidia-uvm"  #: what the CUDA driver opens when initialised (`driver_initialised`)
_GPU_NODE = re.compile(r"/dev/nvidia[0-9]+")
_state = {"cuda_at_fork": ""}


def cuda_initialised() -> bool:
    """Whether CUDA is initialised in this process (`cuda_evidence`)."""
    return bool(cuda_evidence())


def cuda_evidence() -> str:
    """What shows CUDA initialised in this process ("" where nothing does): torch's own flag, or, for
    any other library (pycuda.autoinit, CuPy, a driver call through ctypes), which that flag does not
    see, the driver's state in /proc (`driver_evidence`). The warm process's log names it, so a
    false alarm on a machine of another driver or sandbox can be told from a real one."""
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    try:
        if cuda is not None and cuda.is_initialized():
            return "torch.cuda.is_initialized()"
    except Exception:  # noqa: BLE001 - a half-imported torch: not initialised by torch
        pass
    return driver_evidence(*_proc_view())


def driver_initialised(maps: str, fd_targets: list[str]) -> bool:
    """Whether the CUDA driver was initialised (`cuInit`) in the process whose /proc/<pid>/maps text
    and open file descriptors' targets these are (`driver_evidence`). Pure."""
    return bool(driver_evidence(maps, fd_targets))


def driver_evidence(maps: str, fd_targets: list[str]) -> str:
    """What in a process's /proc/<pid>/maps text and open descriptors' targets shows the CUDA driver
    initialised (`cuInit`), "" where nothing does. Pure. `cuInit` opens the unified-memory device,
    /dev/nvidia-uvm, and keeps it open (without the nvidia_uvm module it fails: CUDA's 'unknown
    error'); NVML, which torch's CUDA check uses here (PYTORCH_NVML_BASED_CUDA_CHECK) and
    DeepSpeed's accelerator asks, opens /dev/nvidiactl and the GPUs' nodes but never that one, and
    merely loading libcuda.so (torch and Triton may, lazily) initialises nothing. So: that device
    open or mapped, or a GPU's node (/dev/nvidia<N>) mapped into memory beside libcuda.so, which a
    context's set-up does and a query through NVML does not."""
    if any(target == UVM_DEVICE for target in fd_targets):
        return f"{UVM_DEVICE} open"
    if "/dev/nvidia" not in maps:  # before every fork: the common answer without parsing the map
        return ""
    mapped = {fields[5].strip() for line in maps.splitlines() if ("/dev/nvidia" in line or "libcuda" in line)
              and len(fields := line.split(maxsplit=5)) == 6}
    if UVM_DEVICE in mapped:
        return f"{UVM_DEVICE} mapped"
    drivers = sorted(path for path in mapped if os.path.basename(path).startswith("libcuda.so"))
    nodes = sorted(path for path in mapped if _GPU_NODE.fullmatch(path))
    return f"{', '.join(nodes)} mapped beside {', '.join(drivers)}" if drivers and nodes else ""


def _proc_view() -> tuple[str, list[str]]:
    """This process's memory map and its open descriptors' targets ("", [] where /proc is not)."""
    try:
        with open("/proc/self/maps") as handle:
            maps = handle.read()
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return "", []
    targets = []
    for fd in fds:
        try:
            targets.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue
    return maps, targets


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
        evidence = cuda_evidence()
        if evidence:
            report["cuda_initialised_by"] = name
            report["cuda_evidence"] = evidence
            break
        report["imported"].append(name)  # type: ignore[union-attr]
    if "deepspeed" in report["imported"] and not report["cuda_initialised_by"]:  # type: ignore[operator]
        report["deepspeed_ops"] = prepare_deepspeed_ops()
    try:
        report["code"] = code_stamp()
    except Exception as exc:  # noqa: BLE001 - without it, only the preload's key tells a start from the next
        report["code_error"] = f"{type(exc).__name__}: {exc}"[:300]
    report["seconds"] = round(time.monotonic() - began, 3)
    # What was imported lives as long as every rank: out of the collector's sight, so a forked rank's
    # collections neither walk it nor write its pages (each write copies a page shared with this
    # process). Measured by bench/warm_vs_cold.py: a warm rank's start 0.51 -> 0.23 s.
    gc.collect()
    gc.freeze()
    return report


def code_stamp(site: tuple[str, ...] = (), stdlib: tuple[str, ...] = ()) -> dict[str, dict[str, list[object]]]:
    """What this process's code is made of, for the slot worker to tell when it changed on disk
    (`workers.warm.warm_plan.code_changed`): a module imported from site-packages is its distribution's
    (importlib.metadata: the version, and the path and mtime of the distribution's METADATA file,
    which `pip install -U` and a reinstall replace); any other module outside the standard library
    (the user's own package, an editable install, this project) is its file's mtime. A stat per
    distribution and per such file is then enough per rank; the modules of site-packages alone
    would be thousands of stats. `site` and `stdlib`: those folders, when not this interpreter's."""
    import importlib.metadata
    import sysconfig

    paths = sysconfig.get_paths()
    stdlib = tuple(os.path.join(os.path.realpath(path), "") for path in stdlib or (paths["stdlib"], paths["platstdlib"]))
    site = tuple(os.path.join(os.path.realpath(path), "") for path in site or (paths["purelib"], paths["platlib"]))
    owners = importlib.metadata.packages_distributions()
    wanted: set[str] = set()
    files: dict[str, list[object]] = {}
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if not isinstance(path, str) or not os.path.isabs(path):  # torch.ops' "_ops.py", "<stdin>": no file
            continue
        real = os.path.realpath(path)
        top = name.partition(".")[0]
        if real.startswith(site) and owners.get(top):
            wanted.update(owners[top])
        elif not real.startswith(stdlib) and real not in files:
            files[real] = [_mtime_ns(real)]
    distributions: dict[str, list[object]] = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        folder = getattr(dist, "_path", None)  # PathDistribution's folder: the only kind pip installs
        if name in wanted and name not in distributions and folder is not None:
            metadata = os.path.join(str(folder), "METADATA")
            distributions[name] = [dist.version, metadata, _mtime_ns(metadata)]
    return {"distributions": distributions, "files": files}


def _mtime_ns(path: str) -> int | None:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return None


def prepare_deepspeed_ops() -> str:
    """Work out once, here, what DeepSpeed works out once per process and every rank asked again in
    `deepspeed.initialize`: which ops this machine can build (`deepspeed.ops.__compatible_ops__`; its
    async-io probe runs the C compiler: 70 ms of every rank on the 2-core machine) and, on CPU, its
    shared-memory communication op, which DeepSpeed keeps per process (`OpBuilder._loaded_ops`) and
    otherwise loads in each rank through torch's JIT path (two subprocesses: ninja's version and
    its up-to-date check). A forked rank finds both done. The op is imported from the library the
    slot worker built (`workers.slot.op_prebuild`) and keeps up to date before every launch
    (`workers.slot.build_locks.rebuild_stale_ops`), never built here, and never while a build holds its
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


def title(slot: str) -> str:
    """What `ps` shows this process as: `autotune warm slot=<slot>` (the slot's queue)."""
    return f"{TITLE_WORD} slot={slot}" if slot else TITLE_WORD


def take_title(slot: str) -> None:
    """Take `title(slot)` through setproctitle, leaving /proc/<pid>/environ as it was (SPT_NOENV,
    read when setproctitle first writes: the ranks forked from here write through the same memory)."""
    try:
        os.environ.setdefault("SPT_NOENV", "1")
        import setproctitle
    except ImportError:  # a dependency; without it the command line shows
        return
    setproctitle.setproctitle(title(slot))


def _main() -> None:
    parent = os.environ.get(PARENT_ENV, "")
    if parent.isdigit() and not die_with_parent(int(parent)):
        os._exit(0)  # started by a process that is already gone: nobody will fork from here
    take_title(os.environ.get("AUTOTUNE_SLOT", ""))  # before the preload's seconds: `ps` names it
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
