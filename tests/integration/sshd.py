"""A private sshd on a loopback port for tests: key auth only, its own config, keys and known_hosts.

Why a real sshd: `python -m deploy` must work through fabric exactly as on a cluster (host key
checks, a session that ends while the workers it started keep running); a mock would prove none
of it. `StrictModes no` because the keys live in a temporary folder, which sshd would refuse.
Stopped by PID.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

SSHD = "/usr/sbin/sshd"


@dataclass
class TestSshd:
    """A running sshd: where it listens, the client key, and the files a client config needs."""

    __test__ = False  #: a helper, not a test class, when a test module imports it

    port: int
    folder: Path
    key: Path
    proc: subprocess.Popen

    def ssh_config(self, aliases: dict[str, tuple[str, int]], known_hosts: Path) -> Path:
        """An SSH client config naming each alias's HostName and Port, with this key and known_hosts."""
        lines = []
        for alias, (address, port) in aliases.items():
            lines += [f"Host {alias}", f"    HostName {address}", f"    Port {port}", "    User root",
                      f"    IdentityFile {self.key}", "    IdentitiesOnly yes",
                      f"    UserKnownHostsFile {known_hosts}", ""]
        path = self.folder / "ssh_config"
        path.write_text("\n".join(lines))
        return path

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_sshd(folder: Path, port: int, listen: str = "127.0.0.1", wrap: list[str] | None = None,
               authorize: Path | None = None) -> TestSshd:
    """sshd in the foreground (-D) on `listen:port`; `wrap` prefixes its argv (e.g. `ip netns exec`).

    `authorize`: a public key to accept instead of this folder's own client key, so one client key
    (one SSH config) reaches several test sshds, as one operator's key reaches every cluster node."""
    folder.mkdir(parents=True, exist_ok=True)
    Path("/run/sshd").mkdir(exist_ok=True)
    for name in ("host_ed25519", "id_ed25519"):
        if not (folder / name).exists():
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(folder / name)], check=True)
    (folder / "authorized_keys").write_text((authorize or folder / "id_ed25519.pub").read_text())
    os.chmod(folder / "authorized_keys", 0o600)
    config = folder / "sshd_config"
    config.write_text("\n".join([
        f"Port {port}", f"ListenAddress {listen}", f"HostKey {folder / 'host_ed25519'}",
        f"PidFile {folder / 'sshd.pid'}", f"AuthorizedKeysFile {folder / 'authorized_keys'}",
        "PubkeyAuthentication yes", "PasswordAuthentication no", "KbdInteractiveAuthentication no",
        "PermitRootLogin prohibit-password", "UsePAM no", "StrictModes no", "AcceptEnv no", ""]))
    subprocess.run([SSHD, "-t", "-f", str(config)], check=True)
    proc = subprocess.Popen([*(wrap or []), SSHD, "-D", "-e", "-f", str(config)],
                            stdout=open(folder / "sshd.log", "ab"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    time.sleep(0.3)
    if proc.poll() is not None:
        raise RuntimeError(f"sshd exited: {(folder / 'sshd.log').read_text()[-500:]}")
    return TestSshd(port, folder, folder / "id_ed25519", proc)
