"""The control path: tuning jobs kept in Redis and run on the cluster's slots.

- `job_store`, `jobs`: a job's spec, queue, running launches and records, in Redis (Lua where two
  control workers could race); submitting, cancelling, ending a job;
- `stores`, `memory_store`: the job store's interfaces (one job; every active job at once) and their
  in-memory twins, over which the decisions of dispatch (whole passes), finish and sweep are tested
  without Redis;
- `dispatch_reads`: what a dispatch pass reads and writes across every active job, in one round trip
  (`RedisActiveJobs`);
- `progress`: a job's step: replay its search over the records so far and queue what it asks next;
- `dispatch`, `placement`, `backfill`: which queued experiment starts on which free slots now
  (gang reservations across nodes, EASY backfill, topology);
- `finish`: a finished launch's bookkeeping in the chord callback (free its slots, close it);
- `fencing`: which launch's result counts (only the one that holds its experiment now);
- `co_runners`: which launches ran beside which, recorded as each starts;
- `sweep`: the control worker's search for lost launches (what no event announces);
- `launches`: what a running launch and its finish message carry;
- `work`: the one seam to the outside (`Work`: launch, revoke, clean up hosts, ask for a step),
  which `tasks.work.CeleryWork` implements; this package imports neither Celery nor deploy;
- `control_loop`: the control worker's sweep.

Imports: `scheduler.report`, `scheduler.search`, `scheduler.launch`, `scheduler.inputs`,
`scheduler.errors`, `workers` (keys, leases, the rank's spec). Imported by: `deploy` (clean-up reads
the job store), `tasks` (the thin Celery tasks) and the commands.
"""
