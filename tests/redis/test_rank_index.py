"""The slots' rank records are found through their index, never by scanning the keyspace
(`workers.process.process_identity`: `record_rank` names each record and pgid key in its slot's
`keys.rank_index`, and the slot in `keys.RANK_SLOTS`): a rank's start reads its own slot's few records
however large a shared Redis is; a name whose key expired leaves the index when it is next read."""
from __future__ import annotations

import os
import time

import redis

from workers.process.process_identity import (RankIdentity, RankProcess, forget_rank, rank_records, record_rank,
                                              recorded_groups, recorded_ranks)
from workers.slot.rank_claim import end_older_launches
from workers.state import keys

SLOT, OTHER = "n1.gpu1", "n1.gpu10"  # one slot's name starts the other's


def _identity(slot: str, launch: str = "a" * 32) -> RankIdentity:
    return RankIdentity(slot, "job", "z1", 0, 1, launch)


def _scans(client: redis.Redis) -> int:
    """How many SCAN and KEYS commands the server has run since its statistics were reset."""
    stats = client.info("commandstats")
    return sum(stats.get(f"cmdstat_{command}", {}).get("calls", 0) for command in ("scan", "keys"))


def _wait_gone(client: redis.Redis, name: str) -> None:
    deadline = time.monotonic() + 5
    while client.exists(name):
        assert time.monotonic() < deadline, f"{name} did not expire"
        time.sleep(0.01)


def test_a_reader_walks_the_index_and_never_scans(client):
    mine = record_rank(client, "t-mine", _identity(SLOT), os.getpid(), 600)
    theirs = record_rank(client, "t-theirs", _identity(OTHER), os.getpid(), 600)
    # Keys no writer indexed, under the slot's own names: a scan would read them, the index does not.
    client.set(keys.rank_process(SLOT, "t-planted"), RankProcess(_identity(SLOT, "b" * 32), 0, 0, 0).to_json())
    client.set(keys.pgid(SLOT, "t-planted"), 0)
    client.config_resetstat()

    assert recorded_ranks(client, SLOT) == [mine]
    assert sorted(recorded_ranks(client), key=lambda record: record.identity.slot) == [mine, theirs]
    assert rank_records(client, OTHER) == {keys.rank_process(OTHER, "t-theirs"): theirs}
    assert recorded_groups(client, SLOT) == {keys.pgid(SLOT, "t-mine"): os.getpid()}
    assert end_older_launches(client, SLOT, "a" * 32, grace_s=1.0) == []  # a rank's start: its own launch only
    assert _scans(client) == 0, "a reader scanned the keyspace"


def test_a_name_whose_record_expired_leaves_the_index_and_forget_drops_both(client):
    kept = record_rank(client, "t-kept", _identity(SLOT), os.getpid(), 600)
    record_rank(client, "t-expiring", _identity(SLOT), os.getpid(), 600)
    record_rank(client, "t-alone", _identity(OTHER), os.getpid(), 600)
    assert 0 < client.ttl(keys.rank_index(SLOT)) <= 600, "the index expires with its records"
    for name in (keys.rank_process(SLOT, "t-expiring"), keys.pgid(SLOT, "t-expiring")):
        client.pexpire(name, 1)
        _wait_gone(client, name)
    assert client.sismember(keys.rank_index(SLOT), keys.rank_process(SLOT, "t-expiring")), "not pruned yet"

    assert recorded_ranks(client, SLOT) == [kept]
    assert sorted(client.smembers(keys.rank_index(SLOT))) == \
        sorted(name.encode() for name in (keys.rank_process(SLOT, "t-kept"), keys.pgid(SLOT, "t-kept")))

    forget_rank(client, SLOT, "t-kept")
    assert not client.exists(keys.rank_process(SLOT, "t-kept"), keys.pgid(SLOT, "t-kept"), keys.rank_index(SLOT))
    assert client.smembers(keys.RANK_SLOTS) == {SLOT.encode(), OTHER.encode()}
    assert [record.identity.slot for record in recorded_ranks(client)] == [OTHER]
    assert client.smembers(keys.RANK_SLOTS) == {OTHER.encode()}, "a slot with no index left leaves the slots'"
