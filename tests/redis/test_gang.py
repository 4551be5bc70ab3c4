"""The gang reservation (`workers.state.gang`) against a real redis-server: every rule read back from the
raw keys (`autotune:gang:<queue>`: the owner token, its PX lease). The contention test and the
stale-rank check stay in tests/integration/test_leases.py."""
from __future__ import annotations

import re
import signal
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import redis

from workers.state import gang, keys
from workers.state.gang import GangReservations, SlotLease
from scheduler.embedded.local_cluster import die_with_parent

LEASE_MS = 30_000


def _ttl_is_lease(client: redis.Redis, queue: str, lease_ms: int = LEASE_MS) -> bool:
    """The key's remaining lease is the one just set (a loaded machine may take a few seconds)."""
    return lease_ms - 10_000 < client.pttl(keys.gang(queue)) <= lease_ms


def test_reserve_sets_every_key_to_the_token_with_the_lease(client: redis.Redis) -> None:
    gangs = GangReservations(client)
    token = gangs.reserve(["n.gpu1", "n.gpu0", "n.gpu1"], 30, owner="job/exp")
    assert token is not None and re.fullmatch(r"job/exp#[0-9a-f]{32}", token)
    assert sorted(client.keys("*")) == [b"autotune:gang:n.gpu0", b"autotune:gang:n.gpu1"]
    assert client.get("autotune:gang:n.gpu0") == client.get("autotune:gang:n.gpu1") == token.encode()
    assert _ttl_is_lease(client, "n.gpu0") and _ttl_is_lease(client, "n.gpu1")


def test_a_token_without_owner_is_bare_and_fresh(client: redis.Redis) -> None:
    gangs = GangReservations(client)
    first, second = gangs.reserve(["a.gpu0"], 30), gangs.reserve(["a.gpu1"], 30.5)
    assert first is not None and re.fullmatch(r"[0-9a-f]{32}", first) and first != second
    assert 20_500 < client.pttl(keys.gang("a.gpu1")) <= 30_500  # fractional seconds kept as ms


def test_reserve_is_all_or_nothing(client: redis.Redis) -> None:
    gangs = GangReservations(client)
    first = gangs.reserve(["n.gpu1"], 30)
    assert first is not None
    assert gangs.reserve(["n.gpu0", "n.gpu1", "n.gpu2"], 30) is None
    assert client.keys("*") == [keys.gang("n.gpu1").encode()]  # the free two were not taken
    assert client.get(keys.gang("n.gpu1")) == first.encode()
    second = gangs.reserve(["n.gpu0", "n.gpu2"], 30, owner="job/exp")
    assert second is not None and second.startswith("job/exp#")
    assert gangs.holders(["n.gpu0", "n.gpu1", "n.gpu2", "n.gpu3"]) == {
        "n.gpu0": "job/exp", "n.gpu1": first, "n.gpu2": "job/exp"}


def test_release_frees_only_what_the_token_holds(client: redis.Redis) -> None:
    gangs = GangReservations(client)
    mine = gangs.reserve(["n.gpu0", "n.gpu1"], 30)
    other = gangs.reserve(["n.gpu2"], 30)
    assert mine is not None and other is not None
    assert gangs.release(["n.gpu0", "n.gpu1", "n.gpu2", "n.gpu3"], mine) == 2
    assert client.keys("*") == [keys.gang("n.gpu2").encode()] and client.get(keys.gang("n.gpu2")) == other.encode()
    assert gangs.release(["n.gpu0", "n.gpu1"], mine) == 0
    assert gangs.release([], other) == 0 and client.exists(keys.gang("n.gpu2"))


def test_a_stale_token_cannot_release_or_keep(client: redis.Redis) -> None:
    gangs = GangReservations(client)
    stale = gangs.reserve(["n.gpu0", "n.gpu1"], 30)
    assert stale is not None
    client.delete(keys.gang("n.gpu0"), keys.gang("n.gpu1"))  # its lease lapsed: the slots are free ...
    fresh = gangs.reserve(["n.gpu0", "n.gpu1"], 20)  # ... and another launch takes them
    assert fresh is not None
    assert gangs.release(["n.gpu0", "n.gpu1"], stale) == 0
    assert gangs.keep("n.gpu0", stale, 90).held is False
    assert gangs.holds(["n.gpu0", "n.gpu1"], fresh) and not gangs.holds(["n.gpu0"], stale)
    assert client.get(keys.gang("n.gpu0")) == fresh.encode()
    assert _ttl_is_lease(client, "n.gpu0", 20_000)  # the stale renewal did not touch the new owner's lease


def test_keep_extends_only_its_own_slots_lease(client: redis.Redis) -> None:
    gangs = GangReservations(client)
    token = gangs.reserve(["n.gpu0", "n.gpu1"], 20)
    assert token is not None
    assert gangs.keep("n.gpu0", token, 120).held is True
    assert 110_000 < client.pttl(keys.gang("n.gpu0")) <= 120_000
    assert _ttl_is_lease(client, "n.gpu1", 20_000) and client.get(keys.gang("n.gpu0")) == token.encode()


def test_keep_retakes_a_slot_only_on_another_server(client: redis.Redis) -> None:
    gangs = GangReservations(client)
    token = gangs.reserve(["n.gpu0"], 30)
    assert token is not None
    server = gangs.keep("n.gpu0", token, 30).server
    assert re.fullmatch(r"[0-9a-f]{32}", server) and client.get(keys.SERVER_EPOCH) == server.encode()
    assert gangs.keep("n.gpu0", token, 30).server == server  # the same data: the same token
    client.delete(keys.gang("n.gpu0"))  # gone, as after a restart without the data ...
    assert gangs.keep("n.gpu0", token, 45, "0" * 32).held is True  # ... renewed last in other data
    assert gangs.holds(["n.gpu0"], token) and _ttl_is_lease(client, "n.gpu0", 45_000)
    client.delete(keys.gang("n.gpu0"))  # freed on the server the rank renewed on: lapsed or released
    assert gangs.keep("n.gpu0", token, 45, server).held is False
    assert gangs.keep("n.gpu0", token, 45).held is False  # never renewed before: nothing to take back
    assert not client.exists(keys.gang("n.gpu0"))


def test_a_renewal_after_stop_launch_released_the_slot_leaves_it_free(client: redis.Redis) -> None:
    gangs = GangReservations(client)
    token = gangs.reserve(["n.gpu0", "n.gpu1"], 30, owner="job/exp")
    assert token is not None
    lease = SlotLease(client, "n.gpu0", token, 0.03)
    assert lease.renew() is False and gangs.holds(["n.gpu0"], token)
    assert gangs.release(["n.gpu0", "n.gpu1"], token) == 2  # stop_launch gave the launch up
    time.sleep(0.02)  # the next renewal is due
    assert lease.renew() is True
    assert client.keys(keys.gang("*")) == []  # the dead launch holds nothing
    assert lease.renew() is True and client.keys(keys.gang("*")) == []


class _RestartableRedis:
    """A redis-server of this test's own on a unix socket, restarted without its data on demand."""

    def __init__(self, folder: Path) -> None:
        self.socket, self._folder, self._proc = str(folder / "r.sock"), folder, None

    def start(self) -> redis.Redis:
        self._proc = subprocess.Popen(
            ["redis-server", "--port", "0", "--unixsocket", self.socket, "--save", "", "--appendonly", "no",
             "--dir", str(self._folder)], stdout=subprocess.DEVNULL, preexec_fn=die_with_parent(signal.SIGTERM))
        probe = redis.Redis(unix_socket_path=self.socket)
        deadline = time.monotonic() + 20
        while True:
            try:
                probe.ping()
                return probe
            except redis.ConnectionError:
                assert time.monotonic() < deadline and self._proc.poll() is None, "redis-server did not start"
                time.sleep(0.02)

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None


def test_a_rank_takes_its_slot_back_at_the_first_poll_after_redis_lost_its_data(tmp_path: Path,
                                                                                monkeypatch) -> None:
    clock = [1000.0]  # the lease's own clock, moved by hand: a third of a 30 s lease is not waited out
    monkeypatch.setattr(gang, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    server = _RestartableRedis(tmp_path)
    try:
        client = server.start()
        token = GangReservations(client).reserve(["n.gpu0"], 30)
        assert token is not None
        lease = SlotLease(client, "n.gpu0", token, 30)  # renewed every 10 s
        assert lease.renew() is False
        clock[0] += 10.5
        server.stop()
        with pytest.raises(redis.ConnectionError):
            lease.renew()  # due, and Redis is away
        fresh = server.start()  # back without its data
        assert fresh.keys("*") == []
        fresh.set(keys.gang("n.gpu1"), "another#launch")  # another launch's renewal came first ...
        assert GangReservations(fresh).keep("n.gpu1", "another#launch", 30, "f" * 32).held  # ... and set the token
        clock[0] += SlotLease.RETRY_S + 0.1  # the next poll after the retry pause, not 10 s later
        assert lease.renew() is False
        assert fresh.get(keys.gang("n.gpu0")) == token.encode() and 20_000 < fresh.pttl(keys.gang("n.gpu0")) <= 30_000
    finally:
        server.stop()


def test_a_lapsed_lease_frees_the_slot(client: redis.Redis) -> None:
    gangs = GangReservations(client)
    assert gangs.reserve(["n.gpu0"], 0.2) is not None
    assert client.pttl(keys.gang("n.gpu0")) <= 200  # (-2 when already gone on a slow machine)
    deadline = time.monotonic() + 30
    while client.exists(keys.gang("n.gpu0")) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gangs.held(["n.gpu0"]) == set()
    assert gangs.reserve(["n.gpu0"], 30) is not None


def test_holds_needs_every_queue_held_by_the_token(client: redis.Redis) -> None:
    gangs = GangReservations(client)
    token = gangs.reserve(["n.gpu0", "n.gpu1"], 30)
    assert token is not None
    assert gangs.holds(["n.gpu1", "n.gpu0", "n.gpu0"], token)
    assert not gangs.holds(["n.gpu0", "n.gpu2"], token)  # one free
    client.set(keys.gang("n.gpu2"), "someone-else")
    assert not gangs.holds(["n.gpu2"], token) and not gangs.holds(["n.gpu0", "n.gpu2"], token)
    assert gangs.holds([], token)  # nothing asked, nothing lapsed


def test_holders_and_held_read_the_owner_part(client: redis.Redis) -> None:
    gangs = GangReservations(client)
    client.set(keys.gang("n.gpu0"), "job/a#0123")
    client.set(keys.gang("n.gpu1"), "#0456")  # a token with an empty owner part
    client.set(keys.gang("n.gpu2"), "bare")
    asked = ["n.gpu3", "n.gpu2", "n.gpu1", "n.gpu0", "n.gpu0"]
    assert gangs.holders(asked) == {"n.gpu0": "job/a", "n.gpu1": "?", "n.gpu2": "bare"}
    assert list(gangs.holders(asked)) == ["n.gpu0", "n.gpu1", "n.gpu2"]
    assert gangs.held(asked) == {"n.gpu0", "n.gpu1", "n.gpu2"}
    assert gangs.held([]) == set() and gangs.holders([]) == {}
    assert gangs.held(["n.gpu3"]) == set() and gangs.holders(["n.gpu3"]) == {}
