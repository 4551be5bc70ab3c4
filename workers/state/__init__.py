"""The slots' state in Redis: its keyspace, the slots' registration, gang leases, rendezvous, views, health.

`keys` is the one place every Redis key is named; `connection` opens the cluster's Redis, and
`redis_tls` and `redis_url` check its TLS files and its URL and mask it; `registry` registers a slot
and keeps its heartbeat; `gang` holds a gang's slot leases (Lua); `rendezvous` lets a launch's ranks
meet; `slot_view` is the live slots as dispatch sees them; `slot_health` reports a slot's device
memory held by others; `rank_groups` keeps the training group each rank started, for the clean-ups
that kill what a dead worker left. `store` puts what callers do with these behind one interface
(`BaseSlotStore`, in Redis `RedisSlotStore`, which also holds what only Redis has: pipelined
releases, the heartbeat, lease and health threads), and `memory_store` is its in-memory twin, which
the decisions' unit tests use. From outside this package the slots' state is reached through `store`
only: `registry`, `gang`, `slot_view`, `slot_health` and `rank_groups` are its insides
(tests/unit/test_architecture.py holds that).

Imports: the standard library, redis, `workers.device` (what a slot is), `workers.in_rank` (the
failure vocabulary) and this package; never `workers.process`, `workers.warm` or `workers.slot`.
Imported by: the slot worker's packages, the embedded cluster, `scheduler.cluster`, `scheduler.launch`
(the Redis URL's rules), the commands, `deploy`, the Celery app's settings and tasks.
"""
