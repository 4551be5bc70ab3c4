"""Stale torch build locks (`workers.build_locks`): a lock no live build holds is removed before an
experiment starts; one a build is working under, or one just taken, is kept (issue 21 item 1)."""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from workers.build_locks import FRESH_S, clear_stale_locks, stale_locks


def _lock(root: Path, op: str, age_s: float) -> Path:
    folder = root / op
    folder.mkdir()
    lock = folder / "lock"
    lock.touch()
    then = time.time() - age_s
    os.utime(lock, (then, then))
    return lock


def test_only_old_locks_in_idle_folders_are_stale() -> None:
    a, b, c = Path("/x/a/lock"), Path("/x/b/lock"), Path("/x/c/lock")
    locks = [(a, 0.0), (b, 0.0), (c, 1000.0 - FRESH_S / 2)]
    assert stale_locks(locks, busy_dirs={Path("/x/b")}, now=1000.0) == [a]


def test_a_lock_left_by_a_killed_build_is_cleared_and_a_live_ones_kept(tmp_path: Path) -> None:
    left = _lock(tmp_path, "deepspeed_shm_comm", age_s=2 * FRESH_S)
    held = _lock(tmp_path, "fused_adam", age_s=2 * FRESH_S)
    fresh = _lock(tmp_path, "cpu_adam", age_s=1)
    builder = subprocess.Popen(["sleep", "30"], cwd=held.parent)  # ninja works in the op's folder
    try:
        assert clear_stale_locks(tmp_path) == [left]
        assert not left.exists() and held.exists() and fresh.exists()
    finally:
        builder.kill()
        builder.wait()
    assert clear_stale_locks(tmp_path) == [held]  # its build is gone now
    assert clear_stale_locks(tmp_path / "missing") == []
