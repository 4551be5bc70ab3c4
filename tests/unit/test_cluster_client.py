"""`scheduler.embedded.local_cluster.cluster_client`, the one set-up of `python -m scheduler.autotune` and
`python -m scheduler.run`: a running cluster's client as given, or an embedded cluster started, its
URL exported while the command runs and taken back after, and an error in the command reaching the
cluster's stop (so the stop is a cold one)."""
from __future__ import annotations

import os

import pytest
import redis

from scheduler.embedded.local_cluster import cluster_client

URL = "redis://autotune:pw@127.0.0.1:1/0"


class FakeCluster:
    """A LocalCluster's context-manager surface: its URL, and what its stop was told."""

    def __init__(self) -> None:
        self.url, self.node, self.exited_with = URL, "n1", "not stopped"

    def __enter__(self) -> FakeCluster:
        return self

    def __exit__(self, exc_type, *exc_info) -> None:
        self.exited_with = exc_type


def test_a_running_clusters_client_is_used_and_nothing_is_started(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AUTOTUNE_REDIS_URL", raising=False)
    given = redis.Redis()
    with cluster_client(given, lambda: pytest.fail("an embedded cluster was started")) as client:
        assert client is given and "AUTOTUNE_REDIS_URL" not in os.environ


@pytest.mark.parametrize("before", [None, ""])
def test_an_embedded_cluster_is_announced_exported_while_it_runs_then_taken_back(
        monkeypatch: pytest.MonkeyPatch, before: str | None) -> None:
    if before is None:
        monkeypatch.delenv("AUTOTUNE_REDIS_URL", raising=False)
    else:
        monkeypatch.setenv("AUTOTUNE_REDIS_URL", before)
    cluster, shown = FakeCluster(), []
    with cluster_client(None, lambda: cluster, shown.append) as client:
        assert shown == [cluster] and os.environ["AUTOTUNE_REDIS_URL"] == URL
        assert client.connection_pool.connection_kwargs["password"] == "pw"
    assert os.environ.get("AUTOTUNE_REDIS_URL") == before and cluster.exited_with is None


def test_an_error_in_the_command_reaches_the_clusters_stop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AUTOTUNE_REDIS_URL", raising=False)
    cluster = FakeCluster()
    with pytest.raises(KeyboardInterrupt):
        with cluster_client(None, lambda: cluster):
            raise KeyboardInterrupt
    assert cluster.exited_with is KeyboardInterrupt and "AUTOTUNE_REDIS_URL" not in os.environ
