"""Before a rank starts on a GPU: wait for memory others hold there to go, and say what still does.

Why: an out-of-memory is a bound on the micro-batch, so a probe must run out of memory only for its
own sake. Two things make it run out early on a real node (issue 21 items 9 and 10):
- a process that just ended (the last experiment's rank, killed or not) lets go of its CUDA context
  only when the driver has torn it down, which for tens of GiB can take seconds;
- other processes hold memory on the GPU: a notebook, another job, a dying experiment of someone else.
The slot worker never opens a CUDA context on its GPU, so whatever nvidia-smi shows as used there
before a launch belongs to someone else. So before each rank: while more than `FREE_BYTES` is used,
wait (polling every `POLL_S`, at most `WAIT_S`); then start anyway and record what was still used
(`device_foreign_bytes`). An out-of-memory under foreign memory is no bound on the config
(`scheduler.search.session.too_large`): the search launches it once more instead.

A wait that ran out without the usage falling is remembered per GPU: the same holder (within
`FREE_BYTES`) is not waited for again at every launch, only recorded. Pure decision logic: the
reading of the usage and the clock are passed in (`workers.gpus.memory_used` in the worker).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

#: Usage at or below this counts as a free GPU: an idle one lists a few MiB, one CUDA context alone
#: takes about 300-600 MiB, so anything above is someone's context.
FREE_BYTES = 512 << 20
#: The longest a rank waits for others' memory to go before it starts anyway.
WAIT_S = 30.0
#: How often the usage is read while waiting.
POLL_S = 1.0


def seconds_setting(text: str | None, default: float) -> float:
    """A worker's setting of seconds from its environment (AUTOTUNE_GPU_WAIT_S,
    AUTOTUNE_MEASURED_GRACE_S): a finite number >= 0, else `default` (the commands refuse a bad value
    up front with one line, scheduler.launch.environment; a worker must not die of it at import)."""
    try:
        value = float(text) if text else default
    except ValueError:
        return default
    return value if 0 <= value < float("inf") else default


def gpu_wait_s(text: str | None) -> float:
    """AUTOTUNE_GPU_WAIT_S as seconds, `WAIT_S` when unset or unusable."""
    return seconds_setting(text, WAIT_S)


@dataclass(frozen=True)
class Wait:
    """How the wait before one launch ended."""

    used_bytes: int | None  #: used on the GPU when the rank started (None: nvidia-smi could not tell)
    waited_s: float

    @property
    def foreign_bytes(self) -> int | None:
        """What others held when the rank started, if more than a free GPU shows (else 0)."""
        if self.used_bytes is None:
            return None
        return self.used_bytes if self.used_bytes > FREE_BYTES else 0


@dataclass
class FreeMemoryWaiter:
    """Waits per GPU; remembers the usage a wait ran out on, so that holder is not waited for again."""

    read_used: Callable[[str], int | None]
    sleep: Callable[[float], None] = time.sleep
    clock: Callable[[], float] = time.monotonic
    wait_s: float = WAIT_S
    poll_s: float = POLL_S
    settled: dict[str, int] = field(default_factory=dict)  #: GPU (UUID) -> usage a wait ran out on

    def wait(self, gpu: str, keep_alive: Callable[[], bool] | None = None) -> Wait:
        """Wait until `gpu` (its UUID) is free, its usage is the holder already waited for, or `wait_s`
        passed. `keep_alive` is called at every poll (the rank renews its slot's lease there); when
        it says stop (the launch was aborted) the wait ends at once."""
        started = self.clock()
        used = self.read_used(gpu)
        while used is not None and used > FREE_BYTES:
            known = self.settled.get(gpu)
            if known is not None and abs(used - known) <= FREE_BYTES:
                break
            if self.clock() - started >= self.wait_s:
                self.settled[gpu] = used
                break
            if keep_alive is not None and keep_alive():
                break
            self.sleep(self.poll_s)
            used = self.read_used(gpu)
        if used is not None and used <= FREE_BYTES:
            self.settled.pop(gpu, None)
        return Wait(used, round(self.clock() - started, 3))
