"""torch's JIT builds around an experiment (`workers.slot.build_locks`): a lock no live build holds is
removed before an experiment starts, one a build is working under, or one just taken, is kept; an op
whose build went out of date is rebuilt first, outside the experiment."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from workers.slot.build_locks import FRESH_S, clear_stale_locks, node_extensions_dir, rebuild_stale_ops, stale_locks


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


BUILD = """rule copy
  command = cp $in $out
build out.txt: copy in.txt
"""


def _op(root: Path, name: str) -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "build.ninja").write_text(BUILD)
    (folder / "in.txt").write_text("source")
    return folder


def test_an_op_whose_build_went_out_of_date_is_rebuilt_before_the_experiment(tmp_path: Path) -> None:
    """A real ninja over a real build file: an op whose output is gone (a build killed half-way) is
    rebuilt, under torch's lock and without leaving it; an op up to date is not touched; an op whose
    lock another build holds is left to that build."""
    stale, fresh, busy = _op(tmp_path, "stale"), _op(tmp_path, "fresh"), _op(tmp_path, "busy")
    ninja = os.path.join(os.path.dirname(sys.executable), "ninja")
    assert subprocess.run([ninja, "-C", str(fresh)], capture_output=True).returncode == 0
    built_at = (fresh / "out.txt").stat().st_mtime_ns
    (busy / "lock").write_text("")
    path = os.path.dirname(ninja)  # the PATH the script would run with
    assert rebuild_stale_ops(tmp_path, path) == [stale]
    assert (stale / "out.txt").read_text() == "source" and not (stale / "lock").exists()
    assert (fresh / "out.txt").stat().st_mtime_ns == built_at
    assert not (busy / "out.txt").exists() and (busy / "lock").exists()
    assert rebuild_stale_ops(tmp_path, path) == []  # now up to date
    assert rebuild_stale_ops(tmp_path, str(tmp_path / "no-ninja-here")) == []  # no ninja: nothing to do



def test_ninja_is_asked_again_only_when_what_its_answer_depends_on_changed(tmp_path: Path) -> None:
    """An op ninja found up to date is not asked about again (a `ninja -n` per rank cost every
    experiment milliseconds) until a file of its folder or a source its build.ninja names outside
    it changes; then it is, and rebuilt when out of date."""
    ops, bin_dir = tmp_path / "ops", tmp_path / "bin"
    folder = _op(ops, "op")
    source = tmp_path / "src.txt"
    source.write_text("outside")
    (folder / "build.ninja").write_text(BUILD + f"build copy.txt: copy {source}\n")
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    real = os.path.join(os.path.dirname(sys.executable), "ninja")
    (bin_dir / "ninja").write_text(f"#!/bin/sh\necho \"$@\" >> {calls}\nexec {real} \"$@\"\n")
    (bin_dir / "ninja").chmod(0o755)
    asked = lambda: len(calls.read_text().splitlines()) if calls.exists() else 0  # noqa: E731
    assert rebuild_stale_ops(ops, str(bin_dir)) == [folder]
    assert rebuild_stale_ops(ops, str(bin_dir)) == [] and asked() == 3  # dry run, build, dry run: up to date
    assert rebuild_stale_ops(ops, str(bin_dir)) == [] and asked() == 3  # not asked again
    (folder / "out.txt").unlink()  # a build killed half-way
    assert rebuild_stale_ops(ops, str(bin_dir)) == [folder] and asked() == 5
    assert rebuild_stale_ops(ops, str(bin_dir)) == [] and asked() == 6
    time.sleep(0.01)
    source.write_text("changed")  # a source outside the folder (DeepSpeed's csrc)
    assert rebuild_stale_ops(ops, str(bin_dir)) == [folder] and (folder / "copy.txt").read_text() == "changed"


def test_an_aborted_launch_stops_the_rebuild_and_releases_the_lock(tmp_path: Path) -> None:
    """The rank renews its lease at every second of a rebuild (`keep_alive`); when that says stop
    (the launch was aborted) ninja is stopped at once, nothing counts as rebuilt, the lock goes."""
    folder = tmp_path / "slow"
    folder.mkdir()
    (folder / "build.ninja").write_text("rule slow\n  command = sleep 60 && touch $out\nbuild out.txt: slow\n")
    calls = []
    started = time.monotonic()
    ninja_dir = os.path.dirname(sys.executable)
    assert rebuild_stale_ops(tmp_path, ninja_dir, keep_alive=lambda: calls.append(1) or len(calls) >= 2) == []
    assert time.monotonic() - started < 30 and len(calls) == 2
    assert not (folder / "lock").exists() and not (folder / "out.txt").exists()


MOUNTS_TEXT = """\
/dev/sda1 / ext4 rw,relatime 0 0
server:/export/home /home nfs4 rw,vers=4.2 0 0
/dev/nvme0n1 /home/scratch xfs rw 0 0
tmpfs /dev/shm tmpfs rw 0 0
"""


@pytest.mark.parametrize(("base", "expected"), [
    ("/home/ana/venv/torch_extensions", "/home/ana/venv/torch_extensions/m-1"),  # a venv in an NFS home
    ("/home/scratch/venv/torch_extensions", "/home/scratch/venv/torch_extensions"),  # local disk mounted inside it
    ("/opt/venv/torch_extensions", "/opt/venv/torch_extensions"),  # the root's ext4
    ("/homework/venv/torch_extensions", "/homework/venv/torch_extensions"),  # /home's prefix is not /home
])
def test_on_a_shared_filesystem_each_machine_builds_in_its_own_folder(base: str, expected: str) -> None:
    """`clear_stale_locks` can only see this machine's builds, so the folder it
    clears must be this machine's alone."""
    assert node_extensions_dir(base, MOUNTS_TEXT, "m-1") == expected


def test_a_rank_gets_its_machines_own_folder(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from workers.slot import build_locks
    from workers.slot.rank_spec import RankSpec, rank_env
    from workers.device.slot import Slot

    mounts = tmp_path / "mounts"
    mounts.write_text("server:/export / nfs rw 0 0\n")
    monkeypatch.setattr(build_locks, "MOUNTS", mounts)
    monkeypatch.setattr(build_locks, "machine_id", lambda: "abc/def")
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    spec = RankSpec(job="j", name="z1", attempt="a", results_root="/r", script_argv=["t.py"], ds_config={}, rank=0,
                    world_size=1, local_rank=0, local_world_size=1, node_rank=0, num_nodes=1, timeout_s=60.0)
    slot = Slot("n", 0, "cpu", 2**30, "127.0.0.1", 1, (0,), "w@n")
    env = rank_env(spec, slot, ("127.0.0.1", 29500))
    assert env["TORCH_EXTENSIONS_DIR"] == os.path.join(os.path.realpath(sys.prefix), "torch_extensions", "abc_def")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "/chosen")  # the user's own choice stands
    assert rank_env(spec, slot, ("127.0.0.1", 29500))["TORCH_EXTENSIONS_DIR"] == "/chosen"
