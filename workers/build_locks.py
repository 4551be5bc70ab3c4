"""Stale build locks of torch's JIT extensions, cleared before an experiment starts.

Why: DeepSpeed compiles its ops (the CPU all-reduce, FusedAdam, CPUAdam) on first use, inside an
experiment, under torch's build lock: `TORCH_EXTENSIONS_DIR/<op>/lock`, a file created with O_EXCL
and waited on with no timeout by every other process that needs the op. A rank killed during the
build (a peer's OOM, a timeout, Ctrl-C: the whole group goes, ninja with it) leaves the file behind,
and every later experiment needing that op sleeps until its time limit and is recorded `timeout`
(seen in this project's own test suite: an op left half built, a kill mid-rebuild, then every
DeepSpeed experiment hung; issue 21 item 1). So a rank clears, before it starts the script, every
lock that no live build holds: torch runs ninja with the op's folder as its working directory, so a
build is alive while some process works there. A lock younger than `FRESH_S` is left alone: its
holder may not have started ninja yet.
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable
from pathlib import Path

import psutil

log = logging.getLogger(__name__)

#: A lock younger than this may belong to a build that has not started ninja yet.
FRESH_S = 60.0


def stale_locks(locks: Iterable[tuple[Path, float]], busy_dirs: set[Path], now: float,
                fresh_s: float = FRESH_S) -> list[Path]:
    """The locks no live build holds: older than `fresh_s` and in a folder no process works in."""
    return [path for path, mtime in locks if now - mtime >= fresh_s and path.parent not in busy_dirs]


def clear_stale_locks(extensions_dir: str | os.PathLike[str]) -> list[Path]:
    """Remove the stale build locks under `extensions_dir` (see the module); returns those removed."""
    root = Path(extensions_dir)
    locks = []
    for path in root.glob("*/lock"):
        try:
            locks.append((path, path.stat().st_mtime))
        except OSError:
            continue
    if not locks:
        return []
    busy: set[Path] = set()
    for proc in psutil.process_iter():
        try:
            busy.add(Path(proc.cwd()))
        except (psutil.Error, OSError):
            continue
    removed = []
    for path in stale_locks(locks, busy, time.time()):
        try:
            path.unlink()
        except OSError:
            continue
        log.warning("removed the stale build lock %s (no build works in its folder)", path)
        removed.append(path)
    return removed
