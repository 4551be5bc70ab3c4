"""`python -m deploy redis-user` against real redis-servers: the cluster's user is
created from AUTOTUNE_REDIS_URL with the admin's AUTOTUNE_REDIS_ADMIN_URL, can do what the cluster
does (keys, Lua, a real Celery round trip is test_embedded_cluster's), is refused CONFIG, FLUSHALL
and the rest of @dangerous, survives a restart where the server has a config file, and a rerun takes
back what was granted by hand. Bad input: one `error:` line naming the variable, exit 2."""
from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from deploy.redis_user import may_reconfigure
from integration_helpers import ROOT, wait_for
from scheduler.embedded.local_cluster import free_tcp_port

pytestmark = pytest.mark.integration


class Server:
    """A redis-server whose default user has the admin password; with or without a config file."""

    def __init__(self, tmp: Path, config_file: bool) -> None:
        self.port, self.admin_password = free_tcp_port(), secrets.token_hex(8)
        self.tmp, self.config_file = tmp, config_file
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        text = f'port {self.port}\nbind 127.0.0.1\nrequirepass "{self.admin_password}"\nsave ""\ndir {self.tmp}\n'
        if self.config_file:
            path = self.tmp / "redis.conf"
            if not path.exists():
                path.write_text(text)
            self.proc = subprocess.Popen(["redis-server", str(path)], stdout=subprocess.DEVNULL, start_new_session=True)
        else:
            self.proc = subprocess.Popen(["redis-server", "-"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                         start_new_session=True)
            self.proc.stdin.write(text.encode())
            self.proc.stdin.close()
        admin = redis.Redis(port=self.port, password=self.admin_password, socket_timeout=5)
        wait_for(admin.ping, 10, "redis-server")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def url(self, user: str, password: str) -> str:
        return f"redis://{user}:{password}@127.0.0.1:{self.port}/0"


@pytest.fixture(params=[True, False], ids=["config-file", "config-on-stdin"])
def server(request, tmp_path: Path):
    srv = Server(tmp_path, request.param)
    srv.start()
    yield srv
    srv.stop()


def redis_user(env_extra: dict[str, str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUTOTUNE_REDIS")}
    env.update(env_extra)
    return subprocess.run([sys.executable, "-m", "deploy", "redis-user"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)


def test_the_cluster_user_can_work_and_cannot_take_over_the_server(server: Server) -> None:
    password = secrets.token_hex(8)
    url, admin_url = server.url("autotune", password), server.url("default", server.admin_password)
    done = redis_user({"AUTOTUNE_REDIS_URL": url, "AUTOTUNE_REDIS_ADMIN_URL": admin_url})
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"deploy: Redis user 'autotune' ready on 127.0.0.1:{server.port}: ")
    assert password not in done.stdout + done.stderr and server.admin_password not in done.stdout + done.stderr
    kept = "written into the server's config file" if server.config_file else "lasts until it restarts"
    assert kept in done.stdout

    user = redis.Redis.from_url(url, socket_timeout=5)
    user.set("k", "v")
    assert user.eval("return redis.call('GET', KEYS[1])", 1, "k") == b"v"
    assert user.publish("autotune:events", "x") == 0  # channels: Celery's events and our job events
    for command in (("CONFIG", "SET", "dir", "/tmp"), ("FLUSHALL",), ("SHUTDOWN",), ("ACL", "LIST"),
                    ("MODULE", "LIST"), ("KEYS", "*")):  # DEBUG: Redis 7 refuses it to everyone by default
        with pytest.raises(redis.exceptions.NoPermissionError):
            user.execute_command(*command)
    assert not may_reconfigure(user)
    assert may_reconfigure(redis.Redis.from_url(admin_url, socket_timeout=5))

    admin = redis.Redis.from_url(admin_url, socket_timeout=5)
    admin.execute_command("ACL", "SETUSER", "autotune", "+config", ">leaked-password")  # granted by hand ...
    assert may_reconfigure(user)
    assert redis.Redis.from_url(server.url("autotune", "leaked-password"), socket_timeout=5).ping()
    assert redis_user({"AUTOTUNE_REDIS_URL": url, "AUTOTUNE_REDIS_ADMIN_URL": admin_url}).returncode == 0
    assert not may_reconfigure(user)  # ... and taken back by a rerun, the extra password too
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(server.url("autotune", "leaked-password"), socket_timeout=5).ping()

    if server.config_file:  # kept across a restart
        server.stop()
        server.start()
        restarted = redis.Redis.from_url(url, socket_timeout=5)
        assert restarted.ping() and not may_reconfigure(restarted)


@pytest.mark.parametrize(
    ("url_user", "admin", "message"),
    [("", "admin", "AUTOTUNE_REDIS_URL names no user of its own"),
     ("autotune", None, "AUTOTUNE_REDIS_ADMIN_URL is not set"),
     ("autotune", "wrong", "refused the credentials in AUTOTUNE_REDIS_ADMIN_URL"),
     ("autotune", "not-admin", "AUTOTUNE_REDIS_ADMIN_URL's user may not create users")],
    ids=["no-user", "no-admin-url", "wrong-admin-password", "admin-without-acl"],
)
def test_bad_input_is_one_line_naming_the_variable(tmp_path: Path, url_user: str, admin: str | None,
                                                   message: str) -> None:
    srv = Server(tmp_path, config_file=False)
    srv.start()
    try:
        env = {"AUTOTUNE_REDIS_URL": srv.url(url_user, "pw" + secrets.token_hex(4))}
        if admin == "admin":
            env["AUTOTUNE_REDIS_ADMIN_URL"] = srv.url("default", srv.admin_password)
        elif admin == "wrong":
            env["AUTOTUNE_REDIS_ADMIN_URL"] = srv.url("default", "not-the-password")
        elif admin == "not-admin":
            weak = secrets.token_hex(8)
            redis.Redis(port=srv.port, password=srv.admin_password).execute_command(
                "ACL", "SETUSER", "weak", "on", f">{weak}", "~*", "+@all", "-@dangerous")
            env["AUTOTUNE_REDIS_ADMIN_URL"] = srv.url("weak", weak)
        done = redis_user(env)
        assert done.returncode == 2, done.stdout + done.stderr
        lines = done.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], done.stderr
    finally:
        srv.stop()
