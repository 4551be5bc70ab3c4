"""A slot whose GPU holds memory of other processes is out of tuning until that memory is gone.

Why: an experiment run beside a notebook, another job or a context still
being torn down measures them too: a false out-of-memory, which the search would take for a bound,
or a slower step. So a rank that finds its GPU still used by others after `workers.device.device_idle`'s
wait does not start: it marks its slot unhealthy and its experiment is queued again
(`scheduler.cluster.finish.requeue_for_busy_gpu`), to run on other slots or later. A rank whose
GPU is not free again a wait after its own processes ended marks it too, before the slot is freed.

The mark is one Redis key per slot (`keys.unhealthy`) with a TTL of `MARK_TTL_S`: the slot's worker
renews it while the memory stays (`HealthWatch`, a thread of the worker's main process, which owns no
CUDA context; apart from the registration's heartbeat, so a slow nvidia-smi never lets the slot's
registration lapse), and deletes it once the GPU has been free for `FREE_BEATS` readings in a row,
so a flickering holder does not bring the slot back and out again; each time the same slot is
marked again, it must stay free twice as long (up to `MAX_FREE_BEATS`), so a holder that keeps
coming back costs the job ever fewer wasted waits. A dead worker's mark lapses with its TTL.
Dispatch counts a marked slot as busy with no known end, shows why in `--status`, and stops a job
that could only run on marked slots for `HELD_GRACE_S` (scheduler.cluster.dispatch).
"""
from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import redis

from workers.state import keys
from workers.device.device_idle import FREE_BYTES
from workers.state.registry import HEARTBEAT_S

#: Free readings in a row (one each `POLL_S`) before a slot marked once is offered again; doubled at
#: each later mark of the same slot by the same worker, up to `MAX_FREE_BEATS`.
FREE_BEATS = 3
MAX_FREE_BEATS = 40
#: A slot left unmarked this long starts again from `FREE_BEATS`.
CALM_S = 600.0
POLL_S = HEARTBEAT_S
#: How long a mark outlives its last renewal: a reading may take nvidia-smi's 10 s time limit.
MARK_TTL_S = 30.0

log = logging.getLogger(__name__)


def mark_unhealthy(client: redis.Redis, queue: str, used_bytes: int, why: str) -> None:
    """Take `queue`'s slot out of tuning: its GPU holds `used_bytes` of other processes. Keeps the
    first `since` of a mark still there."""
    key = keys.unhealthy(queue)
    raw = client.get(key)
    since = json.loads(raw).get("since", time.time()) if raw else time.time()
    client.set(key, json.dumps({"used_bytes": used_bytes, "since": since, "why": why}), px=int(MARK_TTL_S * 1000))


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
    """A CUDA slot's worker's watch over its mark: while the slot is marked, read the GPU's usage
    each `POLL_S`, keep the mark alive while others hold memory, and lift it after enough free
    readings in a row (`check` is one reading; `start` runs it in a thread until `stop`)."""

    client: redis.Redis
    queue: str
    gpu: str  #: the GPU's UUID (`Slot.nvidia_smi_id`)
    read_used: Callable[[str], int | None]
    free_beats: int = field(default=0, init=False)
    needed: int = field(default=FREE_BEATS, init=False)  #: free readings that lift the current mark
    lifted: int = field(default=0, init=False)  #: marks lifted since the slot was last calm
    lifted_at: float = field(default=0.0, init=False)
    clock: Callable[[], float] = time.monotonic
    _stop: threading.Event = field(default_factory=threading.Event, init=False, repr=False)

    def check(self) -> None:
        key = keys.unhealthy(self.queue)
        raw = self.client.get(key)
        if raw is None:
            self.free_beats = 0
            if self.lifted and self.clock() - self.lifted_at > CALM_S:
                self.lifted, self.needed = 0, FREE_BEATS
            return
        used = self.read_used(self.gpu)
        if used is not None and used <= FREE_BYTES:
            self.free_beats += 1
            if self.free_beats >= self.needed:
                self.client.delete(key)
                self.free_beats = 0
                self.lifted += 1
                self.lifted_at = self.clock()
                self.needed = min(MAX_FREE_BEATS, FREE_BEATS * 2 ** self.lifted)  # for its next mark
                log.info("slot %s: its GPU is free again; back in tuning", self.queue)
                return
        elif used is not None:
            self.free_beats = 0
        mark = json.loads(raw)
        if used is not None and used > FREE_BYTES:
            mark["used_bytes"] = used  # what --status shows: the holder's usage now
        self.client.set(key, json.dumps(mark), px=int(MARK_TTL_S * 1000))

    def start(self) -> HealthWatch:
        threading.Thread(target=self._run, name=f"health {self.queue}", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                self.check()
            except Exception as exc:  # Redis restarting, nvidia-smi gone: try again next time
                log.warning("health check of slot %s failed: %s", self.queue, exc)
