"""A command waits for the group kills it started in the background (`deploy.cleanup`): its exit
would stop a daemon thread wherever it is, and one stopped inside a compiled extension (the SSH
stack's Rust cryptography, imported by the clean-up) aborted `python -m scheduler.run` after
SIGTERM (SIGABRT, glibc's "FATAL: exception not rethrown"), its groups maybe not yet killed."""
from __future__ import annotations

import threading

import pytest

from deploy import cleanup


@pytest.fixture
def slow_kill(monkeypatch):
    """Every recorded group found, and each node's kill held until the test releases it."""
    release, killed = threading.Event(), []

    def kill_recorded(hosts, groups, grace_s=cleanup.DEFAULT_GRACE_S):
        release.wait(30)
        killed.append(groups)
        return {}

    monkeypatch.setattr(cleanup, "groups_of", lambda slots, launches: [f"group of {launches[0][0]}"])
    monkeypatch.setattr(cleanup, "kill_recorded", kill_recorded)
    return release, killed


def test_the_wait_ends_when_every_clean_up_started_has_ended(slow_kill) -> None:
    release, killed = slow_kill
    cleanup.clean_launch_in_background(None, "a", {})
    cleanup.clean_launch_in_background(None, "b", {})
    threading.Timer(0.3, release.set).start()
    assert cleanup.wait_for_background_cleanups(20.0)
    assert sorted(killed) == [["group of a"], ["group of b"]]


def test_the_wait_is_bounded_and_says_a_clean_up_still_runs(slow_kill) -> None:
    release, killed = slow_kill
    cleanup.clean_launch_in_background(None, "c", {})
    assert not cleanup.wait_for_background_cleanups(0.2)
    assert killed == []
    release.set()
    assert cleanup.wait_for_background_cleanups(20.0) and killed == [["group of c"]]
