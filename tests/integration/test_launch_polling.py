"""How often `workers.process.launch` reads a rank's memory: ten times a second against a memory cap (a CPU
slot's), once a second where there is none (a GPU slot's: only the record's figure), and the peer
abort flag at most twice a second either way; the costly PSS reading only when
the cheap RSS one could change the answer (`workers.process.tree_memory`), without missing a peak.
Every test watches real child processes for seconds, so they run with the integration tests."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from workers.process import launch, tree_memory

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(("cap", "cheap", "full"), [(1 << 40, range(8, 40), range(1, 9)),
                                                   (None, range(2, 5), range(1, 5))])
def test_memory_is_polled_fast_only_against_a_cap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  cap: int | None, cheap: range, full: range) -> None:
    """Against a cap, RSS ten times a second and PSS (the kernel walks every page) about once a
    second while RSS stays put; without a cap, both once a second."""
    calls = {"rss": 0, "pss": 0, "abort": 0}
    real_rss, real_pss = tree_memory.tree_rss, tree_memory.tree_pss

    def counted(kind, real):
        def read(processes, *rest):
            calls[kind] += 1
            return real(processes, *rest)
        return read

    def should_abort() -> bool:
        calls["abort"] += 1
        return False

    monkeypatch.setattr(tree_memory, "tree_rss", counted("rss", real_rss))
    monkeypatch.setattr(tree_memory, "tree_pss", counted("pss", real_pss))
    result = launch.run_watched([sys.executable, "-c", "import time; time.sleep(2.5)"], env={"PATH": "/usr/bin:/bin"},
                                cwd=str(tmp_path), stdout_path=tmp_path / "out", stderr_path=tmp_path / "err",
                                timeout_s=30, memory_cap_bytes=cap, should_abort=should_abort)
    assert result.exit_code == 0 and result.killed_for is None and result.peak_rss_bytes > 0
    assert calls["rss"] in cheap and calls["pss"] in full, calls
    assert 2 <= calls["abort"] <= 7, calls


#: Holds `sys.argv[1]` MiB for 0.6 s after 1.2 s, then frees it and runs on: a peak between two of
#: the once-a-second PSS readings.
SPIKE = ("import sys, time; time.sleep(1.2); block = bytearray(int(sys.argv[1]) << 20); time.sleep(0.6); "
         "del block; time.sleep(1.5)")


def test_a_peak_between_the_slow_readings_is_in_the_figure(tmp_path: Path) -> None:
    result = launch.run_watched([sys.executable, "-c", SPIKE, "200"], env={"PATH": "/usr/bin:/bin"},
                                cwd=str(tmp_path), stdout_path=tmp_path / "out", stderr_path=tmp_path / "err",
                                timeout_s=30, memory_cap_bytes=1 << 40)
    assert result.exit_code == 0 and result.peak_rss_bytes > 200 << 20, result


#: 300 MiB touched, then a forked child that shares them all (RSS counts them twice, PSS once); on
#: the file `sys.argv[1]` appearing, 250 MiB more.
SHARED_THEN_MORE = ("import os, pathlib, sys, time\nblock = bytearray(300 << 20)\nif os.fork() == 0:\n"
                    "    time.sleep(60)\n    os._exit(0)\nflag = pathlib.Path(sys.argv[1])\n"
                    "pathlib.Path(sys.argv[1] + '.forked').touch()\n"
                    "while not flag.exists():\n    time.sleep(0.05)\nmore = bytearray(250 << 20)\ntime.sleep(60)\n")


def test_the_cap_is_held_against_pss_read_whenever_rss_is_over_it(tmp_path: Path) -> None:
    """RSS over the cap only proves nothing: the tree is killed when its PSS is over it."""
    import threading

    flag, forked = tmp_path / "more", tmp_path / "more.forked"
    cap = 450 << 20
    stop = threading.Event()

    def release() -> None:  # a second of polls (ten) with an RSS sum of 600 MiB, then more
        while not forked.exists() and not stop.wait(0.05):
            pass
        if not stop.wait(1.0):
            flag.touch()

    releaser = threading.Thread(target=release, daemon=True)
    releaser.start()
    try:
        result = launch.run_watched([sys.executable, "-c", SHARED_THEN_MORE, str(flag)], env={"PATH": "/usr/bin:/bin"},
                                    cwd=str(tmp_path), stdout_path=tmp_path / "out", stderr_path=tmp_path / "err",
                                    timeout_s=60, memory_cap_bytes=cap)
    finally:
        stop.set()
        releaser.join()
    assert flag.exists(), "killed before it grew: its RSS sum, not its PSS, was held against the cap"
    assert result.killed_for is launch.KillReason.MEMORY and result.peak_rss_bytes > cap, result


def test_a_timeout_is_not_overshot_by_the_slow_poll(tmp_path: Path) -> None:
    result = launch.run_watched([sys.executable, "-c", "import time; time.sleep(30)"], env={"PATH": "/usr/bin:/bin"},
                                cwd=str(tmp_path), stdout_path=tmp_path / "out", stderr_path=tmp_path / "err",
                                timeout_s=1.2, memory_cap_bytes=None)
    assert result.killed_for is launch.KillReason.TIMEOUT
    assert result.wall_s < 1.2 + launch.KILL_GRACE_S, result.wall_s


def test_a_killed_group_is_gone_when_kill_group_returns(tmp_path: Path) -> None:
    """The slot is handed on after kill_group; a process still tearing down its
    memory (a GPU context, here 1.5 GB of host pages) would leave the next experiment short of it."""
    import subprocess

    script = ("import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
              "block = bytearray(1536 << 20)\nprint('ready', flush=True)\ntime.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        assert launch.kill_group(proc.pid, grace_s=0.2) is True
        assert not launch.group_alive(proc.pid)
    finally:
        proc.kill()
        proc.wait()


HANGS_AFTER_MEASURING = ("import pathlib, sys, time; time.sleep(0.3); pathlib.Path(sys.argv[1]).write_text('{}'); "
                         "time.sleep(float(sys.argv[2]))")


def run_measuring(tmp_path: Path, hang_s: float, timeout_s: float, grace_s: float) -> launch.LaunchResult:
    """A script that writes its metrics after 0.3 s, then runs on for `hang_s` (a teardown that hangs)."""
    metrics = tmp_path / "metrics.json"
    return launch.run_watched([sys.executable, "-c", HANGS_AFTER_MEASURING, str(metrics), str(hang_s)],
                              env={"PATH": "/usr/bin:/bin"}, cwd=str(tmp_path), stdout_path=tmp_path / "out",
                              stderr_path=tmp_path / "err", timeout_s=timeout_s, memory_cap_bytes=None,
                              measured=metrics.exists, measured_grace_s=grace_s)


def test_a_rank_hung_after_its_experiment_measured_is_stopped_after_the_grace(tmp_path: Path) -> None:
    """A wrapper's script hung in NCCL's teardown after DeepSpeed's profiling exit."""
    result = run_measuring(tmp_path, hang_s=60, timeout_s=60, grace_s=1.0)
    assert result.killed_for is launch.KillReason.MEASURED
    assert result.wall_s < 0.3 + 1.0 + launch.ABORT_CHECK_S + launch.KILL_GRACE_S, result.wall_s


def test_a_hang_after_measuring_that_meets_the_time_limit_is_no_timeout(tmp_path: Path) -> None:
    result = run_measuring(tmp_path, hang_s=60, timeout_s=1.5, grace_s=30.0)
    assert result.killed_for is launch.KillReason.MEASURED and result.wall_s < 1.5 + launch.KILL_GRACE_S


def test_a_rank_that_leaves_within_the_grace_just_exits(tmp_path: Path) -> None:
    result = run_measuring(tmp_path, hang_s=0.5, timeout_s=30, grace_s=10.0)
    assert (result.exit_code, result.killed_for) == (0, None)


def test_without_a_measurement_the_time_limit_is_a_timeout(tmp_path: Path) -> None:
    result = launch.run_watched([sys.executable, "-c", "import time; time.sleep(30)"], env={"PATH": "/usr/bin:/bin"},
                                cwd=str(tmp_path), stdout_path=tmp_path / "out", stderr_path=tmp_path / "err",
                                timeout_s=1.0, memory_cap_bytes=None, measured=lambda: False, measured_grace_s=0.1)
    assert result.killed_for is launch.KillReason.TIMEOUT


def test_the_time_limit_starts_when_the_process_exists_not_while_it_is_spawned(tmp_path: Path) -> None:
    """A warm start's wait for the warm process (its preload, slowed by a loaded machine) is not the
    experiment's to spend: a spawn that takes longer than the limit, of a process well within it,
    runs to its end; the wall still counts the wait."""
    import subprocess
    import time

    def slow_spawn(argv, env, cwd, out, err):
        time.sleep(2.0)
        return subprocess.Popen(argv, env=env, cwd=cwd, stdout=out, stderr=err, start_new_session=True)

    result = launch.run_watched([sys.executable, "-c", "import time; time.sleep(0.3)"], env={"PATH": "/usr/bin:/bin"},
                                cwd=str(tmp_path), stdout_path=tmp_path / "out", stderr_path=tmp_path / "err",
                                timeout_s=1.5, memory_cap_bytes=None, spawn=slow_spawn)
    assert result.killed_for is None and result.exit_code == 0, result
    assert result.wall_s >= 2.0


def test_a_forked_ranks_inherited_memory_is_its_anonymous_memory_less_its_share() -> None:
    """What a warm-forked rank still shares with the warm process counts in full, as a cold rank
    would own it: all of its anonymous memory, less the proportional part PSS already counts."""
    fields = {"Rss": 900 << 20, "Pss": 500 << 20, "Pss_Anon": 300 << 20, "Anonymous": 700 << 20}
    assert tree_memory.inherited(fields) == 400 << 20
    assert tree_memory.inherited({"Pss": 1}) == 0  # a kernel without the fields: nothing added
    me = tree_memory.smaps_rollup(os.getpid())
    assert me["Pss"] > 0 and me["Anonymous"] >= me["Pss_Anon"] >= 0
    assert tree_memory.smaps_rollup(2**22 + 1) == {}


def test_a_rank_gone_before_its_watch_starts_ended_it_is_not_an_error() -> None:
    """A rank forked from a warm process is reaped by the warm process, not by the slot: a script that
    ends at once can be gone before the watch reads its memory. The watch waits for its status and
    reports no kill, rather than raising psutil.NoSuchProcess."""
    import subprocess

    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()  # reaped: its pid names no process now

    class Ended:
        pid = done.pid
        waited = False

        def poll(self) -> int:
            return 0

        def wait(self, timeout: float | None = None) -> int:
            Ended.waited = True
            return 0

    assert launch._watch(Ended(), deadline=float("inf"), memory_cap_bytes=None, should_abort=lambda: False) == (None, 0)
    assert Ended.waited
