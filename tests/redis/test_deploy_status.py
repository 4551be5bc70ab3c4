"""`python -m deploy status` on a real redis-server: each registered slot shows busy, reserved or idle
from its gang lease (`workers.state.gang`), with the hosts' answers stood in for SSH.

The SSH side is tests/integration/test_deploy.py's; here only what status reads from Redis.
"""
from __future__ import annotations

import argparse

import pytest
import redis

import deploy.__main__ as deploy_main
from deploy.fabric_hosts import Answer
from workers.device.slot import Slot
from workers.state.gang import GangReservations
from workers.state.registry import announce_slot


class _Hosts:
    """Every host answers that its slot workers run (pid 1)."""

    def run_many(self, calls: dict[str, tuple]) -> dict[str, Answer]:
        return {host: Answer(host, {f"gpu{d}": {"pid": 1, "running": True} for d in range(3)}) for host in calls}


def test_status_shows_a_reserved_slot_apart_from_the_idle_ones(
        client: redis.Redis, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    for device in range(3):
        announce_slot(client, Slot("n", device, "cpu", 1 << 30, "127.0.0.1", 1, (device,), worker=f"gpu{device}@n"))
    assert GangReservations(client).reserve(["n.gpu1"], 30, owner="j/a") is not None
    monkeypatch.setattr(deploy_main, "selected_hosts", lambda args: {"n": [0, 1, 2]})
    monkeypatch.setattr(deploy_main, "connected", lambda url: client)
    monkeypatch.setattr(deploy_main, "_hosts", lambda args: _Hosts())
    assert deploy_main.status(argparse.Namespace(run_dir="/tmp/run"), "redis://unused") == 0
    states = {line.split(":")[0]: line.split(": ")[1].split(" ")[0] for line in capsys.readouterr().out.splitlines()}
    assert states == {"n.gpu0": "idle", "n.gpu1": "reserved", "n.gpu2": "idle"}
