"""`python -m deploy redis-user`: the cluster's least-privilege Redis user, created on a running Redis.

Why: every node reaches the cluster's Redis with the URL in AUTOTUNE_REDIS_URL, and every slot worker
runs whatever command a job gives it. Connected as Redis's default user, one compromised node can run
`CONFIG SET dir`/`dbfilename` (make Redis write files where it likes), `MODULE LOAD`, `DEBUG` or
`FLUSHALL` (wipe every job). The URL's user should be able to do what Celery, kombu, Flower and this
project need and nothing else: every key and channel, every command but Redis's `@dangerous` category
(`scheduler.embedded.local_cluster.CLUSTER_USER_RULES`, the embedded cluster's own user). The README's recipe
writes that user into a new server's config; this creates it on a server that already runs.

The user and its password are AUTOTUNE_REDIS_URL's (`redis://autotune:PASSWORD@host:port/0`); the
connection allowed to create users is AUTOTUNE_REDIS_ADMIN_URL's (the admin: the default user with
the server's requirepass, or any user that may run ACL), also from the environment, never on a
command line. The rules are set from scratch (`ACL SETUSER <user> reset ...`), so running it again
takes back anything granted by hand. They are then kept across restarts where the server can keep
them (`ACL SAVE` with an aclfile, else `CONFIG REWRITE` with a config file), and checked as the user
itself: a key written and read, a Lua script run (Celery's result backend uses them), `CONFIG GET`
refused.

`deploy up` warns when the URL's user may still run CONFIG (`may_reconfigure`).
"""
from __future__ import annotations

from urllib.parse import urlparse

import redis

from deploy.plan import check_redis_url
from scheduler.errors import UsageError
from scheduler.embedded.local_cluster import cluster_user_rules
from workers.state import keys
from workers.state.redis_tls import describe_tls_failure
from workers.state.redis_url import masked_url
from workers.state.connection import connect

ADMIN_ENV = "AUTOTUNE_REDIS_ADMIN_URL"


def create_cluster_user(url: str, admin_url: str | None) -> str:
    """Create or reset the URL's user on its server with the cluster's rules (module docstring) and
    return one line saying what was done; UsageError naming the variable and the fix otherwise."""
    user, password = urlparse(url).username, urlparse(url).password
    if not user or user == "default":
        raise UsageError("AUTOTUNE_REDIS_URL names no user of its own (redis://:PASSWORD@... is Redis's "
                         "default user): name the cluster's user, redis://autotune:PASSWORD@HOST:PORT/0")
    if not password:
        raise UsageError("AUTOTUNE_REDIS_URL has no password for its user: generate one with `openssl rand -hex 16`")
    admin_url = check_redis_url(admin_url, ADMIN_ENV)
    if _server(admin_url) != _server(url):
        raise UsageError(f"{ADMIN_ENV} ({masked_url(admin_url)}) and AUTOTUNE_REDIS_URL ({masked_url(url)}) name "
                         "different servers: give the admin's URL of the cluster's own Redis")
    admin = connected(admin_url, ADMIN_ENV)
    try:
        admin.execute_command("ACL", "SETUSER", *_setuser_args(user, password))
    except redis.exceptions.NoPermissionError:
        raise UsageError(f"{ADMIN_ENV}'s user may not create users (ACL SETUSER refused): give the admin's "
                         "URL, redis://:ADMIN_PASSWORD@HOST:PORT/0 for the default user") from None
    kept = _persist(admin)
    _check_as_user(url)
    return (f"deploy: Redis user {user!r} ready on {_server(url)[1]}:{_server(url)[2]}: every key and channel, "
            f"no @dangerous command (CONFIG, MODULE, DEBUG, FLUSHALL, SHUTDOWN, ACL refused); {kept}")


def may_reconfigure(client: redis.Redis) -> bool:
    """Whether the connection's user may run CONFIG (a read is enough to tell; it changes nothing)."""
    try:
        client.execute_command("CONFIG", "GET", "maxmemory")
    except redis.exceptions.NoPermissionError:
        return False
    except redis.RedisError:
        return False  # renamed or disabled by the server's own config: not ours to judge
    return True


def _setuser_args(user: str, password: str) -> list[str]:
    name, *rules = cluster_user_rules(user, password)
    return [name, "reset", *rules]


def _server(url: str) -> tuple[str, str, int]:
    parsed = urlparse(url)
    return parsed.scheme, parsed.hostname or "", parsed.port or 6379


def connected(url: str, source: str = "AUTOTUNE_REDIS_URL") -> redis.Redis:
    """A client of the Redis at `url` that answered a PING, or one UsageError naming `source` (the
    variable the URL came from) and what went wrong: the credentials, TLS, or the address."""
    client = connect(url)
    try:
        client.ping()
    except redis.AuthenticationError:
        raise UsageError(f"Redis at {masked_url(url)} refused the credentials in {source}") from None
    except redis.RedisError as exc:
        raise UsageError(describe_tls_failure(exc) or f"cannot reach Redis at {masked_url(url)} ({source}): {exc}") from None
    return client


def _persist(admin: redis.Redis) -> str:
    """Keep the user across restarts where the server can; say where (or that it cannot)."""
    for command, where in ((("ACL", "SAVE"), "saved in the server's aclfile"),
                           (("CONFIG", "REWRITE"), "written into the server's config file")):
        try:
            admin.execute_command(*command)
            return where
        except redis.ResponseError:
            continue
    return ("the server has no aclfile or config file, so the user lasts until it restarts: add "
            "`user <name> on >PASSWORD ~* &* +@all -@dangerous` to the config it starts with")


def _check_as_user(url: str) -> None:
    """As the new user: a key written and read and a Lua script run work, CONFIG is refused."""
    client = connected(url)
    probe = keys.REDIS_USER_CHECK
    try:
        client.set(probe, "1", ex=10)
        ok = client.eval("return redis.call('GET', KEYS[1])", 1, probe) == b"1"
        client.delete(probe)
    except redis.RedisError as exc:
        raise UsageError(f"the new user cannot use Redis as the cluster does ({exc}): check the server's ACL "
                         "config for rules that override it") from None
    if not ok or may_reconfigure(client):
        raise UsageError("the new user can still run CONFIG or cannot read its own key: check the server's ACL "
                         "config for rules that override it")
