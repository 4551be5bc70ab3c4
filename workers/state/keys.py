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
    autotune:withdrawn:<node>.gpu<i>    str   why that slot's worker withdrew it (workers.slot.consumer_watch),
                                              while it stays withdrawn
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
    autotune:rankkeys:<node>.gpu<i>     set   the names of that slot's rankproc and pgid keys (what a reader
                                              walks instead of scanning the keyspace; expires with them, and
                                              a name whose key is gone is pruned)
    autotune:rankslots                  set   the slots that have a rankkeys set (what a reader of every
                                              slot walks; a slot whose set is gone is pruned)
    autotune:seq                        str   counter: submission order of jobs and of queued experiments
    autotune:jobs                       zset  active jobs, scored by submission order
    autotune:lock:dispatch              str   held while one control process plans and launches
    autotune:job:<job>:spec             str   the job (JSON): what to run and how; its presence = active
    autotune:job:<job>:queue            hash  experiment name -> waiting launch (JSON, with its order)
    autotune:job:<job>:shapes           set   the shapes of its waiting launches ("<nodes>x<slots>:<memory>")
    autotune:job:<job>:queue:<shape>    zset  waiting launches of one shape, by order (scheduler.cluster.job_store)
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
    autotune:redis-user-check           str   `python -m deploy redis-user`'s probe as the new user:
                                              written, read from Lua and deleted at once (EX 10)

`attempt` is a fresh token per launch of an experiment, so a retried experiment never meets the
rendezvous or abort flag of an earlier launch. Celery's own broker and result keys are Celery's.
"""
from __future__ import annotations

import string

PREFIX = "autotune:"


class Key:
    """One key's builder: `Key("job:{job}:spec")("j1")` is `"autotune:job:j1:spec"`. The template's
    fields take values in order or by name; a field with a default (a pattern's `*`) may be left out."""

    def __init__(self, template: str, **defaults: str) -> None:
        self.template = PREFIX + template
        self.fields = tuple(field for _, field, _, _ in string.Formatter().parse(template) if field)
        self.defaults = defaults

    def __call__(self, *values: str, **named: str) -> str:
        if len(values) > len(self.fields) or set(named) - set(self.fields[len(values):]):
            raise TypeError(f"{self!r} takes {', '.join(self.fields)}: got {values} {named}")
        filled = {**self.defaults, **dict(zip(self.fields, values)), **named}
        missing = [field for field in self.fields if field not in filled]
        if missing:
            raise TypeError(f"{self!r} needs {', '.join(missing)}")
        return self.template.format(**filled)

    def __repr__(self) -> str:
        return f"Key({self.template!r})"


SLOT_INDEX = PREFIX + "slots"
SLOT_EPOCH = PREFIX + "slots:epoch"
#: A token of the server's data (workers.state.gang): a lost dataset comes back with another one.
SERVER_EPOCH = PREFIX + "server"
SEQUENCE = PREFIX + "seq"
JOBS = PREFIX + "jobs"
DISPATCH_LOCK = PREFIX + "lock:dispatch"
JOB_STATE_PATTERN = PREFIX + "job:*:state"
REDIS_USER_CHECK = PREFIX + "redis-user-check"

# A slot's and a rank's keys (queue: "<node>.gpu<i>", task_id: the rank task's Celery id).
slot = Key("slot:{queue}")
control = Key("control:{node}")
gang = Key("gang:{queue}")
gpu_claim = Key("gpu:{host}:{gpu_uuid}")
#: Why a slot's worker withdrew it (`workers.slot.consumer_watch`), while it stays withdrawn.
withdrawn = Key("withdrawn:{queue}")
unhealthy = Key("unhealthy:{queue}")
rendezvous = Key("rdzv:{attempt}")
measured = Key("measured:{attempt}")
abort = Key("abort:{attempt}")
pgid = Key("pgid:{queue}:{task_id}")
pgid_pattern = Key("pgid:{queue}:*", queue="*")
rank_claim = Key("claim:{queue}:{task_id}")
rank_process = Key("rankproc:{queue}:{task_id}")
rank_process_pattern = Key("rankproc:{queue}:*", queue="*")
#: The names of a slot's `rank_process` and `pgid` keys: what their readers walk instead of a SCAN.
rank_index = Key("rankkeys:{queue}")
#: The slots that have a `rank_index`: what a reader of every slot walks.
RANK_SLOTS = PREFIX + "rankslots"

# A job's keys: `job:{job}:<part>`, each named `job_<part>`, built from one list of parts so that
# every key of a job stays under the one prefix a reader of all jobs matches (`JOB_STATE_PATTERN`).
(job_spec, job_queue, job_shapes, job_running, job_walls, job_recorded, job_events, job_attempts, job_state,
 job_settling) = (Key("job:{job}:" + part) for part in ("spec", "queue", "shapes", "running", "walls", "recorded",
                                                          "events", "attempts", "state", "settling"))
job_queue_shape = Key("job:{job}:queue:{shape}")


def job_keys(job: str) -> list[str]:
    """The keys that make a job active; deleted together when it ends (events and attempts stay)."""
    return [build(job) for build in (job_spec, job_queue, job_running, job_walls, job_recorded, job_state,
                                     job_settling)]
