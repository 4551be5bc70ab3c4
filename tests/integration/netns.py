"""Two "hosts" on one machine for integration tests: network namespaces joined by a veth pair.

Why namespaces: a multi-node bug (a rank that advertises 127.0.0.1, a worker that names the wrong
node, a rendezvous that only works while everything shares one network stack) stays invisible on
one host. Each namespace has its own interfaces, addresses and loopback, so a process on "node2"
reaches "node1" only across the veth link, as it would across a real network.

RULE: an address inside these namespaces is never contacted from the root namespace. There it is
not local, so it is routed to the default gateway and the traffic would leave the machine. Every
client for these addresses runs through `ip netns exec` (see `inside`).

Needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN) and iproute2; `NamespacesUnavailable` says why not.
"""
from __future__ import annotations

import random
import secrets
import shutil
import subprocess
from dataclasses import dataclass


class NamespacesUnavailable(Exception):
    """Network namespaces cannot be created here (not root, a restricted container, no iproute2)."""


@dataclass(frozen=True)
class Host:
    """One simulated host: its namespace, the veth end inside it, and its address on the link."""

    namespace: str
    link: str
    address: str


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=15)
    if done.returncode != 0:
        raise subprocess.CalledProcessError(done.returncode, ["ip", *args], done.stdout, done.stderr)


def _random_subnet() -> str:
    """The first three octets of a random 10.x.y.0/24, so parallel runs do not share one."""
    return f"10.{random.randint(1, 254)}.{random.randint(0, 255)}"


def create_two_hosts(prefix: str = "cat") -> tuple[Host, Host]:
    """Two namespaces with unique names, linked by a veth pair in a private /24, loopback up.

    Raises NamespacesUnavailable when the first namespace cannot be created; anything created
    before a later failure is deleted again, so a half-built pair never stays behind.
    """
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        raise NamespacesUnavailable("iproute2 (`ip`) and util-linux (`unshare`) are required")
    tag, subnet = secrets.token_hex(3), _random_subnet()
    hosts = tuple(Host(f"{prefix}_n{i}_{tag}", f"{prefix}_v{i}_{tag}", f"{subnet}.{i}") for i in (1, 2))
    try:
        _ip("netns", "add", hosts[0].namespace)
    except subprocess.CalledProcessError as exc:
        raise NamespacesUnavailable(f"`ip netns add` is not permitted here: {exc.stderr.strip()}") from None
    try:
        _ip("netns", "add", hosts[1].namespace)
        _ip("link", "add", hosts[0].link, "type", "veth", "peer", "name", hosts[1].link)
        for host in hosts:
            _ip("link", "set", host.link, "netns", host.namespace)
            _ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", host.link)
            _ip("-n", host.namespace, "link", "set", "lo", "up")
            _ip("-n", host.namespace, "link", "set", host.link, "up")
    except BaseException:
        delete_hosts(hosts)
        raise
    return hosts


def delete_hosts(hosts: tuple[Host, ...]) -> list[str]:
    """Delete the namespaces (their veth ends go with them); the names that could not be deleted."""
    left = []
    for host in hosts:
        done = subprocess.run(["ip", "netns", "del", host.namespace], capture_output=True, text=True,
                              timeout=15)
        if done.returncode != 0 and "No such file" not in done.stderr:
            left.append(host.namespace)
    _delete_stray_link(hosts[0].link)
    return left


def _delete_stray_link(link: str) -> None:
    """A veth end that never made it into its namespace is still in the root namespace."""
    subprocess.run(["ip", "link", "del", link], capture_output=True, timeout=15)


def namespace_exists(name: str) -> bool:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=15).stdout
    return any(line.split()[0] == name for line in listed.splitlines() if line.strip())


def inside(host: Host, argv: list[str]) -> list[str]:
    """`argv` run in `host`'s network namespace. `ip netns exec` execs it, so the PID is argv's own."""
    return ["ip", "netns", "exec", host.namespace, *argv]
