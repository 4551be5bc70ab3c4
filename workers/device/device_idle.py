"""Before a rank starts on a GPU, and after it ended: wait for memory others hold there to go.

Why: an out-of-memory is a bound on the micro-batch, so a probe must run out of memory only for its
own sake. Two things make it run out early on a real node:
- a process that just ended (the last experiment's rank, killed or not) lets go of its CUDA context
  only when the driver has torn it down, which for tens of GiB can take seconds;
- other processes hold memory on the GPU: a notebook, another job, a dying experiment of someone else.
The slot worker never opens a CUDA context on its GPU, so whatever nvidia-smi shows as used there
outside a run belongs to someone else. So before each rank, and after each rank's processes ended:
while more than `FREE_BYTES` is used, wait (polling every `POLL_S`, at most `WAIT_S`). A wait that
runs out is `Wait.busy`: the rank then takes its slot out of tuning (`workers.state.slot_health`) instead
of starting, or, after a run, before its slot is released.

Pure decision logic: the reading of the usage and the clock are passed in (`workers.device.gpus.memory_used`
in the worker).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

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
    """How one wait for a free GPU ended."""

    used_bytes: int | None  #: used on the GPU when the wait ended (None: nvidia-smi could not tell)
    waited_s: float
    stopped: bool = False  #: ended early because `keep_alive` said stop

    @property
    def busy(self) -> bool:
        """The wait ran out with others still holding more than a free GPU shows."""
        return not self.stopped and self.used_bytes is not None and self.used_bytes > FREE_BYTES

    @property
    def foreign_bytes(self) -> int | None:
        """What others held when the wait ended, if more than a free GPU shows (else 0)."""
        if self.used_bytes is None:
            return None
        return self.used_bytes if self.used_bytes > FREE_BYTES else 0


@dataclass
class FreeMemoryWaiter:
    """Waits until a GPU is free, or for at most `wait_s`."""

    read_used: Callable[[str], int | None]
    sleep: Callable[[float], None] = time.sleep
    clock: Callable[[], float] = time.monotonic
    wait_s: float = WAIT_S
    poll_s: float = POLL_S

    def wait(self, gpu: str, keep_alive: Callable[[], bool] | None = None) -> Wait:
        """Wait until `gpu` (its UUID) is free or `wait_s` passed. `keep_alive` is called at every
        poll (the rank renews its slot's lease there); when it says stop (the launch was aborted)
        the wait ends at once."""
        started = self.clock()
        used = self.read_used(gpu)
        while used is not None and used > FREE_BYTES and self.clock() - started < self.wait_s:
            if keep_alive is not None and keep_alive():
                return Wait(used, round(self.clock() - started, 3), stopped=True)
            self.sleep(self.poll_s)
            used = self.read_used(gpu)
        return Wait(used, round(self.clock() - started, 3))
