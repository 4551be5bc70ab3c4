"""Every Redis key this project uses, in one place.

The keyspace (all under one prefix, so a shared Redis can be inspected and cleaned by pattern):

    autotune:slot:<node>.gpu<i>         str   a live slot (JSON): node, device, kind, memory, address, ...
                                              (expires unless its worker's heartbeat renews it)
    autotune:slots                      set   the queues of the registered slots (what dispatch walks
                                              instead of scanning the keyspace; a lapsed one is pruned)
    autotune:slots:epoch                str   a fresh token each time a registration appears, changes or
                                              goes: parsed slots are cached until it changes
    autotune:control:<node>             str   a live control worker (heartbeat, like slots)
    autotune:gang:<node>.gpu<i>         str   owner token of a gang reservation of that slot (PX lease)
    autotune:server                     str   a random token set by the first lease renewal on this
                                              server's data: a new one means Redis lost its data
                                              (a rank then takes its slot back, workers.state.gang)
    autotune:gpu:<host>:<uuid>          str   the slot serving that GPU of that machine (JSON: queue,
                                              worker); claimed with SET NX, renewed with the slot's key
    autotune:unhealthy:<node>.gpu<i>    str   that slot's GPU holds memory of other processes (JSON: used
                                              bytes, since, why): out of tuning until its worker reads the
                                              memory gone (workers.state.slot_health), which renews it meanwhile
    autotune:rdzv:<attempt>             list  rank 0's "addr:port", pushed once per waiting rank
    autotune:abort:<attempt>            str   set when a rank of that attempt failed: the others stop
    autotune:measured:<attempt>         str   set when rank 0's metrics of that attempt are written: a
                                              rank still running a grace period later is hung at exit
    autotune:pgid:<node>.gpu<i>:<task>  str   process group of a rank running on that slot (cleanup
                                              when its worker died without killing it)
    autotune:claim:<node>.gpu<i>:<task> str   the pool process running that rank task (JSON: pid, start
                                              time): a redelivered message finds it (workers.slot.rank_claim)
    autotune:rankproc:<node>.gpu<i>:<task> str the same rank's record (JSON): pid, pgid, start time, job,
                                              experiment, rank, launch (workers.process.process_identity): what
                                              a reader checks a live process against, not its environment
    autotune:seq                        str   counter: submission order of jobs and of queued experiments
    autotune:jobs                       zset  active jobs, scored by submission order
    autotune:lock:dispatch              str   held while one control process plans and launches
    autotune:job:<job>:spec             str   the job (JSON): what to run and how; its presence = active
    autotune:job:<job>:queue            hash  experiment name -> waiting launch (JSON, with its order)
    autotune:job:<job>:shapes           set   the shapes of its waiting launches ("<nodes>x<slots>:<memory>")
    autotune:job:<job>:queue:<shape>    zset  waiting launches of one shape, by order (scheduler.job_queue)
    autotune:job:<job>:running          hash  experiment name -> running launch (JSON): attempt, slots,
                                              gang token, rank task ids, deadline, worker instances
    autotune:job:<job>:walls            hash  "<stage>/<mbs>" -> wall times of finished runs (estimates)
    autotune:job:<job>:recorded         set   names recorded during this job (a fixed job never reuses
                                              an older folder's result)
    autotune:job:<job>:events           list  what the job's submitter prints: phases, records, the end
    autotune:job:<job>:attempts         hash  experiment name -> launches so far (counted before launch)
    autotune:job:<job>:state            hash  what `--status` shows: results dir, queue depth, running,
                                              the head experiment and why it waits
    autotune:job:<job>:settling         str   set for a few seconds when the job is submitted again after
                                              Redis lost its data: nothing is queued meanwhile (PX)

`attempt` is a fresh token per launch of an experiment, so a retried experiment never meets the
rendezvous or abort flag of an earlier launch. Celery's own broker and result keys are Celery's.
"""
from __future__ import annotations

PREFIX = "autotune:"
SLOT_INDEX = PREFIX + "slots"
SLOT_EPOCH = PREFIX + "slots:epoch"
#: A token of the server's data (workers.state.gang): a lost dataset comes back with another one.
SERVER_EPOCH = PREFIX + "server"


def slot(queue: str) -> str:
    return f"{PREFIX}slot:{queue}"


def control(node: str) -> str:
    return f"{PREFIX}control:{node}"


def gang(queue: str) -> str:
    return f"{PREFIX}gang:{queue}"


def gpu_claim(host: str, gpu_uuid: str) -> str:
    return f"{PREFIX}gpu:{host}:{gpu_uuid}"


def withdrawn(queue: str) -> str:
    """Why a slot's worker withdrew it (`workers.slot.consumer_watch`), while it stays withdrawn."""
    return f"{PREFIX}withdrawn:{queue}"


def unhealthy(queue: str) -> str:
    return f"{PREFIX}unhealthy:{queue}"


def rendezvous(attempt: str) -> str:
    return f"{PREFIX}rdzv:{attempt}"


def measured(attempt: str) -> str:
    return f"{PREFIX}measured:{attempt}"


def abort(attempt: str) -> str:
    return f"{PREFIX}abort:{attempt}"


def pgid(queue: str, task_id: str) -> str:
    return f"{PREFIX}pgid:{queue}:{task_id}"


def pgid_pattern(queue: str = "*") -> str:
    return f"{PREFIX}pgid:{queue}:*"


def rank_claim(queue: str, task_id: str) -> str:
    return f"{PREFIX}claim:{queue}:{task_id}"


def rank_process(queue: str, task_id: str) -> str:
    return f"{PREFIX}rankproc:{queue}:{task_id}"


def rank_process_pattern(queue: str = "*") -> str:
    return f"{PREFIX}rankproc:{queue}:*"


def job_events(job: str) -> str:
    return f"{PREFIX}job:{job}:events"


def job_attempts(job: str) -> str:
    return f"{PREFIX}job:{job}:attempts"


def job_state(job: str) -> str:
    return f"{PREFIX}job:{job}:state"


def job_settling(job: str) -> str:
    return f"{PREFIX}job:{job}:settling"


JOB_STATE_PATTERN = PREFIX + "job:*:state"
SEQUENCE = PREFIX + "seq"
JOBS = PREFIX + "jobs"
DISPATCH_LOCK = PREFIX + "lock:dispatch"


def job_spec(job: str) -> str:
    return f"{PREFIX}job:{job}:spec"


def job_queue(job: str) -> str:
    return f"{PREFIX}job:{job}:queue"


def job_shapes(job: str) -> str:
    return f"{PREFIX}job:{job}:shapes"


def job_queue_shape(job: str, shape: str) -> str:
    return f"{PREFIX}job:{job}:queue:{shape}"


def job_running(job: str) -> str:
    return f"{PREFIX}job:{job}:running"


def job_walls(job: str) -> str:
    return f"{PREFIX}job:{job}:walls"


def job_recorded(job: str) -> str:
    return f"{PREFIX}job:{job}:recorded"


def job_keys(job: str) -> list[str]:
    """The keys that make a job active; deleted together when it ends (events and attempts stay)."""
    return [job_spec(job), job_queue(job), job_running(job), job_walls(job), job_recorded(job),
            job_state(job), job_settling(job)]
