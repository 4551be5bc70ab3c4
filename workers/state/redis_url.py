"""The cluster's Redis URL (AUTOTUNE_REDIS_URL): one check of what may be used, one way to show it.

Why one module: the commands (`scheduler.launch.environment`), `python -m deploy` and the workers
at start-up (`deploy.plan`) all read the same URL, and a URL one of them accepts and another refuses
is a cluster that half starts. So the rules are written once, here; what differs between callers is
a policy, passed as a parameter and named where it is chosen:

- the rules: set; no blank or control character; a URL `urllib` can split; scheme redis://,
  rediss:// or unix://; a unix:// URL names its socket path, any other a host, a port 1-65535 and a
  numeric database (in the path or `?db=`); the Redis client accepts it; its TLS files can work
  (`workers.state.redis_tls`);
- `allow_unix`: False where the URL crosses hosts (a socket is one machine's);
- `allow_empty_password`: False where an empty password (`redis://:@host`, what an unset
  `$REDIS_PASSWORD` expands to) would reach a cluster's Redis: it means no password at all.

Every message shows the URL through `masked_url`, so a password never reaches a terminal or a log.
"""
from __future__ import annotations

import urllib.parse

from workers.state.redis_tls import TlsError, tls_files

REDIS_URL_VARIABLE = "AUTOTUNE_REDIS_URL"
REDIS_SCHEMES = ("redis", "rediss", "unix")
EXAMPLE = "redis://:PASSWORD@HOST:PORT/0"


class RedisUrlError(ValueError):
    """A Redis URL that cannot be used; the message names the variable and the fix, the password masked."""


def masked_url(url: str) -> str:
    """The URL with its password (or a bare user info, which may be a token) replaced by ***."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url if "@" not in url else "***@" + url.rsplit("@", 1)[1]
    netloc, slash, path = rest.partition("/")
    if "@" in netloc:
        userinfo, host = netloc.rsplit("@", 1)
        user = userinfo.split(":", 1)[0]
        netloc = f"{user}:***@{host}" if ":" in userinfo else f"***@{host}"
    return f"{scheme}://{netloc}{slash}{path}"


def check_redis_url(url: str | None, name: str = REDIS_URL_VARIABLE, *, allow_unix: bool = True,
                    allow_empty_password: bool = True, hint: str = "") -> str:
    """`url` if it passes the rules above under this policy; otherwise RedisUrlError naming `name`.
    `hint` ends each message about the URL's form (what else the caller's user may do)."""
    if not url:
        raise RedisUrlError(f"{name} is not set: export {name}={EXAMPLE} (see docs/cluster.md)")
    schemes = REDIS_SCHEMES if allow_unix else tuple(s for s in REDIS_SCHEMES if s != "unix")

    def bad(problem: str) -> RedisUrlError:
        return RedisUrlError(f"{name} ({masked_url(url)}): {problem}; write it as {EXAMPLE}"
                             + (f", {hint}" if hint else ""))

    if any(ord(char) < 33 or ord(char) == 127 for char in url):
        raise bad("contains a blank or control character")
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError as exc:
        raise bad(f"not a valid URL ({exc})") from None
    try:
        port = parts.port
    except ValueError as exc:
        raise bad(f"not a valid URL: the port must be a number from 1 to 65535 ({exc})") from None
    if parts.scheme not in schemes:
        raise bad(f"not a Redis URL: the scheme must be one of {', '.join(s + '://' for s in schemes)}")
    if parts.scheme == "unix":
        if not parts.path:
            raise bad("a unix:// URL needs the socket path")
    else:
        if not parts.hostname:
            raise bad("no host name")
        if port == 0:
            raise bad("port 0 is not a port; use 1-65535")
        database = parts.path.lstrip("/")
        if database and not (database.isdigit() and database.isascii()):
            raise bad(f"the database {database!r} is not a number")
    if any(not (db.isdigit() and db.isascii()) for db in urllib.parse.parse_qs(parts.query).get("db", [])):
        raise bad("the db= parameter is not a number")
    if not allow_empty_password and parts.password == "":
        raise RedisUrlError(f"{name} has an empty password (is REDIS_PASSWORD set?): generate one with "
                            "`openssl rand -hex 16` and give it to redis-server --requirepass")
    import redis  # the client parses the URL as every connection will

    try:
        redis.ConnectionPool.from_url(url)
    except (ValueError, TypeError) as exc:
        raise bad(f"the Redis client refuses it ({exc})") from None
    try:
        tls_files(url)
    except TlsError as exc:
        raise RedisUrlError(str(exc)) from None
    return url

