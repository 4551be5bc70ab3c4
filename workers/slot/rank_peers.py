"""How a running rank keeps in touch with its peers and its slot through Redis: it meets them
(rendezvous), waits until every rank's ops are built, tells them to stop when it fails (the abort
flag), says when the launch has its measurement, and renews its own slot's lease while it runs.

Apart from the rank's stages (`workers.slot.rank`) because these are the polled checks and flags a
rank shares with the other ranks of its launch, each tolerant of a Redis outage.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import redis

from workers.state import keys, rendezvous
from workers.state.store import RedisSlotStore
from workers.slot.op_prebuild import PREBUILD_TIMEOUT_S
from workers.slot.rank_spec import RankSpec
from workers.device.slot import Slot

ABORT_TTL_S = 3600


class Measured:
    """Polled while the script runs: whether this launch has its measurement, after which a rank
    still running is hung at exit (`workers.process.launch.MEASURED_GRACE_S`). Rank 0 looks for its metrics
    file (removed before the script started, so one there is this launch's) and tells the other ranks
    through Redis; they read that flag. A Redis outage only delays the news."""

    def __init__(self, client: redis.Redis, key: str, metric_path: Path | None) -> None:
        self._client, self._key, self._metric_path = client, key, metric_path
        self._seen = self._told = False

    def __call__(self) -> bool:
        try:
            if self._metric_path is None:
                self._seen = self._seen or bool(self._client.exists(self._key))
            else:
                self._seen = self._seen or self._metric_path.exists()
                if self._seen and not self._told:
                    self._client.set(self._key, 1, ex=ABORT_TTL_S)
                    self._told = True
        except redis.RedisError:
            pass
        return self._seen


class StopCheck:
    """Polled while the script runs: stop when a peer rank failed, and keep this slot's lease and
    this rank's record alive.

    Renewal happens here, in the rank, rather than in a scheduler process: the lease then lapses
    exactly when the rank's worker or node is gone, which is what frees the slot and tells the
    control worker's sweep that the experiment was lost. A Redis outage is not a reason to stop.
    The rank's record (`keep_record`) is written again with every renewal and at the first poll
    that reaches Redis after one that did not: a restart can come back without it.
    """

    def __init__(self, client: redis.Redis, abort_key: str, queue: str, token: str, lease_s: float) -> None:
        self._client, self._abort_key = client, abort_key
        self._lease = RedisSlotStore(client).lease(queue, token, lease_s) if token else None
        self._record: Callable[[], object] | None = None
        self._record_every_s, self._record_at = max(1.0, lease_s / 3), 0.0

    def __call__(self) -> bool:
        try:
            return self.slot_taken() or bool(self._client.exists(self._abort_key))
        except redis.RedisError:
            return False

    def keep_record(self, write: Callable[[], object] | None) -> None:
        """Write this rank's record with `write` from now on (None: no more, the rank has ended)."""
        self._record, self._record_at = write, time.monotonic() + self._record_every_s

    def slot_taken(self) -> bool:
        """Renew the lease when due; True when another launch owns the slot now (this one was given
        up). The check for after the run, when a failed peer no longer matters."""
        try:
            taken = self._lease is not None and self._lease.renew()
            if self._record is not None and time.monotonic() >= self._record_at:
                self._record()
                self._record_at = time.monotonic() + self._record_every_s
            return taken
        except redis.RedisError:  # tried again at a later poll (workers.state.gang.SlotLease)
            self._record_at = 0.0
            return False


def meet_peers(spec: RankSpec, slot: Slot, client: redis.Redis, stop_check: StopCheck) -> tuple[str, int] | None:
    """The launch's rendezvous address: rank 0 takes a free port and publishes it, the others wait
    for it (None when none came within `spec.rendezvous_timeout_s`)."""
    if spec.world_size == 1:
        return slot.address, rendezvous.free_port(slot.address)
    if spec.rank == 0:
        port = rendezvous.free_port(slot.address)
        rendezvous.publish(client, spec.attempt, slot.address, port, spec.world_size - 1)
        return slot.address, port
    return rendezvous.wait(client, spec.attempt, spec.rendezvous_timeout_s, keep_alive=stop_check,
                           every_s=max(1.0, spec.lease_s / 3))


def ops_ready_everywhere(spec: RankSpec, client: redis.Redis, stop_check: StopCheck) -> bool:
    """After this rank's ops are built: wait until every rank's are, so the scripts start together
    and no rank's time limit runs while a peer node compiles. False when the launch was stopped or
    a peer never got there."""
    if spec.world_size == 1:
        return not stop_check()
    return rendezvous.all_arrived(client, f"{spec.attempt}:ops", spec.world_size, PREBUILD_TIMEOUT_S + 60,
                                  keep_alive=stop_check)


def signal_abort(client: redis.Redis, attempt: str) -> None:
    """Tell the launch's other ranks to stop (`StopCheck`); Redis being away loses only the news."""
    try:
        client.set(keys.abort(attempt), "1", ex=ABORT_TTL_S)
    except redis.RedisError:
        pass
