"""Every Redis key this project uses, in one place.

The keyspace (all under one prefix, so a shared Redis can be inspected and cleaned by pattern):

    autotune:slot:<node>.gpu<i>         hash  a live slot: node, device, kind, memory, address, ...
                                              (expires unless its worker's heartbeat renews it)
    autotune:control:<node>             str   a live control worker (heartbeat, like slots)
    autotune:gang:<node>.gpu<i>         str   owner token of a gang reservation of that slot (PX lease)
    autotune:rdzv:<attempt>             list  rank 0's "addr:port", pushed once per waiting rank
    autotune:abort:<attempt>            str   set when a rank of that attempt failed: the others stop
    autotune:pgid:<node>.gpu<i>:<task>  str   process group of a rank running on that slot (cleanup
                                              when its worker died without killing it)
    autotune:job:<job>:events           list  finished experiments of a tuning job, for its driver
    autotune:job:<job>:attempts         hash  experiment name -> launches so far (counted before launch)
    autotune:job:<job>:state            hash  what `--status` shows: results dir, queue depth, running,
                                              the head experiment and why it waits (expires if the driver dies)

`attempt` is a fresh token per launch of an experiment, so a retried experiment never meets the
rendezvous or abort flag of an earlier launch. Celery's own broker and result keys are Celery's.
"""
from __future__ import annotations

PREFIX = "autotune:"
SLOT_PATTERN = PREFIX + "slot:*"


def slot(queue: str) -> str:
    return f"{PREFIX}slot:{queue}"


def control(node: str) -> str:
    return f"{PREFIX}control:{node}"


def gang(queue: str) -> str:
    return f"{PREFIX}gang:{queue}"


def rendezvous(attempt: str) -> str:
    return f"{PREFIX}rdzv:{attempt}"


def abort(attempt: str) -> str:
    return f"{PREFIX}abort:{attempt}"


def pgid(queue: str, task_id: str) -> str:
    return f"{PREFIX}pgid:{queue}:{task_id}"


def pgid_pattern(queue: str = "*") -> str:
    return f"{PREFIX}pgid:{queue}:*"


def job_events(job: str) -> str:
    return f"{PREFIX}job:{job}:events"


def job_attempts(job: str) -> str:
    return f"{PREFIX}job:{job}:attempts"


def job_state(job: str) -> str:
    return f"{PREFIX}job:{job}:state"


JOB_STATE_PATTERN = PREFIX + "job:*:state"
