"""A rank forked from a real warm process (`workers.warm.warm_start`) through `workers.process.launch.run_watched`
names itself in `ps` (`workers.process.process_identity`): its title names its slot, job, experiment, rank and
launch, though its /proc environ is the warm process's; the slot's group check knows it by that title;
and what it forked that left its group is stopped with it."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import psutil

from workers.process.launch import group_runs_slot, run_watched
from workers.process.process_identity import RankIdentity
from workers.warm.warm_plan import SWITCH_ENV
from workers.warm.rank_start import Start
from workers.warm.warm_start import WarmStarts

from tests.integration.test_warm_start import warm  # noqa: F401  (the warm-process fixture, shared)

ROOT = Path(__file__).resolve().parents[2]
IDENTITY = RankIdentity("test.gpu0", "0123456789abcdef", "z1_mbs2", 0, 1, "c0ffee" * 6)
RANK = '''
import installed_lib, os, sys, time
child = os.fork()
if child == 0:  # leaves the rank's group: a group kill does not reach it
    os.setsid()
    time.sleep(120)
    os._exit(0)
open("escaped.pid", "w").write(str(child))
time.sleep(float(sys.argv[1]))
'''


def test_a_warm_forked_rank_names_itself_and_its_escaped_child_is_stopped(warm: WarmStarts, tmp_path: Path):
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    env = {key: value for key, value in os.environ.items() if not key.startswith("AUTOTUNE_")}
    env.update({"PYTHONPATH": f"{ROOT}:{tmp_path / 'site'}", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                "AUTOTUNE_SLOT": IDENTITY.slot, "CUDA_VISIBLE_DEVICES": "", "RANK": "0", "DS_ACCELERATOR": "cpu",
                SWITCH_ENV: "1"})
    command = [sys.executable, "-m", "workers.in_rank.entry", str(script), "4"]
    start, seen, pids = Start(), {}, []

    def look() -> bool:  # while it runs, as `ps` and the slot's checks see it
        if pids and "title" not in seen:
            try:
                rank = psutil.Process(pids[0])
                seen.update(title=" ".join(rank.cmdline()).strip(), environ=rank.environ(),
                            owned=group_runs_slot(pids[0], IDENTITY.slot),
                            other=group_runs_slot(pids[0], "test.gpu1"))
            except psutil.Error:
                pass
        return False

    result = run_watched(command, env=env, cwd=str(tmp_path), stdout_path=tmp_path / "out.log",
                         stderr_path=tmp_path / "err.log", timeout_s=120, memory_cap_bytes=None,
                         spawn=warm.spawn_for(command[3:], env, "cpu", (), start), on_start=pids.append,
                         should_abort=look, title=IDENTITY.title())
    assert start.path == "warm", start.why_cold
    assert result.exit_code == 0, (tmp_path / "err.log").read_text()
    assert seen["title"] == IDENTITY.title()
    assert "RANK" not in seen["environ"], "a forked rank's /proc environ is the warm process's"
    assert seen["owned"] and not seen["other"]
    escaped = int((tmp_path / "escaped.pid").read_text())
    assert not psutil.pid_exists(escaped) or psutil.Process(escaped).status() == psutil.STATUS_ZOMBIE, \
        "what the rank forked that left its group outlived the launch"
