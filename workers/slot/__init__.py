"""The slot worker's rank task: what a rank is given, its peers, its claim, its launch, its record.

`rank` runs the stages of the `run_rank` task; `rank_spec` is what a rank is given, `rank_peers`
its flags and checks shared with its launch's other ranks, `rank_claim` its claim on a launch,
`rank_record` its record and `records` the records' types (`ExperimentRecord`, `RankRecord`, and
the records of what never ran: `not_started`, `ExperimentRecord.lost`) and an experiment's record
from its ranks' (pure); `timeline` says where a rank's seconds went and `metric_check` whether its
metrics are numbers; `build_locks` and `op_prebuild` (also a child interpreter: `python -m
workers.slot.op_prebuild`) build DeepSpeed's ops outside the rank's limits; `consumer_watch`
withdraws a slot whose consumer stopped.

Imports: every package of `workers` below it (`in_rank`, `files`, `device`, `state`, `process`,
`warm`), the standard library, redis and psutil; never the command side (`scheduler`, `deploy`, `tasks`).
Imported by: the Celery tasks (`tasks.experiment`, `tasks.worker_hooks`), the scheduler and bench/.
"""
