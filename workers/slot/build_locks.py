"""torch's JIT extensions around an experiment: stale build locks cleared, out-of-date ops rebuilt first.

Why: DeepSpeed compiles its ops (the CPU all-reduce, FusedAdam, CPUAdam) on first use, inside an
experiment, under torch's build lock: `TORCH_EXTENSIONS_DIR/<op>/lock`, a file created with O_EXCL
and waited on with no timeout by every other process that needs the op. A rank killed during the
build (a peer's OOM, a timeout, Ctrl-C: the whole group goes, ninja with it) leaves the file behind,
and every later experiment needing that op sleeps until its time limit and is recorded `timeout`
(seen in this project's own test suite: an op left half built, a kill mid-rebuild, then every
DeepSpeed experiment hung). So a rank clears, before it starts the script, every
lock that no live build holds: torch runs ninja with the op's folder as its working directory, so a
build is alive while some process works there. A lock younger than `FRESH_S` is left alone: its
holder may not have started ninja yet.

And an op built before whose build went out of date (its object files gone: a build killed half-way,
as ninja removes an interrupted command's output) would be rebuilt inside the experiment, where the
compiler's gigabyte counts against the slot's memory cap: on this project's CPU slots that made the
GPT example's profile run an `oom` and the whole job abort. So before the script starts, the rank asks
ninja whether each op folder is up to date (`ninja -n`, milliseconds) and rebuilds one that is not
itself, outside the experiment's limits, under torch's own lock (`rebuild_stale_ops`): the ranks'
scripts then load it, or wait for the lock as torch makes them. ninja's answer "no work to do" is
kept with a stamp of what it depends on (the folder's files, their sizes and times, and the sources
build.ninja names outside it); while the stamp holds, the folder is not asked again: a `ninja -n`
per folder per rank cost every experiment 5-15 ms between its slot's previous run and its start
(bench/dispatch_overhead.py). Headers the sources include are not stamped: a DeepSpeed reinstall
rewrites the sources beside them.

Both decisions read this machine's processes, so the folder must be this machine's alone
(`node_extensions_dir`): on a shared filesystem (a venv in an NFS home, as on many clusters) a lock
may be held by a live build on another node, which no process here shows, and clearing it would let
two nodes write one op at once. There each machine builds in its own subfolder.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path

import psutil

from workers.process.launch import kill_marked
from workers.device.slot import machine_id

log = logging.getLogger(__name__)

#: Filesystems whose folders several machines can share (/proc/self/mounts' type names).
SHARED_FILESYSTEMS = frozenset({"nfs", "nfs4", "lustre", "gpfs", "beegfs", "cifs", "smb3", "smbfs", "ceph",
                                "fuse.ceph", "fuse.glusterfs", "fuse.sshfs", "9p", "afs", "panfs", "wekafs",
                                "fuse.juicefs", "virtiofs"})
MOUNTS = Path("/proc/self/mounts")
#: A lock younger than this may belong to a build that has not started ninja yet.
FRESH_S = 60.0
#: Every process of a build carries this variable (a token per build), so a stopped build can be found whole.
BUILD_ENV = "AUTOTUNE_BUILD_TOKEN"
#: The longest a rebuild of one op may take (DeepSpeed's CPU all-reduce: about 80 s on 2 cores).
REBUILD_TIMEOUT_S = 900.0


def filesystem_type(path: str, mounts_text: str) -> str | None:
    """The type of the filesystem holding the absolute `path`, from /proc/self/mounts' text: that of
    its longest mount point (None when no line covers it)."""
    best, kind = "", None
    for line in mounts_text.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, fields[2]
    return kind


def node_extensions_dir(base: str, mounts_text: str, machine: str) -> str:
    """Where this machine builds torch's extensions: `base`, or `base/<machine>` when `base` lies on
    a filesystem other machines may share (see the module)."""
    shared = filesystem_type(base, mounts_text) in SHARED_FILESYSTEMS
    return os.path.join(base, re.sub(r"[^A-Za-z0-9_.-]", "_", machine)) if shared else base


def default_extensions_dir() -> str:
    """The TORCH_EXTENSIONS_DIR of a rank whose worker was given none: the venv's `torch_extensions`
    folder, this machine's own (`node_extensions_dir`)."""
    base = os.path.realpath(os.path.join(sys.prefix, "torch_extensions"))
    try:
        mounts = MOUNTS.read_text()
    except OSError:
        mounts = ""
    return node_extensions_dir(base, mounts, machine_id())


def stale_locks(locks: Iterable[tuple[Path, float]], busy_dirs: set[Path], now: float,
                fresh_s: float = FRESH_S) -> list[Path]:
    """The locks no live build holds: older than `fresh_s` and in a folder no process works in."""
    return [path for path, mtime in locks if now - mtime >= fresh_s and path.parent not in busy_dirs]


def clear_stale_locks(extensions_dir: str | os.PathLike[str], fresh_s: float = FRESH_S,
                      since: float = 0.0) -> list[Path]:
    """Remove the stale build locks under `extensions_dir` (see the module); returns those removed.
    `since`: only locks made from then on (right after killing a build of ours: its locks, at once)."""
    root = Path(extensions_dir)
    locks = []
    for path in root.glob("*/lock"):
        try:
            mtime = path.stat().st_mtime
        except OSError:
            continue
        if mtime >= since:
            locks.append((path, mtime))
    if not locks:
        return []
    busy: set[Path] = set()
    for proc in psutil.process_iter():
        try:
            busy.add(Path(proc.cwd()))
        except (psutil.Error, OSError):
            continue
    removed = []
    for path in stale_locks(locks, busy, time.time(), fresh_s):
        try:
            path.unlink()
        except OSError:
            continue
        log.warning("removed the stale build lock %s (no build works in its folder)", path)
        removed.append(path)
    return removed


def rebuild_stale_ops(extensions_dir: str | os.PathLike[str], path: str | None,
                      keep_alive: Callable[[], bool] | None = None, timeout_s: float = REBUILD_TIMEOUT_S) -> list[Path]:
    """Rebuild every op folder under `extensions_dir` whose ninja build is out of date (see the
    module), holding torch's lock (`<op>/lock`, created exclusively, removed after) while ninja runs;
    a folder whose lock is held is left to its builder. Returns the folders rebuilt. Never raises: a
    build that fails is logged and left to the script, which reports it as torch would.

    `path` is the PATH the script will run with: torch runs the first `ninja` on it, and so must
    this. Two ninja versions (the distribution's and the venv's) each read the other's build log as
    stale, so builds alternating between them recompile every time (and a kill mid-compile deletes
    the object files): exactly the rebuild inside an experiment this is here to prevent.
    `keep_alive` is called every second while ninja runs (the rank renews its slot's lease there);
    when it says stop (the launch was aborted), the build is stopped."""
    ninja = shutil.which("ninja", path=path)
    if ninja is None:
        return []
    rebuilt = []
    for build_file in sorted(Path(extensions_dir).glob("*/build.ninja")):
        folder = build_file.parent
        stamp = _stamp(folder, ninja)
        if stamp is not None and _UP_TO_DATE.get(folder) == stamp:
            continue
        try:
            dry = subprocess.run([ninja, "-C", str(folder), "-n"], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            continue
        if dry.returncode == 0 and "no work to do" in dry.stdout and stamp is not None:
            _UP_TO_DATE[folder] = stamp
        if dry.returncode != 0 or "no work to do" in dry.stdout:
            continue
        lock = folder / "lock"
        try:
            os.close(os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY))  # torch's FileBaton.try_acquire
        except OSError:
            continue
        try:
            code = run_to_end([ninja, "-C", str(folder)], folder / "rebuild.log", keep_alive, timeout_s)
            if code == 0:
                log.warning("rebuilt the out-of-date op %s before the experiment", folder.name)
                rebuilt.append(folder)
            else:
                log.warning("rebuilding the op %s failed (exit %s); see its folder", folder.name, code)
        except OSError as exc:
            log.warning("rebuilding the op %s failed: %s", folder.name, exc)
        finally:
            lock.unlink(missing_ok=True)
    return rebuilt


def run_to_end(argv: list[str], log_path: Path, keep_alive: Callable[[], bool] | None, timeout_s: float,
               env: dict[str, str] | None = None, on_start: Callable[[int], None] | None = None) -> int | None:
    """Run a build (`argv`, output to `log_path`, in a process group of its own whose id goes to
    `on_start`) to the end: its exit status, or None when it was stopped because `keep_alive` said
    stop (checked every second) or `timeout_s` passed."""
    started, token = time.time(), uuid.uuid4().hex
    env = {**(os.environ if env is None else env), BUILD_ENV: token}
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    if on_start is not None:
        on_start(proc.pid)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            if time.monotonic() > deadline or (keep_alive is not None and keep_alive()):
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
                # ninja starts each compiler in a process group of its own: those go by the token
                # they inherited, and once they are gone no process works in the op's folder
                kill_marked(BUILD_ENV, token, started)
                return None


#: op folder -> the stamp (`_stamp`) it had when ninja last found nothing to do there (this process).
_UP_TO_DATE: dict[Path, tuple] = {}
_ESCAPED = re.compile(r"\$(.)")


def _stamp(folder: Path, ninja: str) -> tuple | None:
    """What ninja's verdict on `folder` depends on: the ninja used, the folder's entries (name, size,
    mtime) and the absolute inputs its build.ninja names (path, size, mtime). None when unreadable."""
    try:
        entries = []
        for entry in os.scandir(folder):
            info = entry.stat(follow_symlinks=False)
            entries.append((entry.name, info.st_size, info.st_mtime_ns))
        inputs = []
        for source in _absolute_inputs((folder / "build.ninja").read_text()):
            info = os.stat(source)
            inputs.append((source, info.st_size, info.st_mtime_ns))
    except OSError:
        return None
    return ninja, tuple(sorted(entries)), tuple(inputs)


def _absolute_inputs(build_text: str) -> list[str]:
    """The absolute paths among the inputs of build.ninja's `build` statements (ninja's `$ `, `$:`
    and `$$` escapes undone)."""
    found = []
    for line in build_text.splitlines():
        if not line.startswith("build "):
            continue
        rest = re.split(r"(?<!\$):", line, maxsplit=1)[-1]  # after the outputs
        for token in re.split(r"(?<!\$) +", rest.strip())[1:]:  # the rule's name first
            path = _ESCAPED.sub(r"\1", token)
            if path.startswith("/"):
                found.append(path)
    return found
