"""TLS to the cluster's Redis: which certificate files every connection uses, read from the environment.

Why: on a real cluster every node reaches the Redis that holds the jobs over the network, and the
slots run whatever command a job gives them. A `rediss://` URL makes every connection (Celery's
broker and result backend, our own clients through `workers.state.connection.connect`, Flower, `deploy`)
verify the server's certificate against a CA and its name against the URL's host, and present a
client certificate to a server that asks for one. The files come from the environment, like the URL
(never a command line, never a log):

    AUTOTUNE_REDIS_CA     the CA bundle that signed the server's certificate (required with rediss://)
    AUTOTUNE_REDIS_CERT   a client certificate, with
    AUTOTUNE_REDIS_KEY    its private key (both or neither; for a server with tls-auth-clients yes)

A missing or unreadable file, a certificate without its key, or these variables beside a plain
redis:// URL (which would send the password in clear while the user believes in TLS) are one
`TlsError` line naming the variable. Nothing here connects; `describe_tls_failure` turns the
handshake's own error into such a line when a connection is refused.
"""
from __future__ import annotations

import os
import ssl
import urllib.parse
from collections.abc import Mapping
from typing import Any

CA_ENV = "AUTOTUNE_REDIS_CA"
CERT_ENV = "AUTOTUNE_REDIS_CERT"
KEY_ENV = "AUTOTUNE_REDIS_KEY"
TLS_ENV = (CA_ENV, CERT_ENV, KEY_ENV)


class TlsError(ValueError):
    """The TLS settings cannot work; the message is one line naming the variable and the fix."""


def uses_tls(url: str) -> bool:
    return urllib.parse.urlsplit(url).scheme == "rediss"


def tls_files(url: str, environ: Mapping[str, str] | None = None) -> dict[str, str] | None:
    """The checked certificate paths for `url` ({"ca": ..., "cert": ..., "key": ...}, the last two
    only when set), or None for a URL without TLS. TlsError when they cannot work."""
    environ = os.environ if environ is None else environ
    given = {name: environ.get(name, "") for name in TLS_ENV}
    if not uses_tls(url):
        stray = [name for name, value in given.items() if value]
        if stray:
            raise TlsError(f"{stray[0]} is set but AUTOTUNE_REDIS_URL is not a rediss:// URL: the connection "
                           "would not use TLS; write the URL as rediss://... or unset " + " and ".join(stray))
        return None
    if not given[CA_ENV]:
        raise TlsError(f"{CA_ENV} is not set: a rediss:// URL needs the CA bundle that signed the server's "
                       f"certificate; export {CA_ENV}=/path/to/ca.crt")
    if bool(given[CERT_ENV]) != bool(given[KEY_ENV]):
        missing = KEY_ENV if given[CERT_ENV] else CERT_ENV
        raise TlsError(f"{missing} is not set: a client certificate needs both {CERT_ENV} and {KEY_ENV}")
    files = {"ca": given[CA_ENV]}
    if given[CERT_ENV]:
        files.update(cert=given[CERT_ENV], key=given[KEY_ENV])
    for role, path in files.items():
        name = {"ca": CA_ENV, "cert": CERT_ENV, "key": KEY_ENV}[role]
        if not os.path.isfile(path):
            raise TlsError(f"{name}={path}: no such file; give the path of the {_ROLES[role]}")
        if not os.access(path, os.R_OK):
            raise TlsError(f"{name}={path}: not readable by this user; fix its permissions")
    return files


_ROLES = {"ca": "CA bundle (PEM)", "cert": "client certificate (PEM)", "key": "client key (PEM)"}


def redis_options(url: str, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Keyword arguments for redis-py's `Redis.from_url(url, ...)`: certificate verification and
    the server's name checked against the URL's host; {} without TLS."""
    files = tls_files(url, environ)
    if files is None:
        return {}
    options: dict[str, Any] = {"ssl_cert_reqs": "required", "ssl_ca_certs": files["ca"], "ssl_check_hostname": True}
    if "cert" in files:
        options.update(ssl_certfile=files["cert"], ssl_keyfile=files["key"])
    return options


def celery_options(url: str, environ: Mapping[str, str] | None = None) -> dict[str, Any] | None:
    """`broker_use_ssl` / `redis_backend_use_ssl` for Celery and kombu (the same keys, with the
    `ssl` module's constant); None without TLS. kombu's transport and Celery's backend hand the dict
    to redis-py's SSLConnection as it is, and redis-py 5 checks the server's name only when asked
    (`ssl_check_hostname`): without it a certificate the CA signed for any other host is accepted."""
    files = tls_files(url, environ)
    if files is None:
        return None
    options: dict[str, Any] = {"ssl_cert_reqs": ssl.CERT_REQUIRED, "ssl_ca_certs": files["ca"],
                               "ssl_check_hostname": True}
    if "cert" in files:
        options.update(ssl_certfile=files["cert"], ssl_keyfile=files["key"])
    return options


def describe_tls_failure(error: BaseException) -> str | None:
    """One line for a refused TLS handshake found in `error` or its causes (None when it is not one):
    which variable to look at, with the reason the handshake gave."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        text = str(current)
        if isinstance(current, ssl.SSLCertVerificationError) or "CERTIFICATE_VERIFY_FAILED" in text:
            reason = getattr(current, "verify_message", None) or text
            if "hostname" in str(reason).lower() or "IP address mismatch" in str(reason):
                return (f"the Redis server's certificate does not name the host in AUTOTUNE_REDIS_URL ({reason}); "
                        "connect by a name the certificate holds, or reissue it with that name")
            return (f"the Redis server's certificate did not verify against {CA_ENV} ({reason}); give the CA "
                    "bundle that signed it")
        if isinstance(current, ssl.SSLError) or "SSL" in type(current).__name__:
            return (f"the TLS handshake with Redis failed ({text}); check {CA_ENV}, {CERT_ENV} and {KEY_ENV} "
                    "and that the server listens with TLS on that port")
        current = current.__cause__ or current.__context__
    return None
