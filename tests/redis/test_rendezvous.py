"""Where the ranks of one experiment meet (`workers.state.rendezvous`), against a real redis-server: what rank 0
leaves in Redis, what each waiting rank takes, and a rank that hears nothing giving up on time while
its lease keeps being renewed."""
from __future__ import annotations

import socket
import threading
import time

import redis

from workers.state import keys
from workers.state import rendezvous
from workers.state.rendezvous import KEY_TTL_S, ephemeral_range, free_port, publish, rendezvous_ports, wait


def test_free_port_can_be_bound_on_the_address() -> None:
    port = free_port("127.0.0.1")
    assert 1024 <= port <= 65535
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_the_port_is_drawn_outside_the_kernels_ephemeral_range() -> None:
    """Between rank 0's pick and the TCPStore's bind, an outgoing connection can take
    an ephemeral port; the kernel never hands out the ports below its range on its own."""
    low, high = ephemeral_range()
    ports = {free_port("127.0.0.1") for _ in range(20)}
    assert all(not low <= port <= high for port in ports), (low, high, sorted(ports))
    assert rendezvous_ports((32768, 60999)) == range(20000, 32768)  # Linux's default
    assert rendezvous_ports((1024, 50000)) == range(50001, 65536)  # a range that starts low
    assert rendezvous_ports((1024, 65000)) == range(0)  # no room: the kernel picks, as before


def test_a_taken_port_is_not_given(monkeypatch) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        taken.listen()
        monkeypatch.setattr(rendezvous, "rendezvous_ports", lambda ephemeral: range(port, port + 1))
        assert free_port("127.0.0.1") != port


def test_rank_0_leaves_one_address_per_waiting_rank_with_a_ttl(client: redis.Redis) -> None:
    publish(client, "attempt-1", "10.0.0.7", 29500, waiting_ranks=3)
    key = keys.rendezvous("attempt-1")
    assert client.lrange(key, 0, -1) == [b"10.0.0.7:29500"] * 3
    assert KEY_TTL_S - 5 <= client.ttl(key) <= KEY_TTL_S


def test_a_single_rank_experiment_leaves_nothing(client: redis.Redis) -> None:
    publish(client, "attempt-1", "10.0.0.7", 29500, waiting_ranks=0)
    assert client.keys("*") == []


def test_each_waiting_rank_takes_one_address_ipv6_included(client: redis.Redis) -> None:
    publish(client, "a", "::1", 41000, waiting_ranks=2)
    assert wait(client, "a", timeout_s=5) == ("::1", 41000)
    assert wait(client, "a", timeout_s=5) == ("::1", 41000)
    assert not client.exists(keys.rendezvous("a"))  # all taken
    assert wait(client, "other-attempt", timeout_s=1) is None  # attempts never share addresses


def test_a_rank_waiting_before_rank_0_publishes_is_woken(client: redis.Redis) -> None:
    got: list[tuple[str, int] | None] = []
    waiter = threading.Thread(target=lambda: got.append(wait(client, "late", timeout_s=30)))
    waiter.start()
    time.sleep(0.5)
    publish(client, "late", "10.0.0.9", 29600, waiting_ranks=1)
    waiter.join(timeout=30)
    assert got == [("10.0.0.9", 29600)]


def test_a_rank_that_hears_nothing_gives_up_and_keeps_its_lease_meanwhile(client: redis.Redis) -> None:
    renewals: list[float] = []
    started = time.monotonic()
    assert wait(client, "silent", timeout_s=3, keep_alive=lambda: renewals.append(time.monotonic()),
                every_s=1) is None
    waited = time.monotonic() - started
    assert 3 <= waited < 3 + 5  # gives up after the timeout, give or take one blocking pop
    assert len(renewals) >= 2  # renewed every second or so (a loaded machine may stretch a pop), not once
    assert renewals[0] - started < 0.5


def test_ranks_start_together_once_every_rank_has_arrived(client: redis.Redis) -> None:
    """After their ops are built (workers.slot.op_prebuild) the ranks of one launch wait for each other, so
    no rank's time limit runs while a peer node still compiles: none passes before the last arrives."""
    passed: list[float] = []

    def rank(delay: float) -> None:
        time.sleep(delay)
        assert rendezvous.all_arrived(client, "att:ops", 3, timeout_s=10, every_s=0.05)
        passed.append(time.monotonic())

    last_arrives = time.monotonic() + 0.6
    threads = [threading.Thread(target=rank, args=(d,)) for d in (0.0, 0.3, 0.6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(passed) == 3 and min(passed) >= last_arrives - 0.05
    assert 0 < client.ttl(keys.rendezvous("att:ops")) <= KEY_TTL_S


def test_a_rank_waiting_for_its_peers_stops_when_told_or_on_time(client: redis.Redis) -> None:
    started = time.monotonic()
    assert not rendezvous.all_arrived(client, "att2:ops", 2, timeout_s=0.5, every_s=0.05)  # the peer never came
    assert 0.45 <= time.monotonic() - started < 10  # returned at its limit, not at a later one (load slows it)
    calls = []
    assert not rendezvous.all_arrived(client, "att3:ops", 2, timeout_s=30,
                                      keep_alive=lambda: calls.append(1) or len(calls) > 3, every_s=0.05)
    assert len(calls) == 4  # a peer failed (the abort key): stop at once, not at the timeout
