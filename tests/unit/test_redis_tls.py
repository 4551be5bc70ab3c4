"""Which certificate files a Redis connection uses (workers.state.redis_tls): read from the environment,
checked before anything connects, one line naming the variable when they cannot work."""
from __future__ import annotations

import os
import re
import ssl
from pathlib import Path

import pytest

from workers.state.redis_tls import CA_ENV, CERT_ENV, KEY_ENV, TlsError, celery_options, describe_tls_failure, redis_options

TLS = "rediss://:pw@redis.example:6380/0"
PLAIN = "redis://:pw@redis.example:6379/0"


@pytest.fixture
def files(tmp_path: Path) -> dict[str, str]:
    for name in ("ca.crt", "client.crt", "client.key"):
        (tmp_path / name).write_text("PEM")
    return {CA_ENV: str(tmp_path / "ca.crt"), CERT_ENV: str(tmp_path / "client.crt"), KEY_ENV: str(tmp_path / "client.key")}


def test_rediss_verifies_the_server_and_presents_the_client_certificate(files: dict[str, str]) -> None:
    assert redis_options(TLS, files) == {"ssl_cert_reqs": "required", "ssl_ca_certs": files[CA_ENV],
                                         "ssl_check_hostname": True, "ssl_certfile": files[CERT_ENV],
                                         "ssl_keyfile": files[KEY_ENV]}
    assert celery_options(TLS, files) == {"ssl_cert_reqs": ssl.CERT_REQUIRED, "ssl_ca_certs": files[CA_ENV],
                                          "ssl_check_hostname": True,  # redis-py 5 checks no name unless asked
                                          "ssl_certfile": files[CERT_ENV], "ssl_keyfile": files[KEY_ENV]}
    only_ca = {CA_ENV: files[CA_ENV]}
    assert redis_options(TLS, only_ca) == {"ssl_cert_reqs": "required", "ssl_ca_certs": files[CA_ENV],
                                           "ssl_check_hostname": True}


def test_plain_redis_uses_no_tls() -> None:
    assert redis_options(PLAIN, {}) == {} and celery_options(PLAIN, {}) is None


@pytest.mark.parametrize(
    ("url", "drop", "replace", "message"),
    [
        (TLS, (CA_ENV,), {}, f"{CA_ENV} is not set: a rediss:// URL needs the CA bundle"),
        (TLS, (KEY_ENV,), {}, f"{KEY_ENV} is not set: a client certificate needs both"),
        (TLS, (CERT_ENV,), {}, f"{CERT_ENV} is not set: a client certificate needs both"),
        (TLS, (), {CA_ENV: "/nonexistent/ca.crt"}, f"{CA_ENV}=/nonexistent/ca.crt: no such file"),
        (TLS, (), {KEY_ENV: "/nonexistent/k"}, f"{KEY_ENV}=/nonexistent/k: no such file"),
        (PLAIN, (CERT_ENV, KEY_ENV), {}, f"{CA_ENV} is set but AUTOTUNE_REDIS_URL is not a rediss:// URL"),
    ],
    ids=["no-ca", "cert-without-key", "key-without-cert", "missing-ca", "missing-key", "tls-files-with-plain-url"],
)
def test_settings_that_cannot_work_name_the_variable(files: dict[str, str], url: str, drop: tuple[str, ...],
                                                     replace: dict[str, str], message: str) -> None:
    environ = {k: v for k, v in files.items() if k not in drop} | replace
    with pytest.raises(TlsError, match="^" + re.escape(message)):
        redis_options(url, environ)


def test_a_file_this_user_cannot_read_is_named(files: dict[str, str]) -> None:
    Path(files[CA_ENV]).chmod(0)
    try:
        if os.access(files[CA_ENV], os.R_OK):
            pytest.skip("running as a user who reads every file (root)")
        with pytest.raises(TlsError, match="not readable by this user"):
            redis_options(TLS, files)
    finally:
        Path(files[CA_ENV]).chmod(0o644)


def _chained(outer: BaseException, inner: BaseException) -> BaseException:
    outer.__cause__ = inner
    return outer


@pytest.mark.parametrize(
    ("error", "needle"),
    [
        (_chained(ConnectionError("Error 1 connecting"), ssl.SSLCertVerificationError(
            1, "[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed: unable to get local issuer certificate")),
         f"did not verify against {CA_ENV}"),
        (ConnectionError("Error 1 connecting to localhost:6380. [SSL: CERTIFICATE_VERIFY_FAILED] certificate verify "
                         "failed: IP address mismatch, certificate is not valid for '127.0.0.1'. (_ssl.c:1006)."),
         "does not name the host in AUTOTUNE_REDIS_URL"),
        (ConnectionError("Error 1 connecting to h:6380. [SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed: "
                         "Hostname mismatch, certificate is not valid for 'h'. (_ssl.c:1006)."),
         "does not name the host"),
        (_chained(ConnectionError("x"), ssl.SSLError(1, "[SSL: WRONG_VERSION_NUMBER] wrong version number")),
         "the TLS handshake with Redis failed"),
    ],
    ids=["unknown-issuer", "ip-mismatch", "hostname-mismatch", "not-tls"],
)
def test_a_refused_handshake_is_one_line(error: BaseException, needle: str) -> None:
    assert needle in describe_tls_failure(error)


def test_other_connection_failures_are_not_tls() -> None:
    assert describe_tls_failure(ConnectionError("Error 111 connecting to h:6379. Connection refused.")) is None
