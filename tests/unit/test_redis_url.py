"""One check of the cluster's Redis URL (`workers.state.redis_url`): its rules, the two policies callers
choose (a unix socket, an empty password), the masking of every message, and the commands and
`python -m deploy` agreeing on every URL but those the policies decide."""
from __future__ import annotations

import pytest

from deploy import plan
from scheduler.errors import UsageError
from scheduler.launch import environment
from workers.state.redis_url import RedisUrlError, check_redis_url, masked_url

SECRET = "s3cretpw"
#: (url, what the message says, or None when the URL is accepted) under the default policy.
RULES = [
    (f"redis://:{SECRET}@h:6379/0", None),
    (f"redis://autotune:{SECRET}@h:6379/0?db=1", None),
    ("redis://h:6379", None),
    ("unix:///run/redis.sock?db=0", None),
    ("redis://:@h:6379/0", None),
    (None, "is not set"),
    ("", "is not set"),
    ("not a url", "blank"),
    (f"redis://:{SECRET}@h:1/0\nx", "control"),
    ("localhost:6379", "scheme"),
    ("http://h:1/0", "not a Redis URL"),
    (f"redis://:{SECRET}@h:70000/0", "port must be"),
    (f"redis://:{SECRET}@h:abc/0", "not a valid URL"),
    ("redis://h:0/0", "port 0"),
    ("redis://[::1:6379/0", "not a valid URL"),
    ("redis://", "no host"),
    ("unix://", "socket path"),
    (f"redis://:{SECRET}@h:1/x", "database"),
    (f"redis://:{SECRET}@h:1/0?db=x", "db="),
]
#: The rows a cluster of hosts' policy (`allow_unix=False, allow_empty_password=False`) decides otherwise.
HOSTS_POLICY = {"unix:///run/redis.sock?db=0": "not a Redis URL", "unix://": "not a Redis URL",
                "redis://:@h:6379/0": "empty password"}


@pytest.fixture(autouse=True)
def _no_tls(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("AUTOTUNE_REDIS_CA", "AUTOTUNE_REDIS_CERT", "AUTOTUNE_REDIS_KEY"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("url, problem", RULES)
def test_the_rules(url: str | None, problem: str | None) -> None:
    if problem is None:
        assert check_redis_url(url) == url
        return
    with pytest.raises(RedisUrlError, match=problem) as refused:
        check_redis_url(url, hint="or unset it")
    assert "AUTOTUNE_REDIS_URL" in str(refused.value) and SECRET not in str(refused.value)


@pytest.mark.parametrize("url, problem", RULES)
def test_a_cluster_of_hosts_refuses_a_socket_and_an_empty_password(url: str | None, problem: str | None) -> None:
    problem = HOSTS_POLICY.get(url, problem)
    if problem is None:
        assert check_redis_url(url, allow_unix=False, allow_empty_password=False) == url
    else:
        with pytest.raises(RedisUrlError, match=problem):
            check_redis_url(url, allow_unix=False, allow_empty_password=False)


@pytest.mark.parametrize("url, problem", RULES)
def test_the_commands_and_deploy_differ_only_by_their_policy(url: str | None, problem: str | None) -> None:
    def verdict(check) -> str:
        try:
            check(url)
        except UsageError as exc:
            return "refused" if SECRET not in str(exc) else "leaked"
        return "accepted"

    commands = verdict(environment.check_redis_url) if url else "refused"  # the commands check a set URL only
    expected = "accepted" if problem is None else "refused"
    assert commands == expected
    assert verdict(plan.check_redis_url) == ("refused" if url in HOSTS_POLICY else expected)


@pytest.mark.parametrize("url, shown", [
    (f"redis://:{SECRET}@h:6379/0", "redis://:***@h:6379/0"),
    (f"rediss://autotune:{SECRET}@h:6379/0", "rediss://autotune:***@h:6379/0"),
    (f"redis://{SECRET}@h/0", "redis://***@h/0"),
    ("redis://h:6379/0", "redis://h:6379/0"),
    (f"{SECRET}@h:6379", "***@h:6379"),
    (f"redis://:{SECRET}@[::1:6379/0", "redis://:***@[::1:6379/0"),
])
def test_masking(url: str, shown: str) -> None:
    assert masked_url(url) == shown
