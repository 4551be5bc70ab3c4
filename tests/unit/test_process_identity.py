"""A rank says what it is without its environment (`workers.process.process_identity`): its title names its
slot, job, experiment, rank and launch, and a group is recognised by the slot's record (the leader's
start time) or by that title, never by /proc/<pid>/environ, which a rank forked from the warm
process shows as the warm process's."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from workers.in_rank.entry import TITLE_ENV
from workers.process.launch import group_runs_slot, marked_processes
from workers.process.process_identity import RankIdentity, RankProcess, owns_group, start_time, titled_ranks

ROOT = Path(__file__).resolve().parents[2]
IDENTITY = RankIdentity("n1.gpu3", "0123456789abcdef", "z1_gas1_tmbspg4", 1, 2, "f" * 32)


def test_a_title_names_the_rank_and_reads_back():
    title = IDENTITY.title()
    assert title == ("autotune rank 1/2 slot=n1.gpu3 launch=ffffffffffff job=0123456789abcdef "
                     "exp=z1_gas1_tmbspg4")
    back = RankIdentity.from_title(title)
    assert back is not None and back.same_launch(IDENTITY)
    assert (back.slot, back.job, back.experiment, back.rank, back.world_size) == \
        ("n1.gpu3", "0123456789abcdef", "z1_gas1_tmbspg4", 1, 2)
    cut = RankIdentity.from_title(title[:50])  # cut to the command line it replaced
    assert cut is not None and (cut.slot, cut.rank) == ("n1.gpu3", 1) and cut.experiment == ""
    assert RankIdentity.from_title("python -c from multiprocessing.forkserver import main") is None
    assert RankIdentity.from_title("[celeryd: gpu0@n1:MainProcess]") is None


def test_a_record_reads_back_and_a_bad_one_is_none():
    record = RankProcess(IDENTITY, 10, 10, 4242)
    assert RankProcess.from_json(record.to_json()) == record
    assert RankProcess.from_json(b"{}") is None and RankProcess.from_json(b"not json") is None


#: Forks a rank as the warm process does (`run_forked_rank`, the request on stdin) and prints its pid.
FORKS = """
import json, multiprocessing, sys, time
from workers.warm.warm_rank import run_forked_rank
request = json.loads(sys.stdin.readline())
context = multiprocessing.get_context("fork")
receive, send = context.Pipe(duplex=False)
process = context.Process(target=run_forked_rank, args=(request, send), daemon=True)
process.start()
print(json.dumps([process.pid, *receive.recv()]), flush=True)
time.sleep(120)
"""


@pytest.fixture
def forked_rank(tmp_path):
    """A rank forked as the warm process forks one: the forking process's environment (no
    AUTOTUNE_SLOT, no title) is what /proc shows for it; the rank's own is set after the fork.

    The forking process is started here with a known command line, as long as a title, and
    SPT_NOENV (the warm process's, `workers.warm.warm_preload.take_title`): a title has the room of
    that command line only, whatever launched the test (a pytest-xdist worker's is too short for
    the experiment)."""
    script = tmp_path / "train.py"
    script.write_text("import time\nopen('up', 'w').close()\ntime.sleep(60)\n")
    parent_env = {**{k: v for k, v in os.environ.items() if k != "AUTOTUNE_SLOT"}, "SPT_NOENV": "1"}
    env = {**parent_env, "AUTOTUNE_SLOT": IDENTITY.slot, "RANK": "1", TITLE_ENV: IDENTITY.title()}
    request = {"script_argv": [str(script)], "env": env, "cwd": str(tmp_path), "stdout": str(tmp_path / "out"),
               "stderr": str(tmp_path / "err"), "cpus": []}
    (tmp_path / "out").touch()
    (tmp_path / "err").touch()
    room = "#" * len(IDENTITY.title())  # the command line alone is as long as the whole title
    parent = subprocess.Popen([sys.executable, "-c", FORKS, room], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              cwd=ROOT, env=parent_env, start_new_session=True)
    pid = 0
    try:
        parent.stdin.write(json.dumps(request).encode() + b"\n")
        parent.stdin.close()
        pid, status, why = json.loads(parent.stdout.readline())
        assert status == "ok", why
        deadline = time.monotonic() + 10
        while not (tmp_path / "up").exists():
            assert time.monotonic() < deadline, (tmp_path / "err").read_text()
            time.sleep(0.02)
        yield pid
    finally:
        for group in {pid, parent.pid} - {0}:
            try:
                os.killpg(group, signal.SIGKILL)
            except ProcessLookupError:
                pass
        parent.wait(5)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")
def test_a_forked_rank_is_named_by_its_title_and_its_record_not_by_its_environment(forked_rank):
    pid = forked_rank
    shown = psutil.Process(pid)
    assert "AUTOTUNE_SLOT" not in shown.environ(), "a forked rank shows the environment it was forked with"
    [(found_pid, found)] = titled_ranks([shown]).items()
    # with the room of a command line as long as the title: all of it (the launch's first 12 characters)
    assert found_pid == pid and found == RankIdentity.from_title(IDENTITY.title())
    assert (found.slot, found.job, found.experiment, found.rank) == \
        (IDENTITY.slot, IDENTITY.job, IDENTITY.experiment, IDENTITY.rank)
    assert os.getpgid(pid) == pid
    assert group_runs_slot(pid, IDENTITY.slot), "its title says it runs that slot"
    assert not group_runs_slot(pid, "n1.gpu0"), "another slot's group is not it"
    started = start_time(pid)
    assert started > 0 and owns_group(pid, IDENTITY.slot, started)
    assert not owns_group(pid, IDENTITY.slot, started - 100), "a recorded start that is not its own: a reused PID"
    assert [proc.pid for proc in marked_processes("UNSET_MARK", "x", title=IDENTITY.title())] == [pid]


def test_an_untitled_group_without_a_record_is_not_taken_for_a_rank(tmp_path):
    """A process carrying AUTOTUNE_SLOT in its environment but no title and no record: not ours."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"],
                            env={**os.environ, "AUTOTUNE_SLOT": IDENTITY.slot}, stdout=subprocess.PIPE,
                            start_new_session=True)
    try:
        assert proc.stdout.readline() == b"up\n"
        assert not group_runs_slot(proc.pid, IDENTITY.slot)
        assert group_runs_slot(proc.pid, IDENTITY.slot, start_time(proc.pid)), "its record's start time is its own"
    finally:
        proc.kill()
        proc.wait()

