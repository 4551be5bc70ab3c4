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

import os
import random
import secrets
import shutil
import subprocess
import time
from dataclasses import dataclass

import psutil


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


# Own process spaces: a host whose processes cannot be reached from another "host" by PID.
#
# Network namespaces alone share one PID space, so a `kill` meant for node 2 works just as well
# from node 1: a test could not tell a clean-up that went over SSH to node 2 from one that wrongly
# ran on node 1. A host started with `own_processes` (a PID namespace with its own /proc, its first
# process as init) sees only its own processes, numbered its own way, as a real machine does; a
# pgid recorded on node 2 means nothing on node 1. Killing that init kills everything the host
# runs (the kernel does), which is also the teardown that leaves nothing behind.

def own_processes(host: Host) -> list[str]:
    """Prefix for the argv of a host's first process (its init): `host`'s network namespace, a new
    PID namespace with /proc mounted for it, and the init killed if `unshare` itself dies."""
    return ["ip", "netns", "exec", host.namespace, "unshare", "--pid", "--fork", "--mount-proc",
            "--kill-child"]


def init_of(unshare_pid: int, timeout: float = 10.0) -> int:
    """The root-namespace PID of the init `unshare --fork` started (its only child)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        children = psutil.Process(unshare_pid).children()
        if children:
            return children[0].pid
        time.sleep(0.05)
    raise RuntimeError(f"unshare {unshare_pid} started no init within {timeout}s")


def on_host(init_pid: int, argv: list[str], cwd: str) -> list[str]:
    """`argv` run as a process of the host whose init is `init_pid` (its network, PID and mount
    namespaces, so its /proc too), in `cwd` (entering a mount namespace resets the directory)."""
    return ["nsenter", "-t", str(init_pid), "-n", "-p", "-m", f"--wd={cwd}", *argv]


def processes_of(init_pid: int) -> list[int]:
    """Root-namespace PIDs of every process in the PID namespace of `init_pid`, init included."""
    try:
        space = os.readlink(f"/proc/{init_pid}/ns/pid")
    except OSError:
        return []
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.readlink(f"/proc/{entry}/ns/pid") == space:
                    found.append(int(entry))
            except OSError:
                continue
    return found
