"""Run `deploy.remote` on hosts: over SSH with fabric, or directly on this machine.

Why thin: every decision is in `deploy.plan`; this module only opens connections and carries a
command line (built with shlex quoting) and a stdin payload, and returns the host's JSON answer or
one line saying why there is none. User, port and key come from the SSH config (`~/.ssh/config`,
or the file given), as `ssh HOST` would use them. Host keys are checked against known_hosts
(the config's UserKnownHostsFile, else ~/.ssh/known_hosts); an unknown key is refused unless the
caller explicitly accepts new ones, which are then appended to that file under a lock. Fabric's
own default (paramiko's AutoAddPolicy) would trust any host silently, and it saves by rewriting
the whole file without a lock, so hosts first reached in parallel can lose each other's keys.
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import subprocess
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import paramiko
from fabric import Config, Connection
from paramiko.hostkeys import HostKeyEntry, HostKeys

from deploy.plan import is_local, remote_command

CONNECT_TIMEOUT_S = 10


@dataclass(frozen=True)
class Answer:
    """What one host replied: its JSON, or why there is none (`error`, one line)."""

    host: str
    data: object = None
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error


def local_names() -> set[str]:
    """Names under which this machine appears in a hostfile (handled without SSH)."""
    names = {socket.gethostname(), socket.getfqdn()}
    if os.environ.get("AUTOTUNE_NODE"):
        names.add(os.environ["AUTOTUNE_NODE"])
    return names


class Hosts:
    """Runs `deploy.remote` actions on named hosts, in parallel, one answer per host."""

    def __init__(self, repo: str, python: str, ssh_config: str | None = None,
                 accept_new_host_keys: bool = False, use_ssh_for_local: bool = False) -> None:
        self.repo, self.python = repo, python
        self.ssh_config = ssh_config or os.environ.get("AUTOTUNE_SSH_CONFIG") or None
        self.accept_new = accept_new_host_keys
        self.local = set() if use_ssh_for_local else local_names()

    def run(self, host: str, action: str, options: Sequence[str] = (), stdin: str | None = None,
            timeout: float = 120.0) -> Answer:
        if is_local(host, self.local):
            return self._run_here(host, action, options, stdin, timeout)
        return self._run_ssh(host, action, options, stdin, timeout)

    def run_many(self, calls: dict[str, tuple[str, Sequence[str], str | None]],
                 timeout: float = 120.0) -> dict[str, Answer]:
        """{host: (action, options, stdin)} run on all hosts at once."""
        if not calls:
            return {}
        with ThreadPoolExecutor(max_workers=min(32, len(calls))) as pool:
            futures = {host: pool.submit(self.run, host, action, options, stdin, timeout)
                       for host, (action, options, stdin) in calls.items()}
            return {host: future.result() for host, future in futures.items()}

    def _run_here(self, host: str, action: str, options: Sequence[str], stdin: str | None,
                  timeout: float) -> Answer:
        argv = [sys.executable, "-m", "deploy.remote", action, *options]
        try:
            done = subprocess.run(argv, cwd=self.repo, input=stdin or "", capture_output=True,
                                  text=True, timeout=timeout)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return Answer(host, error=f"{type(exc).__name__}: {exc}")
        return _answer(host, done.returncode, done.stdout, done.stderr)

    def _run_ssh(self, host: str, action: str, options: Sequence[str], stdin: str | None,
                 timeout: float) -> Answer:
        import io

        try:
            conn = self.connection(host)
            with conn:
                result = conn.run(remote_command(self.python, self.repo, action, options), hide=True,
                                  warn=True, in_stream=io.StringIO(stdin or ""), timeout=timeout)
            return _answer(host, result.exited, result.stdout, result.stderr)
        except paramiko.SSHException as exc:
            return Answer(host, error=_ssh_problem(exc))
        except (OSError, socket.timeout, EOFError) as exc:
            return Answer(host, error=f"cannot connect over SSH: {type(exc).__name__}: {exc}")
        except Exception as exc:  # invoke's CommandTimedOut and friends: one line per host
            return Answer(host, error=f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1:]}")

    def connection(self, host: str) -> Connection:
        config = Config(runtime_ssh_path=self.ssh_config) if self.ssh_config else Config()
        conn = Connection(host, config=config, connect_timeout=CONNECT_TIMEOUT_S,
                          connect_kwargs={"allow_agent": True})
        known = Path(conn.ssh_config.get("userknownhostsfile", "~/.ssh/known_hosts").split()[0]).expanduser()
        if self.accept_new:
            known.parent.mkdir(parents=True, exist_ok=True)
            known.touch(mode=0o600, exist_ok=True)
            conn.client.set_missing_host_key_policy(AppendNewHostKey(known))
        else:
            conn.client.set_missing_host_key_policy(paramiko.RejectPolicy())
        if known.is_file():
            conn.client.load_host_keys(str(known))
        return conn


class AppendNewHostKey(paramiko.MissingHostKeyPolicy):
    """Trusts a host key seen for the first time and appends it to known_hosts.

    Why not paramiko's AutoAddPolicy: it re-reads the file, then truncates and rewrites it whole,
    with no lock. When `deploy up` reaches new hosts in parallel, one connection can read while
    another has just truncated, and its rewrite drops that host's key; the next command then
    refuses the host. Here the file is re-read under an exclusive lock and only the new line is
    appended; a different key recorded meanwhile for the same host is refused.
    """

    def __init__(self, known_hosts: Path) -> None:
        self.known_hosts = known_hosts

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        with open(self.known_hosts, "a+") as file:
            fcntl.flock(file, fcntl.LOCK_EX)
            file.seek(0)
            text = file.read()
            known = HostKeys(str(self.known_hosts)).lookup(hostname) or {}
            if key.get_name() in known and known[key.get_name()] != key:
                raise paramiko.BadHostKeyException(hostname, key, known[key.get_name()])
            if key.get_name() not in known:
                file.write(("" if not text or text.endswith("\n") else "\n")
                           + HostKeyEntry([hostname], key).to_line())
        client.get_host_keys().add(hostname, key.get_name(), key)


def _ssh_problem(exc: paramiko.SSHException) -> str:
    text = str(exc)
    if "not found in known_hosts" in text:
        return (f"host key not in known_hosts ({text}); check it and add it (ssh-keyscan), or pass "
                "--accept-new-host-keys")
    if isinstance(exc, paramiko.BadHostKeyException):
        return f"host key CHANGED ({text}); refusing to connect"
    if isinstance(exc, paramiko.AuthenticationException):
        return f"SSH authentication failed ({text}): check User/IdentityFile in the SSH config"
    return f"SSH error: {text}"


def _answer(host: str, exit_code: int, stdout: str, stderr: str) -> Answer:
    lines = [line for line in stdout.splitlines() if line.strip()]
    if exit_code == 0 and lines:
        try:
            return Answer(host, json.loads(lines[-1]))
        except ValueError:
            pass
    tail = (stderr.strip().splitlines() or lines or ["no output"])[-1]
    return Answer(host, error=f"deploy.remote exited {exit_code}: {tail[:300]}")
