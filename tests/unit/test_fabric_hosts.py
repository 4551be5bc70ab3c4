"""Accepting new host keys: every key reached in parallel is kept, none is trusted twice.

The two-host deploy test once lost node 2's key in CI: `deploy up` reached both hosts at once, and
paramiko's AutoAddPolicy rewrites known_hosts whole with no lock, so one connection's rewrite dropped
the other's key and the next `deploy status` refused node 2. The threaded test fails every time
against that policy; the others pin what an accepted key leaves in the file, on real files and keys.
"""
from __future__ import annotations

import threading

import paramiko
import pytest
from paramiko.hostkeys import HostKeys

from deploy.fabric_hosts import AppendNewHostKey


def _client_that_loaded(known_hosts) -> paramiko.SSHClient:
    """An SSH client as `Hosts.connection` leaves it: known_hosts loaded before connecting."""
    client = paramiko.SSHClient()
    client.load_host_keys(str(known_hosts))
    return client


def _recorded(known_hosts) -> dict[str, str]:
    keys = HostKeys(str(known_hosts))
    return {host: keys[host]["ecdsa-sha2-nistp256"].get_base64() for host in keys.keys()}


@pytest.fixture
def known_hosts(tmp_path):
    path = tmp_path / "known_hosts"
    path.touch(mode=0o600)
    return path


def test_two_connections_that_loaded_the_same_file_keep_both_keys(known_hosts):
    key1, key2 = paramiko.ECDSAKey.generate(), paramiko.ECDSAKey.generate()
    first, second = _client_that_loaded(known_hosts), _client_that_loaded(known_hosts)
    policy = AppendNewHostKey(known_hosts)

    policy.missing_host_key(first, "[10.0.0.1]:2222", key1)
    policy.missing_host_key(second, "[10.0.0.2]:2222", key2)

    assert _recorded(known_hosts) == {"[10.0.0.1]:2222": key1.get_base64(),
                                      "[10.0.0.2]:2222": key2.get_base64()}
    assert first.get_host_keys().lookup("[10.0.0.1]:2222")["ecdsa-sha2-nistp256"] == key1


def test_many_threads_appending_at_once_lose_no_key(known_hosts):
    keys = {f"[10.0.1.{n}]:22": paramiko.ECDSAKey.generate() for n in range(8)}
    clients = {host: _client_that_loaded(known_hosts) for host in keys}
    policy, start = AppendNewHostKey(known_hosts), threading.Barrier(len(keys))
    failures = []

    def accept(host):
        try:
            start.wait()
            policy.missing_host_key(clients[host], host, keys[host])
        except Exception as exc:
            failures.append(exc)

    threads = [threading.Thread(target=accept, args=(host,)) for host in keys]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert failures == []
    assert _recorded(known_hosts) == {host: key.get_base64() for host, key in keys.items()}
    assert len(known_hosts.read_text().splitlines()) == len(keys)


def test_a_key_recorded_meanwhile_is_not_written_twice(known_hosts):
    key = paramiko.ECDSAKey.generate()
    late = _client_that_loaded(known_hosts)  # loaded before the other connection recorded the key
    AppendNewHostKey(known_hosts).missing_host_key(_client_that_loaded(known_hosts), "nodeA", key)

    AppendNewHostKey(known_hosts).missing_host_key(late, "nodeA", key)

    assert known_hosts.read_text().count("nodeA ") == 1
    assert late.get_host_keys().lookup("nodeA")["ecdsa-sha2-nistp256"] == key


def test_a_different_key_recorded_meanwhile_is_refused(known_hosts):
    genuine, other = paramiko.ECDSAKey.generate(), paramiko.ECDSAKey.generate()
    late = _client_that_loaded(known_hosts)
    AppendNewHostKey(known_hosts).missing_host_key(_client_that_loaded(known_hosts), "nodeA", genuine)
    before = known_hosts.read_text()

    with pytest.raises(paramiko.BadHostKeyException):
        AppendNewHostKey(known_hosts).missing_host_key(late, "nodeA", other)

    assert known_hosts.read_text() == before
    assert late.get_host_keys().lookup("nodeA") is None


def test_a_file_without_a_final_newline_gets_one_before_the_new_line(known_hosts):
    old, new = paramiko.ECDSAKey.generate(), paramiko.ECDSAKey.generate()
    known_hosts.write_text(f"nodeA ecdsa-sha2-nistp256 {old.get_base64()}")

    AppendNewHostKey(known_hosts).missing_host_key(_client_that_loaded(known_hosts), "nodeB", new)

    assert _recorded(known_hosts) == {"nodeA": old.get_base64(), "nodeB": new.get_base64()}
