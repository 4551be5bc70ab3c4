"""A slot worker's warm interpreter (workers.warm.warm_start) never outlives it: a real slot worker runs
a real job with warm start on, then is stopped as an operator or the kernel stops it, and the warm
process (a multiprocessing forkserver with torch loaded) and multiprocessing's resource tracker
must be gone by the time the process that started them is, its socket folder too.

Why: with warm start on, `deploy down` and the tests' checks for leftovers found the forkserver
still running after its worker had exited (it noticed only after billiard's exit pause, then spent
seconds tearing torch down), and left a /tmp/pymp-* folder per pool process behind.
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil
import pytest

from integration_helpers import run_autotune, wait_for, write_config
from scheduler.embedded.local_cluster import LocalCluster
from workers.warm.warm_plan import SWITCH_ENV
from workers.warm.warm_server import shows_warm

pytestmark = pytest.mark.integration


def _warm_processes(pool: psutil.Process) -> tuple[psutil.Process, psutil.Process]:
    """The pool process's forkserver (the warm interpreter) and resource tracker."""
    children = {proc.pid: " ".join(proc.cmdline()) for proc in pool.children()}
    server = [pid for pid, argv in children.items() if shows_warm(argv)]
    tracker = [pid for pid, argv in children.items() if "multiprocessing.resource_tracker import main" in argv]
    assert len(server) == 1 and len(tracker) == 1, children
    return psutil.Process(server[0]), psutil.Process(tracker[0])


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.parametrize("how", ["warm shutdown", "cold shutdown", "pool process killed"])
def test_the_warm_interpreter_ends_with_its_worker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    monkeypatch.setenv(SWITCH_ENV, "1")  # the workers LocalCluster starts inherit it
    cfg = write_config(tmp_path / "cfg.json", train_micro_batch_size_per_gpu=[1])
    with LocalCluster(1, tmp_path / "cluster", slot_memory="1GiB") as cluster:
        done = run_autotune([str(cfg), "--num_gpus", "1"], tmp_path, {"AUTOTUNE_REDIS_URL": cluster.url})
        assert done.returncode == 0 and "cold: 0." in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]
        worker = psutil.Process(cluster.pids[1])  # [redis-server, the gpu0 worker, the control worker]
        assert "gpu0@" in " ".join(worker.cmdline())
        (pool,) = worker.children()
        server, tracker = _warm_processes(pool)
        sockets = [conn.laddr for conn in server.net_connections(kind="unix") if conn.laddr]
        assert len(sockets) == 1 and Path(sockets[0]).parent.name.startswith("pymp-"), sockets
        folder = Path(sockets[0]).parent
        log = tmp_path / "cluster" / "gpu0.log"
        written = log.stat().st_size

        if how == "pool process killed":  # the kernel's way: no hook runs in the pool process
            pool.kill()
            psutil.wait_procs([pool], timeout=30)
            began = time.monotonic()
            wait_for(lambda: not _alive(server), 0.5, "the warm interpreter to die with its pool process")
            print(f"\nwarm interpreter gone {time.monotonic() - began:.2f}s after its pool process")
            wait_for(lambda: not _alive(tracker), 10, "the resource tracker to end")
            return
        os.kill(worker.pid, signal.SIGTERM if how == "warm shutdown" else signal.SIGQUIT)
        began = time.monotonic()
        psutil.wait_procs([worker], timeout=60)
        stopped = time.monotonic() - began
        left = [proc.pid for proc in (pool, server, tracker) if _alive(proc)]
        said = log.read_bytes()[written:].decode(errors="replace")
        assert not left, f"{left} outlived the worker ({how}, {stopped:.1f}s)"
        assert not folder.exists(), f"{folder} (the warm interpreter's socket) outlived the worker"
        assert ("Warm shutdown" if how == "warm shutdown" else "Cold shutdown") in said, said
        assert stopped < 30, f"the worker took {stopped:.1f}s to stop ({how})"
        print(f"\n{how}: the worker and its warm interpreter gone in {stopped:.1f}s")
