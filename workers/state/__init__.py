"""The slots' state in Redis: its keyspace, the slots' registration, gang leases, rendezvous, views, health.

`keys` is the one place every Redis key is named; `redis_tls` and `redis_url` connect to the
cluster's Redis and check and mask its URL; `registry` registers a slot and keeps its heartbeat;
`gang` holds a gang's slot leases (Lua); `rendezvous` lets a launch's ranks meet; `slot_view` is
the live slots as dispatch sees them; `slot_health` reports a slot's device memory held by others.
`store` puts what callers do with these behind one interface (`BaseSlotStore`, in Redis
`RedisSlotStore`), and `memory_store` is its in-memory twin, which the decisions' unit tests use.

Imports: the standard library, redis, `workers.device` (what a slot is), `workers.in_rank` (the
failure vocabulary) and this package; never `workers.process`, `workers.warm` or `workers.slot`.
Imported by: the slot worker's packages, the embedded cluster, `scheduler.cluster`, `deploy`, the
Celery app's settings and tasks.
"""
