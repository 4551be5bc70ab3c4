"""A restarted slot worker's scan for the groups its killed predecessor left
(`workers.process.process_identity.leftover_groups`, behind `tasks.worker_hooks.kill_orphans`): the groups the
slot recorded that are still those ranks, by the record's start time, or by a rank title of the slot
where only a pgid was recorded; never a process the environment alone names; every record dropped."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from workers.state import keys
from workers.process.process_identity import RankIdentity, leftover_groups, record_rank
from workers.slot.rank_claim import end_older_launches

SLOT = "n1.gpu0"
SLEEPS = ("import setproctitle, sys, time; sys.argv[1] and setproctitle.setproctitle(sys.argv[1]); "
          "print('up', flush=True); time.sleep(120)")


def _process(title: str = "") -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", SLEEPS, title], stdout=subprocess.PIPE, start_new_session=True,
                            env={**os.environ, "AUTOTUNE_SLOT": SLOT})
    assert proc.stdout.readline() == b"up\n"
    return proc


def test_the_scan_finds_the_recorded_ranks_still_running_and_drops_every_record(client):
    identity = RankIdentity(SLOT, "job", "z1", 0, 1, "a" * 32)
    procs = {name: _process(title) for name, title in [("recorded", ""), ("reused", ""), ("bare_untitled", ""),
                                                       ("bare_titled", identity.title())]}
    try:
        record_rank(client, "t-recorded", identity, procs["recorded"].pid, 600)
        reused = record_rank(client, "t-reused", identity, procs["reused"].pid, 600)
        client.set(keys.rank_process(SLOT, "t-reused"),  # its PID, since given to another process
                   json.dumps({**json.loads(reused.to_json()), "started": reused.started - 500}))
        client.set(keys.pgid(SLOT, "t-untitled"), procs["bare_untitled"].pid)
        client.set(keys.pgid(SLOT, "t-titled"), procs["bare_titled"].pid)
        client.set(keys.pgid("n1.gpu1", "t-other-slot"), procs["bare_titled"].pid)

        assert leftover_groups(client, SLOT) == sorted([procs["recorded"].pid, procs["bare_titled"].pid])
        assert sorted(key.decode() for key in client.scan_iter(match="autotune:*")) == \
            [keys.pgid("n1.gpu1", "t-other-slot")], "every record of the slot is dropped, no other slot's"
    finally:
        for proc in procs.values():
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_an_op_builds_untitled_group_is_recorded_so_the_scan_finds_it(client):
    """An op build runs in a group of its own before the script: no rank title. `rank.record_started`
    records it with its leader's start time, so a restarted worker's scan recognises it (a pgid
    alone would need a title)."""
    from workers.slot.rank import record_started
    from workers.slot.rank_peers import StopCheck

    identity = RankIdentity(SLOT, "job", "z1", 0, 1, "b" * 32)
    build = _process()  # untitled, as an op build's compiler is
    try:
        record_started(client, "t-build", identity, build.pid, StopCheck(client, "abort", SLOT, "", 30.0))
        assert leftover_groups(client, SLOT) == [build.pid]
    finally:
        os.killpg(build.pid, signal.SIGKILL)
        build.wait()


def test_a_rank_starting_ends_what_an_older_launch_left_on_its_slot_and_nothing_else(client):
    """The slot's reservation is the new launch's: a rank of another launch still on the slot (a
    frozen node thawed, a pool process killed) is ended before the new rank starts; the new
    launch's own ranks and another slot's are left alone (`end_older_launches`)."""
    older = RankIdentity(SLOT, "job", "z1", 0, 2, "c" * 32)
    newer = RankIdentity(SLOT, "job", "z1", 1, 2, "d" * 32)
    elsewhere = RankIdentity("n1.gpu1", "job", "z1", 0, 2, "c" * 32)
    procs = {"older": _process(older.title()), "newer": _process(newer.title()),
             "elsewhere": _process(elsewhere.title())}
    try:
        for name, identity in (("older", older), ("newer", newer), ("elsewhere", elsewhere)):
            record_rank(client, f"t-{name}", identity, procs[name].pid, 600)
        assert end_older_launches(client, SLOT, newer.launch, grace_s=5.0) == [procs["older"].pid]
        procs["older"].wait(timeout=5)  # ended (TimeoutExpired otherwise)
        assert procs["newer"].poll() is None and procs["elsewhere"].poll() is None
        assert end_older_launches(client, "n1.gpu2", newer.launch, grace_s=5.0) == []
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
