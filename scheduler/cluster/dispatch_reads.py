"""What a dispatch pass reads and writes across every active job, one round trip each: the waiting
launches that can matter, the running launches and their shapes' wall times, the states `--status`
shows, the owners of the leases beside a starting launch, and its start with theirs. `RedisActiveJobs`
is `stores.BaseActiveJobs` over these, and over the other end of a launch, its close with its slots'
release and its job step's reads (`scheduler.cluster.finish`); its in-memory twin is
`memory_store.InMemoryActiveJobs`.

Apart from `scheduler.cluster.job_store` (one job's keys) because these span jobs and exist for
one reader, `scheduler.cluster.dispatch`, whose cost they bound.

The queue is indexed by shape. Within one job and one shape (nodes x slots per node, minimum memory)
waiting launches are interchangeable for placement, and a shape that finds no room in a dispatch
pass finds none for the rest of it (busy slots only accumulate). So at most
`free slots // slots per launch + 1` launches of each (job, shape) can matter to a pass: those that
start, then the first that does not fit. `heads` returns exactly those, so a pass costs
O(shapes + free slots) whatever the depth of the queues.
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import redis

from scheduler.cluster.job_store import JobStore, active_spec_jsons, step_reads_from
from scheduler.cluster.launches import FinishSpec, QueuedLaunch, RunningLaunch
from scheduler.cluster.stores import Heads, StepReads
from workers.state import keys
from workers.state.store import RedisSlotStore


_HEADS = """
-- ARGV[1]   free slots; then per job: ARGV[i] its shapes set, ARGV[i+1] its queue hash, ARGV[i+2] the
--           key of its queue of one shape without the shape, ARGV[i+3] its running launches
-- returns per job {queue depth, {the queued launches (JSON) that can matter, any order}, running names}
local free, found = tonumber(ARGV[1]), {}
for i = 2, #ARGV, 4 do
  local launches = {}
  for _, shape in ipairs(redis.call('SMEMBERS', ARGV[i])) do
    local nodes, per_node = string.match(shape, '^(%d+)x(%d+)')
    local per_launch = math.max(1, tonumber(nodes) * tonumber(per_node))
    local names = redis.call('ZRANGE', ARGV[i + 2] .. shape, 0, math.floor(free / per_launch))
    if #names > 0 then
      for _, raw in ipairs(redis.call('HMGET', ARGV[i + 1], unpack(names))) do
        if raw then launches[#launches + 1] = raw end
      end
    end
  end
  found[#found + 1] = {redis.call('HLEN', ARGV[i + 1]), launches, redis.call('HKEYS', ARGV[i + 3])}
end
return found
"""


_BESIDE = """
-- KEYS      the gang keys of the busy slots beside a starting launch
-- ARGV[1]   the running hash's key before the job's name, ARGV[2] after it
-- returns {owner, its running launch (JSON) or false, ...}, once per owner "job/experiment"
local seen, found = {}, {}
for i = 1, #KEYS do
  local token = redis.call('GET', KEYS[i])
  local owner = token and string.match(token, '^(.*)#[^#]*$')
  if owner and not seen[owner] then
    seen[owner] = true
    local job, name = string.match(owner, '^(.*)/([^/]*)$')
    found[#found + 1] = owner
    found[#found + 1] = job and redis.call('HGET', ARGV[1] .. job .. ARGV[2], name) or false
  end
end
return found
"""


def heads(client: redis.Redis, jobs: list[str], free_slots: int) -> dict[str, list[QueuedLaunch]]:
    """Per job, the waiting launches that can matter to a pass with `free_slots` free slots (module
    docstring), in submission order. One round trip, whatever the depth of the queues."""
    return {job: found.launches for job, found in job_heads(client, jobs, free_slots).items()}


def job_heads(client: redis.Redis, jobs: list[str], free_slots: int) -> dict[str, Heads]:
    """`heads`, with each job's queue depth and running names, read in the same script."""
    if not jobs:
        return {}
    args: list[Any] = [free_slots]
    for job in jobs:
        args += [keys.job_shapes(job), keys.job_queue(job), keys.job_queue_shape(job, ""), keys.job_running(job)]
    found = client.register_script(_HEADS)(args=args)
    return {job: Heads(sorted((QueuedLaunch.from_json(json.loads(raw)) for raw in raws), key=lambda launch: launch.seq),
                       int(depth), {name.decode() for name in running})
            for job, (depth, raws, running) in zip(jobs, found)}


def running_by_job(client: redis.Redis, jobs: list[str]) -> dict[str, list[RunningLaunch]]:
    """Each job's running launches, in one round trip."""
    pipe = client.pipeline(transaction=False)
    for job in jobs:
        pipe.hvals(keys.job_running(job))
    return {job: [RunningLaunch.from_json(json.loads(raw)) for raw in raws] for job, raws in zip(jobs, pipe.execute())}


def walls_by_job(client: redis.Redis, shapes: dict[str, list[str]]) -> dict[str, dict[str, list[float]]]:
    """job -> shape -> wall times of its finished launches, for the shapes asked, in one round trip."""
    asked = {job: wanted for job, wanted in shapes.items() if wanted}
    pipe = client.pipeline(transaction=False)
    for job, wanted in asked.items():
        pipe.hmget(keys.job_walls(job), wanted)
    found = pipe.execute() if asked else []
    return {job: {shape: json.loads(raw) for shape, raw in zip(wanted, raws) if raw is not None}
            for (job, wanted), raws in zip(asked.items(), found)}


def show_all(client: redis.Redis, shown: dict[str, dict[str, Any]], misfits_cleared: Iterable[str] = ()) -> None:
    """`JobStore.show` for several jobs and `clear_misfit` for `misfits_cleared`, in one round trip."""
    pipe = client.pipeline(transaction=False)
    for job in misfits_cleared:
        pipe.hdel(keys.job_state(job), "misfit_since")
    for job, fields in shown.items():
        pipe.hset(keys.job_state(job), mapping=fields)
    pipe.execute()


def lease_owners(client: redis.Redis, queues: list[str]) -> list[tuple[str, RunningLaunch | None]]:
    """`stores.BaseActiveJobs.lease_owners`, in one script."""
    if not queues:
        return []
    before, _, after = keys.job_running("\0").partition("\0")
    found = client.register_script(_BESIDE)(keys=[keys.gang(queue) for queue in queues], args=[before, after])
    return [(owner.decode(), RunningLaunch.from_json(json.loads(raw)) if raw is not None else None)
            for owner, raw in zip(found[::2], found[1::2])]


class RedisActiveJobs:
    """`stores.BaseActiveJobs` in Redis: the functions above, and one transaction for a start."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client

    def store(self, job: str) -> JobStore:
        return JobStore(self.client, job)

    def active_spec_jsons(self) -> list[bytes]:
        return active_spec_jsons(self.client)

    def heads(self, jobs: list[str], free_slots: int) -> dict[str, Heads]:
        return job_heads(self.client, jobs, free_slots)

    def running_by_job(self, jobs: list[str]) -> dict[str, list[RunningLaunch]]:
        return running_by_job(self.client, jobs)

    def walls_by_job(self, shapes: dict[str, list[str]]) -> dict[str, dict[str, list[float]]]:
        return walls_by_job(self.client, shapes)

    def show_all(self, shown: dict[str, dict[str, Any]], misfits_cleared: Iterable[str] = ()) -> None:
        show_all(self.client, shown, misfits_cleared)

    def lease_owners(self, queues: list[str]) -> list[tuple[str, RunningLaunch | None]]:
        return lease_owners(self.client, queues)

    def start_beside(self, job: str, queued: QueuedLaunch, launch: RunningLaunch,
                     beside: list[tuple[str, RunningLaunch]]) -> int:
        pipe = self.client.pipeline(transaction=True)
        for other_job, other in beside:
            JobStore(self.client, other_job).update_running(other, pipe)
        return JobStore(self.client, job).start(queued, launch, pipe)

    def finish_launch(self, finish: FinishSpec, event: dict[str, Any],
                      wall: tuple[str, float] | None) -> StepReads | None:
        """One pipeline: the slots' release, the finish script (its answer None: not the running
        launch) and the step's reads."""
        store = JobStore(self.client, finish.job)
        pipe = self.client.pipeline(transaction=False)
        RedisSlotStore(self.client).release_in(pipe, finish.slots, finish.gang_token)
        store.finish_recorded_in(pipe, finish.name, finish.attempt, event, wall)
        store.step_reads_in(pipe)
        results = pipe.execute()
        return None if results[1] is None else step_reads_from(results)
