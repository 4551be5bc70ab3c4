"""How often `workers.launch` reads a rank's memory: ten times a second against a memory cap (a CPU
slot's), once a second where there is none (a GPU slot's: only the record's figure), and the peer
abort flag at most twice a second either way (issue 21 item 18)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from workers import launch


@pytest.mark.parametrize(("cap", "reads"), [(1 << 40, range(8, 40)), (None, range(2, 5))])
def test_memory_is_polled_fast_only_against_a_cap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  cap: int | None, reads: range) -> None:
    calls = {"rss": 0, "abort": 0}
    real_tree_rss = launch.tree_rss

    def counted(root):
        calls["rss"] += 1
        return real_tree_rss(root)

    def should_abort() -> bool:
        calls["abort"] += 1
        return False

    monkeypatch.setattr(launch, "tree_rss", counted)
    result = launch.run_watched([sys.executable, "-c", "import time; time.sleep(2.5)"], env={"PATH": "/usr/bin:/bin"},
                                cwd=str(tmp_path), stdout_path=tmp_path / "out", stderr_path=tmp_path / "err",
                                timeout_s=30, memory_cap_bytes=cap, should_abort=should_abort)
    assert result.exit_code == 0 and result.killed_for is None and result.peak_rss_bytes > 0
    assert calls["rss"] in reads, calls
    assert 2 <= calls["abort"] <= 7, calls


def test_a_timeout_is_not_overshot_by_the_slow_poll(tmp_path: Path) -> None:
    result = launch.run_watched([sys.executable, "-c", "import time; time.sleep(30)"], env={"PATH": "/usr/bin:/bin"},
                                cwd=str(tmp_path), stdout_path=tmp_path / "out", stderr_path=tmp_path / "err",
                                timeout_s=1.2, memory_cap_bytes=None)
    assert result.killed_for is launch.KillReason.TIMEOUT
    assert result.wall_s < 1.2 + launch.KILL_GRACE_S, result.wall_s


def test_a_killed_group_is_gone_when_kill_group_returns(tmp_path: Path) -> None:
    """Issue 21 item 10: the slot is handed on after kill_group; a process still tearing down its
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
    """Issue 21 item 2: a wrapper's script hung in NCCL's teardown after DeepSpeed's profiling exit."""
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
