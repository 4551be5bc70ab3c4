"""The chaos soak's reading of the pool processes that run its live ranks (`bench.chaos_strikes.read_pools`)
against a real Redis: each slot's rank record, as `record_rank` writes it, is paired with its task's
claim (`workers.slot.rank_claim`), and a claim without a record of a live rank names nothing."""
from __future__ import annotations

import json

import psutil

from bench.chaos_checks import Seen
from bench.chaos_strikes import read_pools
from workers.process.process_identity import RankIdentity, record_rank
from workers.state import keys

LAUNCH = "launch100000".ljust(32, "0")
SEEN = Seen("chaos.gpu0", LAUNCH[:12], "001-list/z0_mbs1", "0")


def _claim(pid: int, started: float) -> str:
    return json.dumps({"pid": pid, "started": started, "group": {"pid": 200, "started": 5.0}})


def test_read_pools_pairs_each_rank_record_with_its_tasks_claim(client):
    me = psutil.Process()
    record_rank(client, "0f3c-task", RankIdentity("chaos.gpu0", "001-list", "z0_mbs1", 0, 1, LAUNCH), 200, 600)
    client.set(keys.rank_claim("chaos.gpu0", "0f3c-task"), _claim(me.pid, me.create_time()))
    client.set(keys.rank_claim("chaos.gpu1", "0f3c-task"), _claim(1, 0.0))  # no record of that slot's rank
    assert [(s.pid, s.rank_pid, s.seen) for s in read_pools(client, {200: SEEN})] == [(me.pid, 200, SEEN)]
    assert read_pools(client, {}) == [], "a record of no live rank names no pool process"
