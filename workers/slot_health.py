"""A slot whose GPU holds memory of other processes is out of tuning until that memory is gone.

Why (issue 21 items 9 and 10): an experiment run beside a notebook, another job or a context still
being torn down measures them too: a false out-of-memory, which the search would take for a bound,
or a slower step. So a rank that finds its GPU still used by others after `workers.device_idle`'s
wait does not start: it marks its slot unhealthy and its experiment is queued again
(`scheduler.cluster.dispatch.requeue_for_busy_gpu`), to run on other slots or later. A rank whose
GPU is not free again a wait after its own processes ended marks it too, before the slot is freed.

The mark is one Redis key per slot (`keys.unhealthy`), with the slot registration's short TTL:
the slot's worker renews it at each heartbeat while the memory stays (`HealthWatch`, in the
worker's main process, which owns no CUDA context), and deletes it once the GPU has been free for
`FREE_BEATS` heartbeats in a row, so a flickering holder does not bring the slot back and out
again. A dead worker's mark lapses with its registration. Dispatch counts a marked slot as busy
with no known end, and shows why in `--status`.
"""
from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import redis

from workers import keys
from workers.device_idle import FREE_BYTES
from workers.registry import TTL_S

#: Heartbeats in a row that must see the GPU free before its slot is offered again.
FREE_BEATS = 3

log = logging.getLogger(__name__)


def mark_unhealthy(client: redis.Redis, queue: str, used_bytes: int, why: str) -> None:
    """Take `queue`'s slot out of tuning: its GPU holds `used_bytes` of other processes. Keeps the
    first `since` of a mark still there."""
    key = keys.unhealthy(queue)
    raw = client.get(key)
    since = json.loads(raw).get("since", time.time()) if raw else time.time()
    client.set(key, json.dumps({"used_bytes": used_bytes, "since": since, "why": why}), px=int(TTL_S * 1000))


def unhealthy(client: redis.Redis, queues: Iterable[str]) -> dict[str, dict]:
    """The marked slots among `queues`: queue -> {"used_bytes", "since", "why"}. One round trip."""
    queues = list(queues)
    if not queues:
        return {}
    raws = client.mget([keys.unhealthy(queue) for queue in queues])
    return {queue: json.loads(raw) for queue, raw in zip(queues, raws) if raw}


def describe(queue: str, mark: dict) -> str:
    """'node.gpu2 (20.0 GiB used by other processes)': what the submitter and `--status` show."""
    return f"{queue} ({mark.get('used_bytes', 0) / 2**30:.1f} GiB used by other processes)"


@dataclass
class HealthWatch:
    """Run at each heartbeat of a CUDA slot's worker: while its slot is marked, read the GPU's usage,
    keep the mark alive while others hold memory, and lift it after `FREE_BEATS` free readings."""

    client: redis.Redis
    queue: str
    gpu: str  #: the GPU's UUID (`Slot.nvidia_smi_id`)
    read_used: Callable[[str], int | None]
    free_beats: int = field(default=0, init=False)

    def __call__(self) -> None:
        key = keys.unhealthy(self.queue)
        raw = self.client.get(key)
        if raw is None:
            self.free_beats = 0
            return
        used = self.read_used(self.gpu)
        if used is not None and used <= FREE_BYTES:
            self.free_beats += 1
            if self.free_beats >= FREE_BEATS:
                self.client.delete(key)
                self.free_beats = 0
                log.info("slot %s: its GPU is free again; back in tuning", self.queue)
                return
        elif used is not None:
            self.free_beats = 0
        mark = json.loads(raw)
        if used is not None and used > FREE_BYTES:
            mark["used_bytes"] = used  # what --status shows: the holder's usage now
        self.client.set(key, json.dumps(mark), px=int(TTL_S * 1000))
