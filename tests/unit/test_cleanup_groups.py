"""Which training groups a stopped launch's clean-up kills (`deploy.cleanup.groups_of`), read from the
slots' store's in-memory twin: the store is the one way the clean-up reads what ranks recorded, and
tests/redis/test_slot_store_contract.py holds the Redis store to the same answers."""
from __future__ import annotations

import threading

import pytest

from deploy import cleanup
from deploy.plan import RecordedGroup
from workers.process.process_identity import RankIdentity, RankProcess
from workers.state.memory_store import MemorySlots

LAUNCH = {"rank_tasks": {"n2.gpu0": "t2", "n1.gpu0": "t1", "n1.gpu1": "t3"}}


def _record(queue: str, pgid: int, started: int) -> str:
    return RankProcess(RankIdentity(queue, "job", "e1", 0, 3, "a" * 32), pgid, pgid, started).to_json()


def test_a_rank_is_killed_by_its_record_where_it_has_one_else_by_its_bare_pgid() -> None:
    slots = MemorySlots().store()
    slots.write_rank_group("n1.gpu0", "t1", _record("n1.gpu0", 4141, 123456), 4141, 600)
    slots.write_rank_group("n2.gpu0", "t2", "not a record", 4242, 600)  # an unreadable record: its pgid
    slots.write_rank_group("n1.gpu0", "other", _record("n1.gpu0", 99, 1), 99, 600)  # another launch's rank
    assert cleanup.groups_of(slots, [("e1", LAUNCH)]) == [RecordedGroup("n1", "n1.gpu0", 4141, "e1", 123456),
                                                          RecordedGroup("n2", "n2.gpu0", 4242, "e1")]
    assert cleanup.groups_of(slots, [("e1", {})]) == [] and cleanup.groups_of(slots, []) == []


def test_a_lapsed_record_is_no_group_to_kill() -> None:
    clock = [1000.0]
    slots = MemorySlots(lambda: clock[0]).store()
    slots.write_rank_group("n1.gpu0", "t1", _record("n1.gpu0", 4141, 1), 4141, 60)
    clock[0] += 61
    assert cleanup.groups_of(slots, [("e1", LAUNCH)]) == []


def test_the_background_clean_up_kills_the_groups_read_before_it_returns(monkeypatch: pytest.MonkeyPatch) -> None:
    killed, done = [], threading.Event()

    def kill_recorded(hosts, groups, grace_s=cleanup.DEFAULT_GRACE_S):
        killed.append(groups)
        done.set()
        return {}

    monkeypatch.setattr(cleanup, "kill_recorded", kill_recorded)
    monkeypatch.setattr("deploy.fabric_hosts.Hosts", lambda **options: None)
    db = MemorySlots()
    cleanup.clean_launch_in_background(db.store(), "e1", LAUNCH)  # nothing recorded: no thread
    assert cleanup.wait_for_background_cleanups(5.0) and killed == []
    db.store().write_rank_group("n1.gpu1", "t3", _record("n1.gpu1", 77, 5), 77, 600)
    cleanup.clean_launch_in_background(db.store(), "e1", LAUNCH)
    db.flush()  # what the store holds after the call is not read again
    assert done.wait(10) and cleanup.wait_for_background_cleanups(10.0)
    assert killed == [[RecordedGroup("n1", "n1.gpu1", 77, "e1", 5)]]
