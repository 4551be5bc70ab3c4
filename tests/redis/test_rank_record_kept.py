"""A running rank's record outlives a Redis restart that lost it (`workers.slot.rank_peers.StopCheck`
writes it again while the rank runs): a rank nobody can find is one no later launch on its slot
ends (the 30-minute soak found one: its record was written in the last second before an
append-only restart, and it ran 40 s beside the next launch's ranks)."""
from __future__ import annotations

import os
import time

import redis

from workers.process.process_identity import RankIdentity, recorded_ranks
from workers.slot.rank import record_started
from workers.slot.rank_peers import StopCheck

SLOT = "n1.gpu0"
IDENTITY = RankIdentity(SLOT, "job", "z1_gas1_tmbspg4", 0, 1, "e" * 32)


def test_a_lost_record_is_written_again_at_the_next_renewal(client):
    stop_check = StopCheck(client, "abort", SLOT, "", lease_s=3.0)  # a renewal every second
    record_started(client, "t-rank", IDENTITY, os.getpid(), stop_check)
    [before] = recorded_ranks(client, SLOT)
    client.flushdb()  # Redis back without its data
    stop_check.slot_taken()
    assert recorded_ranks(client, SLOT) == [], "not before the renewal is due"
    time.sleep(1.1)
    stop_check.slot_taken()
    assert recorded_ranks(client, SLOT) == [before], "the same record: its start time, its group"


def test_after_a_poll_that_missed_redis_the_record_is_written_at_once(client, monkeypatch):
    stop_check = StopCheck(client, "abort", SLOT, "", lease_s=300.0)  # a renewal every 100 s
    record_started(client, "t-rank", IDENTITY, os.getpid(), stop_check)
    [before] = recorded_ranks(client, SLOT)

    class Away:  # the slot's lease, renewed while Redis is away
        def renew(self):
            raise redis.ConnectionError("Connection refused")

    monkeypatch.setattr(stop_check, "_lease", Away())
    assert stop_check.slot_taken() is False, "an outage is no reason to stop"
    client.flushdb()  # back without its data
    monkeypatch.setattr(stop_check, "_lease", None)
    stop_check.slot_taken()
    assert recorded_ranks(client, SLOT) == [before], "written at the first poll that reached Redis"


def test_an_ended_rank_is_not_written_again(client):
    stop_check = StopCheck(client, "abort", SLOT, "", lease_s=3.0)
    record_started(client, "t-rank", IDENTITY, os.getpid(), stop_check)
    stop_check.keep_record(None)
    client.flushdb()
    time.sleep(1.1)
    stop_check.slot_taken()
    assert recorded_ranks(client, SLOT) == []
