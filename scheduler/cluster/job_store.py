"""Every Redis key of a job and of the cluster's job list, behind one typed interface.

Why one store: dispatch, jobs and progress all read and write a job's state; with raw Redis calls
each would know the key layout and the JSON shapes. Here each operation is one method, one round trip or one transaction, on typed records
(`scheduler.cluster.launches`); nothing else touches these keys (see `workers.state.keys` for the layout).

What a dispatch pass reads across every active job at once is `scheduler.cluster.dispatch_reads`.
The operations are the interface `scheduler.cluster.stores.BaseJobStore`, which the in-memory twin
(`scheduler.cluster.memory_store`) implements too.
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import redis

from scheduler.cluster.launches import QueuedLaunch, RunningLaunch
from scheduler.cluster.stores import StepReads
from workers.state import keys
from workers.state.store import HEARTBEAT_S

EVENTS_TTL_S = ATTEMPTS_TTL_S = 7 * 24 * 3600
#: After Redis lost its data, how long a job submitted again queues nothing (`settling`): every
#: live slot worker has announced itself twice (`workers.state.store.HEARTBEAT_S`) and every rank still
#: running has retried its renewal (`workers.state.gang.SlotLease.RETRY_S`), taking its slot back, by then.
RESUME_SETTLE_S = 2 * HEARTBEAT_S


def active_jobs(client: redis.Redis) -> list[str]:
    """Active jobs in submission order."""
    return [job.decode() for job in client.zrange(keys.JOBS, 0, -1)]


_SPECS = """
-- KEYS[1] the active jobs (zset); ARGV[1], ARGV[2] a job's spec key before and after its name
-- returns the specs (JSON) of the active jobs that have one, in submission order
local specs = {}
for _, job in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  local spec = redis.call('GET', ARGV[1] .. job .. ARGV[2])
  if spec then specs[#specs + 1] = spec end
end
return specs
"""


#: Lua: append one wall time (a JSON number) to a shape's list ('' shape: none), then push an event
#: ('' : none) onto the job's events with their TTL; shared by `_RECORDED` and `_FINISH_RECORDED`.
_RECORD_FUNCTION = """
local function record(walls_key, events_key, shape, wall, event, ttl)
  if shape ~= '' then
    local walls = redis.call('HGET', walls_key, shape)
    if not walls or walls == '[]' then
      walls = '[' .. wall .. ']'
    else
      walls = string.sub(walls, 1, -2) .. ', ' .. wall .. ']'
    end
    redis.call('HSET', walls_key, shape, walls)
  end
  if event ~= '' then
    redis.call('RPUSH', events_key, event)
    redis.call('EXPIRE', events_key, ttl)
  end
end
"""
_FINISH_RECORDED = _RECORD_FUNCTION + """
-- KEYS[1] running, KEYS[2] recorded, KEYS[3] wall times, KEYS[4] events; ARGV[1] the name, ARGV[2]
-- the attempt, ARGV[3] a shape ('': no wall time), ARGV[4] its wall time, ARGV[5] an event, ARGV[6] TTL
-- closes the running launch ARGV[2] of ARGV[1] and marks the name recorded, then `record`s; returns
-- the launch (JSON) it closed, or false (nothing changed) when that attempt is not the running one
local raw = redis.call('HGET', KEYS[1], ARGV[1])
if not raw or cjson.decode(raw)['attempt'] ~= ARGV[2] then return false end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('SADD', KEYS[2], ARGV[1])
record(KEYS[3], KEYS[4], ARGV[3], ARGV[4], ARGV[5], ARGV[6])
return raw
"""
_RECORDED = _RECORD_FUNCTION + """
-- KEYS[1] the job's wall times, KEYS[2] its events; ARGV[1] a shape ('': no wall time) and ARGV[2]
-- one more wall time of it (a JSON number), ARGV[3] an event (JSON, '': none), ARGV[4] the events' TTL
record(KEYS[1], KEYS[2], ARGV[1], ARGV[2], ARGV[3], ARGV[4])
return 1
"""


def active_spec_jsons(client: redis.Redis) -> list[bytes]:
    """The active jobs' specs (JSON), in submission order: one round trip, whatever the jobs."""
    before, _, after = keys.job_spec("\0").partition("\0")
    return list(client.register_script(_SPECS)(keys=[keys.JOBS], args=[before, after]))


def any_active(client: redis.Redis) -> bool:
    return bool(client.zcard(keys.JOBS))


def shown_states(client: redis.Redis) -> list[dict[str, str]]:
    """What each active job last published for `--status` (`JobStore.show`), by job id."""
    states = []
    for key in sorted(client.scan_iter(match=keys.JOB_STATE_PATTERN)):
        fields = {k.decode(): v.decode() for k, v in client.hgetall(key).items()}
        if fields:
            states.append({"job": key.decode().split(":")[2], **fields})
    return states


def reserve_seqs(client: redis.Redis, count: int) -> int:
    """The first of `count` consecutive submission numbers, taken in one round trip."""
    return int(client.incrby(keys.SEQUENCE, count)) - count + 1


#: How many results `JobStore.step_reads_in` adds to a pipeline.
STEP_READS = 6


def step_reads_from(results: list[Any]) -> StepReads:
    """`StepReads` from the last STEP_READS results of a pipeline that ran `JobStore.step_reads_in`."""
    spec, recorded, attempts, order, queued, running = results[-STEP_READS:]
    names = lambda raw: {name.decode() for name in raw}  # noqa: E731
    return StepReads(spec, names(recorded), {name.decode(): int(n) for name, n in attempts.items()}, order,
                     names(queued), names(running))


class JobStore:
    """One job's keys: spec, events, queue (with its shape index), running launches, attempts,
    wall times, recorded names and the state `--status` shows (`stores.BaseJobStore` in Redis)."""

    def __init__(self, client: redis.Redis, job: str) -> None:
        self.client, self.job = client, job

    # ------------------------------------------------------------ the job itself

    def spec_json(self) -> bytes | None:
        return self.client.get(keys.job_spec(self.job))

    def order(self) -> float | None:
        """The job's place in keys.JOBS; it changes when the job is submitted again."""
        return self.client.zscore(keys.JOBS, self.job)

    def activate(self, spec_json: str, launched_before: bool = False) -> None:
        """Forget any earlier life of the job, store its spec, append it to the active jobs;
        `launched_before`: counted as a job that has launched (`misfit_since`), submitted again
        after Redis lost its data (`settling` for RESUME_SETTLE_S)."""
        seq = self.client.incr(keys.SEQUENCE)
        pipe = self.client.pipeline(transaction=True)
        pipe.delete(*self._keys(), keys.job_attempts(self.job), keys.job_events(self.job))
        pipe.set(keys.job_spec(self.job), spec_json)
        if launched_before:
            pipe.hset(keys.job_state(self.job), "dispatched", 1)
            pipe.set(keys.job_settling(self.job), 1, px=int(RESUME_SETTLE_S * 1000))
        pipe.zadd(keys.JOBS, {self.job: seq})
        pipe.execute()

    def end(self, event: dict[str, Any]) -> None:
        """The job's last event and the removal of its keys in one transaction, so a submitter that
        finds the spec gone always finds the event too."""
        doomed = self._keys()
        pipe = self.client.pipeline(transaction=True)
        pipe.rpush(keys.job_events(self.job), json.dumps(event))
        pipe.expire(keys.job_events(self.job), EVENTS_TTL_S)
        pipe.delete(*doomed)
        pipe.zrem(keys.JOBS, self.job)
        pipe.execute()

    def _keys(self) -> list[str]:
        shapes = [keys.job_queue_shape(self.job, raw.decode())
                  for raw in self.client.smembers(keys.job_shapes(self.job))]
        return [*keys.job_keys(self.job), keys.job_shapes(self.job), *shapes]

    # ------------------------------------------------------------ events for the submitter

    def publish(self, event: dict[str, Any]) -> None:
        pipe = self.client.pipeline()
        pipe.rpush(keys.job_events(self.job), json.dumps(event))
        pipe.expire(keys.job_events(self.job), EVENTS_TTL_S)
        pipe.execute()

    def next_event(self, timeout_s: float) -> dict[str, Any] | None:
        popped = self.client.blpop([keys.job_events(self.job)], timeout=timeout_s)
        return json.loads(popped[1]) if popped else None

    def vanished(self) -> bool:
        """No spec and no pending event: Redis lost the job (restarted without its data)."""
        return not self.client.exists(keys.job_spec(self.job)) and not self.client.llen(keys.job_events(self.job))

    # ------------------------------------------------------------ the queue

    def queue(self, launches: Iterable[QueuedLaunch], pipe: redis.client.Pipeline | None = None) -> None:
        """Queue launches (replacing those of the same name), in `pipe` or in a transaction of its own."""
        own = pipe is None
        pipe = self.client.pipeline(transaction=True) if pipe is None else pipe
        for launch in launches:
            pipe.hset(keys.job_queue(self.job), launch.name, json.dumps(launch.to_json()))
            pipe.sadd(keys.job_shapes(self.job), launch.shape)
            pipe.zadd(keys.job_queue_shape(self.job, launch.shape), {launch.name: launch.seq})
        if own:
            pipe.execute()

    def _unqueue(self, pipe: redis.client.Pipeline, launch: QueuedLaunch) -> None:
        pipe.hdel(keys.job_queue(self.job), launch.name)
        pipe.zrem(keys.job_queue_shape(self.job, launch.shape), launch.name)

    def unqueue(self, launch: QueuedLaunch) -> None:
        pipe = self.client.pipeline(transaction=True)
        self._unqueue(pipe, launch)
        pipe.execute()

    def queued_names(self) -> set[str]:
        return {name.decode() for name in self.client.hkeys(keys.job_queue(self.job))}

    def queued(self, names: list[str]) -> list[QueuedLaunch]:
        """The waiting launches of `names` (those still queued)."""
        raws = self.client.hmget(keys.job_queue(self.job), names) if names else []
        return [QueuedLaunch.from_json(json.loads(raw)) for raw in raws if raw is not None]

    def depth(self) -> int:
        return int(self.client.hlen(keys.job_queue(self.job)))

    # ------------------------------------------------------------ running launches

    def running(self) -> dict[str, RunningLaunch]:
        return {name.decode(): RunningLaunch.from_json(json.loads(raw))
                for name, raw in self.client.hgetall(keys.job_running(self.job)).items()}

    def running_of(self, names: list[str]) -> dict[str, RunningLaunch]:
        """The running launches among `names`, read by name (one round trip whatever runs besides)."""
        raws = self.client.hmget(keys.job_running(self.job), names) if names else []
        return {name: RunningLaunch.from_json(json.loads(raw)) for name, raw in zip(names, raws) if raw is not None}

    def running_names(self) -> set[str]:
        return {name.decode() for name in self.client.hkeys(keys.job_running(self.job))}

    def update_running(self, launch: RunningLaunch, pipe: redis.client.Pipeline | None = None) -> None:
        """Rewrite a running launch (in `pipe` when given, run with it)."""
        (pipe or self.client).hset(keys.job_running(self.job), launch.name, json.dumps(launch.to_json()))

    def next_exp_id(self) -> int:
        """DeepSpeed's exp_id: numbered in launch order within the job."""
        return int(self.client.hincrby(keys.job_state(self.job), "exp_ids", 1))

    def start(self, queued: QueuedLaunch, launch: RunningLaunch, pipe: redis.client.Pipeline | None = None) -> int:
        """Move a launch from the queue to running, its attempt counted first, in one transaction
        (`pipe`'s, with whatever the caller put in it before); returns its DeepSpeed exp_id
        (`next_exp_id`, taken in the same transaction)."""
        pipe = self.client.pipeline(transaction=True) if pipe is None else pipe
        pipe.hincrby(keys.job_attempts(self.job), launch.name, 1)
        pipe.expire(keys.job_attempts(self.job), ATTEMPTS_TTL_S)
        self._unqueue(pipe, queued)
        pipe.hset(keys.job_running(self.job), launch.name, json.dumps(launch.to_json()))
        pipe.hset(keys.job_state(self.job), "dispatched", 1)
        pipe.hincrby(keys.job_state(self.job), "exp_ids", 1)
        return int(pipe.execute()[-1])

    def finish(self, name: str, attempt: str) -> RunningLaunch | None:
        """Close the running launch `attempt` of `name` and mark the name recorded, in one script,
        telling no one. None (and nothing changed) when that launch is not the running one any more
        (retried or given up meanwhile, or Redis lost the job)."""
        found, args = self._finish_keys_args(name, attempt, None, None)
        raw = self.client.register_script(_FINISH_RECORDED)(keys=found, args=args)
        return None if raw is None else RunningLaunch.from_json(json.loads(raw))

    def finish_recorded_in(self, pipe: redis.client.Pipeline, name: str, attempt: str, event: dict[str, Any],
                           wall: tuple[str, float] | None) -> None:
        """`finish`, then, only when it closed the launch, `recorded_event(event, wall)`: one script
        queued in `pipe`, whose result is the closed launch's JSON or None (`GangReservations.release_in`
        says why EVAL)."""
        found, args = self._finish_keys_args(name, attempt, event, wall)
        pipe.eval(_FINISH_RECORDED, len(found), *found, *args)

    def _finish_keys_args(self, name: str, attempt: str, event: dict[str, Any] | None,
                          wall: tuple[str, float] | None) -> tuple[list[str], list[Any]]:
        """`_FINISH_RECORDED`'s keys and arguments (no event, no wall time: '')."""
        shape, seconds = wall if wall is not None else ("", 0.0)
        return ([keys.job_running(self.job), keys.job_recorded(self.job), keys.job_walls(self.job),
                 keys.job_events(self.job)],
                [name, attempt, shape, json.dumps(float(seconds)), json.dumps(event) if event is not None else "",
                 EVENTS_TTL_S])

    def mark_recorded(self, name: str) -> None:
        """`name` has its record on disk (a launch adopted after Redis lost the job: dispatch)."""
        self.client.sadd(keys.job_recorded(self.job), name)

    def add_wall(self, shape: str, seconds: float) -> None:
        """One more finished launch's wall time for `shape` (dispatch's estimates), appended in Redis."""
        self.recorded_event(None, (shape, seconds))

    def recorded_event(self, event: dict[str, Any] | None, wall: tuple[str, float] | None = None) -> None:
        """`publish` the event of a recorded launch (None: none), with its wall time (shape, seconds)
        added first (`add_wall`), in one script."""
        shape, seconds = wall if wall is not None else ("", 0.0)
        self.client.register_script(_RECORDED)(
            keys=[keys.job_walls(self.job), keys.job_events(self.job)],
            args=[shape, json.dumps(float(seconds)), json.dumps(event) if event is not None else "", EVENTS_TTL_S])

    def requeue(self, launch: RunningLaunch, counted: bool = True) -> None:
        """A launch waits again at its old place, in one transaction; `counted=False` takes its
        launch back from the attempts (it never ran: finish.requeue_for_busy_gpu)."""
        pipe = self.client.pipeline(transaction=True)
        pipe.hdel(keys.job_running(self.job), launch.name)
        if not counted:
            pipe.hincrby(keys.job_attempts(self.job), launch.name, -1)
        self.queue([launch.queued()], pipe)
        pipe.execute()

    def give_up(self, launch: RunningLaunch) -> None:
        """A lost launch out of attempts: no longer running, its name recorded (its record is on disk)."""
        pipe = self.client.pipeline(transaction=True)
        pipe.hdel(keys.job_running(self.job), launch.name)
        pipe.sadd(keys.job_recorded(self.job), launch.name)
        pipe.execute()

    def step_reads(self) -> StepReads:
        """What a job step reads before its search, in one round trip."""
        pipe = self.client.pipeline(transaction=False)
        self.step_reads_in(pipe)
        return step_reads_from(pipe.execute())

    def step_reads_in(self, pipe: redis.client.Pipeline) -> None:
        """`step_reads`'s commands queued in `pipe`: its last STEP_READS results are `step_reads_from`'s."""
        pipe.get(keys.job_spec(self.job))
        pipe.smembers(keys.job_recorded(self.job))
        pipe.hgetall(keys.job_attempts(self.job))
        pipe.zscore(keys.JOBS, self.job)
        pipe.hkeys(keys.job_queue(self.job))
        pipe.hkeys(keys.job_running(self.job))

    def announce_phases(self, phases: list[str], current: str | None = None) -> list[bool]:
        """`announce` of each of `phases`, and `set_phase(current)` when given, in one round trip."""
        pipe = self.client.pipeline(transaction=False)
        for phase in phases:
            pipe.hsetnx(keys.job_state(self.job), f"phase:{phase}", 1)
        if current is not None:
            pipe.hset(keys.job_state(self.job), "phase", current)
        return [bool(first) for first in pipe.execute()[:len(phases)]]

    def attempts(self) -> dict[str, int]:
        return {name.decode(): int(n) for name, n in self.client.hgetall(keys.job_attempts(self.job)).items()}

    def attempts_of(self, name: str) -> int:
        return int(self.client.hget(keys.job_attempts(self.job), name) or 0)

    def recorded(self) -> set[str]:
        """Names recorded during this job (a fixed job never reuses an older folder's result)."""
        return {name.decode() for name in self.client.smembers(keys.job_recorded(self.job))}

    def walls(self, shapes: list[str]) -> dict[str, list[float]]:
        """shape -> wall times of its finished launches, for the shapes asked."""
        if not shapes:
            return {}
        return {shape: json.loads(raw) for shape, raw in zip(shapes, self.client.hmget(keys.job_walls(self.job), shapes))
                if raw is not None}

    # ------------------------------------------------------------ state for --status and refusals

    def announce(self, phase: str) -> bool:
        """True the first time the job reaches `phase` (one `phase` event per phase)."""
        return bool(self.client.hsetnx(keys.job_state(self.job), f"phase:{phase}", 1))

    def set_phase(self, phase: str) -> None:
        self.client.hset(keys.job_state(self.job), "phase", phase)

    def misfit_since(self, now: float) -> tuple[float, bool]:
        """(since when the job's shape has not fit the live cluster, whether it ever launched)."""
        state = keys.job_state(self.job)
        pipe = self.client.pipeline(transaction=True)
        pipe.hsetnx(state, "misfit_since", now)
        pipe.hget(state, "misfit_since")
        pipe.hexists(state, "dispatched")
        _, since, dispatched = pipe.execute()
        return float(since or now), bool(dispatched)

    def settling(self) -> bool:
        """Whether the job was submitted again after Redis lost its data (`activate`'s
        `launched_before`) less than RESUME_SETTLE_S ago (the key's lease, timed by Redis)."""
        return bool(self.client.exists(keys.job_settling(self.job)))

    def clear_misfit(self) -> None:
        self.client.hdel(keys.job_state(self.job), "misfit_since")

    def show(self, fields: dict[str, Any]) -> None:
        """What `python -m scheduler.autotune --status` shows for the job."""
        self.client.hset(keys.job_state(self.job), mapping=fields)

    def shown(self) -> dict[str, str]:
        return {k.decode(): v.decode() for k, v in self.client.hgetall(keys.job_state(self.job)).items()}
